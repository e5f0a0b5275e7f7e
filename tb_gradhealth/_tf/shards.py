"""Records of several shards or replicas, merged on the host and written as summaries (TPU and tf.distribute).

A device record from each shard or replica (:func:`tb_gradhealth.summary.compute`) is merged on the host with the
record's own merge rules (:func:`tb_gradhealth.record.merge_all` through ``tf.numpy_function``: the one merge rule,
never re-implemented in TF), then written with ``tf.summary``. Writers are opened on first use: eager ones cached
per directory (one event file per process and directory, flushed at exit), graph-mode ones per graph.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import _storage, metadata, record
from tb_gradhealth._tf import records
from tb_gradhealth._tf.naming import layer_names

__all__ = ["merge_shards", "flush"]


def check_log_dir(log_dir: Any) -> str:
    if log_dir is None or not isinstance(log_dir, str | os.PathLike) or not str(log_dir):
        raise ValueError(f"log_dir must be a non-empty path (str or os.PathLike), got {log_dir!r}")
    _storage.check_writable(os.fspath(log_dir))  # a log_dir that can never be written fails here, not silently
    return os.fspath(log_dir)


def scalar_tensor(value: Any, what: str, dtype: tf.DType | None = None) -> tf.Tensor:
    """``value`` as a tensor of shape [] (a [1] tensor is accepted); anything else fails now, at build time."""
    try:
        t = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a scalar tensor or number, got {value!r}") from e
    shape = t.shape
    if shape.rank is None or not (shape.rank == 0 or (shape.rank == 1 and shape[0] == 1)):
        raise ValueError(f"{what} must be a scalar (shape [] or [1]), got shape {shape}")
    if dtype is not None:
        if dtype.is_integer and not t.dtype.is_integer:
            raise ValueError(f"{what} must be an integer, got dtype {t.dtype.name}")
        if not (t.dtype.is_integer or t.dtype.is_floating):
            raise ValueError(f"{what} must be numeric, got dtype {t.dtype.name}")
        t = tf.cast(t, dtype)
    return tf.reshape(t, [])



def prepare(grads_and_vars: Any, layers: Sequence[str] | None) -> tuple[list[str], Any]:
    """(layer names, the input in a re-iterable form) from any form ``naming.normalize`` accepts, checked now."""
    if grads_and_vars is None:
        raise ValueError("no gradients given: grads_and_vars is None")
    if not isinstance(grads_and_vars, Mapping):
        grads_and_vars = list(grads_and_vars)  # zip objects are single-use
        if (
            len(grads_and_vars) == 2
            and all(isinstance(x, list | tuple) for x in grads_and_vars)
            and len(grads_and_vars[0]) != len(grads_and_vars[1])
            and any(hasattr(v, "assign") for v in grads_and_vars[1])
        ):
            raise ValueError(
                f"mismatched gradients and variables: {len(grads_and_vars[0])} gradients, "
                f"{len(grads_and_vars[1])} variables"
            )
    names = layer_names(grads_and_vars)
    if not names:
        raise ValueError("no gradients given: grads_and_vars is empty")
    if layers is not None:
        layers = [str(n) for n in layers]
        if len(layers) != len(names):
            raise ValueError(f"{len(layers)} layer names for {len(names)} gradients")
        if len(set(layers)) != len(layers):
            dup = sorted({n for n in layers if layers.count(n) > 1})
            raise ValueError(f"layer names must be unique, repeated: {dup}")
        names = layers
    return names, grads_and_vars


def compute(
    grads_and_vars: Any, record_weights: bool, hist_sample: int | None, seed: Any, weights: Any = None
) -> Any:
    if weights is None:
        weights = True if record_weights else None
    return records.compute(grads_and_vars, weights, hist_sample=hist_sample or 0, seed=seed)


def _merge_device_records(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Shard/replica records ``[S, L, ...]`` (device form) → merged memory-form rows ``[L, F]`` (float64)."""
    return record.merge_all(record.from_device(counts, values), axis=0)


