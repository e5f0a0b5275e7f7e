"""Gradient health across shards and replicas: TPU ``host_call`` and ``tf.distribute`` helpers.

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
``host_call(..., all_reduced=True)``, :func:`applied_record` and docs/DISTRIBUTED.md.

Layer names never travel in tensors: they are Python-side constants captured by ``host_call_fn``.

The host side needs the Python interpreter of the process that builds the graph (``tf.numpy_function``): true for
TPU VMs and for CPU/GPU, not for the old remote "TPU Node" set-up where host ops ran on a remote worker.
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import metadata, record, summary

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

# --- shared pieces --------------------------------------------------------------------------------------------


def _check_log_dir(log_dir: Any) -> str:
    if log_dir is None or not isinstance(log_dir, str | os.PathLike) or not str(log_dir):
        raise ValueError(f"log_dir must be a non-empty path (str or os.PathLike), got {log_dir!r}")
    return os.fspath(log_dir)


def _scalar_tensor(value: Any, what: str, dtype: tf.DType | None = None) -> tf.Tensor:
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


def _check_scalars(scalars: Mapping[str, Any] | None) -> dict[str, tf.Tensor]:
    if scalars is None:
        return {}
    if not isinstance(scalars, Mapping):
        raise ValueError(f"scalars must be a mapping {{tag: scalar}}, got {type(scalars).__name__}")
    out = {}
    for tag, value in scalars.items():
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"scalar tags must be non-empty strings, got {tag!r}")
        out[tag] = _scalar_tensor(value, f"scalar {tag!r}", tf.float32)
    return out


def _prepare(grads_and_vars: Any, layers: Sequence[str] | None) -> tuple[list[str], Any]:
    """(layer names, the input in a re-iterable form) from any form ``summary.normalize`` accepts, checked now."""
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
    names = summary.layer_names(grads_and_vars)
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


def _compute(
    grads_and_vars: Any, record_weights: bool, hist_sample: int | None, seed: Any, weights: Any = None
) -> Any:
    if weights is None:
        weights = True if record_weights else None
    return summary.compute(grads_and_vars, weights, hist_sample=hist_sample or 0, seed=seed)


def _merge_device_records(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Shard/replica records ``[S, L, ...]`` (device form) → merged memory-form rows ``[L, F]`` (float64)."""
    return record.merge_all(record.from_device(counts, values), axis=0)


def _disk_from_device(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
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
# flushes those) and also made a control dependency of the writes, so a plain v1 session works too.
_EAGER_WRITERS: dict[str, Any] = {}
_GRAPH_WRITERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _summary_writer(log_dir: str) -> tuple[Any, bool]:
    """``(writer, in_v1_graph)``: an eager writer (also used from ``tf.function``) or one of the current v1 graph."""
    with tf.init_scope():
        if tf.executing_eagerly():
            writer = _EAGER_WRITERS.get(log_dir)
            if writer is None:
                writer = _EAGER_WRITERS[log_dir] = tf.summary.create_file_writer(log_dir)
            return writer, False
        graph = tf.compat.v1.get_default_graph()
        per_graph = _GRAPH_WRITERS.setdefault(graph, {})
        if log_dir not in per_graph:
            per_graph[log_dir] = tf.summary.create_file_writer(log_dir)
        return per_graph[log_dir], True


def flush(log_dir: str | os.PathLike | None = None) -> None:
    """Flush the eager summary writers this module opened (all, or the one of ``log_dir``) to disk."""
    for d, w in list(_EAGER_WRITERS.items()):
        if log_dir is None or d == os.fspath(log_dir):
            w.flush()


def _flush_at_exit() -> None:
    try:
        flush()
    except Exception:  # noqa: BLE001 - interpreter shutdown: TF may already be half torn down
        pass


atexit.register(_flush_at_exit)


def _write(
    disk: tf.Tensor, layers: Sequence[str], step: tf.Tensor, log_dir: str, scalars: Mapping[str, tf.Tensor],
    name: str, kind: str, hist_sample: int | None, do_flush: bool,
) -> list[Any]:
    """Summary ops writing one disk-form record tensor and plain scalars at ``step``; works eagerly and in graphs."""
    writer, in_v1_graph = _summary_writer(log_dir)
    tag = metadata.tag_for(list(layers), name)
    md = metadata.create_summary_metadata(list(layers), kind=kind, hist_sample=hist_sample or 0)
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


# --- TPU host_call --------------------------------------------------------------------------------------------


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
    log_dir = _check_log_dir(log_dir)
    names, grads_and_vars = _prepare(grads_and_vars, layers)
    step_t = _scalar_tensor(step, "step", tf.int64)
    scalar_ts = _check_scalars(scalars)
    rec = _compute(grads_and_vars, record_weights, hist_sample, seed, weights)
    tensors = [rec.counts[tf.newaxis], rec.values[tf.newaxis], tf.reshape(step_t, [1])]
    tensors += [tf.reshape(v, [1]) for v in scalar_ts.values()]
    scalar_tags = list(scalar_ts)
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
        disk = tf.numpy_function(_disk_from_device, [counts, values], tf.float32, stateful=False)
        disk.set_shape([n_layers, None])
        step0 = tf.reshape(tf.convert_to_tensor(steps), [-1])[0]
        means = {t: tf.reduce_mean(tf.cast(v, tf.float32)) for t, v in zip(scalar_tags, scalar_values, strict=True)}
        return _write(disk, names, step0, log_dir, means, name, "gradients", hist_sample, flush_every_call)

    host_call_fn.layers = tuple(names)  # type: ignore[attr-defined]
    return host_call_fn, tensors


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

    def tensors_of(shard: Any) -> Any:
        if isinstance(shard, Mapping):
            return {k: v if v is None or tf.is_tensor(v) else tf.constant(np.asarray(v, np.float32))
                    for k, v in shard.items()}
        return shard

    def build() -> tuple[list[Any], tf.Tensor]:
        w = None if weights is None else tensors_of(weights)
        built = [
            host_call(tensors_of(s), step, log_dir, None if scalars is None else scalars[i], weights=w,
                      **host_call_kwargs)
            for i, s in enumerate(shards)
        ]
        layer_sets = {fn.layers for fn, _ in built}
        if len(layer_sets) != 1:
            raise ValueError("all shards must have the same layers")
        concat = [tf.concat(list(parts), axis=0) for parts in zip(*(t for _, t in built), strict=True)]
        keep = 1 if host_call_kwargs.get("all_reduced") else None  # what host_call_fn keeps, for the return value
        return built[0][0](*concat), merge_shards(concat[0][:keep], concat[1][:keep])

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


# --- tf.distribute (TF2) --------------------------------------------------------------------------------------


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
    _, grads_and_vars = _prepare(grads_and_vars, None)
    return _compute(grads_and_vars, record_weights, hist_sample, seed)


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
    names, grads_and_vars = _prepare(grads_and_vars, None)
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
    return _compute(rebuilt, record_weights, hist_sample, seed)


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
        return merge_shards(tf.stack(list(counts)), tf.stack(list(values)))


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
    step_t = _scalar_tensor(step, "step", tf.int64)
    rows = merge_replicas(strategy, per_replica_record, all_reduced=all_reduced)
    if log_dir is None:
        summary.write(_device_from_rows(rows), layers, step=step_t, name=name, hist_sample=hist_sample or 0)
        return rows
    disk = tf.numpy_function(record.to_disk, [rows], tf.float32, stateful=False)
    disk.set_shape([len(layers), None])
    _write(disk, layers, step_t, _check_log_dir(log_dir), {}, name, "gradients", hist_sample, False)
    return rows
