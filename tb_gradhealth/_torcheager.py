"""The eager PyTorch record in batched passes: one host read of every tensor's extremes decides which tensors take
the one-pass statistics (all finite, max|x| in :mod:`tb_gradhealth._devicestats`' safe range: the common case);
those are reduced one statistic at a time with no Python branch between, and the histogram samples of all of them
are binned together. The rest (NaN/Inf, extreme or subnormal magnitudes, sparse, missing or empty gradients)
takes the per-layer statistics of ``tb_gradhealth._torchstats``. The numbers are those of
:func:`_devicestats.grad_stats` and :func:`_devicestats.norm_stats`, computed in the same float32 operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tb_gradhealth import _core, _devicestats, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth._core import LayerInputs

#: Flag bytes that one int64 row sum adds without a carry between its eight byte lanes: 255 words of 8 bytes.
_COUNT_ROW = 255
_COUNT_BLOCK = _COUNT_ROW * 8


def count_normal(x: torch.Tensor) -> torch.Tensor:
    """The number of normal values (exponent bits not 0: neither zero nor subnormal) of a flat float32 ``x``, as
    int64. One flag byte a value; the flags are added eight at a time as int64 words, in rows of 255 words so that
    no byte lane carries into the next, then the bytes of the rows' sums are added: a CPU adds words far faster
    than it counts (``count_nonzero``) or adds bytes."""
    flags = (x.view(torch.int32) & 0x7F800000).bool()
    k = flags.numel() - flags.numel() % _COUNT_BLOCK
    tail = flags[k:].sum()
    if k == 0:
        return tail
    words = flags[:k].view(torch.uint8).view(torch.int64).view(-1, _COUNT_ROW).sum(1)
    return words.view(torch.uint8).sum(dtype=torch.int64) + tail


#: Tensors of at most this many values are reduced together, concatenated (one op for all, not one each).
_SMALL = 1 << 13


class _Batch:
    """Nonempty flat float32 tensors reduced one statistic at a time: each large tensor on its own, the small ones
    concatenated and reduced by segment (in float64 for the sums)."""

    def __init__(self, xs: Sequence[torch.Tensor], device: torch.device) -> None:
        self.xs = xs
        self.big = [i for i, x in enumerate(xs) if x.numel() > _SMALL]
        self.small = [i for i, x in enumerate(xs) if x.numel() <= _SMALL]
        if self.small:
            self.values = torch.cat([xs[i] for i in self.small])
            lengths = torch.tensor([xs[i].numel() for i in self.small], device=device)
            self.ids = torch.repeat_interleave(torch.arange(len(self.small), device=device), lengths)

    def reduce(self, one: Any, segmented: Any) -> torch.Tensor:
        """``[len(xs), ...]``: ``one(x)`` of each large tensor, ``segmented(self)`` of the small ones."""
        pieces = []
        if self.big:
            pieces.append((self.big, torch.stack([one(self.xs[i]) for i in self.big])))
        if self.small:
            pieces.append((self.small, segmented(self)))
        return _in_order(pieces)

    def seg_sum(self, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(len(self.small), dtype=v.dtype, device=v.device).index_add_(0, self.ids, v)

    def seg_extreme(self, how: str) -> torch.Tensor:
        out = torch.zeros(len(self.small), device=self.values.device)
        return out.scatter_reduce(0, self.ids, self.values, how, include_self=False)

    def extremes(self) -> torch.Tensor:
        return self.reduce(lambda x: torch.stack(torch.aminmax(x)),
                           lambda b: torch.stack([b.seg_extreme("amin"), b.seg_extreme("amax")], 1))

    def sum_squares(self) -> torch.Tensor:
        return self.reduce(ts.sumsq, lambda b: b.seg_sum(b.values.double().square()).float())

    def term_sums(self, term: Any) -> torch.Tensor:
        """``sum(term(x))`` of each tensor (the small ones' terms in float64)."""
        return self.reduce(lambda x: ts.BE.term_sum(term, x),
                           lambda b: b.seg_sum(term(torch, b.values.double())).float())

    def normal_counts(self) -> torch.Tensor:
        return self.reduce(count_normal, lambda b: b.seg_sum((b.values.view(torch.int32) & 0x7F800000).bool().long()))


def compute(inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(counts int64 [L, 5], values float32 [L, NUM_VALUES + HIST_BINS])`` of every layer, or ``None`` when the
    tensors are on more than one device (then each layer is computed on its own). ``inputs.offsets``: ints."""
    grads, weights, updates, offsets = inputs.grads, inputs.weights, inputs.updates, inputs.offsets
    sizes, hist_sample = inputs.sizes, inputs.hist_sample
    dense = [ts.flat(g) if g is not None and not g.is_sparse and g.numel() else None for g in grads]
    norms = [None if t is None else ts.norm_input(t) for t in (*weights, *updates)]
    tensors = [x for x in (*dense, *norms) if x is not None]
    if len({x.device for x in tensors}) > 1:
        return None
    device = tensors[0].device if tensors else torch.device("cpu")
    ext = _extremes([*dense, *norms], device)
    host = ext.cpu().numpy()
    n = len(grads)
    fast = _devicestats.one_pass_ok(np, host[:n, 0], host[:n, 1]) & np.array([x is not None for x in dense], bool)
    counts, gvec = _grad_rows(grads, dense, sizes, fast, ext[:n], hist_sample, offsets, device)
    w = _norm_rows(norms[:n], ext[n: 2 * n], host[n: 2 * n], device)
    u = _norm_rows(norms[n:], ext[2 * n:], host[2 * n:], device)
    missing = torch.tensor([float(g is None) for g in grads], device=device)
    return counts, _devicestats.assemble_table(ts.BE, gvec, w, u, missing)


def _extremes(xs: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """``[len(xs), 2]`` float32 ``(min, max)`` of each tensor (NaN where it holds one, or is ``None`` or empty)."""
    out = torch.full((len(xs), 2), float("nan"), device=device)
    rows = [i for i, x in enumerate(xs) if x is not None and x.numel()]
    if rows:
        out[rows] = _Batch([xs[i] for i in rows], device).extremes()
    return out


def _in_order(pieces: Sequence[tuple[Sequence[int], torch.Tensor]]) -> torch.Tensor:
    """The rows of the pieces ``(row numbers, rows)`` put in row-number order."""
    numbers = np.concatenate([np.asarray(rows, np.int64) for rows, _ in pieces])
    stacked = torch.cat([t for rows, t in pieces if len(rows)])
    return stacked[torch.from_numpy(np.argsort(numbers, kind="stable")).to(stacked.device)]


def _grad_rows(grads: Sequence[Any], dense: Sequence[Any], sizes: Sequence[int], fast: np.ndarray,
               ext: torch.Tensor, hist_sample: int, offsets: Sequence[int] | None,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts ``[L, 5]`` and :func:`_devicestats.grad_stats` vectors ``[L, 5 + HIST_BINS]`` of every gradient."""
    rows = np.flatnonzero(fast)
    pieces_c, pieces_v = [], []
    if len(rows):
        offs = [None if offsets is None else offsets[i] for i in rows]
        c, v = _one_pass_grads([dense[i] for i in rows], ext[rows], hist_sample, offs, rows, device)
        pieces_c.append((rows, c))
        pieces_v.append((rows, v))
    for i in np.flatnonzero(~fast):
        c, v = ts.grad_record(grads[i], sizes[i], hist_sample, int(i), None if offsets is None else offsets[i],
                              device)
        pieces_c.append(([i], c[None]))
        pieces_v.append(([i], v[None]))
    return _in_order(pieces_c), _in_order(pieces_v)


def _one_pass_grads(xs: Sequence[torch.Tensor], ext: torch.Tensor, hist_sample: int, offsets: Sequence[Any],
                    layers: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_devicestats.grad_stats`' ``_one_pass`` branch for all of ``xs`` at once (their extremes ``ext``)."""
    n = torch.tensor([x.numel() for x in xs], device=device)
    batch = _Batch(xs, device)
    zero = n - batch.normal_counts()
    mn, mx = ext[:, 0], ext[:, 1]
    m = torch.maximum(mx, -mn)
    counts = torch.stack([n, zero * 0, zero * 0, zero * 0, zero], 1)
    hist = _histograms(xs, n - zero, hist_sample, offsets, layers, device)
    sums = [batch.term_sums(s.term) / (n if s.mean else record.power_of(m, s.power)) for s in record.GRAD_SUMS]
    return counts, torch.cat([torch.stack([mn, mx, *sums], 1), hist], 1)


def _sample(x: torch.Tensor, hist_sample: int, offset: Any, layer: int) -> torch.Tensor:
    """The values the histogram bins: every value (exact), or ``hist_sample`` of them by the sampling rule."""
    n = x.numel()
    if not hist_sample or n <= hist_sample:
        return x
    if offset is None:
        pos = _core.sample_positions(ts.data_offset(x, layer), n, hist_sample, const=lambda a: ts.const(a, x))
    else:  # on the host: one small copy instead of three device ops
        pos = torch.from_numpy(_core.sample_positions(offset, n, hist_sample))
    return x[pos.to(x.device)]


def _histograms(xs: Sequence[torch.Tensor], nonzero: torch.Tensor, hist_sample: int, offsets: Sequence[Any],
                layers: Sequence[int], device: torch.device) -> torch.Tensor:
    """``[hist_sample, *histogram]`` float32 rows of all-finite tensors: every layer's sample binned in one pass,
    scaled to the finite nonzero count, or the exact histogram where :func:`record.sample_is_enough` says no."""
    samples = [_sample(x, hist_sample, off, int(i)) for x, off, i in zip(xs, offsets, layers, strict=True)]
    v = torch.cat(samples)
    av = v.abs()
    seg = torch.repeat_interleave(torch.arange(len(xs), device=device),
                                  torch.tensor([s.numel() for s in samples], device=device))
    idx = seg * record.HIST_BINS + torch.bucketize(av, ts.edges(device), right=True)
    keep = (av >= record.FLUSH_BELOW).long()  # all finite: kept unless zero or subnormal
    bins = torch.zeros(len(xs) * record.HIST_BINS, dtype=torch.int64, device=device).index_add_(0, idx, keep)
    bins = bins.view(len(xs), record.HIST_BINS)
    kept, bins = bins.sum(1).float(), bins.float()
    scale = torch.where(kept > 0, nonzero.float() / torch.where(kept > 0, kept, 1.0), 0.0)
    sampled = torch.tensor([s is not x for s, x in zip(samples, xs, strict=True)], device=device)
    rows = torch.cat([kept[:, None], torch.where(sampled[:, None], bins * scale[:, None], bins)], 1)
    if not hist_sample:
        return rows
    exact = sampled & ((nonzero <= hist_sample) | (kept < record.sample_min_kept(hist_sample)))
    for i in np.flatnonzero(exact.cpu().numpy()):  # a sparse tensor whose sample missed its nonzeros
        rows[i] = _devicestats.kept_hist(ts.BE, xs[i])
    return rows


def _norm_rows(xs: Sequence[torch.Tensor | None], ext: torch.Tensor, host: np.ndarray,
               device: torch.device) -> torch.Tensor:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` of each weight or update (NaN where a layer has none)."""
    present = np.array([x is not None and x.numel() > 0 for x in xs], bool)
    fast = present & _devicestats.norm_one_pass_ok(np.maximum(host[:, 1], -host[:, 0]))
    rows = np.flatnonzero(fast)
    pieces = []
    if len(rows):
        m = torch.maximum(ext[rows, 1], -ext[rows, 0])
        ssq = _Batch([xs[i] for i in rows], device).sum_squares()
        pieces.append((rows, torch.stack([m, ssq / (m * m)], 1)))
    for i in np.flatnonzero(~fast):
        x = xs[i]
        v = torch.full((2,), float("nan"), device=device) if x is None else _devicestats.norm_stats(ts.BE, x)
        pieces.append(([i], v[None]))
    return _in_order(pieces)


def norms(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` of flat float32 tensors (weights or updates)."""
    if not xs or len({x.device for x in xs}) > 1:
        return torch.stack([_devicestats.norm_stats(ts.BE, x) for x in xs]) if xs else torch.zeros((0, 2))
    ext = _extremes(xs, xs[0].device)
    return _norm_rows(xs, ext, ext.cpu().numpy(), xs[0].device)