def disk_from_device(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    return record.to_disk(_merge_device_records(counts, values))


def merge_shards(counts: Any, values: Any) -> tf.Tensor:
    """Merge stacked device records (``[S, L, 5]`` int32, ``[S, L, 89]`` float32) → memory rows ``[L, F]`` float64.

    Runs :func:`record.merge_all` on the host through ``tf.numpy_function`` (eager, ``tf.function`` or graph).
    """
    counts = tf.convert_to_tensor(counts)
    values = tf.convert_to_tensor(values)
    out = tf.numpy_function(_merge_device_records, [counts, values], tf.float64, stateful=False)
    out.set_shape([counts.shape[1], record.NUM_FIELDS])
    return out


# Writers: eager ones are cached per directory (one event file per process and directory); graph-mode ones per
# graph, their init op added to the graph's summary-writer collection (TPUEstimator's host-call hook runs and

class _Writers:
    """Summary writers opened by this module: eager ones per directory, v1-graph ones per graph and directory.

    A graph writer's init op is added to the graph's summary-writer collection (TPUEstimator's host-call hook runs
    and flushes those) and made a control dependency of the writes, so a plain v1 session works too.
    """

    def __init__(self) -> None:
        self.eager: dict[str, Any] = {}
        self.graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        atexit.register(self.flush_quietly)

    def get(self, log_dir: str) -> tuple[Any, bool]:
        """``(writer, in_v1_graph)``: an eager writer (also used from ``tf.function``) or one of the v1 graph."""
        with tf.init_scope():
            if tf.executing_eagerly():
                if log_dir not in self.eager:
                    self.eager[log_dir] = tf.summary.create_file_writer(log_dir)
                return self.eager[log_dir], False
            per_graph = self.graph.setdefault(tf.compat.v1.get_default_graph(), {})
            if log_dir not in per_graph:
                per_graph[log_dir] = tf.summary.create_file_writer(log_dir)
            return per_graph[log_dir], True

    def flush(self, log_dir: str | None) -> None:
        for d, w in list(self.eager.items()):
            if log_dir is None or d == log_dir:
                w.flush()

    def flush_quietly(self) -> None:
        try:
            self.flush(None)
        except Exception:  # noqa: BLE001 - interpreter shutdown: TF may already be half torn down
            pass


_WRITERS: _Writers | None = None


def _writers() -> _Writers:
    global _WRITERS
    if _WRITERS is None:
        _WRITERS = _Writers()
    return _WRITERS


def flush(log_dir: str | os.PathLike | None = None) -> None:
    """Flush the eager summary writers this module opened (all, or the one of ``log_dir``) to disk."""
    if _WRITERS is not None:
        _WRITERS.flush(None if log_dir is None else os.fspath(log_dir))


def write(
    disk: tf.Tensor, layers: Sequence[str], step: tf.Tensor, *, log_dir: str, scalars: Mapping[str, tf.Tensor],
    name: str, kind: str, hist_sample: int | None, do_flush: bool,
) -> list[Any]:
    """Summary ops writing one disk-form record tensor and plain scalars at ``step``; works eagerly and in graphs."""
    writer, in_v1_graph = _writers().get(log_dir)
    tag = metadata.tag_for(list(layers), name)
    md = metadata.create_summary_metadata(list(layers), kind=kind, hist_sample=hist_sample or 0,
                                          source=metadata.loop_source("tf"))
    deps = [writer.init()] if in_v1_graph else []  # idempotent (lookup-or-create): safe to run every step
    with tf.control_dependencies(deps), writer.as_default(), tf.summary.record_if(True):
        ops = [tf.summary.write(tag, disk, step=step, metadata=md.SerializeToString())]
        for scalar_tag, v in scalars.items():
            ops.append(tf.summary.scalar(scalar_tag, v, step=step))
    if do_flush:
        if tf.executing_eagerly():
            writer.flush()
        else:
            with tf.control_dependencies(ops):
                ops.append(writer.flush())
    return ops
