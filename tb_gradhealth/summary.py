"""TensorFlow writer: gradient-health records computed on the device (XLA-safe) and written as TF2 summaries.

* :func:`compute` turns gradients into a :class:`DeviceRecord` ``(counts int32 [L, 5], values float32 [L, 89])``
  with the same numbers as :func:`tb_gradhealth.record.compute` (the float64 reference). Each layer's statistics
  run as a small XLA cluster (a nested ``tf.function(jit_compile=True)``) when called eagerly or in a plain
  ``tf.function`` (so they start as soon as that gradient exists and overlap the rest of the backward pass), and
  are inlined into the user's cluster inside a ``jit_compile=True`` step.
* :func:`write` converts a device record to the disk form on the host (through ``tf.numpy_function`` calling
  :func:`record.to_disk`, so there is exactly one encoder) and writes it with ``tf.summary.write``.
* :func:`gradients` = compute + write: the op for custom training loops (eager or ``tf.function``). Inside a
  ``jit_compile=True`` function nothing can be written: return ``compute(...)`` from the compiled step and call
  :func:`write` outside it.

How the statistics stay cheap and exact (see docs/FORMAT.md for measurements):

* fast path, under XLA one blocked loop over the gradient (:func:`_reduce_rows`: one float32 sum and int32
  reductions, the only kind XLA:CPU runs at memory speed): ``sum(g*g)``, the exact-zero count, and ``max``/``min``
  as int32 order-preserving keys; ``sum(g)`` as a reduction of its own; the weight's and the update's ``max|.|``
  and sum of squares in a loop each. When both sums are finite there is no NaN/Inf (a NaN or Inf makes them
  non-finite) and the counts of those are 0; only when they are not finite does a ``tf.cond`` branch count
  NaN/+Inf/-Inf and recompute over the finite values;
* the norm is ``max|g| * sqrt(ssq_rel)`` with ``ssq_rel = sum(g*g) / max|g|^2``: the plain sum of squares is used
  only when it is finite and ``max|g| >= 1e-10`` (so squares that underflow are negligible); otherwise a second
  pass sums ``(g / max|g|)^2``, which is right over float32's whole range (1e-38 .. 3e38);
* the decade histogram is exact over all elements when the tensor has at most ``hist_sample`` elements, else it
  is built from ``hist_sample`` gathered positions (a golden-ratio sequence from one stateless random offset:
  each position uniform over the tensor; O(sample), no shuffle): the finite nonzero draws are binned and scaled by
  ``finite_nonzero / draws_kept``, and ``hist_sample`` records ``draws_kept`` - the rule of
  :func:`record.compute` (estimated count = count x finite_nonzero / hist_sample).

Measured costs and the alternatives tried are in docs/FORMAT.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.python import xla as _xla
from tensorflow.python.framework import ops as _ops
from tensorflow.python.ops import control_flow_util as _cfu

from tb_gradhealth import metadata, record

__all__ = ["DeviceRecord", "Delta", "compute", "layer_names", "normalize", "write", "gradients", "to_disk"]

_NV = record.NUM_VALUES + record.HIST_BINS
_I = {name: i for i, name in enumerate(record.VALUE_FIELDS)}
#: Lower / upper float32 edge of each histogram bin (bin b holds lo[b] <= |g| < hi[b]).
_BIN_LO = np.concatenate([[0.0], record.HIST_EDGES]).astype(np.float32)
_BIN_HI = np.concatenate([record.HIST_EDGES, [np.inf]]).astype(np.float32)
#: Below this max|g| the plain sum of squares may lose underflowed squares: use the scaled pass instead.
_FAST_MIN = {tf.float32: 1e-10, tf.float64: 1e-140}


class DeviceRecord(NamedTuple):
    """Records of ``L`` layers in device form: ``counts`` int32 ``[L, 5]``, ``values`` float32 ``[L, 89]``."""

    counts: Any
    values: Any


class Delta(NamedTuple):
    """An update given as the weight ``before`` and ``after`` it: :func:`compute` records ``before - after``.

    Why not pass the difference: inside the statistics' compiled loop the subtraction is fused into the update's
    own loop (which reads ``before`` and ``after``), so the difference is never written to memory and read back
    (measured in docs/KERAS.md: the Keras callback's logged step).
    """

    before: Any
    after: Any


# --- naming and input normalisation ------------------------------------------------------------------------


def _is_variable(obj: Any) -> bool:
    return obj is not None and hasattr(obj, "assign") and (hasattr(obj, "path") or hasattr(obj, "name"))


def _var_name(var: Any) -> str | None:
    """Keras 3 ``variable.path`` (e.g. ``dense/kernel``), else the TF name without the ``:0`` output suffix."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(var, "name", None)
    if isinstance(name, str) and name:
        head, sep, tail = name.rpartition(":")
        return head if sep and tail.isdigit() else name
    return None


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        k = seen.get(n, 0)
        seen[n] = k + 1
        out.append(n if k == 0 else f"{n}#{k}")
    return out


def normalize(grads: Any, weights: Any = None) -> tuple[list[str], list[Any], list[Any], list[Any]]:
    """``(names, grads, weight_values, variables)`` from ``(grad, var)`` pairs, ``{name: grad}``, or lists.

    Accepted: an iterable of ``(grad, var)`` pairs; a dict ``{name: grad}``; a pair of parallel lists
    ``(grads, vars)``; or a plain list of gradients with ``weights`` a parallel list of variables/tensors (or a dict
    keyed like ``grads``). ``weights=True`` records the pairs' variables; ``None``/``False`` records no weights.
    """
    variables: list[Any]
    if isinstance(grads, Mapping):
        names = [str(k) for k in grads]
        glist = list(grads.values())
        variables = [None] * len(glist)
    else:
        items = list(grads)
        if (
            len(items) == 2
            and isinstance(items[0], list | tuple)
            and isinstance(items[1], list | tuple)
            and len(items[0]) == len(items[1])
            and not (len(items[0]) == 2 and _is_variable(items[0][1]))
            and any(_is_variable(v) for v in items[1])
        ):
            items = list(zip(items[0], items[1], strict=True))
        if items and all(isinstance(it, tuple) and len(it) == 2 and _is_variable(it[1]) for it in items):
            glist = [g for g, _ in items]
            variables = [v for _, v in items]
        else:
            glist = items
            variables = [None] * len(glist)
        names = [None] * len(glist)
    if isinstance(weights, Mapping):
        wlist = [weights.get(n) for n in names]
    elif isinstance(weights, bool) or weights is None:
        wlist = list(variables) if weights else [None] * len(glist)
    else:
        wlist = list(weights)
        if len(wlist) != len(glist):
            raise ValueError(f"{len(glist)} gradients but {len(wlist)} weights")
        variables = [v if v is not None else w for v, w in zip(variables, wlist, strict=True)]
    return _resolve_names(names, variables), glist, wlist, variables


def _resolve_names(names: Sequence[str | None], variables: Sequence[Any]) -> list[str]:
    resolved = []
    for i, (n, v) in enumerate(zip(names, variables, strict=True)):
        resolved.append(n if n is not None else (_var_name(v) if v is not None else None) or f"layer_{i}")
    return _unique(resolved)


def variable_names(variables: Sequence[Any]) -> list[str]:
    """Row names of ``variables``, exactly as :func:`compute` names ``(grad, var)`` pairs of them (one rule for
    every writer, so a layer keeps its name whether it is logged from a custom loop or from Keras)."""
    return _resolve_names([None] * len(variables), list(variables))


def layer_names(grads: Any, weights: Any = None) -> list[str]:
    """The row names :func:`compute` gives the same arguments: variable paths (Keras 3) or names, or dict keys."""
    return normalize(grads, weights)[0]


# --- the statistics (pure TF ops, XLA-compatible, static shapes) ----------------------------------------------


def _flat(t: Any) -> tf.Tensor:
    x = tf.reshape(tf.convert_to_tensor(t), [-1])
    if x.dtype not in (tf.float32, tf.float64):
        x = tf.cast(x, tf.float32)  # float16 / bfloat16 / ints: exactly representable in float32
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
    """Several reductions of same-shape tensors along ``axis`` in one loop (an XLA variadic reduce)."""
    key = tuple((k, x.dtype) for k, x in zip(kinds, operands, strict=True))
    if key not in _REDUCERS:

        def combine(*args):
            n = len(kinds)
            return tuple(_COMBINE[k](a, b) for k, a, b in zip(kinds, args[:n], args[n:], strict=True))

        specs = [tf.TensorSpec([], x.dtype) for x in operands] * 2
        _REDUCERS[key] = tf.function(combine, autograph=False).get_concrete_function(*specs)
    red = _REDUCERS[key]
    red.add_to_graph(_ops.get_default_graph())
    init = [_init(k, x.dtype) for k, x in zip(kinds, operands, strict=True)]
    return list(_xla.variadic_reduce(operands, init, dimensions_to_reduce=[axis], reducer=red))


def _reduce_together(operands: list[tf.Tensor], kinds: tuple[str, ...]) -> list[tf.Tensor]:
    """Several full reductions of same-length vectors in ONE pass (XLA variadic reduce; only under XLA).

    Used for float64 data, and for float32 when the loop would need more than one float32 sum (slow: below).
    """
    return _variadic(operands, kinds, 0)


def _reduce_rows(make: Callable[..., list[tf.Tensor]], vectors: Sequence[tf.Tensor], kinds: tuple[str, ...]):
    """Full reductions of ``make(*vectors)`` (elementwise operands) in one blocked loop over the data.

    The vectors are viewed as rows of ``_ROW`` elements (a free reshape of a prefix; the ragged tail is reduced
    on its own), one XLA variadic reduce gives each operand's per-row results, and small reductions finish them.

    Why this shape (measured on the reference CPU, 4 x 1M float32 values, docs/FORMAT.md "Writer cost"): XLA:CPU
    runs a variadic reduce with **one float32 sum and any number of int32 reductions** at memory speed (0.9 ms),
    but with two float sums, or a float max/min, as a scalar loop (5.0-11.3 ms). So callers pass at most one
    float32 sum and turn max/min into int32 reductions of order-preserving keys (:func:`_order_key`). The rows
    keep the float32 sum accurate: per-row partial sums of ~1K values, then a sum of those (relative error 1e-8
    at 1M and 16M values, against 2e-6 / 1.6e-4 for one running sum over the whole tensor).
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


def _order_key(x: tf.Tensor) -> tf.Tensor:
    """int32 keys that sort like the float32 values (sign-magnitude -> two's complement): max/min as int ops."""
    b = tf.bitcast(x, tf.int32)
    return tf.bitwise.bitwise_xor(b, tf.bitwise.bitwise_and(tf.bitwise.right_shift(b, 31), 0x7FFFFFFF))


def _from_order_key(k: tf.Tensor, empty: float) -> tf.Tensor:
    """The float32 value of a key; ``empty`` (-inf for a max, +inf for a min) where the reduction saw nothing
    (its int32 init, which is the key of a NaN: no NaN reaches the fast path that uses these keys)."""
    x = tf.bitcast(tf.bitwise.bitwise_xor(k, tf.bitwise.bitwise_and(tf.bitwise.right_shift(k, 31), 0x7FFFFFFF)),
                   tf.float32)
    init = tf.int32.min if empty < 0 else tf.int32.max
    return tf.where(tf.equal(k, init), tf.constant(empty, tf.float32), x)


def _abs_bits(x: tf.Tensor) -> tf.Tensor:
    """``|x|`` as int32 bits: they sort like the magnitudes (NaN above +Inf), so ``max`` is an int reduction."""
    return tf.bitcast(tf.abs(x), tf.int32)


def _max_abs_and_ssq_f32(v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(max|v|, sum v^2)`` of a float32 vector in one fast blocked loop (see :func:`_reduce_rows`)."""
    q, m = _reduce_rows(lambda c: [c * c, _abs_bits(c)], [v], ("sum", "max"))
    return tf.bitcast(m, tf.float32), q


def _first_pass(x: tf.Tensor, x_hi: tf.Tensor, x_lo: tf.Tensor, tiny: tf.Tensor, fused: bool) -> list[tf.Tensor]:
    """``[sum, sum of squares, max, min, zero count]`` of a gradient (``x_hi``/``x_lo``: ``x`` with padding masked
    for max/min).

    Under XLA with float32 data: the sum of squares, the zero count and max/min (as int32 keys) in one blocked loop
    (:func:`_reduce_rows`), and the plain sum as a reduction of its own (a library call on the gradient's buffer,
    or folded into the matmul that made it). float64 under XLA: one variadic loop. Outside XLA: separate TF
    reductions. (The weight and the update are reduced by :func:`_max_abs_ssq`, in a loop each.)
    """
    if fused and x.dtype == tf.float32:

        def operands(v: tf.Tensor, hi: tf.Tensor, lo: tf.Tensor) -> list[tf.Tensor]:
            return [v * v, tf.cast(tf.abs(v) < tiny, tf.int32), _order_key(hi), _order_key(lo)]

        q, zero, kmax, kmin = _reduce_rows(operands, [x, x_hi, x_lo], ("sum", "sum", "max", "min"))
        return [tf.reduce_sum(x), q, _from_order_key(kmax, -np.inf), _from_order_key(kmin, np.inf), zero]
    is_zero = tf.cast(tf.abs(x) < tiny, tf.int32)
    if not fused:
        return [tf.reduce_sum(x), tf.reduce_sum(x * x), tf.reduce_max(x_hi), tf.reduce_min(x_lo),
                tf.reduce_sum(is_zero)]
    return _reduce_together([x, x * x, x_hi, x_lo, is_zero], ("sum", "sum", "max", "min", "sum"))


def _scaled_sums(x: tf.Tensor, m: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(sum((x/m)^2), sum(x/m))``: a second pass that is exact in relative terms at any magnitude."""
    safe = tf.where(m > 0, m, tf.ones_like(m))
    y = x / safe
    return tf.reduce_sum(y * y), tf.reduce_sum(y)


def _delta_flat(d: Delta) -> tf.Tensor:
    """``before - after`` flattened, in float32 (float64 stays float64), as an expression to fuse into a loop."""
    b, a = _flat(d.before), _flat(d.after)
    if b.dtype != a.dtype:
        b, a = tf.cast(b, tf.float32), tf.cast(a, tf.float32)
    return b - a


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
        return _scaled_sums(tf.where(fin, x, tf.zeros_like(x)), mf)[0], mf

    ssq, m2 = tf.cond(tf.math.is_finite(q) & (m >= _FAST_MIN[dt]), fast, slow)
    return tf.cast(m2, tf.float32), tf.cast(ssq, tf.float32)


def _seed_for(x: tf.Tensor, layer: Any, seed: Any) -> tf.Tensor:
    """A stateless-RNG seed that differs by layer and by step: from ``seed`` if given, else from the data."""
    salt = tf.cast(layer, tf.int32) * 7919 + 1
    if seed is not None:
        return tf.stack([tf.cast(seed, tf.int32), salt])
    n = x.shape.num_elements()
    probes = tf.cast(tf.gather(x, [0, n // 3, n // 2, n - 1]), tf.float32)
    bits = tf.bitcast(probes, tf.int32)
    mix = tf.bitwise.bitwise_xor(tf.bitwise.bitwise_xor(bits[0], bits[1] * 31), bits[2] * 131 + bits[3])
    return tf.stack([salt, mix])


def _sample_positions(x: tf.Tensor, n: int, k: int, layer: Any, seed: Any, valid_len: tf.Tensor | None) -> tf.Tensor:
    """``k`` positions in ``[0, valid_len or n)``: a golden-ratio (Weyl) sequence from one random offset.

    Each position is uniform over the tensor (so the scaled histogram is an unbiased estimate) and the positions
    are spread evenly (lower variance than independent draws). One random number per tensor instead of ``k``:
    drawing 4096 independent int32 positions per layer measured ~0.1 ms a layer under XLA on the reference CPU.
    """
    m = tf.cast(n if valid_len is None else tf.maximum(valid_len, 1), tf.int64)
    stride = _coprime_stride(n)
    offset = tf.random.stateless_uniform([], seed=_seed_for(x, layer, seed), minval=0, maxval=2**62, dtype=tf.int64)
    i = tf.range(k, dtype=tf.int64)
    return tf.cast((offset + i * stride) % m, tf.int32)


def _coprime_stride(n: int) -> int:
    """The integer nearest ``n / golden ratio`` that is coprime with ``n`` (no early repeats)."""
    s = max(1, int(round(n * 0.6180339887498949)))
    while math.gcd(s, n) != 1:
        s += 1
    return s


def _histogram(
    x: tf.Tensor, n_nonzero: tf.Tensor, hist_sample: int, layer: int, seed: Any, valid_len: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(hist float32 [77], hist_sample float32)``: exact if the tensor is small, else a scaled uniform sample."""
    dt = x.dtype
    n = x.shape.num_elements()
    if n is None:
        raise ValueError("gradients need a static shape for the histogram (XLA-safe sampling)")
    exact = not hist_sample or n <= hist_sample
    if exact:
        v = x
    else:
        v = tf.gather(x, _sample_positions(x, n, hist_sample, layer, seed, valid_len))
    av = tf.abs(v)
    ok = (av >= tf.constant(record.FLUSH_BELOW, dt)) & (av <= dt.max)
    a = tf.where(ok, tf.cast(av, tf.float32), tf.ones_like(av, tf.float32))  # float64 beyond float32 -> inf: top bin
    e = tf.clip_by_value(tf.floor(tf.math.log(a) * np.float32(1 / np.log(10))), -38.0, 38.0)
    b = tf.cast(e, tf.int32) + 38
    b = tf.where(a < tf.gather(_BIN_LO, b), b - 1, b)  # correct log10 rounding at decade edges
    b = tf.where(a >= tf.gather(_BIN_HI, b), b + 1, b)
    w = tf.cast(ok, tf.float32)
    hist = tf.math.unsorted_segment_sum(w, b, record.HIST_BINS)
    kept = tf.reduce_sum(w)
    if exact:
        return hist, kept
    scale = tf.where(kept > 0, tf.cast(n_nonzero, tf.float32) / tf.maximum(kept, 1.0), 0.0)
    return hist * scale, kept


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
) -> tuple[tf.Tensor, tf.Tensor]:
    """Counts int32 [5] and the gradient part of values float32 [89] (min, max, mean, ssq_rel, hist...).

    ``valid_len``/``dense_size``/``extra_zeros`` describe a sparse gradient: only ``x[:valid_len]`` is data (the
    rest is zero padding), and the dense tensor has ``dense_size`` elements of which ``extra_zeros`` beyond
    ``x``'s zeros are implicit zeros (padding already subtracted).
    """
    dt = x.dtype
    tiny = tf.constant(record.FLUSH_BELOW, dt)
    inf = tf.constant(np.inf, dt)
    n = tf.size(x)
    if valid_len is not None:
        inside = tf.range(n) < valid_len
        x_hi = tf.where(inside, x, -inf)
        x_lo = tf.where(inside, x, inf)
    else:
        x_hi = x_lo = x
    size = n if dense_size is None else dense_size
    s, q, mx, mn, zero = _first_pass(x, x_hi, x_lo, tiny, fused)
    if extra_zeros is not None:
        zero = zero + extra_zeros
        has_implicit = extra_zeros > 0
        mx = tf.where(has_implicit, tf.maximum(mx, 0), mx)
        mn = tf.where(has_implicit, tf.minimum(mn, 0), mn)

    def finish(mx, mn, nonfinite, sums):
        mx, mn = _flushed(mx, tiny), _flushed(mn, tiny)
        m = tf.maximum(tf.maximum(mx, -mn), tf.zeros([], dt))
        m = tf.where(tf.math.is_finite(m), m, tf.zeros_like(m))
        nf = tf.cast(size - nonfinite, dt)
        ssq_rel, mean_rel = sums(m)
        ssq_rel = tf.where(m > 0, ssq_rel, tf.zeros_like(ssq_rel))
        mean = tf.where((m > 0) & (nf > 0), mean_rel / tf.maximum(nf, 1) * m, tf.zeros_like(m))
        return mx, mn, mean, ssq_rel

    def fast():
        def sums(m):
            return tf.cond(
                m >= _FAST_MIN[dt],
                lambda: (q / (m * m), s / tf.where(m > 0, m, tf.ones_like(m))),
                lambda: _scaled_sums(x, m),
            )

        mx2, mn2, mean, ssq_rel = finish(mx, mn, 0, sums)
        z = tf.zeros([], tf.int32)
        return z, z, z, mx2, mn2, mean, ssq_rel

    def slow():
        nan = tf.reduce_sum(tf.cast(tf.math.is_nan(x), tf.int32))
        posinf = tf.reduce_sum(tf.cast(tf.equal(x, inf), tf.int32))
        neginf = tf.reduce_sum(tf.cast(tf.equal(x, -inf), tf.int32))
        fin = tf.abs(x) <= dt.max
        xf = tf.where(fin, x, tf.zeros_like(x))
        mx2 = tf.reduce_max(tf.where(fin, x_hi, -inf))
        mn2 = tf.reduce_min(tf.where(fin, x_lo, inf))
        if extra_zeros is not None:
            mx2 = tf.where(extra_zeros > 0, tf.maximum(mx2, 0), mx2)
            mn2 = tf.where(extra_zeros > 0, tf.minimum(mn2, 0), mn2)
        mx2, mn2, mean, ssq_rel = finish(mx2, mn2, nan + posinf + neginf, lambda m: _scaled_sums(xf, m))
        return nan, posinf, neginf, mx2, mn2, mean, ssq_rel

    nan, posinf, neginf, mx, mn, mean, ssq_rel = tf.cond(tf.math.is_finite(s) & tf.math.is_finite(q), fast, slow)
    n_nonzero = size - nan - posinf - neginf - zero
    hist, kept = _histogram(x, n_nonzero, hist_sample, layer, seed, valid_len)
    counts = tf.stack([tf.cast(size, tf.int32), nan, posinf, neginf, zero])
    head = tf.stack([tf.cast(v, tf.float32) for v in (mn, mx, mean, ssq_rel)])
    return counts, tf.concat([head, tf.reshape(kept, [1]), hist], 0)


def _sparse_stats(g: tf.IndexedSlices, rows: int, **kw: Any) -> tuple[tf.Tensor, tf.Tensor]:
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


def _optional_values(weight: Any, update: Any, fused: bool) -> tf.Tensor:
    """Weight and update fields (NaN where not given)."""
    nan = tf.constant(np.nan, tf.float32)
    w = _max_abs_ssq(weight, fused) if weight is not None else (nan, nan)
    u = _max_abs_ssq(update, fused) if update is not None else (nan, nan)
    return tf.stack([w[0], w[1], u[0], u[1], nan, nan])


def _layer_impl(g, w, u, size, hist_sample, layer, seed):
    """``(counts int32 [5], values float32 [89])`` of one layer (``g=None``: the missing record)."""
    fused = _in_xla_context()
    if g is None:
        c = tf.constant([size, 0, 0, 0, 0], tf.int32)
        head = tf.constant([np.inf, -np.inf, 0.0, 0.0], tf.float32)
        tail = tf.concat([tf.constant([1.0, 0.0], tf.float32), tf.zeros([record.HIST_BINS], tf.float32)], 0)
    else:
        kw = dict(hist_sample=hist_sample, layer=layer, seed=seed, fused=fused)
        if isinstance(g, tf.IndexedSlices):
            c, v = _sparse_stats(g, size_rows(g, size), **kw)
        else:
            c, v = _dense_stats(_flat(g), **kw)
        head, tail = v[:4], tf.concat([tf.zeros([1], tf.float32), v[4:]], 0)  # missing=0, hist_sample, hist
    opt = _optional_values(w, u, fused)
    return c, tf.concat([head, opt, tail], 0)


_LAYER_FNS: dict[tuple, Any] = {}


def _spec(t: Any) -> Any:
    if t is None:
        return None
    if isinstance(t, tf.IndexedSlices):
        return ("slices", tuple(t.values.shape), t.values.dtype, tuple(t.indices.shape))
    if isinstance(t, Delta):
        return ("delta", _spec(t.before), _spec(t.after))
    return (tuple(t.shape), t.dtype)


def _layer_jit(g, w, u, size, hist_sample, layer, seed):
    """One compiled function per distinct layer signature (each traced once: no retracing warnings)."""
    key = (_spec(g), _spec(w), _spec(u), size, hist_sample, seed is None)
    fn = _LAYER_FNS.get(key)
    if fn is None:

        def one(g, w, u, layer, seed):
            return _layer_impl(g, w, u, size, hist_sample, layer, seed)

        fn = _LAYER_FNS[key] = tf.function(one, jit_compile=True, autograph=False)
        fn._omit_frequent_tracing_warning = True  # one trace per signature, by design
    return fn(g, w, u, tf.constant(layer, tf.int32), seed)


def _compute_impl(grads, weights, updates, sizes, hist_sample, seed, layer_fn=_layer_impl):
    counts, values = [], []
    for i, (g, w, u, size) in enumerate(zip(grads, weights, updates, sizes, strict=True)):
        c, v = layer_fn(g, w, u, size, hist_sample, i, seed)
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


_compute_jit = tf.function(_compute_impl, jit_compile=True, autograph=False)
_compute_jit._omit_frequent_tracing_warning = True  # retraced per model signature, by design


def _in_xla_context() -> bool:
    return bool(_cfu.GraphOrParentsInXlaContext(_ops.get_default_graph()))


def _static_size(g: Any, var: Any, w: Any) -> int:
    for t in (var, w, g):
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            dense = tf.get_static_value(t.dense_shape)
            if dense is not None:
                return int(np.prod(dense))
            continue
        shape = getattr(t, "shape", None)
        if shape is not None:
            n = tf.TensorShape(shape).num_elements()
            if n is not None:
                return int(n)
    return -1


def _as_tensor(t: Any) -> Any:
    if t is None or isinstance(t, tf.IndexedSlices):
        return t
    if isinstance(t, Delta):
        return Delta(_as_tensor(t.before), _as_tensor(t.after))
    value = getattr(t, "value", None)  # Keras 3 variable -> its tf.Variable
    if _is_variable(t) and isinstance(value, tf.Variable):
        t = value
    return tf.convert_to_tensor(t)


@tf.autograph.experimental.do_not_convert
def compute(
    grads: Any,
    weights: Any = None,
    updates: Any = None,
    *,
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    seed: Any = None,
    jit: bool = True,
) -> DeviceRecord:
    """Device records of ``grads`` (pairs, dict or lists: see :func:`normalize`), rows in :func:`layer_names` order.

    ``weights=True`` (with pairs) or a list/dict of tensors adds the weight norms; ``updates`` (list/dict) the
    applied-update norms, each a tensor or a :class:`Delta` ``(before, after)`` (cheaper: the difference is
    fused into the update's loop, never written out). ``seed`` (int or scalar tensor, e.g. the step) seeds
    histogram sampling; by default the seed comes from the data. ``jit=True`` runs each layer's statistics as a
    small XLA cluster (fast; works eagerly and in ``tf.function``; inside ``jit_compile=True`` they are inlined
    into the caller's cluster); ``jit="cluster"`` puts all layers in one cluster; ``jit=False`` uses plain TF ops.
    """
    names, glist, wlist, variables = normalize(grads, weights)
    if isinstance(updates, Mapping):
        ulist = [updates.get(n) for n in names]
    elif updates is None:
        ulist = [None] * len(glist)
    else:
        ulist = list(updates)
    sizes = tuple(_static_size(g, v, w) for g, v, w in zip(glist, variables, wlist, strict=True))
    for g, size in zip(glist, sizes, strict=True):
        if g is None and size < 0:
            raise ValueError("a None gradient needs its variable (or weight) to know the layer's size")
    args = (
        tuple(_as_tensor(g) for g in glist),
        tuple(_as_tensor(w) for w in wlist),
        tuple(_as_tensor(u) for u in ulist),
        sizes,
        int(hist_sample or 0),
        None if seed is None else tf.convert_to_tensor(seed),
    )
    if not jit or _in_xla_context():  # inside a compiled function: inline into its cluster
        return _compute_impl(*args)
    if jit == "cluster":
        return _compute_jit(*args)
    return _compute_impl(*args, layer_fn=_layer_jit)


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
) -> tf.Tensor | bool:
    """Write a device record (or a callable making one, evaluated only when recording) as one summary event.

    Uses the default ``tf.summary`` writer; ``step`` defaults to ``tf.summary.experimental.get_step()``. Returns
    what ``tf.summary.write`` returns (whether a summary was written). Not usable inside ``jit_compile=True``.
    """
    if _in_xla_context():
        raise RuntimeError(
            "tb_gradhealth.summary.write cannot run inside a jit_compile=True function: return "
            "summary.compute(...) from the compiled step and call summary.write(record, names) outside it"
        )
    layers = [str(n) for n in layers]
    md = metadata.create_summary_metadata(layers, kind=kind, hist_sample=hist_sample)

    def tensor() -> tf.Tensor:
        rec = device_record() if callable(device_record) else device_record
        return to_disk(DeviceRecord(*rec))

    return tf.summary.write(metadata.tag_for(layers, name), tensor, step=step, metadata=md)


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
    jit: bool | str = True,
) -> tf.Tensor | bool:
    """Record gradient health as one summary: ``compute`` + ``write``, for custom loops (eager or ``tf.function``).

    Use it under ``writer.as_default()`` like any ``tf.summary`` op; nothing is computed when no summary is being
    recorded (``tf.summary.record_if``). ``weights=True`` also records the norms of the pairs' variables.
    Inside ``jit_compile=True`` it raises: return ``compute(...)`` from the compiled step, ``write(...)`` outside.
    """
    if _in_xla_context():
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
    return write(
        lambda: compute(grads_and_vars, weights, updates, hist_sample=hist_sample, seed=seed, jit=jit),
        names,
        step,
        name,
        hist_sample=hist_sample,
    )
