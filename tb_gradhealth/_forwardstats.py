"""The forward record's statistics of one layer output, written once for array libraries with a numpy-like namespace
(torch, jax.numpy, TensorFlow's numpy): the PyTorch, JAX and Keras writers call :func:`output_stats` with their
backend (:class:`tb_gradhealth._devicestats.Backend`), so every device computes what
:func:`tb_gradhealth.record.compute_activations` (the float64 reference) defines, the same way. Imports numpy only.

Every statistic is a reduction of the output on its device: counts, extremes, the relative sums (shared with the
gradient record: :func:`tb_gradhealth._devicestats.grad_sums`), the saturated count against
:func:`record.saturation_edges`, and each unit's ``alive`` bit (a reduction over every axis but the unit axis).
What leaves the device is a few numbers and one bit a unit (:func:`rows`: the alive bits of the parts of one batch
are ORed before the dead units are counted, :func:`record.act_merge_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth import record
from tb_gradhealth._devicestats import F32_MAX, Backend, grad_sums, one_pass_ok

#: The counts :func:`output_stats` gives, in order (``units`` and ``dead`` come from ``alive``).
COUNTS = ("size", "nan", "posinf", "neginf", "zero", "saturated")
#: The values it gives, in order.
VALUES = ("min", "max", *record.GRAD_SUM_NAMES)


class OutputStats(NamedTuple):
    """One output's statistics on its device: ``counts`` int ``[len(COUNTS)]``, ``values`` float32
    ``[len(VALUES)]`` and ``alive`` bool ``[units]``."""

    counts: Any
    values: Any
    alive: Any


def unit_axis_of(ndim: int, unit_axis: int) -> int | None:
    """The unit axis of an output of ``ndim`` axes as a non-negative index, None for an output of fewer than two axes
    (one unit: a value per example)."""
    if ndim < 2:
        return None
    if not -ndim <= unit_axis < ndim:
        raise ValueError(f"unit_axis {unit_axis} is outside an output of {ndim} axes")
    return unit_axis % ndim


def per_unit_extremes(reduce_min: Callable[[Any, tuple[int, ...]], Any],
                      reduce_max: Callable[[Any, tuple[int, ...]], Any]) -> Callable[[Any, int], tuple[Any, Any]]:
    """The ``unit_extremes`` of :func:`output_stats` from a library's reductions over several axes
    (``reduce(x, axes)``): each unit's minimum and maximum over every axis but its own."""

    def unit_extremes(x: Any, axis: int) -> tuple[Any, Any]:
        others = tuple(d for d in range(len(x.shape)) if d != axis)
        return reduce_min(x, others), reduce_max(x, others)

    return unit_extremes


