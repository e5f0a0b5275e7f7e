"""Device-side statistics of ONE layer's gradient-health record: TF ops, XLA-safe, static shapes.

Records of whole models come from :mod:`tb_gradhealth._tf.packed` (all layers from a fixed number of XLA loops); this
module computes a layer on its own: with plain TF ops (``summary.compute(..., jit=False)``, or a TensorFlow without
XLA's variadic reduce), and for ``IndexedSlices`` gradients. One layer's record (:func:`layer_record`) is
``(counts int32 [5], values float32 [89])``, the numbers of :func:`tb_gradhealth.record.compute` (the float64
reference) computed where the gradient lives:

* under XLA, float32 statistics run in one blocked loop over the gradient (:func:`_reduce_rows`: one float32 sum
  and int32 reductions, the only kind XLA:CPU runs at memory speed): ``sum(g*g)``, the exact-zero count, and
  ``max``/``min`` as int32 order-preserving keys; ``sum(g)`` as a reduction of its own. When both sums are finite
  there is no NaN/Inf and those counts are 0; only otherwise does a ``tf.cond`` branch count NaN/+Inf/-Inf and
  recompute over the finite values;
* the norm is kept as ``max|g|`` and ``ssq_rel = sum(g*g) / max|g|^2``; the plain sum of squares is used only when it
  is finite and ``max|g|`` is large enough that underflowed squares are negligible, else a second pass sums
  ``(g / max|g|)^2``, right over float32's whole range;
* the histogram comes from :mod:`tb_gradhealth._tf.histogram`.

The private XLA reduce is reached through :mod:`tb_gradhealth._tf.compat`; docs/PERFORMANCE.md has the measured costs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tb_gradhealth import record
from tb_gradhealth._core import LayerInputs
from tb_gradhealth._tf import compat, histogram
from tb_gradhealth.record import Delta

_NV = record.NUM_VALUES + record.HIST_BINS
#: Below this max|g| the plain sum of squares may lose underflowed squares: use the scaled pass instead.
_FAST_MIN = {tf.float32: 1e-10, tf.float64: 1e-140}

class DeviceRecord(NamedTuple):
    """Records of ``L`` layers in device form: ``counts`` int32 ``[L, 5]``, ``values`` float32 ``[L, 89]``."""

    counts: Any
    values: Any


@functools.cache
def fused_reductions_available() -> bool:
    """Whether this TensorFlow has XLA's variadic reduce (then :mod:`tb_gradhealth._tf.packed` computes records)."""
    return compat.has_variadic_reduce()


def fused_reductions() -> bool:
    """Whether to reduce in XLA variadic loops: under XLA, when this TensorFlow has them (else plain TF ops)."""
    return compat.in_xla_context() and fused_reductions_available()


def _flat(t: Any, keep_float64: bool = False) -> tf.Tensor:
    """``t`` flattened, as float32: a record describes the values as float32 holds them (float16 / bfloat16 / ints
    exactly; float64 rounded, beyond float32's range to +-Inf, as in :func:`tb_gradhealth.record.flush_to_zero`)."""
    x = tf.reshape(tf.convert_to_tensor(t), [-1])
    if x.dtype != tf.float32 and not (keep_float64 and x.dtype == tf.float64):
        x = tf.cast(x, tf.float32)
    return x


_REDUCERS: dict[tuple, Any] = {}
_COMBINE = {"sum": tf.add, "max": tf.maximum, "min": tf.minimum}
_FINISH = {"sum": tf.reduce_sum, "max": tf.reduce_max, "min": tf.reduce_min}
#: Elements per row of the blocked reductions (see :func:`_reduce_rows`).
_ROW = 1024


def _init(kind: str, dtype: tf.DType) -> tf.Tensor:
    if kind == "sum":
        return tf.constant(0, dtype)
    if dtype.is_integer:
        return tf.constant(dtype.min if kind == "max" else dtype.max, dtype)
    return tf.constant(-np.inf if kind == "max" else np.inf, dtype)


