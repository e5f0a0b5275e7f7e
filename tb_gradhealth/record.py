"""The gradient-health record and the forward record: the one definition of their fields, histogram edges, merge
rules and encodings.

Every path (numpy writer, TF summary op, TPU host_call, readers, docs) uses this module, so a record written by
one path is read and merged by any other. It imports numpy only.

A record describes one tensor (normally one variable's gradient) at one logged step:

* exact counts: ``size``, ``nan``, ``posinf``, ``neginf``, ``zero``;
* exact finite statistics: ``min``, ``max``, ``mean`` (over finite values) and ``ssq_rel``, the sum of squares of
  the finite values *divided by max|g|^2*. Storing the sum of squares relative to the largest magnitude keeps it
  in ``[1, n]`` whatever the scale of the gradient, so the L2 norm ``max_abs * sqrt(ssq_rel)`` is right from
  1e-38 to 1e+38 where a plain sum of squares under- or overflows float32 (at about 1e-19 and 1e+19);
* optional fields (NaN when not recorded): the weight's and the applied update's max|.| and relative sum of
  squares, the number of micro-batches and the relative spread of micro-batch gradients (gradient noise);
* ``missing``: 0 when the variable has a gradient, :data:`MISSING` (1) when none reached it (a ``None`` gradient
  of a variable that should learn), :data:`FROZEN` (2) when it has none by the user's choice (``requires_grad=False``,
  a parameter outside the optimizer): a frozen record has no values, like a missing one, and is not a disease;
* a log-magnitude histogram of the finite nonzero values with fixed decade edges (:data:`HIST_EDGES`), holding
  *estimated element counts* per bin, and ``hist_sample``: how many finite nonzero elements it was built from.
  When ``hist_sample`` equals the finite nonzero count the histogram is exact; otherwise it is a uniform sample
  scaled up to the finite nonzero count, so histograms of any parts still add.

A record describes the values as float32 holds them, whatever the input dtype. Values below float32's smallest
normal number (1.18e-38) count as zero: TensorFlow and XLA flush them to zero on CPU, GPU and TPU, so that is what a
device sees, and the numpy path does the same so that both writers agree. A float64 value whose magnitude rounds
beyond float32's largest finite number (about 3.4e38) counts as +Inf or -Inf, as a cast to float32 makes it: such a
gradient overflows any float32 device, and the disk form (float32) could not hold its extremes anyway.

Three encodings share these fields:

* memory form: float64 ``[..., NUM_FIELDS]`` (:data:`FIELDS` order); counts are exact integers in float64;
* device form (the TF path): a pair ``(counts int32 [..., 5], values float32 [..., 12 + HIST_BINS])``;
* disk form: one float32 ``[L, 5 + 12 + 1 + W]`` tensor per event: the 5 counts as int32 bit patterns (exact, no
  float32 rounding), the 12 values, ``hist_lo`` (first histogram bin kept) and ``W`` histogram bins
  ``[hist_lo, hist_lo + W)``: bins that are empty in every layer of the event are trimmed from both ends, which
  keeps a layer-step near 150 bytes instead of 400.

The forward record (:data:`ACT_FIELDS`, v3) describes one layer's output over a logged step's batch: its counts
(NaN/Inf, exact zeros, units dead for every input of the batch, elements saturated at a bounded activation's
bounds), its extremes, mean and ``ssq_rel``; float32 ``[L, 14]`` on disk, under tags of its own
(:func:`compute_activations`, :func:`act_merge_all`, :func:`act_to_disk`; docs/FORMAT.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

#: v2: the ``missing`` field may hold :data:`FROZEN`; a v1 reader would read such a row as damaged, so it refuses v2.
#: v3: the forward record (:data:`ACTIVATIONS` tags, :data:`ACT_FIELDS`); gradient tags are unchanged since v2 and
#: still written as v2 (:data:`KIND_VERSION`), so a v2 reader reads them and refuses only the activation tags.
FORMAT_VERSION = 3
#: The values of the ``missing`` field: a gradient, none reached the variable, none by the user's choice.
HAS_GRADIENT, MISSING, FROZEN = 0.0, 1.0, 2.0

COUNT_FIELDS: tuple[str, ...] = ("size", "nan", "posinf", "neginf", "zero")

#: The value fields' order in every encoding; a gradient field that is a sum over the values is listed here and in
#: :data:`GRAD_SUMS`, which says how every backend computes and merges it.
VALUE_FIELDS: tuple[str, ...] = (
    "min",
    "max",
    "mean",
    "ssq_rel",
    "weight_max_abs",
    "weight_ssq_rel",
    "update_max_abs",
    "update_ssq_rel",
    "micro_batches",
    "noise_ssq_rel",
    "missing",
    "hist_sample",
)


def identity(xp: Any, x: Any) -> Any:
    """The term of a plain sum (``xp``: the array namespace: numpy, tf, torch, jax.numpy)."""
    return x


def square(xp: Any, x: Any) -> Any:
    """The term of a sum of squares (a backend may reduce it with a faster op of its own)."""
    return x * x


class GradSum(NamedTuple):
    """A gradient value field that is a sum of an elementwise ``term`` over the finite values: the one table
    (:data:`GRAD_SUMS`) that the numpy reference, every device backend and every merge rule evaluate.

    ``term`` is homogeneous of degree ``power`` in max|g| (``m``): ``sum(term(x)) = m**power * sum(term(x / m))``.
    A relative field (``mean=False``) stores ``sum(term(x / m))`` (any magnitude, no under- or overflow; merged by
    rescaling each part by ``(m_part / m_all)**power``, then adding); a ``mean`` field stores
    ``sum(term(x)) / finite count`` (merged weighted by the parts' finite counts).
    """

    name: str
    term: Callable[[Any, Any], Any]
    power: int
    mean: bool = False


GRAD_SUMS: tuple[GradSum, ...] = (
    GradSum("mean", identity, 1, mean=True),
    GradSum("ssq_rel", square, 2),
)
GRAD_SUM_NAMES: tuple[str, ...] = tuple(s.name for s in GRAD_SUMS)
#: The optional fields: NaN when not recorded.
OPTIONAL_FIELDS: tuple[str, ...] = ("weight_max_abs", "weight_ssq_rel", "update_max_abs", "update_ssq_rel",
                                    "micro_batches", "noise_ssq_rel")


def power_of(x: Any, power: int) -> Any:
    """``x`` multiplied by itself ``power`` times (``x * x`` for 2: one rounding, the same bits on every backend)."""
    out = x
    for _ in range(power - 1):
        out = out * x
    return out


#: Decade edges of the log-magnitude histogram, float32 (the comparison is done in float32 on every path).
#: Bin 0 is (0, 1e-37): every normal float32 below 1e-37; bin k (1..75) is [1e(k-38), 1e(k-37)); bin 76 is
#: [1e38, inf): the open top. Zero and non-finite values are not in the histogram; they have exact counts.
HIST_EDGES: np.ndarray = np.array([10.0**e for e in range(-37, 39)], dtype=np.float32)
HIST_BINS: int = len(HIST_EDGES) + 1
#: log10 of each bin's lower edge (bin 0 reports -38: its values sit between 1.18e-38 and 1e-37).
HIST_BIN_LOG10_LO: np.ndarray = np.arange(-38, -38 + HIST_BINS, dtype=np.int64)

HIST_FIELDS: tuple[str, ...] = tuple(f"hist_{i}" for i in range(HIST_BINS))
FIELDS: tuple[str, ...] = COUNT_FIELDS + VALUE_FIELDS + HIST_FIELDS
NUM_FIELDS: int = len(FIELDS)
NUM_COUNTS: int = len(COUNT_FIELDS)
NUM_VALUES: int = len(VALUE_FIELDS)
INDEX: dict[str, int] = {name: i for i, name in enumerate(FIELDS)}
HIST_START: int = NUM_COUNTS + NUM_VALUES
#: Index of ``hist_lo`` in a disk row (the column where a memory row's histogram starts), and where a disk row's
#: histogram bins start.
DISK_HIST_LO: int = HIST_START
DISK_HIST_START: int = DISK_HIST_LO + 1

#: Smallest normal float32: anything smaller in magnitude is flushed to zero (see module docstring).
FLUSH_BELOW: float = float(np.finfo(np.float32).tiny)
#: Default number of elements the histogram samples from a larger tensor (the exact fields stay exact).
DEFAULT_HIST_SAMPLE: int = 4096
#: Device counts are int32: one tensor part may hold at most this many elements.
MAX_ELEMENTS_PER_PART: int = 2**31 - 1

_OPTIONAL_PAIRS = (("weight_max_abs", "weight_ssq_rel"), ("update_max_abs", "update_ssq_rel"))


def empty(shape: tuple[int, ...] = ()) -> np.ndarray:
    """Records of empty tensors: the identity of :func:`merge` (min=+inf, max=-inf, optional fields NaN)."""
    rec = np.zeros(tuple(shape) + (NUM_FIELDS,), dtype=np.float64)
    rec[..., INDEX["min"]] = np.inf
    rec[..., INDEX["max"]] = -np.inf
    for name in OPTIONAL_FIELDS:
        rec[..., INDEX[name]] = np.nan
    return rec


class Delta(NamedTuple):
    """An update given as the weight ``before`` and ``after`` the optimizer step: every writer records
    ``before - after``. Any array type (TF, torch, JAX, numpy); one definition for all of them.

    Why not pass the difference: the device paths fuse the subtraction into the update's own reduction (which reads
    ``before`` and ``after``), so the difference is never written to memory and read back (docs/KERAS.md, *Cost*).
    """

    before: Any
    after: Any


def value_defaults() -> dict[str, float]:
    """Each value field as :func:`empty` has it: what a writer that does not compute a field stores there (NaN for
    the optional fields, the extremes' identities for min/max, 0 otherwise). Writers stack their values by name
    from :data:`VALUE_FIELDS`, taking this for any field they do not know, so a new field needs no edit there."""
    row = empty()
    return {name: float(row[INDEX[name]]) for name in VALUE_FIELDS}


def missing() -> np.ndarray:
    """The record of a variable that received no gradient (``None``)."""
    rec = empty()
    rec[INDEX["missing"]] = MISSING
    return rec


def frozen(size: int = 0) -> np.ndarray:
    """The record of a variable frozen by the user (no gradient by choice: ``requires_grad=False``, outside the
    optimizer) with ``size`` elements: no values, and no rule reads it as a disease."""
    rec = empty()
    rec[INDEX["missing"]] = FROZEN
    rec[INDEX["size"]] = size
    return rec


def flush_to_zero(x: np.ndarray) -> np.ndarray:
    """The values as a float32 device sees them: float32 (float64 beyond float32's range becomes ±Inf), subnormals
    flushed to zero."""
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.asarray(x).astype(np.float32)
        return np.where(np.abs(x) < FLUSH_BELOW, np.zeros((), x.dtype), x)


def hist_bin(abs_values: np.ndarray) -> np.ndarray:
    """Histogram bin of each magnitude (finite, nonzero), comparing in float32 exactly as the TF path does."""
    with np.errstate(over="ignore"):
        a = np.asarray(abs_values, dtype=np.float64).astype(np.float32)
    return np.searchsorted(HIST_EDGES, a, side="right")


#: A device path's sampled histogram gives way to the exact one (every finite nonzero value binned, as
#: :func:`compute` does) when the sample kept fewer finite nonzero draws than this (or than half its draws, for a
#: ``hist_sample`` below twice this): a sparse tensor's sample may hold none of its few nonzero values, and an
#: empty histogram could not sum to their count.
SAMPLE_MIN_KEPT: int = 64


def sample_min_kept(hist_sample: int) -> int:
    """The fewest finite nonzero draws a device path's sample of ``hist_sample`` positions must keep."""
    return min(SAMPLE_MIN_KEPT, max(1, hist_sample // 2))


def sample_is_enough(n_nonzero: int, kept: int, hist_sample: int) -> bool:
    """Whether a device path may keep its histogram from a sample of ``hist_sample`` positions that kept ``kept``
    finite nonzero draws, for a tensor of ``n_nonzero`` finite nonzero values (the float64 statement of the rule
    that the TF, PyTorch and JAX paths apply on the device; its tests read it from here).

    Not when the tensor has at most ``hist_sample`` finite nonzero values: then the exact histogram is what
    :func:`compute` gives too; nor when the sample kept fewer than :func:`sample_min_kept` of them.
    """
    return n_nonzero > hist_sample and kept >= sample_min_kept(hist_sample)


def sample_salt(layer: int | np.ndarray) -> int | np.ndarray:
    """The per-layer salt of the device paths' histogram sampling (so layers of one step sample differently)."""
    return layer * 7919 + 1


def sample_stride(n: int) -> int:
    """Stride of the device paths' histogram sample: the integer nearest ``n / golden ratio`` coprime with ``n``.

    Positions ``(offset + i * stride) % n`` for ``i < hist_sample`` are each uniform over the tensor when
    ``offset`` is, and spread evenly with no early repeats (one random number per tensor instead of one per draw).
    """
    s = max(1, int(round(n * 0.6180339887498949)))
    while math.gcd(s, n) != 1:
        s += 1
    return s


def _max_abs_and_ssq_rel(finite: np.ndarray) -> tuple[float, float]:
    """max|x| and sum((x / max|x|)^2) in float64, robust to any magnitude."""
    if finite.size == 0:
        return 0.0, 0.0
    a = np.abs(finite.astype(np.float64))
    m = float(a.max())
    if m == 0.0 or not np.isfinite(m):
        return m, 0.0
    return m, float(np.sum(np.square(a / m)))


def compute(
    grad: np.ndarray | None,
    weight: np.ndarray | None = None,
    update: np.ndarray | None = None,
    *,
    size: int | None = None,
    hist_sample: int | None = DEFAULT_HIST_SAMPLE,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """The record (memory form) of one gradient tensor, computed in float64 from the float32 view of the values.

    ``grad=None`` gives the ``missing`` record (``size`` then defaults to the weight's size). ``hist_sample``
    bounds the histogram's work: a larger tensor is sampled with replacement (``None`` or 0: always exact).
    """
    if grad is None:
        rec = missing()
        if size is not None:
            rec[INDEX["size"]] = size
        elif weight is not None:
            rec[INDEX["size"]] = np.size(weight)
    else:
        rec = empty()
        finite = _set_counts_and_moments(rec, flush_to_zero(np.asarray(grad)).reshape(-1))
        _set_histogram(rec, np.abs(finite[finite != 0]), hist_sample, rng)
    _set_optional(rec, "weight", weight)
    _set_optional(rec, "update", update)
    return rec


def _set_counts_and_moments(rec: np.ndarray, g: np.ndarray, index: dict[str, int] = INDEX) -> np.ndarray:
    """Fill the counts, extremes, mean and ``ssq_rel`` of the flat values ``g`` (at ``index``: the gradient's or
    the forward record's); returns their finite values."""
    nan, posinf, neginf = np.isnan(g), np.isposinf(g), np.isneginf(g)
    finite = g[~(nan | posinf | neginf)]
    rec[index["size"]] = g.size
    rec[index["nan"]] = int(nan.sum())
    rec[index["posinf"]] = int(posinf.sum())
    rec[index["neginf"]] = int(neginf.sum())
    rec[index["zero"]] = int(np.count_nonzero(finite == 0))
    if finite.size:
        f64 = finite.astype(np.float64)
        rec[index["min"]] = f64.min()
        rec[index["max"]] = f64.max()
        m = float(np.abs(f64).max())
        if m > 0:
            for name, value in grad_sums(f64, m).items():
                rec[index[name]] = value
    return finite


def grad_sums(f64: np.ndarray, m: float) -> dict[str, float]:
    """The :data:`GRAD_SUMS` fields of the finite values ``f64`` (float64) whose max|x| is ``m > 0``, each from
    ``sum(term(x / m))``: the float64 reference of every backend's sums."""
    y = f64 / m
    out = {}
    for s in GRAD_SUMS:
        total = float(np.sum(s.term(np, y)))
        out[s.name] = total / y.size * power_of(m, s.power) if s.mean else total
    return out


def _set_histogram(rec: np.ndarray, nonzero: np.ndarray, hist_sample: int | None,
                   rng: np.random.Generator | None) -> None:
    """Fill the histogram of the finite nonzero magnitudes: exact, or from ``hist_sample`` draws with replacement
    scaled to their count (the rule every path shares, docs/FORMAT.md)."""
    n_nonzero = nonzero.size
    if hist_sample and n_nonzero > hist_sample:
        rng = rng if rng is not None else np.random.default_rng()
        sample = nonzero[rng.integers(0, n_nonzero, size=hist_sample)]
        counts = np.bincount(hist_bin(sample), minlength=HIST_BINS).astype(np.float64)
        rec[HIST_START:] = counts * (n_nonzero / hist_sample)
        rec[INDEX["hist_sample"]] = hist_sample
    else:
        rec[HIST_START:] = np.bincount(hist_bin(nonzero), minlength=HIST_BINS)
        rec[INDEX["hist_sample"]] = n_nonzero


def _set_optional(rec: np.ndarray, prefix: str, values: np.ndarray | None) -> None:
    if values is None:
        return
    v = flush_to_zero(np.asarray(values)).reshape(-1)
    v = v[np.isfinite(v)]
    m, ssq = _max_abs_and_ssq_rel(v)
    rec[INDEX[f"{prefix}_max_abs"]] = m
    rec[INDEX[f"{prefix}_ssq_rel"]] = ssq


def noise_fields(micro_grads: list[np.ndarray]) -> tuple[float, float]:
    """``(micro_batches, noise_ssq_rel)`` for the mean of ``micro_grads``: the float64 reference of the noise.

    ``noise_ssq_rel = sum_i ||g_i - mean||^2 / (k - 1) / max|mean|^2`` (0 for a single micro-batch), so that
    ``noise = sqrt(noise_ssq_rel / ssq_rel)`` is the sample standard deviation of the micro-batch gradients (as
    a vector norm) over the norm of their mean: the inverse of a gradient signal-to-noise ratio.
    """
    k = len(micro_grads)
    stack = np.stack([flush_to_zero(np.asarray(g)).astype(np.float64).reshape(-1) for g in micro_grads])
    mean = stack.mean(axis=0)
    m = float(np.abs(mean).max()) if mean.size else 0.0
    if k < 2 or m == 0.0:
        return float(k), 0.0
    dev = (stack - mean) / m
    return float(k), float(np.sum(np.square(dev)) / (k - 1))


def _rescaled(rel: np.ndarray, scale: np.ndarray, new_scale: np.ndarray, power: int = 2) -> np.ndarray:
    """A relative sum of degree ``power`` taken from ``scale`` to ``new_scale`` (0 where that is 0)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(new_scale > 0, scale / np.where(new_scale > 0, new_scale, 1.0), 0.0)
    return rel * power_of(ratio, power)


def merge(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Merge records (memory form) of disjoint parts of one tensor (shards, slices) or of several steps.

    The result describes all the parts' values together: counts and histograms add, min/max combine, the mean
    is weighted by finite counts, relative sums of squares are rescaled to the larger max|.| and added. An
    optional field that one part lacks (NaN) is taken from the other part, so :func:`empty` is the identity;
    it stays NaN only when no part has it. Broadcasts over leading dimensions.
    """
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))
    return merge_all(np.stack([a, b]))


def _merge_grad_sums(r: np.ndarray, out: np.ndarray, ma: np.ndarray, m: np.ndarray, n: np.ndarray,
                     index: dict[str, int]) -> None:
    """The :data:`GRAD_SUMS` fields (at ``index``: the gradient's or the forward record's) of the parts ``r``
    (max|.| ``ma``, largest ``m``, ``n`` finite values each) merged into ``out``: a mean weighted by the parts'
    finite counts (a lone part's comes back exactly: x 1.0), a relative sum rescaled to ``m``, added."""
    total = n.sum(axis=0)
    for s in GRAD_SUMS:
        v = r[..., index[s.name]]
        if s.mean:
            with np.errstate(invalid="ignore", divide="ignore"):
                weighted = np.where(n > 0, n / np.where(total > 0, total, 1) * v, 0.0).sum(axis=0)
            out[..., index[s.name]] = np.where(total > 0, weighted, v[-1])
        else:
            out[..., index[s.name]] = _rescaled(v, ma, m, s.power).sum(axis=0)


def merge_all(records: np.ndarray, axis: int = 0) -> np.ndarray:
    """Merge records along ``axis`` (the shard axis of a host_call tensor, the steps of a window) with the rules of
    :func:`merge`: one reduction per field, not a fold of pairs (a window of long-run steps has thousands of layers:
    one pass per field, no temporary per pair). Rows may be cut inside the histogram."""
    r = np.moveaxis(np.asarray(records, dtype=np.float64), axis, 0)
    if r.shape[0] == 0:
        return empty(r.shape[1:-1])[..., : r.shape[-1]]
    out = np.empty(r.shape[1:], dtype=np.float64)
    for name in COUNT_FIELDS + ("hist_sample",):
        out[..., INDEX[name]] = r[..., INDEX[name]].sum(axis=0)
    out[..., HIST_START:] = r[..., HIST_START:].sum(axis=0)
    out[..., INDEX["min"]] = np.minimum.reduce(r[..., INDEX["min"]], axis=0)
    out[..., INDEX["max"]] = np.maximum.reduce(r[..., INDEX["max"]], axis=0)
    ma = max_abs(r)
    m = ma.max(axis=0)
    _merge_grad_sums(r, out, ma, m, finite_count(r), INDEX)
    noise = _rescaled(r[..., INDEX["noise_ssq_rel"]], ma, m)
    out[..., INDEX["noise_ssq_rel"]] = np.where(np.isnan(noise).all(axis=0), np.nan, np.nansum(noise, axis=0))
    out[..., INDEX["micro_batches"]] = np.fmax.reduce(r[..., INDEX["micro_batches"]], axis=0)
    for scale_name, ssq_name in _OPTIONAL_PAIRS:
        sk = r[..., INDEX[scale_name]]
        s = np.fmax.reduce(sk, axis=0)
        added = np.nan_to_num(_rescaled(r[..., INDEX[ssq_name]], sk, s)).sum(axis=0)
        out[..., INDEX[ssq_name]] = np.where(np.isnan(s), np.nan, added)
        out[..., INDEX[scale_name]] = s
    out[..., INDEX["missing"]] = np.minimum.reduce(r[..., INDEX["missing"]], axis=0)
    return out


#: Fields that :func:`merge` adds: the counts, the relative sums of squares, the histogram and its sample size.
ADDITIVE: tuple[int, ...] = tuple(
    [INDEX[name] for name in COUNT_FIELDS + tuple(s.name for s in GRAD_SUMS if not s.mean)
     + ("weight_ssq_rel", "update_ssq_rel", "noise_ssq_rel", "hist_sample")]
    + list(range(HIST_START, NUM_FIELDS))
)


def scale(rec: np.ndarray, factor: float | np.ndarray) -> np.ndarray:
    """The records with their additive fields (:data:`ADDITIVE`) times ``factor`` (broadcast over the leading
    dimensions), the rest unchanged: ``scale(merge(a, b), 1/2)`` is the mean step of two steps, as long runs keep
    their older steps (:mod:`tb_gradhealth._tiers`), and ``scale(mean, k)`` gives back the merge of ``k`` steps."""
    out = np.array(rec, dtype=np.float64)
    factor = np.asarray(factor, dtype=np.float64)[..., None]
    for lo, hi in _ADDITIVE_RUNS:  # slices, not a fancy index: no gather and scatter of every row
        out[..., lo:hi] *= factor  # (rows cut before the histogram, as the charts read them, have fewer fields)
    return out


def _runs(indices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Sorted indices as ``(start, end)`` runs of consecutive ones."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return tuple((lo, hi) for lo, hi in out)


_ADDITIVE_RUNS = _runs(ADDITIVE)


# --- derived quantities ---------------------------------------------------------------------------------------


def nonfinite_count(rec: np.ndarray) -> np.ndarray:
    """NaN + Inf elements of each record."""
    rec = np.asarray(rec)
    return rec[..., INDEX["nan"]] + rec[..., INDEX["posinf"]] + rec[..., INDEX["neginf"]]


def finite_count(rec: np.ndarray) -> np.ndarray:
    return np.asarray(rec)[..., INDEX["size"]] - nonfinite_count(rec)


def max_abs(rec: np.ndarray) -> np.ndarray:
    """max|g| over finite values (0 when there are none)."""
    rec = np.asarray(rec)
    m = np.maximum(-rec[..., INDEX["min"]], rec[..., INDEX["max"]])
    return np.where(np.isfinite(m), m, 0.0) if np.ndim(m) else (float(m) if np.isfinite(m) else 0.0)


def _norm(scale: np.ndarray, ssq_rel: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return scale * np.sqrt(ssq_rel)


def derived(rec: np.ndarray) -> dict[str, np.ndarray]:
    """Human-facing quantities of records (memory form), as float64 arrays over the leading dimensions.

    ``norm``/``rms``/``mean``/``max_abs`` are over finite values, NaN (unknown, never 0) where every element is
    NaN/Inf;
    ``zero_fraction`` and ``nonfinite`` over all elements; ratios are NaN when their optional field was not
    recorded. A weight or update keeps its norm over its finite elements only, so where the gradient has no finite
    value (NaN weights make NaN gradients) a weight norm of 0 is unknown too.
    """
    rec = np.asarray(rec, dtype=np.float64)
    size = rec[..., INDEX["size"]]
    n = finite_count(rec)
    m = np.where((n > 0) | (size == 0), max_abs(rec), np.nan)  # an empty tensor's norm is 0; all-NaN: unknown
    norm = _norm(m, rec[..., INDEX["ssq_rel"]])
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(n > 0, norm / np.sqrt(np.where(n > 0, n, 1)), np.nan)
        weight_norm = _norm(rec[..., INDEX["weight_max_abs"]], rec[..., INDEX["weight_ssq_rel"]])
        weight_norm = np.where((n > 0) | (size == 0) | (weight_norm > 0), weight_norm, np.nan)
        weight_rms = weight_norm / np.sqrt(np.where(size > 0, size, np.nan))
        update_norm = _norm(rec[..., INDEX["update_max_abs"]], rec[..., INDEX["update_ssq_rel"]])
        noise_norm = _norm(m, rec[..., INDEX["noise_ssq_rel"]])
        out = {
            "size": size,
            "finite": n,
            "nan": rec[..., INDEX["nan"]],
            "inf": rec[..., INDEX["posinf"]] + rec[..., INDEX["neginf"]],
            "zero": rec[..., INDEX["zero"]],
            "zero_fraction": np.where(size > 0, rec[..., INDEX["zero"]] / np.where(size > 0, size, 1), np.nan),
            "min": rec[..., INDEX["min"]],
            "max": rec[..., INDEX["max"]],
            "mean": np.where(np.isfinite(m), rec[..., INDEX["mean"]], np.nan),
            "max_abs": m,
            "norm": norm,
            "rms": rms,
            "weight_norm": weight_norm,
            "weight_rms": weight_rms,
            "grad_to_weight": norm / weight_norm,
            "update_norm": update_norm,
            "update_to_weight": update_norm / weight_norm,
            "micro_batches": rec[..., INDEX["micro_batches"]],
            "noise": np.where(norm > 0, noise_norm / np.where(norm > 0, norm, 1.0), np.nan),
            "missing": rec[..., INDEX["missing"]],
            "hist_exact": rec[..., INDEX["hist_sample"]] >= (n - rec[..., INDEX["zero"]]),
        }
    return out


# --- encodings ------------------------------------------------------------------------------------------------


def _check_rows(rec: np.ndarray) -> np.ndarray:
    rec = np.asarray(rec, dtype=np.float64)
    if rec.ndim != 2 or rec.shape[1] != NUM_FIELDS:
        raise ValueError(f"expected records of shape [L, {NUM_FIELDS}], got {rec.shape}")
    return rec


def hist_window(hist: np.ndarray) -> tuple[int, int]:
    """``(lo, hi)``: the bins ``[lo, hi)`` of histograms ``[..., HIST_BINS]`` outside which every bin is empty in
    every row (``(0, 0)`` when all are): the window the disk form keeps and the ``histograms`` route shows."""
    nonempty = np.flatnonzero(np.any(np.reshape(hist, (-1, HIST_BINS)) != 0, axis=0))
    return (int(nonempty[0]), int(nonempty[-1]) + 1) if nonempty.size else (0, 0)


def to_disk(rec: np.ndarray) -> np.ndarray:
    """Memory-form rows ``[L, NUM_FIELDS]`` → the float32 disk tensor (counts as int32 bits, histogram trimmed)."""
    rec = _check_rows(rec)
    counts = rec[:, :NUM_COUNTS]
    if np.any(counts > MAX_ELEMENTS_PER_PART):
        raise ValueError(f"a count exceeds {MAX_ELEMENTS_PER_PART}: split the tensor into parts")
    hist = rec[:, HIST_START:]
    lo, hi = hist_window(hist)
    out = np.empty((rec.shape[0], DISK_HIST_START + hi - lo), dtype=np.float32)
    out.view(np.int32)[:, :NUM_COUNTS] = np.rint(counts).astype(np.int32)
    out[:, NUM_COUNTS:DISK_HIST_LO] = rec[:, NUM_COUNTS:HIST_START]
    out[:, DISK_HIST_LO] = lo
    out[:, DISK_HIST_START:] = hist[:, lo:hi]
    return out


def from_disk(tensor: np.ndarray) -> np.ndarray:
    """The float32 disk tensor (from any writer) → memory-form rows ``[L, NUM_FIELDS]`` float64."""
    t = np.ascontiguousarray(np.asarray(tensor), dtype=np.float32)
    if t.ndim != 2 or t.shape[1] < DISK_HIST_START:
        raise ValueError(f"not a gradhealth record tensor: shape {t.shape}")
    out = np.zeros((t.shape[0], NUM_FIELDS), dtype=np.float64)
    from_disk_into(t, out, slice(None))
    return out


def from_disk_into(tensor: np.ndarray, out: np.ndarray, rows: slice | np.ndarray) -> None:
    """Decode the disk tensor into ``out[rows]`` (memory form, ``out`` float64 ``[N, NUM_FIELDS]`` whose histogram
    bins are already zero), writing only the counts, the values and the tensor's histogram window: a large array
    of zeros then keeps the pages of bins no record uses untouched (never allocated)."""
    t = np.ascontiguousarray(np.asarray(tensor), dtype=np.float32)
    width = t.shape[1] - DISK_HIST_START
    out[rows, :NUM_COUNTS] = t.view(np.int32)[:, :NUM_COUNTS]
    out[rows, NUM_COUNTS:HIST_START] = t[:, NUM_COUNTS:DISK_HIST_LO]
    if t.shape[0]:
        lo = int(t[0, DISK_HIST_LO])
        if lo < 0 or lo + width > HIST_BINS or not np.all(t[:, DISK_HIST_LO] == lo):
            raise ValueError(f"corrupt record tensor: histogram window {lo}+{width} of {HIST_BINS}")
        if width:
            out[rows, HIST_START + lo : HIST_START + lo + width] = t[:, DISK_HIST_START:]


#: Relative slack of the consistency checks on float32-stored sums (``ssq_rel``, the mean, histogram totals).
_CHECK_RTOL = 1e-3


def check_disk(t: np.ndarray, rows_per_event: int | None = None) -> tuple[np.ndarray, dict[int, str]]:
    """Which rows of a float32 disk tensor ``[L, C]`` are damaged: ``(bad [L] bool, {row: reason})``.

    ``rows_per_event``: ``t`` is several events of that many rows each, stacked (one call for many events is much
    cheaper than one per event); the ``hist_lo`` rule then holds per event.

    Every writer produces rows that pass these checks; a flipped byte, a truncated copy spliced into a file or a
    writer bug usually fails one of them. A row is damaged when: a count is negative or the nonfinite and zero counts
    exceed ``size``; ``missing`` is not 0, 1 or 2; finite values exist but ``min``/``max`` are not finite,
    ``min > max``, the mean is outside ``[min, max]``, or ``ssq_rel`` is outside ``[1, finite count]`` (0 when all
    are zero); an optional field or a histogram bin is negative or infinite; the histogram's total differs from the
    finite nonzero count; its ``hist_lo`` differs from the event's (the median of its rows: the value more than half
    of them share, when one does), or its window leaves the histogram. A flip that keeps every field plausible is
    not detected here (the event file's data checksum catches it when it is checked).
    """
    t = np.asarray(t, dtype=np.float32)
    if t.shape[0] == 0:
        return np.zeros(0, dtype=bool), {}
    # One contiguous row per count (a strided view would make every check below several times slower).
    counts = np.ascontiguousarray(np.ascontiguousarray(t[:, :NUM_COUNTS]).view(np.int32).T, dtype=np.int64)
    v = np.ascontiguousarray(t[:, NUM_COUNTS:DISK_HIST_LO].T, dtype=np.float64)  # one contiguous row per field
    vi = {name: v[i] for i, name in enumerate(VALUE_FIELDS)}
    finite = counts[0] - counts[1] - counts[2] - counts[3]
    zero = counts[4]
    reasons: dict[int, str] = {}
    for mask, why in (*_count_checks(counts, finite, zero), *_value_checks(finite, zero, vi),
                      *_histogram_checks(t[:, DISK_HIST_START:], finite, zero, vi),
                      *_window_checks(t, rows_per_event)):
        for i in np.flatnonzero(mask):
            reasons.setdefault(int(i), why)  # a row's first failed check is its reason
    bad = np.zeros(t.shape[0], dtype=bool)
    bad[list(reasons)] = True
    return bad, reasons


#: A check of :func:`check_disk`: the rows failing it, and why.
_Check = tuple[np.ndarray, str]


def _count_checks(counts: np.ndarray, finite: np.ndarray, zero: np.ndarray) -> list[_Check]:
    return [(np.any(counts < 0, axis=0), "negative count"),
            (finite - zero < 0, "NaN, Inf and zero counts exceed size")]


def _value_checks(finite: np.ndarray, zero: np.ndarray, vi: dict[str, np.ndarray]) -> list[_Check]:
    """The value fields against the counts and each other (a relative sum: in ``[1, finite count]``, as the
    element at max|g| adds 1 and each other at most 1)."""
    mn, mx, mean = vi["min"], vi["max"], vi["mean"]
    relative = [s.name for s in GRAD_SUMS if not s.mean]
    has = (finite > 0) & (vi["missing"] == 0)
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.maximum(np.abs(mn), np.abs(mx))
        slack = _CHECK_RTOL * m
        nonzero = has & (finite - zero > 0)
        checks = [
            (~np.isin(vi["missing"], (HAS_GRADIENT, MISSING, FROZEN)), "missing flag is not 0, 1 or 2"),
            (has & ~(np.isfinite(mn) & np.isfinite(mx)),
             "min/max not finite although finite values are counted (a value beyond float32's range?)"),
            (has & (mn > mx), "min > max"),
            (has & ~((mean >= mn - slack) & (mean <= mx + slack)), "mean outside [min, max]"),
        ]
        checks += [(nonzero & ~((vi[name] >= 1.0 - _CHECK_RTOL) & (vi[name] <= finite * (1.0 + _CHECK_RTOL))),
                    f"{name} outside [1, finite count]") for name in relative]
        rel_nonzero = np.logical_or.reduce([vi[name] != 0 for name in relative])
        checks += [(has & (finite - zero == 0) & ((m != 0) | rel_nonzero),
                    f"all values zero but min/max/{'/'.join(relative)} are not")]
        checks += [(~(np.isnan(vi[name]) | ((vi[name] >= 0) & np.isfinite(vi[name]))),
                    f"{name} negative or infinite") for name in OPTIONAL_FIELDS + ("hist_sample",)]
    return checks


def _histogram_checks(hist: np.ndarray, finite: np.ndarray, zero: np.ndarray, vi: dict[str, np.ndarray]
                      ) -> list[_Check]:
    """The histogram bins: each a count, together the finite nonzero count."""
    with np.errstate(invalid="ignore", over="ignore"):
        total = hist.sum(axis=1, dtype=np.float64)
        expect = np.where(vi["missing"] == 0, finite - zero, 0)
        # NaN fails both comparisons, so one combined mask checks "finite and not negative" in one pass.
        counts_ok = np.logical_and.reduce((hist >= 0) & (hist < np.inf), axis=1)
        return [(~counts_ok, "histogram bin negative or not finite"),
                (np.abs(total - expect) > _CHECK_RTOL * np.maximum(expect, 1) + 0.5,
                 "histogram total differs from the finite nonzero count")]


def _window_checks(t: np.ndarray, rows_per_event: int | None) -> list[_Check]:
    """``hist_lo``: the event's own (the median of its rows), and a window inside the histogram."""
    width = t.shape[1] - DISK_HIST_START
    lo = t[:, DISK_HIST_LO].astype(np.float64).reshape(-1, rows_per_event or t.shape[0])
    finite_lo = np.isfinite(lo)
    with np.errstate(invalid="ignore"):
        common = np.median(np.where(finite_lo, lo, np.inf), axis=1, keepdims=True)  # NaN rows count as +inf
        common = np.where(np.isfinite(common), common, np.nan)
        outside = ~((common == np.floor(common)) & (common >= 0) & (common <= HIST_BINS - width))
        return [(~finite_lo.ravel(), "histogram window start is not a number"),
                ((finite_lo & (lo != common)).ravel(), "histogram window start differs from the rest of its event"),
                (np.broadcast_to(outside & finite_lo, lo.shape).ravel(),
                 f"histogram window of {width} bins starts outside the {HIST_BINS} bins")]


def decode_disk(t: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """The disk tensor → ``(memory-form rows, {row: reason})``: damaged rows (see :func:`check_disk`) are all-NaN,
    the others decoded as :func:`from_disk` does. Raises ValueError only for a tensor that is not ``[L, >= 18]``."""
    t = np.ascontiguousarray(np.asarray(tensor_or_raise(t)), dtype=np.float32)
    bad, reasons = check_disk(t)
    if not bad.any():
        return from_disk(t), reasons
    out = np.full((t.shape[0], NUM_FIELDS), np.nan)
    if not bad.all():
        out[~bad] = from_disk(t[~bad])
    return out, reasons


def tensor_or_raise(t: np.ndarray) -> np.ndarray:
    """``t`` if it has the disk form's shape ``[L, >= 18]``, else ValueError."""
    if np.ndim(t) != 2 or np.shape(t)[1] < DISK_HIST_START:
        raise ValueError(f"tensor of shape {np.shape(t)} is not a gradhealth record tensor")
    return t


def from_device(counts: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The TF path's ``(counts int32 [..., 5], values float32 [..., 12 + HIST_BINS])`` → memory form."""
    counts = np.asarray(counts)
    values = np.asarray(values)
    if counts.shape[-1] != NUM_COUNTS or values.shape[-1] != NUM_VALUES + HIST_BINS:
        raise ValueError(
            f"expected counts [..., {NUM_COUNTS}] and values [..., {NUM_VALUES + HIST_BINS}], "
            f"got {counts.shape} and {values.shape}"
        )
    return np.concatenate([counts.astype(np.float64), values.astype(np.float64)], axis=-1)


# --- the forward record ---------------------------------------------------------------------------------------

#: The kind (tag metadata ``kind``) of forward records: one layer's output at a logged step.
ACTIVATIONS = "activations"
GRADIENTS = "gradients"
#: The format version a tag of each kind is written with (a reader reads up to :data:`FORMAT_VERSION`): a tag of
#: any other ``kind`` (a label its writer chose, such as ``"merged"``) holds gradient records, written as v2.
KIND_VERSION: dict[str, int] = {GRADIENTS: 2, ACTIVATIONS: 3}


def version_of(kind: str) -> int:
    """The format version a tag of ``kind`` is written with (:data:`KIND_VERSION`)."""
    return KIND_VERSION.get(kind, KIND_VERSION[GRADIENTS])

#: The forward record's exact counts: the output's elements, its NaN/+Inf/-Inf and exact zeros (after flush to
#: zero), its ``units`` (the size of its unit axis: a Dense layer's features, a convolution's channels), the units
#: ``dead`` for every input of the batch (exactly zero at every other index) and the finite elements ``saturated``
#: within :data:`SATURATION_MARGIN` of a bound of a bounded activation (0 when unbounded).
ACT_COUNT_FIELDS: tuple[str, ...] = ("size", "nan", "posinf", "neginf", "zero", "units", "dead", "saturated")
#: Its values: the finite extremes, the mean and ``ssq_rel`` (as the gradient record's :data:`GRAD_SUMS`), and the
#: activation's bounds (NaN: not a bounded activation, or not known).
ACT_VALUE_FIELDS: tuple[str, ...] = ("min", "max", "mean", "ssq_rel", "bound_lo", "bound_hi")
ACT_FIELDS: tuple[str, ...] = ACT_COUNT_FIELDS + ACT_VALUE_FIELDS
ACT_NUM_FIELDS: int = len(ACT_FIELDS)
ACT_NUM_COUNTS: int = len(ACT_COUNT_FIELDS)
ACT_INDEX: dict[str, int] = {name: i for i, name in enumerate(ACT_FIELDS)}

#: A bounded activation's output counts as saturated within this fraction of its range from a bound: for tanh
#: ``|a| >= 0.98`` and for sigmoid ``a <= 0.01`` or ``a >= 0.99``, where the derivative is at most 4% of its
#: largest (``1 - 0.98**2 = 0.0396``; ``0.99 * 0.01 / 0.25 = 0.0396``).
SATURATION_MARGIN: float = 0.01
#: The bounded activations, as the writers name them (Keras' names; :mod:`tb_gradhealth.torch_kinds` maps torch's).
BOUNDS: dict[str, tuple[float, float]] = {
    "sigmoid": (0.0, 1.0), "hard_sigmoid": (0.0, 1.0), "softmax": (0.0, 1.0),
    "tanh": (-1.0, 1.0), "hard_tanh": (-1.0, 1.0), "softsign": (-1.0, 1.0),
}


def activation_bounds(activation: str) -> tuple[float, float] | None:
    """The ``(lo, hi)`` bounds of a bounded activation by its name (:data:`BOUNDS`), None for any other."""
    return BOUNDS.get(str(activation).lower())


def saturation_edges(bounds: tuple[float, float]) -> tuple[np.float32, np.float32]:
    """The float32 thresholds every writer compares an output with (``a <= lo_edge`` or ``a >= hi_edge``: saturated),
    :data:`SATURATION_MARGIN` of the range inside each bound."""
    lo, hi = float(bounds[0]), float(bounds[1])
    margin = SATURATION_MARGIN * (hi - lo)
    return np.float32(lo + margin), np.float32(hi - margin)


def act_empty(shape: tuple[int, ...] = ()) -> np.ndarray:
    """Forward records of empty outputs: the identity of :func:`act_merge_all` (min=+inf, max=-inf, bounds NaN)."""
    rec = np.zeros(tuple(shape) + (ACT_NUM_FIELDS,), dtype=np.float64)
    rec[..., ACT_INDEX["min"]] = np.inf
    rec[..., ACT_INDEX["max"]] = -np.inf
    rec[..., ACT_INDEX["bound_lo"]] = np.nan
    rec[..., ACT_INDEX["bound_hi"]] = np.nan
    return rec


def _units_view(v: np.ndarray, unit_axis: int) -> np.ndarray:
    """The output as ``[batch positions, units]``: its unit axis last, every other axis one (an output of fewer than
    two axes, a value per example, is one unit)."""
    if v.ndim < 2:
        return v.reshape(-1, 1)
    return np.moveaxis(v, unit_axis, -1).reshape(-1, v.shape[unit_axis])


def unit_alive(output: np.ndarray, *, unit_axis: int = -1) -> np.ndarray:
    """``bool [units]``: the units not exactly zero (after flush to zero) for some input of the batch, a NaN or Inf
    counting as not zero. A unit is dead for a batch made of parts exactly where no part has it alive, so writers
    that record a batch in parts (micro-batches, data-parallel shards) OR these before counting
    (:func:`act_merge_batches`)."""
    v = _units_view(flush_to_zero(np.asarray(output)), unit_axis)
    return np.any(v != 0, axis=0)


def compute_activations(
    output: np.ndarray,
    *,
    unit_axis: int = -1,
    bounds: tuple[float, float] | None = None,
) -> np.ndarray:
    """The forward record (memory form ``[ACT_NUM_FIELDS]``) of one layer's output over a batch, in float64 from
    the float32 view of the values (as :func:`compute`): the float64 reference of every writer.

    ``unit_axis``: the axis of the output's units (-1 for Keras and Dense layers, 1 for PyTorch's ``NCHW``
    convolutions); every other axis is a batch axis (examples, positions). ``bounds``: the activation's
    ``(lo, hi)`` (:func:`activation_bounds`) for the saturated count, None for an unbounded one.
    """
    v = flush_to_zero(np.asarray(output))
    rec = act_empty()
    finite = _set_counts_and_moments(rec, v.reshape(-1), ACT_INDEX)
    alive = unit_alive(v, unit_axis=unit_axis) if v.size else np.zeros(0, bool)
    rec[ACT_INDEX["units"]] = alive.size
    rec[ACT_INDEX["dead"]] = int(np.count_nonzero(~alive))
    if bounds is not None:
        lo, hi = saturation_edges(bounds)
        rec[ACT_INDEX["saturated"]] = int(np.count_nonzero((finite <= lo) | (finite >= hi)))
        rec[ACT_INDEX["bound_lo"]], rec[ACT_INDEX["bound_hi"]] = float(bounds[0]), float(bounds[1])
    return rec


#: The forward record's fields that :func:`act_merge_all` adds (counts, and the relative sum of squares).
ACT_ADDITIVE: tuple[int, ...] = tuple(ACT_INDEX[name] for name in ACT_COUNT_FIELDS
                                      + tuple(s.name for s in GRAD_SUMS if not s.mean))


def act_merge_all(records: np.ndarray, axis: int = 0) -> np.ndarray:
    """Merge forward records along ``axis``: of disjoint sets of units of one output (tensor-parallel shards), or of
    several steps (a window). Counts add (so ``dead / units`` of steps is their mean dead fraction), min/max
    combine, the mean and ``ssq_rel`` merge as :func:`merge`'s, the bounds are taken where known.

    Parts of one batch (micro-batches, data-parallel shards) share their units: merge them with
    :func:`act_merge_batches`, which needs each part's :func:`unit_alive`.
    """
    r = np.moveaxis(np.asarray(records, dtype=np.float64), axis, 0)
    if r.shape[0] == 0:
        return act_empty(r.shape[1:-1])
    out = np.empty(r.shape[1:], dtype=np.float64)
    for name in ACT_COUNT_FIELDS:
        out[..., ACT_INDEX[name]] = r[..., ACT_INDEX[name]].sum(axis=0)
    out[..., ACT_INDEX["min"]] = np.minimum.reduce(r[..., ACT_INDEX["min"]], axis=0)
    out[..., ACT_INDEX["max"]] = np.maximum.reduce(r[..., ACT_INDEX["max"]], axis=0)
    mn, mx = r[..., ACT_INDEX["min"]], r[..., ACT_INDEX["max"]]
    ma = np.maximum(-mn, mx)
    ma = np.where(np.isfinite(ma), ma, 0.0)
    m = ma.max(axis=0)
    n = r[..., ACT_INDEX["size"]] - r[..., ACT_INDEX["nan"]] - r[..., ACT_INDEX["posinf"]] - r[..., ACT_INDEX["neginf"]]
    _merge_grad_sums(r, out, ma, m, n, ACT_INDEX)
    for name in ("bound_lo", "bound_hi"):
        out[..., ACT_INDEX[name]] = np.fmax.reduce(r[..., ACT_INDEX[name]], axis=0)
    return out


def act_merge_batches(records: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """The forward record of one output over a batch given in parts: ``records [k, ACT_NUM_FIELDS]`` of the parts
    and their :func:`unit_alive` ``[k, units]``. Equal to :func:`compute_activations` of the whole batch: a unit
    is dead where it is dead in every part."""
    records = np.asarray(records, dtype=np.float64)
    alive = np.asarray(alive, dtype=bool)
    out = act_merge_all(records)
    out[ACT_INDEX["units"]] = alive.shape[-1]
    out[ACT_INDEX["dead"]] = int(np.count_nonzero(~np.any(alive, axis=0)))
    return out


def act_scale(rec: np.ndarray, factor: float | np.ndarray) -> np.ndarray:
    """The forward records with their additive fields (:data:`ACT_ADDITIVE`) times ``factor``: a window's mean
    step, as :func:`scale` for the gradient record."""
    out = np.array(rec, dtype=np.float64)
    factor = np.asarray(factor, dtype=np.float64)
    for i in ACT_ADDITIVE:
        out[..., i] *= factor
    return out


def act_derived(rec: np.ndarray) -> dict[str, np.ndarray]:
    """Human-facing quantities of forward records, float64 over the leading dimensions: ``rms``, ``mean``,
    ``max_abs`` over the finite values (NaN where there are none); ``nonfinite``; ``zero_fraction`` of the
    elements; ``dead_fraction`` of the units; ``saturated_fraction`` of the finite elements (NaN for an unbounded
    activation)."""
    rec = np.asarray(rec, dtype=np.float64)
    col = {name: rec[..., i] for name, i in ACT_INDEX.items()}
    size, units = col["size"], col["units"]
    nonfinite = col["nan"] + col["posinf"] + col["neginf"]
    n = size - nonfinite
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = np.maximum(-col["min"], col["max"])
        m = np.where((n > 0) & np.isfinite(m), m, np.nan)
        rms = np.where(n > 0, m * np.sqrt(col["ssq_rel"] / np.where(n > 0, n, 1)), np.nan)
        bounded = np.isfinite(col["bound_lo"]) & np.isfinite(col["bound_hi"])
        return {
            "size": size,
            "finite": n,
            "nonfinite": nonfinite,
            "zero_fraction": np.where(size > 0, col["zero"] / np.where(size > 0, size, 1), np.nan),
            "units": units,
            "dead": col["dead"],
            "dead_fraction": np.where(units > 0, col["dead"] / np.where(units > 0, units, 1), np.nan),
            "saturated_fraction": np.where(bounded & (n > 0), col["saturated"] / np.where(n > 0, n, 1), np.nan),
            "min": col["min"],
            "max": col["max"],
            "mean": np.where(n > 0, col["mean"], np.nan),
            "max_abs": m,
            "rms": rms,
        }


def _check_act_rows(rec: np.ndarray) -> np.ndarray:
    rec = np.asarray(rec, dtype=np.float64)
    if rec.ndim != 2 or rec.shape[1] != ACT_NUM_FIELDS:
        raise ValueError(f"expected forward records of shape [L, {ACT_NUM_FIELDS}], got {rec.shape}")
    return rec


def act_to_disk(rec: np.ndarray) -> np.ndarray:
    """Forward records ``[L, ACT_NUM_FIELDS]`` -> the float32 disk tensor ``[L, ACT_NUM_FIELDS]``: the counts as
    int32 bit patterns (exact), the values as float32."""
    rec = _check_act_rows(rec)
    counts = rec[:, :ACT_NUM_COUNTS]
    if np.any(counts > MAX_ELEMENTS_PER_PART):
        raise ValueError(f"a count exceeds {MAX_ELEMENTS_PER_PART}: split the output into parts")
    out = np.empty(rec.shape, dtype=np.float32)
    out.view(np.int32)[:, :ACT_NUM_COUNTS] = np.rint(counts).astype(np.int32)
    with np.errstate(over="ignore"):
        out[:, ACT_NUM_COUNTS:] = rec[:, ACT_NUM_COUNTS:]
    return out


def act_from_disk(tensor: np.ndarray) -> np.ndarray:
    """The float32 disk tensor of forward records -> memory form ``[L, ACT_NUM_FIELDS]`` float64."""
    t = act_tensor_or_raise(np.ascontiguousarray(np.asarray(tensor), dtype=np.float32))
    out = np.empty(t.shape, dtype=np.float64)
    out[:, :ACT_NUM_COUNTS] = t.view(np.int32)[:, :ACT_NUM_COUNTS]
    out[:, ACT_NUM_COUNTS:] = t[:, ACT_NUM_COUNTS:]
    return out


def act_tensor_or_raise(t: np.ndarray) -> np.ndarray:
    """``t`` if it has the forward disk form's shape ``[L, ACT_NUM_FIELDS]``, else ValueError."""
    if np.ndim(t) != 2 or np.shape(t)[1] != ACT_NUM_FIELDS:
        raise ValueError(f"tensor of shape {np.shape(t)} is not a forward record tensor ([L, {ACT_NUM_FIELDS}])")
    return t


def act_check_disk(t: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """Which rows of a forward disk tensor are damaged: ``(bad [L] bool, {row: reason})``, as :func:`check_disk`.

    A row is damaged when a count is negative; the nonfinite and zero counts exceed ``size``; ``dead`` exceeds
    ``units`` or ``units`` exceeds ``size`` (or is 0 for a nonempty output); ``saturated`` exceeds the finite count,
    or is not 0 without bounds; the bounds are not both NaN or both finite with ``lo < hi``; finite values are counted
    but min/max are not finite, ``min > max``, the mean is outside ``[min, max]`` or ``ssq_rel`` outside
    ``[1, finite count]`` (0 when all are zero).
    """
    t = np.asarray(act_tensor_or_raise(np.asarray(t)), dtype=np.float32)
    c = {name: np.ascontiguousarray(t[:, i]).view(np.int32).astype(np.int64) for i, name in enumerate(ACT_COUNT_FIELDS)}
    v = {name: t[:, ACT_INDEX[name]].astype(np.float64) for name in ACT_VALUE_FIELDS}
    finite = c["size"] - c["nan"] - c["posinf"] - c["neginf"]
    has = finite > 0
    lo, hi = v["bound_lo"], v["bound_hi"]
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.maximum(np.abs(v["min"]), np.abs(v["max"]))
        slack = _CHECK_RTOL * m
        nonzero = has & (finite - c["zero"] > 0)
        checks = [
            (np.any(np.stack(list(c.values())) < 0, axis=0), "negative count"),
            (finite - c["zero"] < 0, "NaN, Inf and zero counts exceed size"),
            ((c["dead"] > c["units"]) | (c["units"] > np.maximum(c["size"], 1)) | ((c["size"] > 0) & (c["units"] == 0)),
             "dead units exceed units, or units exceed size"),
            (c["saturated"] > np.maximum(finite, 0), "saturated count exceeds the finite count"),
            (~((np.isnan(lo) & np.isnan(hi)) | (np.isfinite(lo) & np.isfinite(hi) & (lo < hi))),
             "bounds are not both NaN or an interval"),
            (np.isnan(lo) & (c["saturated"] != 0), "saturated count without bounds"),
            (has & ~(np.isfinite(v["min"]) & np.isfinite(v["max"])), "min/max not finite although finite values are "
                                                                     "counted"),
            (has & (v["min"] > v["max"]), "min > max"),
            (has & ~((v["mean"] >= v["min"] - slack) & (v["mean"] <= v["max"] + slack)), "mean outside [min, max]"),
            (nonzero & ~((v["ssq_rel"] >= 1.0 - _CHECK_RTOL) & (v["ssq_rel"] <= finite * (1.0 + _CHECK_RTOL))),
             "ssq_rel outside [1, finite count]"),
            (has & (finite - c["zero"] == 0) & ((m != 0) | (v["ssq_rel"] != 0)), "all values zero but min/max/ssq_rel "
                                                                                  "are not"),
        ]
    reasons: dict[int, str] = {}
    for mask, why in checks:
        for i in np.flatnonzero(mask):
            reasons.setdefault(int(i), why)
    bad = np.zeros(t.shape[0], dtype=bool)
    bad[list(reasons)] = True
    return bad, reasons
