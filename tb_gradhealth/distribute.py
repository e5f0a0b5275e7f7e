"""Gradient health under ``tf.distribute`` (TF2): per-replica or applied-gradient records, merged on the host.

* :func:`replica_record` (inside ``strategy.run``): this replica's own gradients, no communication; the host merges
  the replicas' records (:func:`merge_and_write`): the union of their gradient values, like the TPU ``host_call``.
* :func:`applied_record` (inside ``strategy.run``): the all-reduced gradient, the one the optimizer applies; every
  replica then holds the same record and the host keeps one (``all_reduced=True``).

See docs/DISTRIBUTED.md for what each record describes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tb_gradhealth import record, summary
from tb_gradhealth._tf import shards

__all__ = ["replica_record", "applied_record", "merge_replicas", "merge_and_write"]


def replica_record(
    grads_and_vars: Any,
    *,
    record_weights: bool = True,
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
    seed: int | None = None,
) -> Any:
    """The device record of this replica's own gradients: call inside the ``strategy.run`` step function and
    return it; merge on the host with :func:`merge_and_write` (the union of the replicas' gradients, like the
    TPU host_call). No cross-replica communication."""
    _, grads_and_vars = shards.prepare(grads_and_vars, None)
    return shards.compute(grads_and_vars, record_weights, hist_sample, seed)


def applied_record(
    grads_and_vars: Any,
    *,
    reduce_op: tf.distribute.ReduceOp = tf.distribute.ReduceOp.SUM,
    record_weights: bool = True,
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
    seed: int | None = None,
) -> Any:
    """The device record of the all-reduced gradient (what the optimizer applies), inside ``strategy.run``.

    All-reduces the gradients (``SUM``, as Keras optimizers do; use ``MEAN`` if your update divides by the number
    of replicas) and records the result: every replica then holds the same record, so
    :func:`merge_and_write` with ``all_reduced=True`` keeps one. It costs one extra gradient all-reduce (the
    optimizer does its own), so build it into a separate logging step function that runs every N steps.
    """
    names, grads_and_vars = shards.prepare(grads_and_vars, None)
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        raise ValueError("applied_record must be called in a replica context (inside strategy.run)")
    _, grads, _, variables = summary.normalize(grads_and_vars)
    present = [tf.convert_to_tensor(g) for g in grads if g is not None]
    reduced = iter(ctx.all_reduce(reduce_op, present)) if present else iter(())
    grads = [None if g is None else next(reduced) for g in grads]
    if all(v is not None for v in variables):
        rebuilt: Any = list(zip(grads, variables, strict=True))
    else:
        rebuilt = dict(zip(names, grads, strict=True))
    return shards.compute(rebuilt, record_weights, hist_sample, seed)


def merge_replicas(
    strategy: tf.distribute.Strategy, per_replica_record: Any, *, all_reduced: bool = False
) -> tf.Tensor:
    """Per-replica device records (``strategy.run``'s result) → merged memory rows ``[L, F]`` float64.

    ``all_reduced=False``: merges the replicas' records (:func:`record.merge_all`, through ``tf.numpy_function``).
    ``all_reduced=True``: the records are identical (from :func:`applied_record`), so one is kept.
    """
    counts = strategy.experimental_local_results(per_replica_record.counts)
    values = strategy.experimental_local_results(per_replica_record.values)
    if all_reduced:
        return tf.concat([tf.cast(counts[0], tf.float64), tf.cast(values[0], tf.float64)], axis=-1)
    with tf.device("/cpu:0"):
        return shards.merge_shards(tf.stack(list(counts)), tf.stack(list(values)))


def _device_from_rows(rows: tf.Tensor) -> Any:
    return summary.DeviceRecord(
        tf.cast(rows[:, : record.NUM_COUNTS], tf.int32), tf.cast(rows[:, record.NUM_COUNTS :], tf.float32)
    )


def merge_and_write(
    strategy: tf.distribute.Strategy,
    per_replica_record: Any,
    layers: Sequence[str],
    step: Any,
    log_dir: str | os.PathLike | None = None,
    *,
    all_reduced: bool = False,
    name: str = "gradients",
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
) -> tf.Tensor:
    """Merge per-replica records (see :func:`merge_replicas`) and write them at ``step``; returns the rows.

    Writes to ``log_dir`` (a writer cached per directory) or, when ``log_dir`` is None, to the default
    ``tf.summary`` writer (``with writer.as_default():``). Call it outside ``strategy.run``, eagerly or in the
    same ``tf.function`` (whose automatic control dependencies keep the write; this TF2 helper returns no ops
    for a v1 session).
    """
    layers = [str(n) for n in layers]
    if len(set(layers)) != len(layers):
        raise ValueError("layer names must be unique")
    counts0 = strategy.experimental_local_results(per_replica_record.counts)[0]
    if counts0.shape.rank != 2 or counts0.shape[0] != len(layers):
        raise ValueError(f"{len(layers)} layer names for records of shape {counts0.shape}")
    step_t = shards.scalar_tensor(step, "step", tf.int64)
    rows = merge_replicas(strategy, per_replica_record, all_reduced=all_reduced)
    if log_dir is None:
        summary.write(_device_from_rows(rows), layers, step=step_t, name=name, hist_sample=hist_sample or 0)
        return rows
    disk = tf.numpy_function(record.to_disk, [rows], tf.float32, stateful=False)
    disk.set_shape([len(layers), None])
    shards.write(disk, layers, step_t, log_dir=shards.check_log_dir(log_dir), scalars={}, name=name, kind="gradients",
                 hist_sample=hist_sample, do_flush=False)
    return rows

