"""The record's statistics and shard merge written once for array libraries with a numpy-like namespace (torch,
jax.numpy): :mod:`tb_gradhealth.torch` and :mod:`tb_gradhealth.jax` call these with their own namespace, so the
two device paths compute the same numbers the same way. No data-dependent Python branch: the choices are the
backend's ``cond`` (``torch.cond`` / ``lax.cond`` when traced), so they trace under ``torch.compile`` and
``jax.jit``. Imports numpy only.

A tensor whose values are all finite with max|x| in ``[SAFE_LO, SAFE_HI]`` (a healthy gradient) takes the one-pass
statistics: its extremes, the count of normal values, the plain sum and sum of squares, reductions a compiler can
fuse into one loop (a backend with ``holds`` computes them before the conditional, beside the extremes); any
other takes the scaled passes (NaN/Inf counted apart, sums of ``x / max|x|``). :func:`wide_grad_stats` is one pass
with no conditional at all, for a backend with float64 sums. The histogram bins a sample, or every value when the
sample would not describe the tensor (:func:`grad_stats`). :func:`one_pass_ok` states which tensors take the one
pass, so that the batched PyTorch passes (``tb_gradhealth._torcheager``: one host read of every tensor's
statistics; ``tb_gradhealth._torchfused``: one compiled function) choose by the same rule and reuse
:func:`one_pass`, :func:`scaled` and :func:`kept_hist`.

A backend is a :class:`Backend`: the namespace ``xp`` (``torch`` or ``jax.numpy``), a float32 cast, the histogram
of float32 magnitudes (``torch.bucketize`` + ``index_add`` / :func:`tb_gradhealth._core.exponent_bins` +
``.at[].add``), the division, the conditional, and optional reductions where the namespace has faster forms than
the generic ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth import record

F32_MAX = float(np.finfo(np.float32).max)
#: Columns of the value fields in a packed row (after the 5 counts).
COL = {name: i for i, name in enumerate(record.VALUE_FIELDS)}


class Backend(NamedTuple):
    xp: Any
    f32: Callable[[Any], Any]
    #: ``(abs values float32 [k], weights [k]) -> hist [HIST_BINS]`` of the weights' dtype (float32 edges).
    histogram: Callable[[Any, Any], Any]
    #: ``(numpy array, like) -> array`` on ``like``'s device (``like`` may be ``None``: the default device).
    const: Callable[[np.ndarray, Any], Any]
    #: ``(x, m) -> x / m`` for a scalar ``m > 0`` up to 3.4e38 (XLA needs care: ``tb_gradhealth.jax._divide``).
    divide: Callable[[Any, Any], Any]
    #: ``(pred, true_fn, false_fn, operands) -> true_fn(*operands) if pred else false_fn(*operands)``, with a
    #: traced ``pred`` (``torch.cond`` / ``lax.cond``): only the branch taken runs.
    cond: Callable[[Any, Callable, Callable, tuple], Any]
    #: Sum of a flat float32 array, accurate to float32's rounding of the result (``xp.sum`` when it is already).
    fsum: Callable[[Any], Any] | None = None
    #: ``x -> (min(x), max(x))`` in one pass (NaN when ``x`` holds a NaN).
    aminmax: Callable[[Any], tuple[Any, Any]] | None = None
    #: ``x -> sum(x * x)`` in one pass.
    sumsq: Callable[[Any], Any] | None = None
    #: ``x -> the number of elements with |x| >= FLUSH_BELOW`` (of an all-finite ``x``), in one pass.
    count_normal: Callable[[Any], Any] | None = None
    #: ``x -> x`` as float64, for the one-pass statistics of :func:`wide_grad_stats` (``None``: no such type).
    wide: Callable[[Any], Any] | None = None
    #: ``mask -> its number of True values`` as the backend adds them fastest (``xp.count_nonzero`` by default).
    count: Callable[[Any], Any] | None = None
    #: ``(mn, mx, one_pass result) -> whether it holds``, for a compiler that fuses a tensor's reductions into one
    #: loop (``jax.jit``): :func:`grad_stats` then computes the one-pass statistics beside the extremes, before its
    #: conditional (and this decides), instead of in its branch. ``None``: :func:`one_pass_ok` first.
    holds: Callable[[Any, Any, tuple[Any, Any]], Any] | None = None

    def min_max(self, x: Any) -> tuple[Any, Any]:
        return self.aminmax(x) if self.aminmax else (self.xp.min(x), self.xp.max(x))

    def sum_squares(self, x: Any) -> Any:
        return self.sumsq(x) if self.sumsq else (self.fsum or self.xp.sum)(x * x)

    def term_sum(self, term: Callable[[Any, Any], Any], x: Any) -> Any:
        """``sum(term(x))``: the backend's own reduction of a square where it has one."""
        if term is record.square:
            return self.sum_squares(x)
        return (self.fsum or self.xp.sum)(term(self.xp, x))

    def normal_count(self, x: Any) -> Any:
        if self.count_normal:
            return self.count_normal(x)
        return self.xp.count_nonzero(self.xp.abs(x) >= record.FLUSH_BELOW)


