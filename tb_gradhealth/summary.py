"""The TensorFlow summary op: gradient-health records computed on the device and written as TF2 summaries.

* :func:`compute` turns gradients into a :class:`DeviceRecord` ``(counts int32 [L, 5], values float32 [L, 89])``
  with the numbers of :func:`tb_gradhealth.record.compute` (the float64 reference). All layers' statistics run in
  one layout (:mod:`tb_gradhealth._tf.packed`: a fixed number of loops whatever the number of layers): by default
  as plain TF ops in the caller's graph, inlined into the caller's cluster inside a ``jit_compile=True`` step, so
  nothing compiles XLA that the user did not ask to compile; ``jit=True`` compiles them as one XLA function of
  their own even in a plain ``tf.function`` (a model of hundreds of variables compiles in seconds).
* :func:`write` encodes a device record on the host (``tf.numpy_function`` calling :func:`record.to_disk`: one
  encoder) and writes it with ``tf.summary.write``.
* :func:`gradients` = compute + write, for custom training loops (eager or ``tf.function``). Inside
  ``jit_compile=True`` nothing can be written: return ``compute(...)`` from the compiled step, ``write`` outside.

Names come from :mod:`tb_gradhealth._tf.naming`, the statistics from :mod:`tb_gradhealth._tf.packed` (and the one-layer
:mod:`tb_gradhealth._tf.kernels`), the histogram bins from :mod:`tb_gradhealth._tf.histogram`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import metadata, progress, record
from tb_gradhealth._tf import compat, records
from tb_gradhealth._tf.kernels import DeviceRecord, size_rows
from tb_gradhealth._tf.naming import layer_names, normalize, variable_names
from tb_gradhealth.record import Delta

__all__ = [
    "DeviceRecord", "Delta", "compute", "layer_names", "normalize", "variable_names", "write", "gradients",
    "to_disk", "size_rows", "step_skipped", "write_step_skipped",
]


@tf.autograph.experimental.do_not_convert
def compute(
    grads: Any,
    weights: Any = None,
    updates: Any = None,
    *,
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    seed: Any = None,
    jit: bool | str = "graph",
) -> DeviceRecord:
    """Device records of ``grads`` (pairs, dict or lists: see :func:`normalize`), rows in :func:`layer_names` order.

    ``weights=True`` (with pairs) or a list/dict of tensors adds the weight norms; ``updates`` (list/dict) the
    applied-update norms, each a tensor or a :class:`Delta` ``(before, after)`` (cheaper: the difference is
    fused into the update's loop, never written out). ``seed`` (int or scalar tensor, e.g. the step) seeds
    histogram sampling; by default the seed comes from the data. ``jit="graph"`` (default) computes every layer's
    statistics as plain TF ops in the caller's graph (no XLA compile and none of XLA's memory; inside
    ``jit_compile=True`` they are compiled with the caller's cluster, as with ``True``); ``jit=True``
    computes them in one XLA function, compiled once per model signature even outside a compiled
    step (:mod:`tb_gradhealth._tf.packed`; eagerly and in ``tf.function``: one fused loop over the data, at the
    price of a compile and XLA's memory); ``jit=False`` uses plain TF ops, layer by layer.
    """
    return records.compute(grads, weights, updates, hist_sample=hist_sample, seed=seed, jit=jit)


# --- host-side write ------------------------------------------------------------------------------------------


def _to_disk_np(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    return record.to_disk(record.from_device(counts, values))


@tf.autograph.experimental.do_not_convert
def to_disk(device_record: DeviceRecord) -> tf.Tensor:
    """The float32 disk tensor ``[L, 18 + W]`` of a device record, encoded on the host by :func:`record.to_disk`."""
    counts, values = device_record
    out = tf.numpy_function(_to_disk_np, [counts, values], tf.float32, stateful=False)
    out.set_shape([counts.shape[0], None])
    return out


@tf.autograph.experimental.do_not_convert
def write(
    device_record: DeviceRecord | Callable[[], DeviceRecord],
    layers: Sequence[str],
    step: Any = None,
    name: str = "gradients",
    *,
    kind: str = "gradients",
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    layer_info: Sequence[tuple[str, str]] = (),
    source: Mapping[str, str] | None = None,
) -> tf.Tensor | bool:
    """Write a device record (or a callable making one, evaluated only when recording) as one summary event.

    Uses the default ``tf.summary`` writer; ``step`` defaults to ``tf.summary.experimental.get_step()``. Returns
    what ``tf.summary.write`` returns (whether a summary was written). Not usable inside ``jit_compile=True``.
    The tag carries the step's block (:func:`metadata.tag_for`), as the numpy ``Writer``'s, so that a run of any
    length is read in bounded answers. ``layer_info``: per row, ``(layer kind, activation)`` of the model
    (:func:`tb_gradhealth.layerinfo.model_layer_info`), which the diagnosis uses to word its fixes; ``source``: what
    the tag's metadata says of the training loop (default ``{"loop": "tf"}``, a custom TensorFlow loop; name the
    optimizer with :func:`tb_gradhealth.metadata.loop_source`).
    """
    if compat.in_xla_context():
        raise RuntimeError(
            "tb_gradhealth.summary.write cannot run inside a jit_compile=True function: return "
            "summary.compute(...) from the compiled step and call summary.write(record, names) outside it"
        )
    layers = [str(n) for n in layers]
    md = metadata.create_summary_metadata(layers, kind=kind, hist_sample=hist_sample,
                                          layer_info=tuple(tuple(x) for x in layer_info),
                                          source=source or metadata.loop_source("tf"))

    def tensor() -> tf.Tensor:
        rec = device_record() if callable(device_record) else device_record
        return to_disk(DeviceRecord(*rec))

    base = metadata.tag_for(layers, name)
    at = tf.summary.experimental.get_step() if step is None else step
    if at is None:  # tf.summary.write raises its own error for a missing step (when it records)
        tag: Any = base
    else:
        block = tf.cast(at, tf.int64) // metadata.block_steps(len(layers))
        tag = tf.strings.join([base + ".", tf.strings.as_string(block)])
    return tf.summary.write(tag, tensor, step=step, metadata=md)


@tf.autograph.experimental.do_not_convert
def gradients(
    grads_and_vars: Any,
    step: Any = None,
    name: str = "gradients",
    weights: Any = True,
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    *,
    updates: Any = None,
    seed: Any = None,
    jit: bool | str = "graph",
) -> tf.Tensor | bool:
    """Record gradient health as one summary: ``compute`` + ``write``, for custom loops (eager or ``tf.function``).

    Use it under ``writer.as_default()`` like any ``tf.summary`` op; nothing is computed when no summary is being
    recorded (``tf.summary.record_if``). ``weights=True`` also records the norms of the pairs' variables. ``jit``
    as for :func:`compute`: by default nothing is compiled with XLA (``jit=True`` compiles the statistics).
    Inside ``jit_compile=True`` it raises: return ``compute(...)`` from the compiled step, ``write(...)`` outside.
    """
    if compat.in_xla_context():
        raise RuntimeError(
            "tb_gradhealth.summary.gradients cannot write inside a jit_compile=True function: return "
            "rec = summary.compute(grads_and_vars) from the compiled step and call "
            "summary.write(rec, summary.layer_names(grads_and_vars), step) outside it"
        )
    if not isinstance(grads_and_vars, Mapping):
        grads_and_vars = list(grads_and_vars)  # zip objects are single-use
    names = layer_names(grads_and_vars, weights if not isinstance(weights, bool) else None)
    if isinstance(weights, bool) and weights and all(v is None for v in normalize(grads_and_vars, True)[3]):
        weights = None  # a dict of gradients has no variables to take weights from
    if updates is not None:
        write_step_skipped(lambda: step_skipped(records.layer_inputs(grads_and_vars, weights, updates, 0, None)),
                           step)
    return write(
        lambda: compute(grads_and_vars, weights, updates, hist_sample=hist_sample, seed=seed, jit=jit),
        names,
        step,
        name,
        hist_sample=hist_sample,
    )


def step_skipped(inputs: Any) -> tf.Tensor:
    """Whether the optimizer skipped a step whose gradients hold NaN/Inf, from its gradients and applied updates (a
    :class:`tb_gradhealth._core.LayerInputs`): 1.0 when every update is exactly zero (the weights are bitwise
    unchanged: what a loss-scale optimizer does after an overflow); 0.0 when some update is not zero (the step moved
    the weights, NaN included); NaN when every gradient is finite (nothing to forgive) or no update is given."""

    def values(t: Any) -> Any:
        if isinstance(t, tf.IndexedSlices):
            return t.values
        if isinstance(t, Delta):
            return tf.cast(t.after != t.before, tf.float32)  # bitwise: NaN != NaN moves
        return t

    moved = [tf.reduce_any(values(u) != 0) for u in inputs.updates if u is not None]
    overflowed = [tf.logical_not(tf.reduce_all(tf.math.is_finite(values(g)))) for g in inputs.grads if g is not None]
    if not moved or not overflowed:
        return tf.constant(float("nan"))
    flag = tf.where(tf.reduce_any(tf.stack(moved)), 0.0, 1.0)
    return tf.where(tf.reduce_any(tf.stack(overflowed)), flag, float("nan"))


@tf.autograph.experimental.do_not_convert
def write_step_skipped(flag: Any, step: Any = None) -> tf.Tensor | bool:
    """Write the scalar :data:`tb_gradhealth.progress.SKIPPED_TAG` (1 skipped, 0 applied) that the diagnosis reads
    as the evidence of a skipped step, where ``flag`` is not NaN: a float scalar or a callable making one
    (evaluated only when recording), e.g. :func:`step_skipped`, which says something only at a step with NaN/Inf
    gradients (a healthy run's Scalars tab gets no tag of flat zeros)."""
    from tensorboard.plugins.scalar import metadata as scalar_metadata

    md = scalar_metadata.create_summary_metadata(display_name=None, description=None)

    def recorded() -> Any:
        value = tf.cast(flag() if callable(flag) else flag, tf.float32)
        return tf.cond(tf.math.is_nan(value), lambda: tf.constant(False),
                       lambda: tf.summary.write(progress.SKIPPED_TAG, value, step=step, metadata=md))

    return tf.cond(tf.summary.should_record_summaries(), recorded, lambda: tf.constant(False))
