"""The whole PyTorch record as one traceable function, each tensor read once: for ``torch.compile``.

Each dense gradient's reductions read only the tensor, so inductor fuses them into one loop a tensor (an update
``Delta(before, after)`` is subtracted inside its loop, never written out); every histogram sample is gathered and
binned at once. Two forms:

* ``compile=True`` (:func:`records` with ``exact_in_graph=False``): the one-pass statistics of
  :mod:`tb_gradhealth._devicestats` (extremes, normal count, plain sums in float32 rows of :data:`_ROW` added in
  float64) with no conditional, and a flag per layer where they do not hold (a NaN/Inf, extreme or subnormal
  magnitudes: :func:`_devicestats.one_pass_ok`) or where a sample does not describe its tensor
  (:func:`record.sample_is_enough`): the caller computes those layers again eagerly (:func:`redo`). On a CPU
  the float32 loop costs half what the float64 one does.
* traced inside a caller's own compiled function (``exact_in_graph=True``): :func:`_devicestats.wide_grad_stats`
  (float64 sums: right at any magnitude and with NaN/Inf, still one pass), and one ``torch.cond`` bins the
  flagged samples' tensors whole.

Missing, empty and sparse gradients take the per-layer statistics of ``tb_gradhealth._torchstats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tb_gradhealth import _core, _devicestats, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth._core import LayerInputs

_HIST = len(_devicestats.GRAD_FIELDS) - 1  # where a grad_stats vector's hist_sample is, its bins after it
#: Values a float32 partial sum adds before the float64 sum of the partial sums (rows of a tensor's prefix).
_ROW = 1024


def _by_rows(t: torch.Tensor, reduce: Any, combine: Any) -> torch.Tensor:
    """``reduce`` over rows of :data:`_ROW` values of a flat ``t``'s prefix (``reduce(rows)``: one value a row),
    then ``combine`` of those and of the tail's: every reduction of a tensor over the same rows, so that inductor
    makes of them one loop (a reduction over the flat tensor beside them would be a loop of its own)."""
    k = t.numel() - t.numel() % _ROW
    parts = [reduce(t[:k].view(-1, _ROW))] if k else []
    if k < t.numel():
        parts.append(reduce(t[k:].view(1, -1)))
    return combine(torch.cat(parts) if len(parts) > 1 else parts[0])


def _row_sum(t: torch.Tensor) -> torch.Tensor:
    """``sum(t)`` of a flat float32 ``t``: float32 sums of rows of :data:`_ROW` added in float64, as float32 (one
    float32 loop over millions of values drifts by 1e-5)."""
    return _by_rows(t, lambda r: r.sum(1), lambda p: p.double().sum().float())


#: The torch backend of the one-pass statistics, in forms inductor fuses into one loop a tensor.
FUSED = ts.BE._replace(
    fsum=_row_sum,
    aminmax=lambda x: (_by_rows(x, lambda r: r.amin(1), torch.amin), _by_rows(x, lambda r: r.amax(1), torch.amax)),
    sumsq=lambda x: _row_sum(x * x),
    # float32 counts of a row (exact: at most _ROW of them) in the loop of the other reductions (an int32 one
    # makes a loop of its own), added in float64
    count_normal=lambda x: _by_rows(x, lambda r: (r.abs() >= record.FLUSH_BELOW).float().sum(1),
                                    lambda p: p.double().sum().to(torch.int32)),
)


def records(inputs: LayerInputs, exact_in_graph: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(counts int64 [L, 5], values float32 [L, NUM_VALUES + HIST_BINS], redo bool [L])``: every layer's record;
    ``redo`` flags the layers to compute again eagerly (all False with ``exact_in_graph``). ``inputs.offsets``:
    ``None`` (from the data), or an int64 tensor ``[L]``."""
    grads, hs = inputs.grads, inputs.hist_sample
    device = next((t.device for t in (*grads, *inputs.weights) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    dense = [ts.flat(g) if g is not None and not g.is_sparse and g.numel() else None for g in grads]
    rows = [i for i, x in enumerate(dense) if x is not None]
    false = torch.zeros((), dtype=torch.bool, device=device)
    counts, vectors, flags = [], [], []
    if rows:
        counts, vectors, flags, due = _dense_rows([dense[i] for i in rows], rows, inputs, exact_in_graph)
    at = {layer: k for k, layer in enumerate(rows)}
    out_c, out_v, redo = [], [], []
    for i, g in enumerate(grads):
        if i in at:
            out_c.append(counts[at[i]])
            out_v.append(vectors[at[i]])
            redo.append(flags[at[i]])
        else:
            offset = None if inputs.offsets is None else inputs.offsets[i]
            c, v = ts.grad_record(g, inputs.sizes[i], hs, i, offset, device)
            out_c.append(c)
            out_v.append(v)
            redo.append(false)
    vec = torch.stack(out_v)
    sampled = [i for i in rows if hs and dense[i].numel() > hs]
    if exact_in_graph and sampled:
        due_all = torch.zeros(len(grads), dtype=torch.bool, device=device).index_put(
            (ts.const(np.array(rows), due),), due)

        def exact(v: torch.Tensor, d: torch.Tensor, *xs: torch.Tensor) -> torch.Tensor:
            return _exact_where(v, d, dict(zip(sampled, xs, strict=True)))

        vec = ts.BE.cond(due_all.any(), exact, lambda v, d, *xs: v * 1.0, (vec, due_all, *[dense[i] for i in sampled]))
    missing = ts.const(np.array([g is None for g in grads], np.float32), vec)
    w, w_redo = _norm_column(inputs.weights, vec, exact_in_graph)
    u, u_redo = _norm_column(inputs.updates, vec, exact_in_graph)
    values = _devicestats.assemble_table(ts.BE, vec, w, u, missing)
    return torch.stack(out_c), values, torch.stack(redo) | w_redo | u_redo


def _dense_rows(xs: Sequence[torch.Tensor], layers: Sequence[int], inputs: LayerInputs,
                wide: bool) -> tuple[Any, Any, Any, Any]:
    """``(counts [k, 5], grad_stats vectors [k, 5 + HIST_BINS], redo [k], due [k])`` of ``k`` flat float32
    gradients: ``due`` flags the samples that do not describe their tensor; ``redo`` those, and (not ``wide``) the
    tensors whose one-pass statistics do not hold."""
    hs = inputs.hist_sample
    if wide:
        stats = [_devicestats.wide_grad_stats(ts.BE, x) for x in xs]
        holds = None
    else:
        ext = [FUSED.min_max(x) for x in xs]
        stats = [_devicestats.one_pass(FUSED, x, 0, mn, mx, torch.maximum(mx, -mn)) for x, (mn, mx) in
                 zip(xs, ext, strict=True)]
        holds = torch.stack([_devicestats.one_pass_ok(torch, mn, mx) for mn, mx in ext])
    counts = torch.stack([c.long() for c, _ in stats])
    head = torch.stack([h for _, h in stats])
    nonzero = counts[:, 0] - counts[:, 1] - counts[:, 2] - counts[:, 3] - counts[:, 4]
    samples, sampled = [], []
    for x, i in zip(xs, layers, strict=True):
        n = x.numel()
        if hs and n > hs:
            offset = ts.data_offset(x, i) if inputs.offsets is None else inputs.offsets[i]
            samples.append(x[_core.sample_positions(offset, n, hs, const=lambda a, x=x: ts.const(a, x))])
            sampled.append(True)
        else:
            samples.append(x)
            sampled.append(False)
    bins = _binned(samples, xs[0].device)
    kept = bins.sum(1)
    is_sampled = ts.const(np.array(sampled), bins)
    scale = torch.where(is_sampled & (kept > 0), nonzero.float() / torch.where(kept > 0, kept, 1.0), 1.0)
    due = is_sampled & ((nonzero <= hs) | (kept < record.sample_min_kept(hs))) if hs else is_sampled
    vec = torch.cat([head, kept[:, None], bins * scale[:, None]], 1)
    return counts, vec, due if holds is None else due | ~holds, due


def _binned(samples: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[len(samples), HIST_BINS]`` float32: each sample's finite nonzero values in their decade bins, binned at
    once (:func:`_core.exponent_bins`; zeros, subnormals and NaN/Inf are left out)."""
    width = record.HIST_BINS + 2
    v = torch.cat(list(samples))
    seg = torch.cat([torch.full((s.numel(),), k * width, device=device) for k, s in enumerate(samples)])
    bits = _core.exponent_bins(v.view(torch.int32) & 0x7FFFFFFF, lambda t, e: ts.const(t, v)[e],
                               lambda t, k: t >> k)
    bins = torch.zeros(len(samples) * width, device=device).index_add_(0, seg + bits, torch.ones_like(v))
    return bins.view(len(samples), width)[:, : record.HIST_BINS]


def _exact_where(vec: torch.Tensor, due: torch.Tensor, exact_of: dict[int, torch.Tensor]) -> torch.Tensor:
    """``vec`` (grad_stats vectors ``[L, 5 + HIST_BINS]``) with the ``[hist_sample, *histogram]`` of each layer
    flagged ``due`` binned from every value of its gradient (``exact_of``: layer -> flat gradient)."""
    tail = [(_devicestats.kept_hist(ts.BE, exact_of[i]) if i in exact_of else vec[i, _HIST:])
            for i in range(vec.shape[0])]
    return torch.cat([vec[:, :_HIST], torch.where(due[:, None], torch.stack(tail), vec[:, _HIST:])], 1)


def _norm_column(ts_: Sequence[Any], like: torch.Tensor, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_stats [L, 2] of weights or updates (NaN rows where ``None``), redo [L])``: one pass each, in
    float64 (``wide``), or plain float32 rows flagged where max|x| leaves the safe range."""
    nan = ts.const(np.full(2, np.nan, np.float32), like)
    false = torch.zeros((), dtype=torch.bool, device=like.device)
    rows, redo = [], []
    for t in ts_:
        if t is None:
            rows.append(nan)
            redo.append(false)
            continue
        x = ts.norm_input(t)
        if wide or not x.numel():
            rows.append(_devicestats.wide_norm_stats(ts.BE, x))
            redo.append(false)
            continue
        mn, mx = FUSED.min_max(x)
        m = torch.maximum(mx, -mn)
        rows.append(torch.stack([m, FUSED.sum_squares(x) / (m * m)]))
        redo.append(~_devicestats.norm_one_pass_ok(m))
    if not rows:
        return ts.const(np.zeros((0, 2), np.float32), like), torch.zeros(0, dtype=torch.bool, device=like.device)
    return torch.stack(rows), torch.stack(redo)


def redo(stacked: torch.Tensor, flags: np.ndarray, inputs: LayerInputs) -> torch.Tensor:
    """``stacked`` with each layer flagged (read on the host) computed again eagerly, on its own."""
    if not flags.any():
        return stacked
    stacked = stacked.clone()
    offsets = inputs.offsets
    for i in np.flatnonzero(flags):
        offset = None if offsets is None else int(offsets[i])
        counts, values = ts.layer_record(inputs.grads[i], inputs.weights[i], inputs.updates[i], inputs.sizes[i],
                                         inputs.hist_sample, int(i), offset)
        stacked[i, : record.NUM_COUNTS] = counts.to(torch.int32).view(torch.float32)
        stacked[i, record.NUM_COUNTS:] = values
    return stacked