#: max|x| within which the one-pass statistics hold (plain squares neither overflow nor, summed over up to 2**31
#: elements, lose more than 2**-35 relative to flushing); outside it, or with a NaN/Inf, the scaled passes run.
SAFE_LO, SAFE_HI = 2.0**-30, 2.0**30


def one_pass_ok(xp: Any, mn: Any, mx: Any) -> Any:
    """Whether a gradient with extremes ``mn``, ``mx`` takes the one-pass statistics: max|x| within
    ``[SAFE_LO, SAFE_HI]`` and neither extreme subnormal (flushed to zero, so not the record's min/max); False for
    NaN. ``xp``: the namespace of ``mn`` and ``mx`` (numpy on the host too)."""
    m = xp.maximum(mx, -mn)

    def tiny(v: Any) -> Any:
        return (xp.abs(v) < record.FLUSH_BELOW) & (v != 0)

    return (m >= SAFE_LO) & (m <= SAFE_HI) & ~tiny(mx) & ~tiny(mn)


def norm_one_pass_ok(m: Any) -> Any:
    """Whether a weight or update with max|x| ``m`` takes the one-pass sum of squares (False for NaN)."""
    return (m >= SAFE_LO) & (m <= SAFE_HI)


def _relative(be: Backend, x: Any, m: Any) -> Any:
    """``x / m`` (``x`` where ``m`` is 0): values whose sums are exact in relative terms at any magnitude."""
    return be.divide(x, be.xp.where(m > 0, m, 1.0))


def grad_sums(be: Backend, x: Any, m: Any, nf: Any, plain: bool, known: dict[str, Any] | None = None) -> list[Any]:
    """The :data:`record.GRAD_SUMS` fields of a flat gradient ``x`` with max|x| ``m`` and ``nf`` finite values (the
    one evaluation of that table for these backends), in its order. ``plain``: an all-finite ``x`` whose max|x| is
    in ``[SAFE_LO, SAFE_HI]``: ``sum(term(x)) / m**power`` (or ``/ nf``), one pass each (``known``: the sums
    ``sum(term(x))`` a caller already has, by field name); else ``x`` holds only its finite unflushed values (0
    elsewhere) and each sum is of ``term(x / m)``, right at any magnitude."""
    xp = be.xp
    if plain:
        known = known or {}
        return [(known[s.name] if s.name in known else be.term_sum(s.term, x))
                / (nf if s.mean else record.power_of(m, s.power)) for s in record.GRAD_SUMS]
    y = _relative(be, x, m)
    fsum = be.fsum or xp.sum
    out = []
    for s in record.GRAD_SUMS:
        rel = fsum(s.term(xp, y))
        out.append(xp.where(nf > 0, rel / xp.where(nf > 0, nf, 1) * record.power_of(m, s.power), 0.0) if s.mean
                   else rel)
    return out


