"""JAX writer: gradient-health records as a pure, ``jax.jit``-able function of a gradient pytree.

* :func:`compute` maps a gradient pytree (from ``jax.grad``, optax, flax, ...) to the stacked records
  ``[L, NUM_FIELDS]`` float32 (the 5 counts as int32 bit patterns, then the value fields and the 77 histogram
  bins, one float32 row a layer), rows named by :func:`layer_names` from the pytree paths (``params/dense/kernel``).
  It is pure: call it inside your jitted step and return the record; only the record leaves the device.
* Sharded gradients: under ``jax.jit`` with sharded inputs (``NamedSharding``) the reductions run where the shards
  live and XLA combines them, so the record is the full gradient's. Inside ``shard_map``, pass the mesh axis:
  ``compute(local_grads, axis_name="data")`` computes each device's shard record and merges them with
  ``lax.pmax`` / ``lax.psum`` (:func:`merge`), the rule of :func:`record.merge_all`.
* :func:`recording` wraps an optax-style ``GradientTransformation`` (``init``/``update``; optax itself is not
  imported): its state carries the record of the gradient and of the transformed update (the update the optimizer
  applies), computed every ``every`` steps. :func:`add_records` / :func:`write_state` copy the record to the host
  and write it with :class:`tb_gradhealth.Writer`; :class:`StepWatch` writes each new one with the step's loss and
  says whether ``stop_on`` asks the loop to stop.
* Frozen parameters: ``compute(..., frozen=mask)`` gives the leaves ``mask`` names the frozen record (no
  statistics computed); :func:`recording` finds the leaves its optimizer never updates from the optimizer's
  structure (``set_to_zero``, ``transforms.freeze``, a ``multi_transform`` partition: :mod:`tb_gradhealth._jaxfrozen`).

* Each layer's output (the forward record, docs/ACTIVATIONS.md): :func:`forward_records` of flax's
  ``capture_intermediates`` or of what a model ``sow``s, inside the jitted step of a logged step (a separate
  ``apply`` with ``capture_intermediates=True`` for those steps only: the other steps' graph is unchanged), and
  :func:`add_forward_records` on the host.

The statistics are :mod:`tb_gradhealth._devicestats`, shared with the PyTorch path; the numbers match
:func:`record.compute` as documented in docs/TORCH_JAX.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from tb_gradhealth import _core, _devicestats, _forwardstats, _jaxfrozen, metadata, record
from tb_gradhealth._core import LayerInputs
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth.live import StopCheck, StopEvent, Stoppable
from tb_gradhealth.writer import Writer

__all__ = ["RecordingState", "StepWatch", "StopEvent", "add_forward_records", "add_records", "compute",
           "forward_names", "forward_records", "frozen_rows", "keras_callback", "layer_names", "merge", "recording",
           "to_memory", "write_state"]

_log = logging.getLogger("tb_gradhealth")
#: What the records' metadata says of the loop when the caller names nothing more.
JAX_LOOP = {"loop": "jax"}


def _histogram(av: jax.Array, w: jax.Array) -> jax.Array:
    """The weights ``w`` added in the decade bins of the magnitudes ``av`` (:func:`_core.exponent_bins`: two
    table look-ups a value, not a binary search; zeros, subnormals and NaN/Inf land past the bins, dropped)."""
    bits = lax.bitcast_convert_type(av.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
    b = _core.exponent_bins(bits, lambda table, e: jnp.asarray(table)[e], lambda t, k: t >> k)
    return jnp.zeros(record.HIST_BINS + 2, w.dtype).at[b].add(w)[: record.HIST_BINS]


def _divide(x: jax.Array, m: jax.Array) -> jax.Array:
    """``x / m`` for ``m`` up to 3.4e38: XLA on CPU computes ``x * (1 / m)`` and flushes a subnormal ``1 / m``
    (``m > 8.5e37``) to zero, so above 2**100 both sides are first scaled by 2**-64 (exact). What that scaling
    flushes (values below 2**-62) is below 2**-162 relative to ``m``: nothing in a sum of squares or a mean."""
    c = jnp.where(m > 2.0**100, 2.0**-64, 1.0)
    return (x * c) / (m * c)


#: Values each partial result of the first level of every reduction covers (see :func:`_fsum`).
_ROW = 32
#: Rows reduced side by side: groups of ``_ROW`` values strided by this many, so that XLA:CPU adds a vector of
#: them at a time (a reduction along rows of contiguous values runs a scalar loop a row).
_LANES = 256


def _by_rows(x: jax.Array, reduce: Callable[..., jax.Array], finish: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """``reduce`` of a flat ``x`` in groups of :data:`_ROW` values (the bulk as ``[-1, _ROW, _LANES]`` reduced over
    its middle axis, the rest in plain rows and a tail), then ``finish`` of the partial results: every reduction
    of a tensor has this one shape, which XLA can fuse into one loop (on GPUs: a reduction of the whole flat
    tensor beside them would be a loop of its own)."""
    n = x.shape[0]
    bulk = n - n % (_ROW * _LANES)
    rows = n - n % _ROW
    parts = []
    if bulk:
        parts.append(jnp.reshape(reduce(jnp.reshape(x[:bulk], (-1, _ROW, _LANES)), axis=1), (-1,)))
    if rows > bulk:
        parts.append(reduce(jnp.reshape(x[bulk:rows], (-1, _ROW)), axis=1))
    if n > rows:
        parts.append(reduce(x[rows:], axis=0, keepdims=True))
    return finish(parts[0] if len(parts) == 1 else jnp.concatenate(parts))


def _fsum(y: jax.Array) -> jax.Array:
    """A flat sum as a tree of rows of 32 (XLA:CPU's single loop adds 1e-6-sized squares to a running sum near 1
    one by one and drifts by a few 1e-6; a tree keeps the error near float32's rounding of the result)."""
    while y.shape[0] > 64:
        y = _by_rows(y, jnp.sum, lambda p: p)
    return jnp.sum(y)


def _min_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(min, max)`` over the same groups as the sums. XLA:CPU's fast min/max
    (``xla_cpu_enable_fast_min_max``) may skip a NaN: :func:`_holds` reads a NaN from the sums instead."""
    return _by_rows(x, jnp.min, jnp.min), _by_rows(x, jnp.max, jnp.max)


def _holds(mn: jax.Array, mx: jax.Array, fast: tuple[jax.Array, jax.Array]) -> jax.Array:
    """:func:`_devicestats.one_pass_ok` of the extremes, and the one-pass sums finite: a NaN (which the extremes
    may have skipped) makes every sum NaN."""
    return _devicestats.one_pass_ok(jnp, mn, mx) & jnp.all(jnp.isfinite(fast[1]))


def _count_normal(x: jax.Array) -> jax.Array:
    """The number of values with ``|x| >= FLUSH_BELOW``, over the same rows as the other reductions."""
    return _by_rows(jnp.abs(x) >= record.FLUSH_BELOW, lambda r, **k: jnp.sum(r, dtype=jnp.int32, **k), jnp.sum)


_BE = _devicestats.Backend(
    jnp, lambda t: jnp.asarray(t).astype(jnp.float32), _histogram, lambda a, like: jnp.asarray(a),
    _divide, lambda pred, true_fn, false_fn, operands: lax.cond(pred, true_fn, false_fn, *operands), _fsum,
    aminmax=_min_max, count_normal=_count_normal, holds=_holds,
)


_unit_extremes = _forwardstats.per_unit_extremes(jnp.min, jnp.max)


def _is_none(x: Any) -> bool:
    return x is None


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _leaves(tree: Any) -> tuple[list[str], list[Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
    return ["/".join(_key_name(k) for k in path) or f"layer_{i}" for i, (path, _) in enumerate(flat)], \
        [leaf for _, leaf in flat]


def layer_names(grads: Any) -> list[str]:
    """Row names: each leaf's pytree path joined with ``/`` (dict keys, attribute names, sequence indices)."""
    return _leaves(grads)[0]


def _mix(h: jax.Array) -> jax.Array:
    """A uint32 hash finaliser (murmur3's), so nearby seeds and layers give unrelated offsets."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _sampler(x: jax.Array, hist_sample: int, layer: int, seed: Any) -> Callable[[jax.Array], jax.Array] | None:
    """The values at :func:`_core.sample_positions` of ``x``, the offset from ``seed`` or the data (``None``: the
    exact histogram is due)."""
    n = int(x.size)
    if not hist_sample or n <= hist_sample:
        return None
    if seed is None:
        h = _core.probe_hash(lax.bitcast_convert_type(x[jnp.asarray(_core.probe_indices(n))], jnp.uint32))
    else:
        h = jnp.asarray(seed).astype(jnp.uint32) * jnp.uint32(0x9E3779B9)
    offset = _mix(h + jnp.uint32(record.sample_salt(layer) & 0xFFFFFFFF)) % jnp.uint32(n)
    pos = _core.sample_positions(offset, n, hist_sample, const=lambda a: jnp.asarray(a, jnp.uint32))
    return lambda v: v[pos.astype(jnp.int32)]


def _flat(t: Any) -> jax.Array:
    return jnp.reshape(jnp.asarray(t), (-1,)).astype(jnp.float32)  # the values as float32 holds them


def _aligned(tree: Any, names: list[str]) -> list[Any]:
    if tree is None:
        return [None] * len(names)
    got = dict(zip(*_leaves(tree), strict=True))
    return [got.get(n) for n in names]


def frozen_rows(frozen: Any, names: list[str]) -> list[bool]:
    """Which of the rows ``names`` are frozen: ``frozen`` is ``None`` (none), a predicate on the row name
    (``lambda name: name.startswith("params/backbone/")``), or a pytree of bools (an optax-style mask: a leaf
    freezes the row at its path and every row under it, ``{"params": {"backbone": True}}``). The mask is static:
    Python or numpy bools, known when a step is traced."""
    if frozen is None:
        return [False] * len(names)
    if callable(frozen):
        flags = [frozen(n) for n in names]
        bad = next((n for n, f in zip(names, flags, strict=True) if not isinstance(f, (bool, np.bool_))), None)
        if bad is not None:
            raise TypeError(f"frozen: the predicate must return a bool for a row name; it returned "
                            f"{type(flags[names.index(bad)]).__name__} for {bad!r}")
        return [bool(f) for f in flags]
    marks = {}
    for n, leaf in zip(*_leaves(frozen), strict=True):
        if leaf is None:
            continue
        if isinstance(leaf, jax.core.Tracer):
            raise TypeError(f"frozen: the mask's leaf {n!r} is traced; give Python or numpy bools")
        marks[n] = bool(np.asarray(leaf))

    def flag(name: str) -> bool:
        parts = name.split("/")
        return next((marks[p] for p in ("/".join(parts[:k]) for k in range(len(parts), 0, -1)) if p in marks),
                    False)

    return [flag(n) for n in names]


def _frozen_record(size: int) -> tuple[jax.Array, jax.Array]:
    """``(counts, values)`` of a frozen layer of ``size`` elements (:func:`record.frozen`): constants."""
    row = record.frozen(size)
    return (jnp.asarray(row[: record.NUM_COUNTS], jnp.int32),
            jnp.asarray(row[record.NUM_COUNTS:], jnp.float32))


def compute(grads: Any, weights: Any = None, updates: Any = None, *, hist_sample: int = record.DEFAULT_HIST_SAMPLE,
            seed: Any = None, axis_name: Any = None, frozen: Any = None) -> jax.Array:
    """Packed records ``[L, NUM_FIELDS]`` float32 of the gradient pytree ``grads`` (pure; jit-able).

    ``weights`` / ``updates``: pytrees with the same paths (e.g. the params and the optimizer's updates) for the
    optional norms. A ``None`` leaf is a missing gradient (its size from ``weights``). ``seed`` (an int or a traced
    scalar, e.g. the step) seeds histogram sampling; by default it comes from the data. ``axis_name``: inside
    ``shard_map``, the mesh axis over which ``grads`` are sharded: the shards' records are merged (:func:`merge`).
    ``frozen`` (:func:`frozen_rows`: a mask or a predicate on the row name): those leaves get the frozen record
    (:func:`record.frozen`, their size and nothing else), their gradient unread.
    """
    names, glist = _leaves(grads)
    wlist = _aligned(weights, names)
    inputs = LayerInputs(grads=glist, weights=wlist, updates=_aligned(updates, names),
                         sizes=[_size(g, w) for g, w in zip(glist, wlist, strict=True)],
                         hist_sample=hist_sample, seed=seed)
    rows = [_frozen_record(inputs.sizes[i]) if f else _layer_record(inputs, i)
            for i, f in enumerate(frozen_rows(frozen, names))]
    if not rows:
        return jnp.zeros((0, record.NUM_FIELDS), jnp.float32)
    c, v = jnp.stack([c for c, _ in rows]), jnp.stack([v for _, v in rows])
    if axis_name is not None:
        return merge(c, v, axis_name)
    return _stack(c, v)


def _size(g: Any, w: Any) -> int:
    """A layer's element count: its gradient's, else (missing) its weight's, else 0."""
    t = g if g is not None else w
    return 0 if t is None else int(np.size(t))


def _layer_record(inputs: LayerInputs, i: int) -> tuple[jax.Array, jax.Array]:
    """``(counts int32 [5], values float32 [89])`` of layer ``i`` (a ``None`` or empty gradient: the empty record
    of the layer's size)."""
    g, w, u = inputs.grads[i], inputs.weights[i], inputs.updates[i]
    wr = None if w is None else _devicestats.norm_stats(_BE, _flat(w))
    ur = None if u is None else _devicestats.norm_stats(_BE, _flat(u))
    if g is None or np.size(g) == 0:
        c = jnp.asarray([inputs.sizes[i], 0, 0, 0, 0], jnp.int32)
        gv = _devicestats.empty_values(_BE, None)
    else:
        x = _flat(g)
        c, gv = _devicestats.grad_stats(_BE, x, 0, inputs.hist_sample, _sampler(x, inputs.hist_sample, i, inputs.seed))
    return c.astype(jnp.int32), _devicestats.assemble(_BE, gv, wr, ur, g is None)


def _stack(counts: jax.Array, values: jax.Array) -> jax.Array:
    """``[L, 5]`` int counts and ``[L, 89]`` float32 values -> the stacked ``[L, 94]`` float32 array."""
    return _core.stack(lax.bitcast_convert_type(counts.astype(jnp.int32), jnp.float32), values.astype(jnp.float32),
                       lambda p: jnp.concatenate(p, axis=1))


def merge(counts: jax.Array, values: jax.Array, axis_name: Any) -> jax.Array:
    """Merge the shards' records over the mapped axis ``axis_name`` (``lax.pmax`` then ``lax.psum``; counts in
    int32, exact) into the full tensors' stacked records, on every shard."""
    c, v = _devicestats.merge(_BE, counts, values, lambda t: lax.pmax(t, axis_name), lambda t: lax.psum(t, axis_name),
                             all_sum_counts=lambda t: lax.psum(t, axis_name))
    return _stack(c, v)


def to_memory(stacked: Any) -> np.ndarray:
    """Packed records (device or host) -> memory-form rows ``[L, NUM_FIELDS]`` float64: the one host copy."""
    return _core.decode_stacked(jax.device_get(stacked))


def add_records(writer: Writer, step: int, names: list[str], stacked: Any, *, name: str = "gradients",
                frozen: Any = None, source: Mapping[str, str] | None = None) -> str:
    """Copy stacked records (e.g. returned by a jitted step) to the host and write them. Returns the tag.
    ``frozen`` (:func:`frozen_rows`): those rows are written as the frozen record of their size, filled on the
    host, whatever was computed for them. ``source``: what the tags' metadata says of the loop (default ``{"loop":
    "jax"}``; an optimizer's name may be added, e.g. ``{"loop": "jax", "optimizer": "adamw"}``)."""
    rows = to_memory(stacked)
    flags = frozen_rows(frozen, list(names))
    if any(flags):
        rows = _core.with_frozen(rows[[not f for f in flags]], flags, rows[:, record.INDEX["size"]])
    return writer.add_records(step, names, rows, name=name, source=source or JAX_LOOP)


# --- forward records -----------------------------------------------------------------------------------------


#: The row order :func:`forward_records` saw each structure of outputs in (the order the layers were called):
#: a dict that leaves a jitted function comes back with its keys sorted, so :func:`forward_names` of the returned
#: outputs looks its order up here by their structure (which sorting leaves the same).
_CALL_ORDER: dict[Any, list[str]] = {}


def _ordered(tree: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """``(path, leaf)`` of every array of a pytree of dicts, tuples and lists, dicts in their own order (flax fills
    its ``intermediates`` as the layers are called), unlike ``tree_flatten``, which sorts dict keys."""
    if isinstance(tree, Mapping):
        return [item for k, v in tree.items() for item in _ordered(v, (*path, str(k)))]
    if isinstance(tree, (tuple, list)):
        return [item for i, v in enumerate(tree) for item in _ordered(v, (*path, f"#{i}"))]
    return [] if tree is None else [(path, tree)]


def _forward_leaves(outputs: Any) -> tuple[list[str], list[Any]]:
    """``(row names, arrays)`` of a pytree of layer outputs, in call order: flax's ``capture_intermediates``
    (``{"Dense_0": {"__call__": (out,)}}``: the method name left out, a module called again gets ``#1``, ``#2``), a
    ``sow`` collection, or a plain ``{name: array}``. The root module's own output (a ``__call__`` at the top) is
    the last layer's again: left out."""
    names, arrays = [], []
    for path, leaf in _ordered(outputs):
        keys = [k for k in path if k != "__call__"]
        call = keys.pop() if keys and keys[-1].startswith("#") else "#0"
        if not keys:
            continue
        names.append("/".join(keys) + ("" if call == "#0" else call))
        arrays.append(leaf)
    return names, arrays


def forward_names(outputs: Any) -> list[str]:
    """The row names :func:`forward_records` gives ``outputs``, in the order it saw the layers called (also for
    outputs returned by the jitted function, whose dicts come back sorted)."""
    known = _CALL_ORDER.get(jax.tree_util.tree_structure(outputs))
    return list(known) if known is not None else _forward_leaves(outputs)[0]


def forward_records(outputs: Any, *, activations: Mapping[str, str] | None = None,
                    unit_axis: int | Mapping[str, int] = -1) -> jax.Array:
    """Each layer's output as its forward record (docs/ACTIVATIONS.md), computed on the device (inside a jitted
    step too): ``[L, ACT_NUM_FIELDS]`` float32 in the disk form, rows in :func:`forward_names` order.

    ``outputs``: the layer outputs of one batch, e.g. ``mutated["intermediates"]`` of ``model.apply(variables, x,
    capture_intermediates=True, mutable=["intermediates"])`` (every module's output: a ``Dense`` before the
    activation function that follows it) or the ``intermediates`` a model ``sow``s (``self.sow("intermediates",
    "relu_1", x)``: post-activation values of your choice). ``activations``: ``{row name: activation}`` (a bounded
    one gets its saturated count); ``unit_axis``: -1 (flax's features last) or ``{row name: axis}``.
    """
    names, arrays = _forward_leaves(outputs)
    _CALL_ORDER[jax.tree_util.tree_structure(outputs)] = names
    acts = dict(activations or {})
    axes = dict(unit_axis) if isinstance(unit_axis, Mapping) else dict.fromkeys(names, unit_axis)
    rows = []
    for n, x in zip(names, arrays, strict=True):
        bounds = record.activation_bounds(acts.get(n, ""))
        stats = _forwardstats.output_stats(_BE, jnp.asarray(x), unit_axis=int(axes.get(n, -1)), bounds=bounds,
                                           unit_extremes=_unit_extremes)
        rows.append(_forwardstats.disk_row(_BE, stats, bounds,
                                           lambda c: lax.bitcast_convert_type(c.astype(jnp.int32), jnp.float32)))
    return jnp.stack(rows) if rows else jnp.zeros((0, record.ACT_NUM_FIELDS), jnp.float32)


def add_forward_records(writer: Writer, step: int, names: Sequence[str], stacked: Any, *,
                        activations: Mapping[str, str] | None = None, name: str = "gradients",
                        source: Mapping[str, str] | None = None) -> str:
    """Copy :func:`forward_records` (e.g. returned by a jitted step) to the host and write them beside the
    gradients of the stream ``name``; ``activations`` as given to :func:`forward_records` (kept in the tag's
    metadata for the diagnosis). Returns the tag."""
    rows = record.act_from_disk(np.asarray(jax.device_get(stacked), dtype=np.float32))
    acts = dict(activations or {})
    info = [("", str(acts.get(n, ""))) for n in names] if acts else ()
    return writer.add_records(step, list(names), rows, name=name, kind=record.ACTIVATIONS, layer_info=info,
                              source=source or JAX_LOOP)


# --- optax-style wrapper --------------------------------------------------------------------------------------


class RecordingState(NamedTuple):
    """State of :func:`recording`: the inner state, the step count, and the last logged step's record."""

    inner: Any
    count: jax.Array
    #: Packed records of the gradients with the transformed updates' norms, computed at step ``recorded_at``.
    record: jax.Array
    recorded_at: jax.Array


class GradientTransformation(NamedTuple):
    """The optax protocol (``init(params)``, ``update(updates, state, params=None)``), without importing optax."""

    init: Callable[..., Any]
    update: Callable[..., Any]


def recording(
    inner: Any, *, every: int = 100, first: int = 10, weights: bool = True,
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
) -> GradientTransformation:
    """Wrap an optax-style transformation so that its state records the gradients it receives and the update it
    returns (``update_max_abs``/``update_ssq_rel``: the update the optimizer applies) on the ``first`` steps and
    every ``every``-th (by default the Keras callback's cadence, 100, after the first 10 steps).

    Use it as the last (outermost) transformation so the recorded update is the applied one, e.g.
    ``recording(optax.adamw(1e-3))``. Between logged steps ``lax.cond`` skips the statistics. Write with
    :func:`write_state` outside the jitted step (layer names: :func:`layer_names` of the gradients).

    A leaf whose update ``inner`` makes zero by construction (``optax.set_to_zero``, ``optax.transforms.freeze``,
    a ``multi_transform`` / ``partition`` label mapped to ``set_to_zero``: how optax and flax freeze a subtree) is
    recorded frozen: read once from the jaxpr of ``inner.update`` (:mod:`tb_gradhealth._jaxfrozen`), when the step
    is traced, never from the values.
    """
    never: dict[Any, Any] = {}  # the frozen mask of each structure of (grads, state, params)

    def frozen_mask(grads: Any, inner_state: Any, params: Any, extra: dict[str, Any]) -> Any:
        key = jax.tree_util.tree_structure((grads, inner_state, params, extra))
        if key not in never:
            never[key] = _jaxfrozen.never_updated(inner.update, grads, inner_state, params, extra)
        return never[key]

    def init(params: Any) -> RecordingState:
        n = len(layer_names(params))
        return RecordingState(inner.init(params), jnp.zeros([], jnp.int32),
                              jnp.zeros((n, record.NUM_FIELDS), jnp.float32), jnp.full([], -1, jnp.int32))

    def update(grads: Any, state: RecordingState, params: Any = None, **extra: Any) -> tuple[Any, RecordingState]:
        new_updates, new_inner = inner.update(grads, state.inner, params, **extra)

        frozen = frozen_mask(grads, state.inner, params, extra)

        def rec() -> tuple[jax.Array, jax.Array]:
            w = params if weights else None
            return compute(grads, w, new_updates, hist_sample=hist_sample, seed=state.count, frozen=frozen), \
                state.count

        logged = (state.count % every == 0) | (state.count < first)
        r, at = lax.cond(logged, rec, lambda: (state.record, state.recorded_at))
        return new_updates, RecordingState(new_inner, state.count + 1, r, at)

    return GradientTransformation(init, update)


def write_state(writer: Writer, state: RecordingState, names: list[str], *, name: str = "gradients") -> int | None:
    """Write the record a :func:`recording` state holds, at the step it was computed (host copy: the record and
    one int). Returns that step, or ``None`` when nothing was recorded yet. Call it once per logged step."""
    at = int(jax.device_get(state.recorded_at))
    if at < 0:
        return None
    add_records(writer, at, names, state.record, name=name)
    return at


class StepWatch(Stoppable):
    """A JAX/optax loop's logged steps written with their loss, and ``stop_on``: call :meth:`step` after each
    training step; it says whether to stop.

    ``names``: the rows (:func:`layer_names` of the gradients); ``stop_on``: statuses of
    :data:`tb_gradhealth.health.FLAGS` (e.g. ``("nonfinite", "exploding")``; empty: never stop) checked with
    ``thresholds`` by the diagnosis ``tb-gradhealth report --step S`` gives on the logdir at each logged step ``S``
    (:class:`tb_gradhealth.live.StopCheck`); ``optimizer``: its name, kept in the tags' metadata for the diagnosis
    (e.g. ``"sgd"``; ``momentum``: its momentum, where it has one).
    """

    def __init__(self, writer: Writer, names: Sequence[str], *, stop_on: Sequence[str] = (), thresholds: Any = None,
                 name: str = "gradients", optimizer: str | None = None, momentum: float | None = None) -> None:
        self.writer, self.names, self.name = writer, list(names), name
        self.source = {**JAX_LOOP, **({"optimizer": optimizer} if optimizer else {}),
                       **({"momentum": f"{momentum:g}"} if momentum else {})}
        self._stop = StopCheck(stop_on, thresholds=thresholds, name=name) if stop_on else None
        if self._stop is not None:
            self._stop.watch(writer)
        #: the step of the last record written (-1: none yet)
        self.last_step = -1

    def step(self, record_or_state: Any, *, loss: Any = None, step: int | None = None) -> bool:
        """After a training step: the :func:`recording` state (its record is written once, at the step it was
        computed: the first call that sees it; the other calls read one int) or a stacked record of ``step``
        (:func:`compute`'s, returned by the step), written with the step's ``loss``; then ``stop_on``'s check of
        that step. Returns :attr:`should_stop`."""
        if isinstance(record_or_state, RecordingState):
            at = int(jax.device_get(record_or_state.recorded_at))
            stacked = record_or_state.record
        elif step is None:
            raise TypeError("step: a stacked record needs the step it was computed at")
        else:
            at, stacked = int(step), record_or_state
        if at < 0 or at == self.last_step:
            return self.should_stop
        self.last_step = at
        if loss is not None:
            self.writer.add_loss(at, loss)
        add_records(self.writer, at, self.names, stacked, name=self.name, source=self.source)
        if self._stop is not None and self._stop.event is None and (event := self._stop.check(at)) is not None:
            _log.warning("%s; the loop should stop (StepWatch.should_stop)", event.message())
        return self.should_stop


def keras_callback(writer: Writer, key: str = "gradhealth", *, every: int = 1, name: str = "gradients") -> Any:
    """A Keras 3 callback (JAX backend) that writes the stacked record a custom ``train_step`` puts in its logs.

    Keras' own callback cannot see the gradients on the JAX backend (``fit`` computes them inside its jitted
    ``train_step``), so the step computes the record itself: ``logs[key] = tb_gradhealth.jax.compute(grads,
    trainable_variables, updates)`` (docs/TORCH_JAX.md has the whole ``train_step``). Rows are named by the model's
    ``trainable_variables`` paths; steps count the training batches this callback has seen, from 0. On those steps
    it also writes the ``loss`` of the logs (:meth:`Writer.add_loss`) and keeps each variable's layer kind and
    activation in the tags' metadata (:func:`tb_gradhealth.layerinfo.model_layer_info`): evidence the diagnosis
    weighs.
    """
    import keras

    from tb_gradhealth.layerinfo import model_layer_info

    class GradHealthLogs(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.step = 0
            #: what failed on the host costs a warning and a count, never the training
            self.failsafe = Failsafe()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if logs and key in logs and self.step % every == 0:
                self.failsafe.run("writing a gradient-health record", self.write, logs[key], records=1)
                if "loss" in logs:
                    self.failsafe.run("recording the loss", writer.add_loss, self.step, logs["loss"])
            self.step += 1

        def write(self, stacked: Any) -> None:
            variables = self.model.trainable_variables
            info = self.failsafe.run("reading the layers' kinds", model_layer_info, self.model, variables) or ()
            writer.add_records(self.step, [v.path for v in variables], to_memory(stacked), name=name, layer_info=info,
                               source=metadata.loop_source("keras.fit", self.model.optimizer))

    return GradHealthLogs()
