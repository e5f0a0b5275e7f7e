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

#: What users import: the writers, the diagnosis, the readers, the plugin and the CLI, and the modules beside them
#: (``record``, ``metadata``: the format; ``problems``: the kind of each line a reader reports; ``progress``,
#: ``layerinfo``: the loss and the layer kinds read beside the records). Any public submodule loads on first access;
#: a module whose name starts with ``_`` (``_eventfile``, ``_tf``, ...) is the package's own, imported by the modules
#: that use it and never exposed here (as optax keeps ``_src``).
_ENTRY_POINTS = (
    "summary", "keras", "tpu", "distribute", "accumulate", "torch", "jax", "writer", "health", "reader", "testing",
    "live",
    "plugin", "cli", "origin", "tf_origin", "torch_origin", "jax_origin", "lightning", "transformers",
    "record", "metadata", "problems", "progress", "layerinfo",
)
_LAZY_ATTRS = {"Writer": "writer", "Thresholds": "health"}

__all__ = ["Writer", "Thresholds", "__version__", *_ENTRY_POINTS]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        return getattr(importlib.import_module(f"tb_gradhealth.{_LAZY_ATTRS[name]}"), name)
    if not name.startswith("_") and importlib.util.find_spec(f"tb_gradhealth.{name}") is not None:
        return importlib.import_module(f"tb_gradhealth.{name}")
    raise AttributeError(f"module 'tb_gradhealth' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