def grad_stats(be: Backend, x: Any, extra_zeros: int, hist_sample: int, sample: Callable[[Any], Any] | None):
    """``(counts [5] int, [min, max, mean, ssq_rel, hist_sample, *hist] float32)`` of a flat float32 gradient.

    ``extra_zeros``: implicit zeros beyond ``x`` (a sparse gradient's untouched rows). ``sample``: ``None`` for the
    exact histogram, else a function returning ``hist_sample`` elements of ``x`` at the sampling rule's positions.
    The histogram is exact (``hist_sample`` = the finite nonzero count) when that count is at most ``hist_sample``
    or the sample kept fewer than :func:`record.sample_min_kept` finite nonzero values (a very sparse tensor whose
    sample missed its few nonzeros), so the bins always add up to the finite nonzero count.
    """
    xp = be.xp
    mn0, mx0 = be.min_max(x)
    m0 = xp.maximum(mx0, -mn0)
    if be.holds is not None:  # the one pass beside the extremes' loop, taken where it holds
        fast = one_pass(be, x, extra_zeros, mn0, mx0, m0)
        counts, head = be.cond(be.holds(mn0, mx0, fast), lambda x, c, h: (c, h),
                               lambda x, c, h: scaled(be, x, extra_zeros), (x, *fast))
    else:
        counts, head = be.cond(one_pass_ok(xp, mn0, mx0),
                               lambda x, mn, mx, m: one_pass(be, x, extra_zeros, mn, mx, m),
                               lambda x, mn, mx, m: scaled(be, x, extra_zeros), (x, mn0, mx0, m0))
    nonzero = counts[0] - counts[1] - counts[2] - counts[3] - counts[4]
    if sample is None:
        hist = kept_hist(be, x)
    else:  # the scaled sample, unless the exact histogram is due (record.sample_is_enough's rule)
        hist = kept_hist(be, sample(x))
        kept = hist[0]
        from_sample = xp.concatenate([xp.reshape(kept, (1,)), hist[1:] * xp.where(
            kept > 0, be.f32(nonzero) / xp.where(kept > 0, kept, 1.0), 0.0)])
        exact = (nonzero <= hist_sample) | (kept < record.sample_min_kept(hist_sample))
        hist = be.cond(exact, lambda x, s: kept_hist(be, x), lambda x, s: s * 1.0, (x, from_sample))
    return counts, xp.concatenate([head, hist])


def _extremes(be: Backend, mn: Any, mx: Any, extra_zeros: int) -> tuple[Any, Any]:
    if extra_zeros:  # a sparse gradient's implicit zeros
        return be.xp.where(mn < 0, mn, 0.0), be.xp.where(mx > 0, mx, 0.0)
    return mn, mx


def one_pass(be: Backend, x: Any, extra_zeros: int, mn: Any, mx: Any, m: Any) -> tuple[Any, Any]:
    """``(counts, [min, max, mean, ssq_rel])`` of an all-finite ``x`` whose max|x| is in ``[SAFE_LO, SAFE_HI]``:
    plain sums of values and squares (one pass each), the extremes already known."""
    xp = be.xp
    n = math.prod(x.shape)
    zero = n - be.normal_count(x) + extra_zeros
    sums = grad_sums(be, x, m, n + extra_zeros, plain=True)
    mn, mx = _extremes(be, mn, mx, extra_zeros)
    counts = xp.stack([zero * 0 + n + extra_zeros, zero * 0, zero * 0, zero * 0, zero])
    return counts, be.f32(xp.stack([mn, mx, *sums]))


def scaled(be: Backend, x: Any, extra_zeros: int) -> tuple[Any, Any]:
    """``(counts, [min, max, mean, ssq_rel])`` of any ``x``: NaN/Inf counted apart, sums of ``x / max|x|``."""
    xp = be.xp
    n = math.prod(x.shape)
    inf = float("inf")
    a = xp.abs(x)
    finite = a <= F32_MAX  # False for NaN and +-Inf
    keep = finite & (a >= record.FLUSH_BELOW)  # finite and not flushed to zero
    nfin = xp.count_nonzero(finite)
    nonzero = xp.count_nonzero(keep)
    nan = xp.count_nonzero(xp.isnan(x))
    posinf = xp.count_nonzero(x == inf)
    neginf = n - nfin - nan - posinf
    xk = xp.where(keep, x, 0.0)
    mn, mx = _extremes(be, xp.min(xp.where(finite, xk, inf)), xp.max(xp.where(finite, xk, -inf)), extra_zeros)
    m = xp.maximum(mx, -mn)
    m = xp.where(m > 0, m, 0.0)  # no finite value: -inf -> 0
    sums = grad_sums(be, xk, m, nfin + extra_zeros, plain=False)
    counts = xp.stack([nan * 0 + n + extra_zeros, nan, posinf, neginf, nfin - nonzero + extra_zeros])
    return counts, be.f32(xp.stack([mn, mx, *sums]))


def kept_hist(be: Backend, v: Any) -> Any:
    """``[finite nonzero count, *histogram]`` float32 of the values ``v`` (all of them binned; integer counts, so
    exact up to float32's own rounding of the result)."""
    av = be.xp.abs(v)
    keep = (av >= record.FLUSH_BELOW) & (av <= F32_MAX)
    count = be.xp.reshape(be.xp.count_nonzero(keep), (1,))
    return be.xp.concatenate([be.f32(count), be.f32(be.histogram(av, keep * 1))])


