"""tb_gradhealth: per-layer gradient health records for TensorBoard.

``import tb_gradhealth`` imports nothing heavy and never TensorFlow: every submodule loads on first attribute
access (``tb_gradhealth.summary``, ``tb_gradhealth.health``, ...), and the TF-based writers (``summary``, ``keras``,
``tpu``, ``distribute``, ``accumulate`` and their helpers) import TensorFlow only then, so the plugin, the CLI and
the numpy :class:`Writer` work on a machine without TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

#: What users import: the writers, the diagnosis, the readers, the plugin and the CLI. Every other submodule loads
#: on first access too (``tb_gradhealth.testing``, ...): any name that is a submodule of the package is one.
_ENTRY_POINTS = (
    "summary", "keras", "tpu", "distribute", "accumulate", "torch", "jax", "writer", "health", "reader", "testing",
    "plugin", "cli", "origin", "tf_origin", "torch_origin", "jax_origin",
)
_LAZY_ATTRS = {"Writer": "writer", "Thresholds": "health"}

__all__ = ["Writer", "Thresholds", "__version__", *_ENTRY_POINTS]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(f"tb_gradhealth.{_LAZY_ATTRS[name]}"), name)
    if not name.startswith("__") and importlib.util.find_spec(f"tb_gradhealth.{name}") is not None:
        return importlib.import_module(f"tb_gradhealth.{name}")
    raise AttributeError(f"module 'tb_gradhealth' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