def _variadic(operands: list[tf.Tensor], kinds: tuple[str, ...], axis: int) -> list[tf.Tensor]:
    """Several reductions of same-shape tensors along ``axis`` in one loop (an XLA variadic reduce); outside XLA,
    one TensorFlow reduction each (same results: empty reductions give the same identities)."""
    if not compat.in_xla_context():
        return [_FINISH[k](x, axis) for k, x in zip(kinds, operands, strict=True)]
    key = tuple((k, x.dtype) for k, x in zip(kinds, operands, strict=True))
    if key not in _REDUCERS:

        def combine(*args):
            n = len(kinds)
            return tuple(_COMBINE[k](a, b) for k, a, b in zip(kinds, args[:n], args[n:], strict=True))

        specs = [tf.TensorSpec([], x.dtype) for x in operands] * 2
        _REDUCERS[key] = tf.function(combine, autograph=False).get_concrete_function(*specs)
    init = [_init(k, x.dtype) for k, x in zip(kinds, operands, strict=True)]
    return compat.variadic_reduce(operands, init, axis, _REDUCERS[key])


def _reduce_together(operands: list[tf.Tensor], kinds: tuple[str, ...]) -> list[tf.Tensor]:
    """Several full reductions of same-length vectors in ONE pass (XLA variadic reduce; only under XLA).

    Used for float64 data, and for float32 when the loop would need more than one float32 sum (slow: below).
    """
    return _variadic(operands, kinds, 0)