def norm_stats(be: Backend, x: Any) -> Any:
    """``[max|w|, sum((w / max|w|)^2)]`` float32 over the finite, unflushed values of a flat weight or update."""
    xp = be.xp
    if math.prod(x.shape) == 0:
        return be.f32(xp.stack([xp.sum(x), xp.sum(x)]))
    mn, mx = be.min_max(x)
    m = xp.maximum(mx, -mn)
    if be.holds is not None:  # the sum of squares beside the extremes' loop; a NaN they skipped makes it NaN
        fast = be.f32(xp.stack([m, be.sum_squares(x) / (m * m)]))
        return be.cond(norm_one_pass_ok(m) & xp.all(xp.isfinite(fast)), lambda x, f: f,
                       lambda x, f: norm_scaled(be, x), (x, fast))
    return be.cond(norm_one_pass_ok(m), lambda x, m: be.f32(xp.stack([m, be.sum_squares(x) / (m * m)])),
                   lambda x, m: norm_scaled(be, x), (x, m))


def norm_scaled(be: Backend, x: Any) -> Any:
    xp = be.xp
    a = xp.abs(x)
    af = xp.where((a >= record.FLUSH_BELOW) & (a <= F32_MAX), a, 0.0)
    m = xp.max(af)
    y = _relative(be, af, m)
    return be.f32(xp.stack([m, (be.fsum or xp.sum)(y * y)]))


def wide_grad_stats(be: Backend, x: Any) -> tuple[Any, Any]:
    """``(counts [5], [min, max, *GRAD_SUMS fields])`` of a nonempty flat float32 ``x`` in one pass and with no
    conditional, for a backend with a float64 type (``be.wide``): NaN and Inf are counted apart and the sums taken
    over the finite, unflushed values in float64, where no float32 value's square (or sum of 2**31 of them) under-
    or overflows, so that any magnitude is right without the scaled passes. Every reduction reads ``x`` alone, in
    compare-and-add form (no per-element branch): a compiler fuses them into one vectorised loop."""
    xp = be.xp
    inf = float("inf")
    n = math.prod(x.shape)
    a = xp.abs(x)
    finite = a <= F32_MAX  # False for NaN and +-Inf
    small = a < record.FLUSH_BELOW  # zero or subnormal: counted as zero (False for NaN)
    y = xp.where(finite & ~small, x, 0.0)
    count = be.count or xp.count_nonzero
    nan, posinf, nfin, zero = count(x != x), count(x == inf), count(finite), count(small)
    mn, mx = xp.min(xp.where(finite, y, inf)), xp.max(xp.where(finite, y, -inf))
    m = xp.maximum(mx, -mn)
    m = be.wide(xp.where(m > 0, m, 0.0))  # 0 where no value is finite (-inf)
    w = be.wide(y)
    fields = []
    for s in record.GRAD_SUMS:
        total = xp.sum(s.term(xp, w))
        by = be.wide(nfin) if s.mean else record.power_of(m, s.power)
        fields.append(xp.where(by > 0, total / xp.where(by > 0, by, 1.0), 0.0))
    counts = xp.stack([nan * 0 + n, nan, posinf, n - nfin - nan - posinf, zero])
    return counts, xp.stack([be.f32(v) for v in (mn, mx, *fields)])


def wide_norm_stats(be: Backend, x: Any) -> Any:
    """:func:`norm_stats` in one pass (``be.wide``: the sum of squares in float64), for a flat float32 ``x``."""
    xp = be.xp
    if math.prod(x.shape) == 0:
        return be.f32(xp.stack([xp.sum(x), xp.sum(x)]))
    a = xp.abs(x)
    keep = (a >= record.FLUSH_BELOW) & (a <= F32_MAX)
    m = xp.max(xp.where(keep, a, 0.0))
    w = be.wide(xp.where(keep, x, 0.0))
    m2 = be.wide(m) * be.wide(m)
    ssq = xp.where(m2 > 0, xp.sum(w * w) / xp.where(m2 > 0, m2, 1.0), 0.0)
    return xp.stack([be.f32(m), be.f32(ssq)])


#: The fields of :func:`grad_stats`' (and :func:`empty_values`') vector before its histogram bins, in order.
GRAD_FIELDS = ("min", "max", *record.GRAD_SUM_NAMES, "hist_sample")
#: :func:`record.value_defaults`, read once: constants to the tracers of ``torch.compile`` and ``jax.jit``.
_DEFAULTS = record.value_defaults()


