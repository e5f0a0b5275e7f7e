"""The record's statistics of every layer at once, for traced code (``torch.compile``, ``jax.jit``).

Each tensor's one-pass statistics are computed; then one conditional for the whole model takes the scaled passes
only when some tensor needs them (NaN/Inf, extreme or subnormal magnitudes), and one bins every value only when
some sampled histogram must give way to the exact one (:func:`record.sample_is_enough`). A compiler traces each
branch of a conditional as a graph of its own, so one conditional per tensor made a model's first compile slow.
Every conditional's first branch is the common, cheap one: :func:`speculative` takes it without a conditional.
Tensor by tensor the numbers are those of :func:`_devicestats.grad_stats` and :func:`_devicestats.norm_stats`, in
the same operations. Imports numpy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tb_gradhealth import _devicestats, record
from tb_gradhealth._devicestats import Backend


def records(be: Backend, grads: Sequence[Any], extras: Sequence[int], weights: Sequence[Any],
            updates: Sequence[Any], hist_sample: int, samplers: Sequence[Callable[[Any], Any] | None],
            other: Callable[[int], tuple[Any, Any]], missing: Sequence[bool]) -> tuple[Any, Any]:
    """``(counts [L, 5], values [L, NUM_VALUES + HIST_BINS])`` of every layer.

    ``grads``: each layer's flat float32 gradient, or ``None`` where ``other(layer)`` gives its ``(counts,
    grad_stats vector)`` (missing, empty or sparse); ``extras``: implicit zeros beyond each gradient;
    ``samplers``: :func:`_devicestats.grad_stats`' ``sample`` of each; ``weights`` / ``updates``: flat float32
    arrays or ``None``; ``missing``: whether each layer had no gradient.
    """
    xp = be.xp
    rows = [i for i, g in enumerate(grads) if g is not None]
    table = grad_table(be, [grads[i] for i in rows], [extras[i] for i in rows], hist_sample,
                       [samplers[i] for i in rows]) if rows else None
    at = {layer: k for k, layer in enumerate(rows)}  # (a list's index() per layer: quadratic in a 1,000-layer trace)
    counts, vectors = [], []
    for i in range(len(grads)):
        c, v = (table[0][at[i]], table[1][at[i]]) if i in at else other(i)
        counts.append(c)
        vectors.append(v)
    vec = xp.stack(vectors)
    missing_col = be.const(np.array(missing, np.float32), vec)
    w, u = norm_column(be, weights, vec), norm_column(be, updates, vec)
    return xp.stack(counts), _devicestats.assemble_table(be, vec, w, u, missing_col)


def grad_table(be: Backend, xs: Sequence[Any], extras: Sequence[int], hist_sample: int,
               samplers: Sequence[Callable[[Any], Any] | None]) -> tuple[Any, Any]:
    """``(counts [k, 5], grad_stats vectors [k, 5 + HIST_BINS])`` of ``k`` flat float32 gradients."""
    xp = be.xp
    ext = [be.min_max(x) for x in xs]
    mn, mx = xp.stack([e[0] for e in ext]), xp.stack([e[1] for e in ext])

    def fast(mn: Any, mx: Any, *xs: Any) -> tuple[Any, Any]:
        rows = [_devicestats.one_pass(be, x, e, mn[i], mx[i], xp.maximum(mx[i], -mn[i]))
                for i, (x, e) in enumerate(zip(xs, extras, strict=True))]
        return xp.stack([c for c, _ in rows]), xp.stack([h for _, h in rows])

    def blend(mn: Any, mx: Any, *xs: Any) -> tuple[Any, Any]:
        ok = _devicestats.one_pass_ok(xp, mn, mx)[:, None]
        counts, head = fast(mn, mx, *xs)
        slow = [_devicestats.scaled(be, x, e) for x, e in zip(xs, extras, strict=True)]
        return (xp.where(ok, counts, xp.stack([c for c, _ in slow])),
                xp.where(ok, head, xp.stack([h for _, h in slow])))

    counts, head = be.cond(xp.all(_devicestats.one_pass_ok(xp, mn, mx)), fast, blend, (mn, mx, *xs))
    nonzero = counts[:, 0] - counts[:, 1] - counts[:, 2] - counts[:, 3] - counts[:, 4]
    hist = xp.stack([_sample_hist(be, x, s, nonzero[i]) for i, (x, s) in enumerate(zip(xs, samplers, strict=True))])
    if any(s is not None for s in samplers):
        hist = _exact_where_due(be, xs, samplers, hist, nonzero, hist_sample)
    return counts, xp.concatenate([head, hist], 1)


def _sample_hist(be: Backend, x: Any, sample: Callable[[Any], Any] | None, nonzero: Any) -> Any:
    """``[kept, *histogram]`` of every value of ``x`` (no sampler), or of its sample scaled to ``nonzero``."""
    if sample is None:
        return _devicestats.kept_hist(be, x)
    h = _devicestats.kept_hist(be, sample(x))
    kept = h[0]
    xp = be.xp
    return xp.concatenate([h[:1], h[1:] * xp.where(kept > 0, be.f32(nonzero) / xp.where(kept > 0, kept, 1.0), 0.0)])


def _exact_where_due(be: Backend, xs: Sequence[Any], samplers: Sequence[Any], hist: Any, nonzero: Any,
                     hist_sample: int) -> Any:
    """The sampled rows of ``hist`` replaced by every value's histogram where the sample does not describe the
    tensor (at most ``hist_sample`` finite nonzero values, or too few of them drawn): one conditional for all."""
    xp = be.xp
    sampled = be.const(np.array([s is not None for s in samplers]), hist)
    due = sampled & ((nonzero <= hist_sample) | (hist[:, 0] < record.sample_min_kept(hist_sample)))

    def exact(due: Any, hist: Any, *xs: Any) -> Any:
        rows = [_devicestats.kept_hist(be, x) if s is not None else hist[i]
                for i, (x, s) in enumerate(zip(xs, samplers, strict=True))]
        return xp.where(due[:, None], xp.stack(rows), hist)

    return be.cond(~xp.any(due), lambda due, hist, *xs: hist * 1.0, exact, (due, hist, *xs))


def norm_column(be: Backend, xs: Sequence[Any], like: Any) -> Any:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` of flat weights or updates (NaN rows where ``None``)."""
    xp = be.xp
    rows = [i for i, x in enumerate(xs) if x is not None and x.shape[0]]
    table = norm_table(be, [xs[i] for i in rows]) if rows else None
    nan = be.const(np.full(2, np.nan, np.float32), like)
    at = {layer: k for k, layer in enumerate(rows)}
    out = [table[at[i]] if i in at else (nan if x is None else _devicestats.norm_stats(be, x))
           for i, x in enumerate(xs)]
    return xp.stack(out) if out else be.const(np.zeros((0, 2), np.float32), like)