def _reduce_rows(make: Callable[..., list[tf.Tensor]], vectors: Sequence[tf.Tensor], kinds: tuple[str, ...]):
    """Full reductions of ``make(*vectors)`` (elementwise operands) in one blocked loop over the data.

    The vectors are viewed as rows of ``_ROW`` elements (a free reshape of a prefix; the ragged tail is reduced
    on its own), one XLA variadic reduce gives each operand's per-row results, and small reductions finish them.

    Why this shape (measured: docs/DEVELOPMENT.md, design notes): XLA:CPU runs a variadic reduce with **one float32
    sum and any number of int32 reductions** at memory speed, but one with two float sums, or a float max/min, as a
    scalar loop several times slower. So callers pass at most one float32 sum and turn max/min into int32
    reductions of order-preserving keys (:func:`_order_key`). The rows keep the float32 sum accurate: per-row
    partial sums of ~1K values, then a sum of those, instead of one running sum over the whole tensor.
    """
    n = vectors[0].shape[0]
    rows = 1 if n is None else max(1, n // _ROW)  # unknown length: one row (the histogram then asks for a shape)
    if rows == 1:
        return _variadic(make(*vectors), kinds, 0)
    main = n // rows * rows
    views = [tf.reshape(v[:main] if main < n else v, [rows, main // rows]) for v in vectors]
    partial = _variadic(make(*views), kinds, 1)
    out = [_FINISH[k](p) for k, p in zip(kinds, partial, strict=True)]
    if main < n:
        tail = _variadic(make(*[v[main:] for v in vectors]), kinds, 0)
        out = [_COMBINE[k](a, b) for k, a, b in zip(kinds, out, tail, strict=True)]
    return out


def _flip(b: tf.Tensor) -> tf.Tensor:
    """Sign-magnitude int32 bits <-> two's-complement order keys (the map is its own inverse)."""
    return tf.bitwise.bitwise_xor(b, tf.bitwise.bitwise_and(tf.bitwise.right_shift(b, 31), 0x7FFFFFFF))


def _order_key(x: tf.Tensor) -> tf.Tensor:
    """int32 keys that sort like the float32 values, so max/min run as int reductions."""
    return _flip(tf.bitcast(x, tf.int32))


def _from_order_key(k: tf.Tensor, empty: float) -> tf.Tensor:
    """The float32 value of a key; ``empty`` (-inf for a max, +inf for a min) where the reduction saw nothing
    (its int32 init, which is the key of a NaN: no NaN reaches the fast path that uses these keys)."""
    init = tf.int32.min if empty < 0 else tf.int32.max
    return tf.where(tf.equal(k, init), tf.constant(empty, tf.float32), tf.bitcast(_flip(k), tf.float32))


def _abs_bits(x: tf.Tensor) -> tf.Tensor:
    """``|x|`` as int32 bits: they sort like the magnitudes (NaN above +Inf), so ``max`` is an int reduction."""
    return tf.bitcast(tf.abs(x), tf.int32)


def _max_abs_and_ssq_f32(v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(max|v|, sum v^2)`` of a float32 vector in one fast blocked loop (see :func:`_reduce_rows`)."""
    q, m = _reduce_rows(lambda c: [c * c, _abs_bits(c)], [v], ("sum", "max"))
    return tf.bitcast(m, tf.float32), q


def _first_pass(x: tf.Tensor, x_hi: tf.Tensor, x_lo: tf.Tensor, tiny: tf.Tensor, fused: bool
                ) -> tuple[list[tf.Tensor], tf.Tensor, tf.Tensor, tf.Tensor]:
    """``(sum(term(x)) of each record.GRAD_SUMS term, max, min, zero count)`` of a gradient (``x_hi``/``x_lo``:
    ``x`` with padding masked for max/min).

    Under XLA with float32 data: the sum of squares, the zero count and max/min (as int32 keys) in one blocked loop
    (:func:`_reduce_rows`), each other term's sum as a reduction of its own (the plain sum: a library call on the
    gradient's buffer, or folded into the matmul that made it). float64 under XLA: one variadic loop. Outside XLA:
    separate TF reductions. (The weight and the update are reduced by :func:`_max_abs_ssq`, in a loop each.)
    """
    if fused and x.dtype == tf.float32:

        def operands(v: tf.Tensor, hi: tf.Tensor, lo: tf.Tensor) -> list[tf.Tensor]:
            return [v * v, tf.cast(tf.abs(v) < tiny, tf.int32), _order_key(hi), _order_key(lo)]

        q, zero, kmax, kmin = _reduce_rows(operands, [x, x_hi, x_lo], ("sum", "sum", "max", "min"))
        return _term_sums(x, q), _from_order_key(kmax, -np.inf), _from_order_key(kmin, np.inf), zero
    is_zero = tf.cast(tf.abs(x) < tiny, tf.int32)
    if not fused:
        return _term_sums(x, None), tf.reduce_max(x_hi), tf.reduce_min(x_lo), tf.reduce_sum(is_zero)
    k = len(record.GRAD_SUMS)
    *sums, mx, mn, zero = _reduce_together([*(s.term(tf, x) for s in record.GRAD_SUMS), x_hi, x_lo, is_zero],
                                           ("sum",) * k + ("max", "min", "sum"))
    return sums, mx, mn, zero


def _term_sums(x: tf.Tensor, squares: tf.Tensor | None) -> list[tf.Tensor]:
    """``sum(term(x))`` of each :data:`record.GRAD_SUMS` term, in its order (the sum of squares ``squares`` when the
    fused loop has it)."""
    return [squares if squares is not None and s.term is record.square else _sum_of(s, x) for s in record.GRAD_SUMS]


def _sum_of(s: record.GradSum, x: tf.Tensor) -> tf.Tensor:
    """``sum(term(x))`` in ``x``'s dtype: the plain sum and the squares as one reduction; any other term summed in
    float64 (XLA's one running float32 sum of millions of values drifts by 1e-3; one beyond float32 is then Inf)."""
    t = s.term(tf, x)
    if s.term is record.identity or s.term is record.square:
        return tf.reduce_sum(t)
    return tf.cast(tf.reduce_sum(tf.cast(t, tf.float64)), x.dtype)


def _relative(x: tf.Tensor, m: tf.Tensor) -> tf.Tensor:
    """``x / m`` (``x`` where ``m`` is 0): values whose sums are exact in relative terms at any magnitude."""
    return x / tf.where(m > 0, m, tf.ones_like(m))


def _scaled_sums(x: tf.Tensor, m: tf.Tensor) -> list[tf.Tensor]:
    """``sum(term(x / m))`` of each :data:`record.GRAD_SUMS` term: a second pass, right at any magnitude."""
    y = _relative(x, m)
    return [_sum_of(s, y) for s in record.GRAD_SUMS]


def _delta_flat(d: Delta) -> tf.Tensor:
    """``before - after`` flattened, as float32 (float64 weights are subtracted in float64 first, so an update far
    below the weight's float32 resolution is kept), as an expression to fuse into a loop."""
    b, a = _flat(d.before, keep_float64=True), _flat(d.after, keep_float64=True)
    if b.dtype != a.dtype:
        b, a = tf.cast(b, tf.float32), tf.cast(a, tf.float32)
    return tf.cast(b - a, tf.float32)


def _flushed(v: tf.Tensor, tiny: tf.Tensor) -> tf.Tensor:
    return tf.where(tf.abs(v) < tiny, tf.zeros_like(v), v)


def _max_abs_ssq(t: Any, fused: bool = False) -> tuple[tf.Tensor, tf.Tensor]:
    """``(max|w|, sum((w/max|w|)^2))`` over the finite values of a weight or update, float32.

    Under XLA one loop over the data (float32: :func:`_reduce_rows`; a :class:`Delta` is subtracted inside it).
    """
    x = _delta_flat(t) if isinstance(t, Delta) else _flat(t)
    dt = x.dtype
    tiny = tf.constant(record.FLUSH_BELOW, dt)
    a = tf.abs(x)
    if fused and dt == tf.float32:
        m, q = _max_abs_and_ssq_f32(x)
    elif fused:
        m, q = _reduce_together([a, x * x], ("max", "sum"))
    else:
        m, q = tf.reduce_max(a), tf.reduce_sum(x * x)
    m = tf.maximum(m, tf.zeros([], dt))  # empty: -inf -> 0

    def fast() -> tuple[tf.Tensor, tf.Tensor]:
        return tf.where(m > 0, q / tf.where(m > 0, m * m, tf.ones_like(m)), tf.zeros_like(m)), m

    def slow() -> tuple[tf.Tensor, tf.Tensor]:
        fin = a <= dt.max
        mf = tf.reduce_max(tf.where(fin, a, tf.zeros_like(a)))
        mf = tf.maximum(_flushed(mf, tiny), tf.zeros([], dt))
        y = _relative(tf.where(fin, x, tf.zeros_like(x)), mf)
        return tf.reduce_sum(y * y), mf

    ssq, m2 = tf.cond(tf.math.is_finite(q) & (m >= _FAST_MIN[dt]), fast, slow)
    return tf.cast(m2, tf.float32), tf.cast(ssq, tf.float32)



class _FirstPass(NamedTuple):
    """A gradient's first-pass results and what both branches of :func:`_dense_stats` need."""

    x: tf.Tensor
    x_hi: tf.Tensor
    x_lo: tf.Tensor
    tiny: tf.Tensor
    size: tf.Tensor
    extra_zeros: tf.Tensor | None
    sums: list[tf.Tensor]  # sum(term(x)) of each record.GRAD_SUMS term
    mx: tf.Tensor
    mn: tf.Tensor


def _with_implicit_zeros(mx: tf.Tensor, mn: tf.Tensor, extra_zeros: tf.Tensor | None) -> tuple[tf.Tensor, tf.Tensor]:
    """max/min widened to include 0 when a sparse gradient has implicit zero rows."""
    if extra_zeros is None:
        return mx, mn
    has = extra_zeros > 0
    return tf.where(has, tf.maximum(mx, 0), mx), tf.where(has, tf.minimum(mn, 0), mn)


def _finish(p: _FirstPass, mx: tf.Tensor, mn: tf.Tensor, nonfinite: Any, sums: Callable[[tf.Tensor], Any]):
    """``(min, max, *GRAD_SUMS fields)`` from the finite extremes and a ``sums(max|g|)`` giving the relative sums
    ``sum(term(x / m))`` (the one evaluation of :data:`record.GRAD_SUMS` for this kernel)."""
    dt = p.x.dtype
    mx, mn = _flushed(mx, p.tiny), _flushed(mn, p.tiny)
    m = tf.maximum(tf.maximum(mx, -mn), tf.zeros([], dt))
    m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
    nf = tf.cast(p.size - nonfinite, dt)
    out = []
    for s, rel in zip(record.GRAD_SUMS, sums(m), strict=True):
        if s.mean:
            out.append(tf.where((m > 0) & (nf > 0), rel / tf.maximum(nf, 1) * record.power_of(m, s.power),
                                tf.zeros_like(m)))
        else:
            out.append(tf.where(m > 0, rel, tf.zeros_like(rel)))
    return (mx, mn, *out)


def _all_finite(p: _FirstPass) -> tuple[tf.Tensor, ...]:
    """Branch for finite sums: no NaN/Inf; the first pass's sums are reused when they did not underflow."""
    dt = p.x.dtype

    def sums(m: tf.Tensor) -> Any:
        return tf.cond(
            m >= _FAST_MIN[dt],
            lambda: [t / record.power_of(m, s.power) for s, t in zip(record.GRAD_SUMS, p.sums, strict=True)],
            lambda: _scaled_sums(p.x, m),
        )

    z = tf.zeros([], tf.int32)
    return (z, z, z, *_finish(p, p.mx, p.mn, 0, sums))


def _with_nonfinite(p: _FirstPass) -> tuple[tf.Tensor, ...]:
    """Branch for non-finite sums: count NaN/+Inf/-Inf, then recompute everything over the finite values."""
    x, dt = p.x, p.x.dtype
    inf = tf.constant(np.inf, dt)
    nan = tf.reduce_sum(tf.cast(tf.math.is_nan(x), tf.int32))
    posinf = tf.reduce_sum(tf.cast(tf.equal(x, inf), tf.int32))
    neginf = tf.reduce_sum(tf.cast(tf.equal(x, -inf), tf.int32))
    fin = tf.abs(x) <= dt.max
    xf = tf.where(fin, x, tf.zeros_like(x))
    mx, mn = _with_implicit_zeros(
        tf.reduce_max(tf.where(fin, p.x_hi, -inf)), tf.reduce_min(tf.where(fin, p.x_lo, inf)), p.extra_zeros
    )
    return (nan, posinf, neginf, *_finish(p, mx, mn, nan + posinf + neginf, lambda m: _scaled_sums(xf, m)))


def _dense_stats(
    x: tf.Tensor,
    *,
    hist_sample: int,
    layer: int,
    seed: Any,
    valid_len: tf.Tensor | None = None,
    dense_size: tf.Tensor | None = None,
    extra_zeros: tf.Tensor | None = None,
    fused: bool = False,
) -> tuple[tf.Tensor, dict[str, tf.Tensor], tf.Tensor]:
    """Counts int32 [5], the gradient's value fields by name (min, max, mean, ssq_rel, hist_sample) and its
    histogram float32 [77].

    ``valid_len``/``dense_size``/``extra_zeros`` describe a sparse gradient: only ``x[:valid_len]`` is data (the
    rest is zero padding), and the dense tensor has ``dense_size`` elements of which ``extra_zeros`` beyond
    ``x``'s zeros are implicit zeros (padding already subtracted).
    """
    dt = x.dtype
    tiny = tf.constant(record.FLUSH_BELOW, dt)
    n = tf.size(x)
    if valid_len is not None:
        inside = tf.range(n) < valid_len
        x_hi = tf.where(inside, x, tf.constant(-np.inf, dt))
        x_lo = tf.where(inside, x, tf.constant(np.inf, dt))
    else:
        x_hi = x_lo = x
    sums, mx, mn, zero = _first_pass(x, x_hi, x_lo, tiny, fused)
    if extra_zeros is not None:
        zero = zero + extra_zeros
    mx, mn = _with_implicit_zeros(mx, mn, extra_zeros)
    size = n if dense_size is None else dense_size
    p = _FirstPass(x, x_hi, x_lo, tiny, size, extra_zeros, sums, mx, mn)
    finite = functools.reduce(tf.logical_and, [tf.math.is_finite(t) for t in sums])
    nan, posinf, neginf, mx, mn, *sums = tf.cond(finite, lambda: _all_finite(p), lambda: _with_nonfinite(p))
    n_nonzero = size - nan - posinf - neginf - zero
    hist, kept = histogram.histogram(x, n_nonzero, hist_sample, layer, seed, valid_len)
    count_fields = {"size": tf.cast(size, tf.int32), "nan": nan, "posinf": posinf, "neginf": neginf, "zero": zero}
    counts = tf.stack([count_fields[name] for name in record.COUNT_FIELDS])
    fields = {"min": mn, "max": mx, **dict(zip(record.GRAD_SUM_NAMES, sums, strict=True)), "hist_sample": kept}
    return counts, {k: tf.cast(v, tf.float32) for k, v in fields.items()}, hist


def _sparse_stats(g: tf.IndexedSlices, rows: int, **kw: Any) -> tuple[tf.Tensor, dict[str, tf.Tensor], tf.Tensor]:
    """Statistics of the dense gradient an ``IndexedSlices`` stands for, without building it.

    Duplicate indices are summed first (as the dense gradient would be) with a sort and a segment sum of static
    size; rows no index touches are the dense tensor's implicit zeros: they count as zeros (``zero``, ``size``,
    mean, min/max), and take no part in the histogram of nonzero values.
    """
    values = tf.convert_to_tensor(g.values)
    k = values.shape[0]
    row = int(np.prod(values.shape[1:])) if values.shape.rank and values.shape.rank > 1 else 1
    if k is None:
        raise ValueError("IndexedSlices gradients need a static number of slices")
    idx = tf.cast(g.indices, tf.int32)
    order = tf.argsort(idx, stable=True)
    sidx = tf.gather(idx, order)
    new = tf.concat([tf.ones([min(k, 1)], tf.bool), sidx[1:] != sidx[:-1]], 0)
    seg = tf.cumsum(tf.cast(new, tf.int32)) - 1
    unique = tf.reduce_sum(tf.cast(new, tf.int32))
    summed = tf.math.unsorted_segment_sum(tf.gather(values, order), seg, k)
    x = _flat(summed)
    return _dense_stats(
        x,
        valid_len=unique * row,
        dense_size=tf.constant(rows * row, tf.int32),
        extra_zeros=tf.constant((rows - k) * row, tf.int32),
        **kw,
    )


def stack_values(fields: dict[str, tf.Tensor], shape: Sequence[int]) -> tf.Tensor:
    """The value fields float32 ``[*shape, NUM_VALUES]`` in :data:`record.VALUE_FIELDS` order, from tensors of
    ``shape`` by name; a field not given is :func:`record.value_defaults`' (e.g. NaN: not recorded)."""
    defaults = record.value_defaults()
    cols = [fields[name] if name in fields else tf.fill(shape, np.float32(defaults[name]))
            for name in record.VALUE_FIELDS]
    return tf.stack(cols, len(shape))


def _optional_fields(weight: Any, update: Any, fused: bool) -> dict[str, tf.Tensor]:
    """Weight and update fields by name, of those given (the others keep their defaults: NaN, not recorded)."""
    out = {}
    for prefix, t in (("weight", weight), ("update", update)):
        if t is not None:
            out[f"{prefix}_max_abs"], out[f"{prefix}_ssq_rel"] = _max_abs_ssq(t, fused)
    return out


def layer_record(inputs: LayerInputs, layer: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(counts int32 [5], values float32 [89])`` of one layer of ``inputs`` (no gradient: the missing record)."""
    g, w, u, size = inputs.grads[layer], inputs.weights[layer], inputs.updates[layer], inputs.sizes[layer]
    fused = fused_reductions()
    if g is None:
        c = tf.constant([size if name == "size" else 0 for name in record.COUNT_FIELDS], tf.int32)
        grad = {"missing": tf.constant(1.0, tf.float32)}  # the other fields at their defaults (record.empty)
        hist = tf.zeros([record.HIST_BINS], tf.float32)
    else:
        salt = layer if inputs.ids is None else inputs.ids[layer]
        kw = dict(hist_sample=inputs.hist_sample, layer=salt, seed=inputs.seed, fused=fused)
        if isinstance(g, tf.IndexedSlices):
            c, grad, hist = _sparse_stats(g, size_rows(g, size), **kw)
        else:
            c, grad, hist = _dense_stats(_flat(g), **kw)
        grad["missing"] = tf.constant(0.0, tf.float32)
    return c, tf.concat([stack_values({**grad, **_optional_fields(w, u, fused)}, []), hist], 0)


def compute_layers(inputs: LayerInputs) -> DeviceRecord:
    """The :class:`DeviceRecord` of all layers, each by :func:`layer_record`."""
    n = len(inputs.grads)
    if not n == len(inputs.weights) == len(inputs.updates) == len(inputs.sizes):
        raise ValueError("grads, weights, updates and sizes need one entry per layer")
    counts, values = [], []
    for i in range(n):
        c, v = layer_record(inputs, i)
        counts.append(c)
        values.append(v)
    if not counts:
        return DeviceRecord(tf.zeros([0, record.NUM_COUNTS], tf.int32), tf.zeros([0, _NV], tf.float32))
    return DeviceRecord(tf.stack(counts), tf.stack(values))


def size_rows(g: tf.IndexedSlices, size: int) -> int:
    """Number of rows of the dense tensor behind an ``IndexedSlices`` (static)."""
    values = g.values
    row = int(np.prod(values.shape[1:])) if values.shape.rank and values.shape.rank > 1 else 1
    if size >= 0 and row:
        return size // row
    dense = tf.get_static_value(g.dense_shape)
    if dense is None:
        raise ValueError("IndexedSlices gradient needs a static dense_shape (or its variable)")
    return int(dense[0])