def empty_values(be: Backend, like: Any) -> Any:
    """:data:`GRAD_FIELDS` and the histogram of a layer with no values (the missing or empty record)."""
    head = np.array([_DEFAULTS[name] for name in GRAD_FIELDS], np.float32)
    return be.const(np.concatenate([head, np.zeros(record.HIST_BINS, np.float32)]), like)


def assemble(be: Backend, grad: Any, weight: Any, update: Any, missing: bool) -> Any:
    """One layer's values ``[NUM_VALUES + HIST_BINS]``, stacked by name in :data:`record.VALUE_FIELDS` order, from
    :func:`grad_stats`' (or :func:`empty_values`') vector and the optional :func:`norm_stats` of the weight and the
    update; a field none of them gives takes :func:`record.value_defaults`' value."""
    k = len(GRAD_FIELDS)
    fields = {name: grad[i] for i, name in enumerate(GRAD_FIELDS)}
    for prefix, norms in (("weight", weight), ("update", update)):
        if norms is not None:
            fields[f"{prefix}_max_abs"], fields[f"{prefix}_ssq_rel"] = norms[0], norms[1]
    defaults = {**_DEFAULTS, "missing": float(missing)}
    head = [fields[name] if name in fields else be.const(np.array(defaults[name], np.float32), grad)
            for name in record.VALUE_FIELDS]
    return be.xp.concatenate([be.xp.stack(head), grad[k:]])


def assemble_table(be: Backend, grad: Any, weight: Any, update: Any, missing: Any) -> Any:
    """Every layer's values ``[L, NUM_VALUES + HIST_BINS]`` at once (:func:`assemble` row by row) from the stacked
    :func:`grad_stats` (or :func:`empty_values`) vectors ``[L, 5 + HIST_BINS]``, the weight's and the update's
    :func:`norm_stats` ``[L, 2]`` (NaN where a layer has none: the fields' defaults) and ``missing`` ``[L]``."""
    fields = {name: grad[:, i] for i, name in enumerate(GRAD_FIELDS)}
    for prefix, norms in (("weight", weight), ("update", update)):
        fields[f"{prefix}_max_abs"], fields[f"{prefix}_ssq_rel"] = norms[:, 0], norms[:, 1]
    fields["missing"] = missing
    rows = grad.shape[0]
    head = [fields[name] if name in fields else be.const(np.full(rows, _DEFAULTS[name], np.float32), grad)
            for name in record.VALUE_FIELDS]
    return be.xp.concatenate([be.xp.stack(head, 1), grad[:, len(GRAD_FIELDS):]], 1)


#: The per-layer sums :func:`merge` adds over the shards, after the counts and before the histogram, in order.
_SUMMED = (*record.GRAD_SUM_NAMES, "weight_ssq_rel", "update_ssq_rel", "hist_sample", "ranks")


def merge(
    be: Backend,
    counts: Any,
    values: Any,
    all_max: Callable[[Any], Any],
    all_sum: Callable[[Any], Any],
    all_sum_counts: Callable[[Any], Any] | None = None,
) -> tuple[Any, Any]:
    """Records of shards ``(counts [L, 5] int, values [L, 89])`` -> the full tensors' records, on every shard.

    ``all_max`` / ``all_sum`` are the collectives (``all_reduce`` MAX / SUM, ``lax.pmax`` / ``lax.psum``): first
    the max of ``[max, -min, max|g|, max|w|, max|u|, -missing]`` (``missing`` merges to its least value, as in
    :func:`record.merge`: frozen on every shard stays frozen, a gradient on any shard is a gradient), then (each
    relative sum of squares rescaled to the global max|.|) the sum of the counts, histogram, ``hist_sample``,
    finite-weighted mean and sums of squares. The same result as :func:`record.merge_all` over the shards. The
    counts join the float sum (exact when ``values`` are float64) unless ``all_sum_counts`` sums them on their own
    (integers: exact in float32 backends too).
    """
    scales = _scales(be, values)
    maxes = all_max(be.xp.stack([scales["max"], scales["-min"], scales["grad"], scales["weight"], scales["update"],
                                 -values[:, COL["missing"]]], 1))
    k = 0 if all_sum_counts is not None else record.NUM_COUNTS
    sums = all_sum(_summands(be, counts, values, scales, maxes, with_counts=k > 0))
    out_c = sums[:, :k] if k else all_sum_counts(counts)
    merged = _merged_values(be, out_c, sums[:, k:], maxes)
    return (be.xp.round(out_c) if k else out_c), merged


