"""tb_gradhealth: per-layer gradient health records for TensorBoard.

``import tb_gradhealth`` never imports TensorFlow: the TF-based writers (``summary``, ``keras``, ``tpu``,
``accumulate``) load on first attribute access, so the plugin, the CLI and the numpy :class:`Writer` work on a
machine without TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY_MODULES = ("summary", "keras", "tpu", "accumulate")
_LAZY_ATTRS = {"Writer": "writer", "Thresholds": "health"}

__all__ = ["Writer", "Thresholds", "__version__", *_LAZY_MODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"tb_gradhealth.{name}")
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(f"tb_gradhealth.{_LAZY_ATTRS[name]}"), name)
    raise AttributeError(f"module 'tb_gradhealth' has no attribute {name!r}")
