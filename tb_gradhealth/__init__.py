"""tb_gradhealth: per-layer gradient health records for TensorBoard.

``import tb_gradhealth`` imports nothing heavy and never TensorFlow: every submodule loads on first attribute
access (``tb_gradhealth.summary``, ``tb_gradhealth.health``, ...), and the TF-based writers (``summary``, ``keras``,
``tpu``, ``distribute``, ``accumulate`` and their helpers) import TensorFlow only then, so the plugin, the CLI and
the numpy :class:`Writer` work on a machine without TensorFlow.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Submodules that import TensorFlow (loaded only when used).
_TF_MODULES = (
    "summary", "packed", "kernels", "histogram", "compat", "keras", "capture", "tpu", "distribute", "shards",
    "accumulate", "tf_origin",
)
#: TensorFlow-free submodules.
_PLAIN_MODULES = (
    "record", "metadata", "naming", "eventfile", "writer", "health", "reader", "payloads", "plugin", "cli", "origin"
)
#: Submodules for other frameworks (optional extras ``torch`` and ``jax``; imported only when used).
_FRAMEWORK_MODULES = ("torch", "jax", "torch_origin", "jax_origin")
_LAZY_MODULES = _TF_MODULES + _PLAIN_MODULES + _FRAMEWORK_MODULES
_LAZY_ATTRS = {"Writer": "writer", "Thresholds": "health"}

__all__ = ["Writer", "Thresholds", "__version__", *_LAZY_MODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"tb_gradhealth.{name}")
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(f"tb_gradhealth.{_LAZY_ATTRS[name]}"), name)
    raise AttributeError(f"module 'tb_gradhealth' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