def norm_table(be: Backend, xs: Sequence[Any]) -> Any:
    """``[k, 2]`` :func:`_devicestats.norm_stats` of ``k`` nonempty flat tensors, one conditional for all."""
    xp = be.xp
    ext = [be.min_max(x) for x in xs]
    m = xp.stack([xp.maximum(hi, -lo) for lo, hi in ext])

    def fast(m: Any, *xs: Any) -> Any:
        return xp.stack([be.f32(xp.stack([m[i], be.sum_squares(x) / (m[i] * m[i])])) for i, x in enumerate(xs)])

    def blend(m: Any, *xs: Any) -> Any:
        ok = _devicestats.norm_one_pass_ok(m)[:, None]
        return xp.where(ok, fast(m, *xs), xp.stack([_devicestats.norm_scaled(be, x) for x in xs]))

    return be.cond(xp.all(_devicestats.norm_one_pass_ok(m)), fast, blend, (m, *xs))


def speculative(be: Backend, taken: list[Any]) -> Backend:
    """``be`` whose conditional always takes its first (common, cheap) branch and appends the predicate to
    ``taken``: the result is right when every predicate is true (else compute again with ``be``). What
    ``compile=True`` compiles: no conditional, so one graph."""

    def first(pred: Any, true_fn: Callable, false_fn: Callable, operands: tuple) -> Any:
        taken.append(pred)
        return true_fn(*operands)

    return be._replace(cond=first)
