"""Shared test set-up: quiet TensorFlow logs and keep TF on the CPU, with a fixed thread budget."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