def output_stats(be: Backend, x: Any, *, unit_axis: int = -1, bounds: tuple[float, float] | None = None,
                 unit_any: Callable[[Any, int], Any] | None = None,
                 unit_extremes: Callable[[Any, int], tuple[Any, Any]] | None = None) -> OutputStats:
    """The statistics of one output ``x`` (any float dtype, taken as float32 holds it). ``unit_any(mask, axis)``:
    ``bool [units]``, whether each unit has a True anywhere along the other axes (default: the namespace's
    ``moveaxis``, ``reshape`` and ``any``).

    ``unit_extremes(x, axis)``: ``(min, max)`` of each unit over the other axes, given with a backend whose ``cond``
    runs one branch only: then an output of known shape whose values are all finite and of usual magnitude (every
    healthy one) takes :func:`one_pass_output_stats`, a few plain passes, and any other the masked passes below."""
    xp = be.xp
    x = be.f32(x)
    shape = tuple(x.shape)
    static = all(d is not None for d in shape)  # a traced TensorFlow step may know its batch only when it runs
    if unit_extremes is not None and static and math.prod(int(d) for d in shape) > 0:
        axis = unit_axis_of(len(shape), unit_axis)
        if axis is None:
            lo, hi = be.min_max(xp.reshape(x, (-1,)))
            unit_min, unit_max = xp.reshape(lo, (1,)), xp.reshape(hi, (1,))
        else:
            unit_min, unit_max = unit_extremes(x, axis)
        # a compiled maximum may skip a NaN (XLA's does): the sum of the values sees every one (and is the mean's)
        total = (be.fsum or xp.sum)(xp.reshape(x, (-1,)))
        ok = one_pass_ok(xp, xp.min(unit_min), xp.max(unit_max)) & xp.isfinite(total)
        return be.cond(ok, lambda x, lo, hi, s: one_pass_output_stats(be, x, lo, hi, bounds=bounds, total=s),
                       lambda x, lo, hi, s: output_stats(be, x, unit_axis=unit_axis, bounds=bounds, unit_any=unit_any),
                       (x, unit_min, unit_max, total))
    flat = xp.reshape(x, (-1,))
    a = xp.abs(flat)
    finite = a <= F32_MAX  # False for NaN and +-Inf
    keep = finite & (a >= record.FLUSH_BELOW)  # finite and not flushed to zero
    nfin = xp.count_nonzero(finite)
    nan = xp.count_nonzero(xp.isnan(flat))
    posinf = xp.count_nonzero(flat == float("inf"))
    if static:
        n = nfin * 0 + math.prod(int(d) for d in shape)  # in the counts' integer type
        neginf = n - nfin - nan - posinf
    else:  # counted: the size is not known while the step traces
        neginf = xp.count_nonzero(flat == -float("inf"))
        n = nfin + nan + posinf + neginf
    xk = xp.where(keep, flat, 0.0)
    empty = static and math.prod(int(d) for d in shape) == 0
    mn = xp.asarray(float("inf")) if empty else xp.min(xp.where(finite, xk, float("inf")))
    mx = xp.asarray(-float("inf")) if empty else xp.max(xp.where(finite, xk, -float("inf")))
    m = xp.maximum(mx, -mn)
    m = xp.where(m > 0, m, 0.0)  # no finite value: -inf -> 0
    sums = [xp.asarray(0.0)] * len(record.GRAD_SUMS) if empty else grad_sums(be, xk, m, be.f32(nfin), plain=False)
    saturated = nfin * 0
    if bounds is not None:
        lo, hi = record.saturation_edges(bounds)
        saturated = xp.count_nonzero(finite & ((xk <= float(lo)) | (xk >= float(hi))))
    counts = xp.stack([n, nan, posinf, neginf, nfin - xp.count_nonzero(keep), saturated])
    dims = [-1 if d is None else int(d) for d in shape]
    if dims.count(-1) <= 1:
        alive_mask = xp.reshape(~finite | keep, tuple(dims))  # not exactly zero: nonzero, NaN or Inf
    else:  # more than one axis known only when the step runs: from the output itself
        alive_mask = ~(xp.abs(x) < record.FLUSH_BELOW)
    axis = unit_axis_of(len(shape), unit_axis)
    if axis is None:
        alive = xp.reshape(xp.any(alive_mask), (1,))
    else:
        alive = xp.zeros((shape[axis],), dtype=bool) if empty else (unit_any or _unit_any)(xp, alive_mask, axis)
    return OutputStats(counts, be.f32(xp.stack([mn, mx, *sums])), alive)


def one_pass_output_stats(be: Backend, x: Any, unit_min: Any, unit_max: Any, *,
                          bounds: tuple[float, float] | None = None, total: Any = None) -> OutputStats:
    """The statistics of an output ``x`` (float32) whose values are all finite with max|x| in ``[SAFE_LO, SAFE_HI]``
    and neither extreme subnormal (:func:`tb_gradhealth._devicestats.one_pass_ok` of the extremes), from the
    per-unit extremes ``unit_min``, ``unit_max`` (``[units]``; one entry for an output of fewer than two axes):
    what :func:`output_stats` gives for such an output, in a few plain passes instead of its masked ones (the
    extremes and the alive bits come from the per-unit extremes; the sums are plain, as the gradient's one pass;
    ``total``: the sum of ``x`` where the caller has it)."""
    xp = be.xp
    flat = xp.reshape(x, (-1,))
    n = math.prod(int(d) for d in x.shape)
    mn, mx = xp.min(unit_min), xp.max(unit_max)
    m = xp.maximum(mx, -mn)
    normal = be.normal_count(flat)
    count = be.count or xp.count_nonzero
    nothing = normal * 0
    saturated = nothing
    if bounds is not None:
        lo, hi = (float(e) for e in record.saturation_edges(bounds))
        # edges that meet or cross leave no value between them: every value is saturated
        saturated = count(flat <= lo) + count(flat >= hi) if lo < hi else nothing + n
    counts = xp.stack([nothing + n, nothing, nothing, nothing, n - normal, saturated * 1 + nothing])
    sums = grad_sums(be, flat, m, n, plain=True, known=None if total is None else {"mean": total})
    alive = (unit_max >= record.FLUSH_BELOW) | (unit_min <= -record.FLUSH_BELOW)
    return OutputStats(counts, be.f32(xp.stack([mn, mx, *sums])), alive)