def _scales(be: Backend, values: Any) -> dict[str, Any]:
    """Each shard's max, -min, max|g| (0 when not finite), max|w| and max|u| (-1 when not recorded)."""
    xp = be.xp
    mn, mx = values[:, COL["min"]], values[:, COL["max"]]
    m = xp.maximum(-mn, mx)
    out = {"max": mx, "-min": -mn, "grad": xp.where(xp.isfinite(m), m, 0.0)}
    for k in ("weight", "update"):
        out[k] = xp.where(xp.isnan(values[:, COL[f"{k}_max_abs"]]), -1.0, values[:, COL[f"{k}_max_abs"]])
    return out


def _summands(be: Backend, counts: Any, values: Any, scales: dict[str, Any], maxes: Any, with_counts: bool) -> Any:
    """What the shards add: (the counts,) the :data:`_SUMMED` columns rescaled to the global maxima ``maxes``,
    and the histogram."""
    xp = be.xp

    def rescaled(rel: Any, s: Any, s_all: Any, power: int = 2) -> Any:
        r = xp.where(s_all > 0, s / xp.where(s_all > 0, s_all, 1.0), 0.0)
        out = rel
        for _ in range(power):
            out = out * r
        return xp.where(xp.isnan(rel), 0.0, out)

    c = counts * xp.ones_like(values[:, :1])  # counts in the values' float type (float64: exact)
    nf = c[:, 0] - c[:, 1] - c[:, 2] - c[:, 3]
    m = xp.where(maxes[:, 2] > 0, maxes[:, 2], 1.0)
    summed = {  # a mean times its finite count, relative to m**power: no float32 overflow
        s.name: (values[:, COL[s.name]] / record.power_of(m, s.power) * nf if s.mean
                 else rescaled(values[:, COL[s.name]], scales["grad"], maxes[:, 2], s.power))
        for s in record.GRAD_SUMS}
    summed |= {
        "weight_ssq_rel": rescaled(values[:, COL["weight_ssq_rel"]], scales["weight"], maxes[:, 3]),
        "update_ssq_rel": rescaled(values[:, COL["update_ssq_rel"]], scales["update"], maxes[:, 4]),
        "hist_sample": values[:, COL["hist_sample"]],
        "ranks": nf * 0 + 1,
    }
    head = [c] if with_counts else []
    return xp.concatenate([*head, xp.stack([summed[name] for name in _SUMMED], 1), values[:, record.NUM_VALUES:]], 1)


def _merged_values(be: Backend, counts: Any, sums: Any, maxes: Any) -> Any:
    """The merged value fields and histogram from the summed counts, the :data:`_SUMMED` columns and histogram
    (``sums``), and the global maxima."""
    xp = be.xp
    s = {name: sums[:, i] for i, name in enumerate(_SUMMED)}
    ranks = s["ranks"]
    g_nf = (counts[:, 0] - counts[:, 1] - counts[:, 2] - counts[:, 3]) * 1.0 + ranks * 0
    nan = ranks * np.nan
    cols = {f.name: (xp.where(g_nf > 0, s[f.name] / xp.where(g_nf > 0, g_nf, 1.0) * record.power_of(maxes[:, 2],
                                                                                                      f.power), 0.0)
                     if f.mean else s[f.name]) for f in record.GRAD_SUMS}
    cols |= {
        "min": -maxes[:, 1],
        "max": maxes[:, 0],
        "weight_max_abs": xp.where(maxes[:, 3] >= 0, maxes[:, 3], nan),
        "weight_ssq_rel": xp.where(maxes[:, 3] >= 0, s["weight_ssq_rel"], nan),
        "update_max_abs": xp.where(maxes[:, 4] >= 0, maxes[:, 4], nan),
        "update_ssq_rel": xp.where(maxes[:, 4] >= 0, s["update_ssq_rel"], nan),
        "micro_batches": nan,
        "noise_ssq_rel": nan,
        "missing": -maxes[:, 5],
        "hist_sample": s["hist_sample"],
    }
    head = xp.stack([be.f32(cols[name]) for name in record.VALUE_FIELDS], 1)
    return xp.concatenate([head, be.f32(sums[:, len(_SUMMED):])], 1)
