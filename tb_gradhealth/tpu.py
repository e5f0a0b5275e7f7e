"""Gradient health across TPU shards: ``host_call`` for ``TPUEstimatorSpec`` and a CPU simulation of it.

A TPU cannot send full gradients to the host, and every ``host_call`` tensor gets a leading shard dimension
(TPUEstimator concatenates the shards' tensors along axis 0). So each shard computes its packed record on the
device (a few hundred bytes per layer, :func:`tb_gradhealth.summary.compute`), and the host **merges** the shards'
records with the record's own merge rules (:func:`tb_gradhealth.record.merge_all`, called through
``tf.numpy_function``: the one merge rule, never re-implemented in TF) and writes one record per layer.

What the merged record describes: the union of the shards' gradient values (``size`` = shards x variable size).
Counts, NaN/Inf, max|g|, min/max, zero fraction and the histogram are exact over all shards' values; the norm of
the union is ``sqrt(sum_s ||g_s||^2)`` (about ``sqrt(shards)`` times one shard's), and the replicated weights are
merged the same way (one copy per shard), so ``grad_to_weight`` is the root-mean-square of the per-shard ratios.
This is *not* the record of the gradient the optimizer applies (the cross-shard sum): for that, see
``host_call(..., all_reduced=True)`` and docs/DISTRIBUTED.md. The ``tf.distribute`` helpers live in
:mod:`tb_gradhealth.distribute` (re-exported here).

Layer names never travel in tensors: they are Python-side constants captured by ``host_call_fn``.

The host side needs the Python interpreter of the process that builds the graph (``tf.numpy_function``): true for
TPU VMs and for CPU/GPU, not for the old remote "TPU Node" set-up where host ops ran on a remote worker.

TPUEstimator is not part of TensorFlow from 2.16 on; ``host_call`` keeps the contract (tensors with a leading shard
dimension, a host function) so that code built on it, and :func:`simulate_shards`, keep working.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import record
from tb_gradhealth._tf.shards import (
    check_log_dir,
    compute,
    disk_from_device,
    flush,
    merge_shards,
    prepare,
    scalar_tensor,
    write,
)
from tb_gradhealth.distribute import applied_record, merge_and_write, merge_replicas, replica_record

__all__ = [
    "host_call",
    "merge_shards",
    "simulate_shards",
    "flush",
    "replica_record",
    "applied_record",
    "merge_replicas",
    "merge_and_write",
]


def _check_scalars(scalars: Mapping[str, Any] | None) -> dict[str, tf.Tensor]:
    if scalars is None:
        return {}
    if not isinstance(scalars, Mapping):
        raise ValueError(f"scalars must be a mapping {{tag: scalar}}, got {type(scalars).__name__}")
    out = {}
    for tag, value in scalars.items():
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"scalar tags must be non-empty strings, got {tag!r}")
        out[tag] = scalar_tensor(value, f"scalar {tag!r}", tf.float32)
    return out



def host_call(
    grads_and_vars: Any,
    step: Any,
    log_dir: str | os.PathLike,
    scalars: Mapping[str, Any] | None = None,
    *,
    name: str = "gradients",
    layers: Sequence[str] | None = None,
    record_weights: bool = True,
    weights: Any = None,
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
    seed: int | None = None,
    all_reduced: bool = False,
    flush_every_call: bool = False,
) -> tuple[Callable[..., list[Any]], list[tf.Tensor]]:
    """``(host_call_fn, tensors)`` for ``TPUEstimatorSpec(host_call=...)``: per-shard records, merged on the host.

    Call it in ``model_fn`` (on each shard). ``tensors`` is ``[counts [1,L,5] int32, values [1,L,89] float32,
    step [1] int64, *scalars [1] float32]``: every tensor has rank >= 1 and leading dimension 1, as TPUEstimator
    requires; it concatenates them over shards and calls ``host_call_fn(*tensors)`` on the host, which merges the
    shards' records (:func:`record.merge_all`, not shard 0) and writes one record per layer plus the scalars
    (the **mean over shards**: the global loss when shards have equal batches) at ``step`` (shard 0's, all equal)
    to ``log_dir``. ``host_call_fn`` returns its summary ops (not ``all_v2_summary_ops()``, which would also
    re-run every other summary op of the graph); it works in a ``tf.compat.v1`` graph, eagerly and in
    ``tf.function``. Weights come from the pairs' variables (``record_weights``) or from ``weights`` (a dict or
    list, as :func:`summary.compute` takes them). ``flush_every_call`` adds a writer flush to every call
    (TPUEstimator flushes at the end of each loop itself; on GCS a flush per step is expensive).

    ``all_reduced=True`` says the gradients are already summed over shards (e.g.
    ``tf.compat.v1.tpu.cross_replica_sum(g)``): every shard then holds the same record, and the host keeps one
    instead of merging identical copies - the record of the gradient actually applied (docs/DISTRIBUTED.md).

    Bad input (no gradients, duplicate or mismatched ``layers``, non-scalar ``step``, missing ``log_dir``,
    non-scalar ``scalars``) raises ``ValueError`` here, at graph-build time, not on the host thread.
    """
    log_dir = check_log_dir(log_dir)
    names, grads_and_vars = prepare(grads_and_vars, layers)
    step_t = scalar_tensor(step, "step", tf.int64)
    scalar_ts = _check_scalars(scalars)
    rec = compute(grads_and_vars, record_weights, hist_sample, seed, weights)
    tensors = [rec.counts[tf.newaxis], rec.values[tf.newaxis], tf.reshape(step_t, [1])]
    tensors += [tf.reshape(v, [1]) for v in scalar_ts.values()]
    host_call_fn = _host_call_fn(names, list(scalar_ts), log_dir, name=name, hist_sample=hist_sample,
                                 all_reduced=all_reduced, flush_every_call=flush_every_call)
    return host_call_fn, tensors


def _host_call_fn(names: list[str], scalar_tags: list[str], log_dir: str, *, name: str, hist_sample: int | None,
                  all_reduced: bool, flush_every_call: bool) -> Callable[..., list[Any]]:
    """The host side of :func:`host_call`: checks the concatenated shard tensors, merges, writes."""
    n_layers = len(names)

    def host_call_fn(counts: tf.Tensor, values: tf.Tensor, steps: tf.Tensor, *scalar_values: tf.Tensor) -> list[Any]:
        if len(scalar_values) != len(scalar_tags):
            raise ValueError(f"host_call_fn expected {len(scalar_tags)} scalar tensors, got {len(scalar_values)}")
        counts = tf.convert_to_tensor(counts)
        values = tf.convert_to_tensor(values)
        if counts.shape[1:] != (n_layers, record.NUM_COUNTS) or values.shape[1:] != (
            n_layers, record.NUM_VALUES + record.HIST_BINS
        ):
            raise ValueError(
                f"host_call_fn expected records [shards, {n_layers}, ...], got {counts.shape} and {values.shape}"
            )
        if all_reduced:
            counts, values = counts[:1], values[:1]
        disk = tf.numpy_function(disk_from_device, [counts, values], tf.float32, stateful=False)
        disk.set_shape([n_layers, None])
        step0 = tf.reshape(tf.convert_to_tensor(steps), [-1])[0]
        means = {t: tf.reduce_mean(tf.cast(v, tf.float32)) for t, v in zip(scalar_tags, scalar_values, strict=True)}
        return write(disk, names, step0, log_dir=log_dir, scalars=means, name=name, kind="gradients",
                     hist_sample=hist_sample, do_flush=flush_every_call)

    host_call_fn.layers = tuple(names)  # type: ignore[attr-defined]
    return host_call_fn


def _as_tensors(shard: Any) -> Any:
    """A ``{layer: array}`` shard as float32 tensors (tensors and None kept); other forms unchanged."""
    if isinstance(shard, Mapping):
        return {k: v if v is None or tf.is_tensor(v) else tf.constant(np.asarray(v, np.float32))
                for k, v in shard.items()}
    return shard


def _simulated_host_call(shards: Sequence[Any], step: int, log_dir: Any, scalars: Any, weights: Any,
                         host_call_kwargs: dict[str, Any]) -> tuple[list[Any], tf.Tensor]:
    """Each shard's :func:`host_call` tensors, concatenated as TPUEstimator does, through shard 0's host function:
    ``(its ops, the merged rows it writes)``."""
    w = None if weights is None else _as_tensors(weights)
    built = [
        host_call(_as_tensors(s), step, log_dir, None if scalars is None else scalars[i], weights=w,
                  **host_call_kwargs)
        for i, s in enumerate(shards)
    ]
    if len({fn.layers for fn, _ in built}) != 1:
        raise ValueError("all shards must have the same layers")
    concat = [tf.concat(list(parts), axis=0) for parts in zip(*(t for _, t in built), strict=True)]
    keep = 1 if host_call_kwargs.get("all_reduced") else None  # what host_call_fn keeps, for the return value
    return built[0][0](*concat), merge_shards(concat[0][:keep], concat[1][:keep])


def simulate_shards(
    shards: Sequence[Any],
    step: int,
    log_dir: str | os.PathLike,
    scalars: Sequence[Mapping[str, float]] | None = None,
    *,
    weights: Mapping[str, Any] | None = None,
    graph: bool = False,
    **host_call_kwargs: Any,
) -> np.ndarray:
    """Run the host_call contract on CPU: one ``grads_and_vars`` per simulated shard → one merged write.

    A shard is a ``{layer: gradient}`` mapping of arrays (the simplest for a demo; ``weights`` then gives the
    replicated weights as ``{layer: array}``) or any ``grads_and_vars`` form :func:`host_call` takes (tensors of
    the current graph, or eager ones). Each shard's tensors come from :func:`host_call`; they are concatenated
    along axis 0 exactly as TPUEstimator does and passed to shard 0's ``host_call_fn``, in a ``tf.compat.v1``
    graph and session (``graph=True``, TPUEstimator's way: a new graph unless one is already the default) or
    eagerly. ``scalars`` is one mapping per shard. The event is flushed to ``log_dir``. Returns the merged
    memory-form rows ``[L, F]`` that were written (for demos and checks).

    Example (what ``demo/`` can run on a laptop)::

        shards = [{"dense/kernel": rng.normal(size=(64, 32)), "dense/bias": rng.normal(size=32)} for _ in range(8)]
        tpu.simulate_shards(shards, step, "logs/tpu_sim", [{"loss": 0.5}] * 8,
                            weights={"dense/kernel": w, "dense/bias": b})
    """
    if not shards:
        raise ValueError("simulate_shards needs at least one shard")
    if scalars is not None and len(scalars) != len(shards):
        raise ValueError(f"{len(scalars)} scalar mappings for {len(shards)} shards")
    host_call_kwargs = {**host_call_kwargs, "flush_every_call": True}

    def build() -> tuple[list[Any], tf.Tensor]:
        return _simulated_host_call(shards, step, log_dir, scalars, weights, host_call_kwargs)

    if not graph:
        _, merged = build()
        flush(log_dir)
        return merged.numpy()
    if not tf.executing_eagerly():
        with tf.compat.v1.Session() as sess:
            ops, merged = build()
            return sess.run([ops, merged])[1]
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        ops, merged = build()
        return sess.run([ops, merged])[1]