def _unit_any(xp: Any, mask: Any, axis: int) -> Any:
    units = mask.shape[axis]
    return xp.any(xp.reshape(xp.moveaxis(mask, axis, -1), (-1, units)), axis=0)


def row(counts: np.ndarray, values: np.ndarray, alive: np.ndarray, bounds: tuple[float, float] | None) -> np.ndarray:
    """One part's forward record (memory form) from its statistics on the host (before the parts of its batch are
    merged: ``dead`` here is the part's own)."""
    rec = record.act_empty()
    for name, v in zip(COUNTS, np.asarray(counts, dtype=np.float64), strict=True):
        rec[record.ACT_INDEX[name]] = v
    for name, v in zip(VALUES, np.asarray(values, dtype=np.float64), strict=True):
        rec[record.ACT_INDEX[name]] = v
    alive = np.asarray(alive, dtype=bool)
    rec[record.ACT_INDEX["units"]] = alive.size if rec[record.ACT_INDEX["size"]] else 0
    rec[record.ACT_INDEX["dead"]] = int(np.count_nonzero(~alive)) if rec[record.ACT_INDEX["size"]] else 0
    if bounds is not None:
        rec[record.ACT_INDEX["bound_lo"]], rec[record.ACT_INDEX["bound_hi"]] = bounds
    return rec


def merged_row(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
               bounds: tuple[float, float] | None) -> np.ndarray:
    """The forward record of one output over a batch seen in ``parts`` (each ``(counts, values, alive)`` on the
    host: micro-batches of one step): :func:`record.act_merge_batches` of their rows."""
    rows = np.stack([row(c, v, a, bounds) for c, v, a in parts])
    if len(parts) == 1:
        return rows[0]
    sizes = {np.size(a) for _, _, a in parts}
    if len(sizes) != 1:  # the same layer with other units (another input shape): its parts' own dead counts add
        return record.act_merge_all(rows)
    return record.act_merge_batches(rows, np.stack([np.asarray(a, dtype=bool) for _, _, a in parts]))


def disk_row(be: Backend, stats: OutputStats, bounds: tuple[float, float] | None, bits: Callable[[Any], Any]) -> Any:
    """One output's forward record in the disk form ``[ACT_NUM_FIELDS]`` float32, on the device: a batch seen
    whole (no parts to merge), so its dead units are counted there. ``bits``: integer counts -> the float32 bit
    patterns of their int32 values (the backend's cast and bitcast)."""
    xp = be.xp
    counts = dict(zip(COUNTS, [stats.counts[i] for i in range(len(COUNTS))], strict=True))
    units = int(stats.alive.shape[0])
    size = counts["size"]
    counts["units"] = xp.where(size > 0, units, 0)
    counts["dead"] = xp.where(size > 0, units - xp.count_nonzero(stats.alive), 0)
    lo, hi = bounds if bounds is not None else (float("nan"), float("nan"))
    values = dict(zip(VALUES, [stats.values[i] for i in range(len(VALUES))], strict=True))
    values |= {"bound_lo": be.f32(xp.asarray(lo)), "bound_hi": be.f32(xp.asarray(hi))}
    head = bits(xp.stack([counts[name] for name in record.ACT_COUNT_FIELDS]))
    return xp.concatenate([head, xp.stack([be.f32(values[name]) for name in record.ACT_VALUE_FIELDS])])
