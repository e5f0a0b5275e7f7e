"""The eager PyTorch record: each dense tensor's statistics in a few cheap passes, one tensor at a time, and one
host read for the whole model.

A tensor is read :data:`CHUNK` values at a time, every statistic of a piece before the next piece (what a pass
writes then stays in cache): its extremes (``aminmax``), its sum, its sum of squares (the squares written into a
scratch buffer kept from call to call, then summed) and its count of normal values (the exponent bits masked into
the same buffer, their signs summed). Tensors of at most :data:`_SMALL` values are concatenated and reduced by
segment. The pieces' results and every layer's histogram bins (all samples binned at once) come to the host in one
copy; there a tensor whose extremes are not finite or leave :mod:`tb_gradhealth._devicestats`' safe range is
computed again by the scaled per-layer passes of ``tb_gradhealth._torchstats``, a sample that does not describe its
tensor gives way to the exact histogram, and the record is assembled. The numbers are those of
:func:`_devicestats.grad_stats` and :func:`_devicestats.norm_stats`.

Why so (docs/DEVELOPMENT.md, *Why the writers' statistics are built as they are*): on a CPU each such pass costs
about what ``torch._foreach_norm`` costs, a fresh temporary the size of a tensor costs more than the pass that
writes it (its pages are faulted in every time), and a comparison that writes booleans costs several passes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from tb_gradhealth import _core, _devicestats, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth._core import LayerInputs

#: Values a pass reads at a time: its scratch (4 MB of float32) stays in cache, and its float32 count of normal
#: values stays exact (below 2**24).
CHUNK = 1 << 20
#: Tensors of at most this many values are reduced together, concatenated (one op for all, not one each).
_SMALL = 1 << 13
#: The exponent bits of a float32: zero exactly for zeros and subnormals (what the record counts as zero).
_EXPONENT = 0x7F800000

_local = threading.local()


def _scratch(n: int, device: torch.device) -> torch.Tensor:
    """``n <= CHUNK`` float32 values of a buffer kept per thread and device (written and read within one pass)."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(device)
    if buf is None:
        buf = buffers[device] = torch.empty(CHUNK, device=device)
    return buf[:n]


def _normal_signs(c: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``buf`` filled with 1 where ``c``'s value is normal (or Inf/NaN), 0 where it is zero or subnormal: its
    exponent bits, masked in as an int32 and read back as a float32 (0, or a power of two), then their sign. Their
    float32 sum is exact (a piece holds fewer than 2**24 values)."""
    torch.bitwise_and(c.view(torch.int32), _EXPONENT, out=buf.view(torch.int32))
    return torch.sign(buf, out=buf)


def count_normal(x: torch.Tensor) -> torch.Tensor:
    """The number of normal values (neither zero nor subnormal) of a flat float32 ``x``, as int64."""
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for c in x.split(CHUNK):
        total += _normal_signs(c, _scratch(c.numel(), c.device)).sum().long()
    return total


#: Values a sum of squares adds in float32 before the next level of its sum (the norm of a row of them: one
#: norm of millions of values drifts by 1e-4).
_ROW = 1024


def _term_sum(term: Any, c: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    """``sum(term(c))``: squares as the norms of rows of :data:`_ROW` values (one pass, nothing written but a norm
    a row), the plain sum as it is, another term written into ``buf``."""
    if term is record.square:
        k = c.numel() - c.numel() % _ROW
        q = torch.linalg.vector_norm(c[:k].view(-1, _ROW), dim=1).square().sum() if k else c.sum() * 0
        return q + torch.mul(c[k:], c[k:], out=buf[: c.numel() - k]).sum() if k < c.numel() else q
    if term is record.identity:
        return c.sum()
    return torch.sum(term(torch, c))


class _Kind(NamedTuple):
    """What is reduced of a tensor beside its extremes: the columns' names, each piece's values
    (``piece(c, buf)``) and each small tensor's (``segment(values, as float64)``: per value, summed by segment)."""

    columns: tuple[str, ...]
    piece: Any
    segment: Any


def _grad_piece(c: torch.Tensor, buf: torch.Tensor) -> list[torch.Tensor]:
    sums = [_term_sum(s.term, c, buf) for s in record.GRAD_SUMS]
    return [_normal_signs(c, buf).sum(), *sums]


def _grad_segment(v: torch.Tensor, v64: torch.Tensor) -> list[torch.Tensor]:
    normal = torch.sign((v.view(torch.int32) & _EXPONENT).view(torch.float32))
    return [normal, *(s.term(torch, v64) for s in record.GRAD_SUMS)]


#: A gradient: its count of normal values, then each :data:`record.GRAD_SUMS` term's sum; a weight or an update:
#: its sum of squares.
GRAD = _Kind(("normal", *record.GRAD_SUM_NAMES), _grad_piece, _grad_segment)
NORM = _Kind(("sumsq",), lambda c, buf: [_term_sum(record.square, c, buf)], lambda v, v64: [v64 * v64])


def _piece_rows(x: torch.Tensor, kind: _Kind, positions: np.ndarray | None,
                samples: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """``[min, max, *kind's columns]`` float32 of each :data:`CHUNK` of ``x``, every statistic of a piece before
    the next piece; with ``samples``, the values at ``positions`` (sorted; ``None``: every value) are appended to
    it piece by piece, while the piece is in cache."""
    rows = []
    for lo, c in zip(range(0, x.numel(), CHUNK), x.split(CHUNK), strict=True):
        mn, mx = torch.aminmax(c)
        rows.append(torch.stack([mn, mx, *kind.piece(c, _scratch(c.numel(), c.device))]))
        if samples is None:
            continue
        if positions is None:
            samples.append(c)
        elif c.numel() == x.numel():
            samples.append(c.index_select(0, torch.from_numpy(positions).to(c.device)))
        else:
            a, b = np.searchsorted(positions, [lo, lo + c.numel()])
            samples.append(c.index_select(0, torch.from_numpy(positions[a:b] - lo).to(c.device)))
    return rows


def _small_rows(xs: Sequence[torch.Tensor], kind: _Kind, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of :func:`_piece_rows` of small tensors, concatenated and reduced by segment (sums in float64),
    and their values laid end to end."""
    v = torch.cat(list(xs))
    ids = _segments(tuple(x.numel() for x in xs), device)
    k = len(xs)

    def extreme(how: str) -> torch.Tensor:
        return torch.zeros(k, device=device).scatter_reduce(0, ids, v, how, include_self=False)

    def seg_sum(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros(k, dtype=t.dtype, device=device).index_add_(0, ids, t).float()

    return torch.stack([extreme("amin"), extreme("amax"), *map(seg_sum, kind.segment(v, v.double()))], 1), v


_SEGMENTS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _segments(lengths: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The segment index of every value of tensors of ``lengths`` laid end to end (kept: the same model's shapes
    come back at every logged step)."""
    key = (lengths, device)
    ids = _SEGMENTS.get(key)
    if ids is None:
        if len(_SEGMENTS) > 64:
            _SEGMENTS.clear()
        ids = _SEGMENTS[key] = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths)).to(device)
    return ids


class _Reduced(NamedTuple):
    """What the device computed for a list of tensors, read on the host: each tensor's ``min``, ``max`` and its
    kind's columns (pieces combined, float64), and the decade bins of each one's histogram sample."""

    stats: dict[str, np.ndarray]
    bins: np.ndarray | None  # float64 [len(xs), HIST_BINS] (gradients only)


def _reduce(xs: Sequence[torch.Tensor], kind: _Kind, device: torch.device,
            positions: Sequence[np.ndarray | None] | None = None) -> _Reduced:
    """Every statistic of the nonempty flat float32 tensors ``xs`` and (``positions`` given: each tensor's sorted
    sample positions, ``None`` for all its values) the bins of their samples, in one copy to the host."""
    small = [i for i, x in enumerate(xs) if x.numel() <= _SMALL]
    owner, rows, samples, sample_owner = [], [], [], []
    for i, x in enumerate(xs):
        if x.numel() > _SMALL:
            got = len(samples)
            pieces = _piece_rows(x, kind, None if positions is None else positions[i],
                                 None if positions is None else samples)
            rows += pieces
            owner += [i] * len(pieces)
            if positions is not None:
                sample_owner.append(np.full(sum(t.numel() for t in samples[got:]), i))
    width = 2 + len(kind.columns)
    table = torch.stack(rows) if rows else torch.zeros((0, width), device=device)
    if small:
        small_table, values = _small_rows([xs[i] for i in small], kind, device)
        table = torch.cat([table, small_table])
        owner += small
        if positions is not None and all(positions[i] is None for i in small):  # every value binned
            samples.append(values)
            sample_owner.append(np.repeat(small, [xs[i].numel() for i in small]))
        elif positions is not None:
            for i in small:
                pos = positions[i]
                samples.append(xs[i] if pos is None else xs[i].index_select(0, torch.from_numpy(pos).to(device)))
                sample_owner.append(np.full(samples[-1].numel(), i))
    flat = [table.reshape(-1)]
    if positions is not None:
        owners = np.concatenate(sample_owner) if sample_owner else np.zeros(0, np.int64)
        flat.append(_binned(samples, owners.astype(np.int64), len(xs), device).float().reshape(-1))
    host = torch.cat(flat).cpu().numpy().astype(np.float64)
    pieces = host[: table.numel()].reshape(-1, width)
    at = np.asarray(owner, np.int64)
    stats = {"min": np.full(len(xs), np.inf), "max": np.full(len(xs), -np.inf)}
    with np.errstate(invalid="ignore", over="ignore"):
        np.minimum.at(stats["min"], at, pieces[:, 0])  # a NaN wins, as in aminmax
        np.maximum.at(stats["max"], at, pieces[:, 1])
        for j, name in enumerate(kind.columns):
            stats[name] = np.zeros(len(xs))
            np.add.at(stats[name], at, pieces[:, 2 + j])
    bins = host[table.numel():].reshape(len(xs), record.HIST_BINS) if positions is not None else None
    return _Reduced(stats, bins)


# --- the histogram -------------------------------------------------------------------------------------------


def _positions(xs: Sequence[torch.Tensor], layers: np.ndarray, offsets: Sequence[int] | None,
               hist_sample: int) -> list[np.ndarray | None]:
    """Each tensor's histogram sample positions by the sampling rule (sorted where the tensor is read in pieces):
    ``None`` where every value is binned. The offsets from ``offsets`` (the seed's), else from each tensor's four
    probes (:func:`_torchstats.data_offset`'s rule, on the host: one small copy for all)."""
    out: list[np.ndarray | None] = [None] * len(xs)
    big = [j for j, x in enumerate(xs) if hist_sample and x.numel() > hist_sample]
    if not big:
        return out
    ids = np.asarray(layers)[big]
    if offsets is None:
        probes = torch.stack([xs[j].index_select(0, torch.tensor(_core.probe_indices(xs[j].numel()),
                                                                  device=xs[j].device)) for j in big])
        bits = probes.view(torch.int32).cpu().numpy().astype(np.int64).T
        offs = (_core.probe_hash(list(bits)) ^ record.sample_salt(ids)) & 0x7FFFFFFFFFFF
    else:
        offs = np.array([offsets[i] for i in ids], np.int64)
    ns = tuple(xs[j].numel() for j in big)
    n = np.array(ns, np.int64)[:, None]
    pos = _reduced_steps(ns, hist_sample) + offs[:, None] % n  # (offset + i * stride) % n: both terms below n
    pos -= n * (pos >= n)
    for row, j in zip(pos, big, strict=True):
        out[j] = np.sort(row) if xs[j].numel() > CHUNK else row  # in order where the tensor is read in pieces
    return out


@functools.lru_cache(maxsize=64)
def _reduced_steps(ns: tuple[int, ...], k: int) -> np.ndarray:
    """:func:`_core.sample_steps` of each size modulo it, ``[len(ns), k]`` (kept: a model's sizes come back at
    every logged step; read-only)."""
    out = _core.sample_steps(np.array(ns, np.int64), k) % np.array(ns, np.int64)[:, None]
    out.flags.writeable = False
    return out


_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _take(table: np.ndarray, e: torch.Tensor) -> torch.Tensor:
    """``table[e]`` of one of :mod:`tb_gradhealth._core`'s exponent tables, kept on ``e``'s device."""
    tables = _TABLES.get(e.device)
    if tables is None:
        tables = _TABLES[e.device] = tuple(torch.from_numpy(t).to(e.device)
                                           for t in (_core.EXPONENT_BASE, _core.EXPONENT_EDGE_BITS))
    return (tables[0] if table is _core.EXPONENT_BASE else tables[1]).index_select(0, e)


def _binned(samples: Sequence[torch.Tensor], owner: np.ndarray, n: int, device: torch.device) -> torch.Tensor:
    """``[n, HIST_BINS]`` int64: the finite nonzero values of the samples laid end to end, each counted in the
    decade bin of its owner's row (``owner``: one int a value), all at once (:func:`_core.exponent_bins`; zeros,
    subnormals and NaN/Inf are left out)."""
    width = record.HIST_BINS + 2
    if not samples:
        return torch.zeros((n, record.HIST_BINS), dtype=torch.int64, device=device)
    v = torch.cat(list(samples))
    bins = _core.exponent_bins(v.view(torch.int32) & 0x7FFFFFFF, _take, lambda t, k: t >> k)
    counts = torch.bincount(torch.from_numpy(owner).to(device) * width + bins, minlength=n * width)
    return counts.view(n, width)[:, : record.HIST_BINS]


def _hist_rows(sampled: np.ndarray, bins: np.ndarray, nonzero: np.ndarray,
               hist_sample: int) -> tuple[np.ndarray, np.ndarray]:
    """``([hist_sample, *histogram] float64 rows, which rows are due the exact histogram)`` from each tensor's
    sample's bins, scaled to its finite nonzero count (:func:`record.sample_is_enough` decides)."""
    kept = bins.sum(1).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):  # float32, as every device path scales
        scale = np.where(sampled & (kept > 0), nonzero.astype(np.float32) / kept, np.float32(1.0))
    rows = np.concatenate([kept[:, None], bins.astype(np.float32) * scale[:, None]], 1).astype(np.float64)
    due = sampled & ((nonzero <= hist_sample) | (kept < record.sample_min_kept(hist_sample)))
    return rows, due


# --- the records ---------------------------------------------------------------------------------------------


#: The host's backend of :func:`_devicestats.assemble_table` (numpy arrays in, numpy arrays out).
_HOST = _devicestats.Backend(np, lambda t: np.asarray(t, np.float32), None, lambda a, like: a, np.divide, None)


def compute(inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(counts int64 [L, 5], values float32 [L, NUM_VALUES + HIST_BINS])`` of every layer, or ``None`` when the
    tensors are on more than one device (then each layer is computed on its own). ``inputs.offsets``: ints."""
    dense = [ts.flat(g) if g is not None and not g.is_sparse and g.numel() else None for g in inputs.grads]
    weights = [None if t is None else ts.norm_input(t) for t in inputs.weights]
    updates = [None if t is None else ts.norm_input(t) for t in inputs.updates]
    tensors = [x for x in (*dense, *weights, *updates) if x is not None]
    if len({x.device for x in tensors}) > 1:
        return None
    device = tensors[0].device if tensors else torch.device("cpu")
    counts, gvec = _grad_rows(inputs, dense, device)
    missing = np.array([g is None for g in inputs.grads], np.float32)
    values = _devicestats.assemble_table(_HOST, gvec, _norm_rows(weights, device), _norm_rows(updates, device),
                                         missing)
    return torch.from_numpy(counts).to(device), torch.from_numpy(np.asarray(values, np.float32)).to(device)


def _grad_rows(inputs: LayerInputs, dense: Sequence[torch.Tensor | None],
               device: torch.device) -> tuple[np.ndarray, np.ndarray]:
    """Counts ``[L, 5]`` int64 and :func:`_devicestats.grad_stats` vectors ``[L, 5 + HIST_BINS]`` float64 of every
    gradient, on the host."""
    grads, offsets, hs = inputs.grads, inputs.offsets, inputs.hist_sample
    counts = np.zeros((len(grads), record.NUM_COUNTS), np.int64)
    vec = np.zeros((len(grads), len(_devicestats.GRAD_FIELDS) + record.HIST_BINS))
    rows = np.array([i for i, x in enumerate(dense) if x is not None], np.int64)
    fast = np.zeros(len(grads), bool)
    if len(rows):
        xs = [dense[i] for i in rows]
        positions = _positions(xs, rows, offsets, hs)
        red = _reduce(xs, GRAD, device, positions)
        st = red.stats
        n = np.array([x.numel() for x in xs], np.float64)
        ok = _devicestats.one_pass_ok(np, st["min"], st["max"])
        sampled = np.array([p is not None for p in positions])
        hist, due = _hist_rows(sampled, red.bins, st["normal"], hs)
        for j in np.flatnonzero(ok & due):  # a sparse tensor whose sample missed its nonzeros: every value binned
            hist[j] = _devicestats.kept_hist(ts.BE, xs[j]).double().cpu().numpy()
        m = np.maximum(st["max"], -st["min"])
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            fields = {"min": st["min"], "max": st["max"]} | {
                s.name: st[s.name] / (n if s.mean else record.power_of(m, s.power)) for s in record.GRAD_SUMS}
        head = np.stack([fields[name] for name in _devicestats.GRAD_FIELDS[:-1]], 1)  # all but hist_sample
        fast[rows[ok]] = True
        counts[rows[ok]] = np.stack([n, 0 * n, 0 * n, 0 * n, n - st["normal"]], 1)[ok]
        vec[rows[ok]] = np.concatenate([head, hist], 1)[ok]
    for i in np.flatnonzero(~fast):  # NaN/Inf, extreme or subnormal extremes, sparse, missing or empty
        c, v = ts.grad_record(grads[i], inputs.sizes[i], hs, int(i), None if offsets is None else offsets[i], device)
        counts[i], vec[i] = c.cpu().numpy(), v.double().cpu().numpy()
    return counts, vec


def _norm_rows(xs: Sequence[torch.Tensor | None], device: torch.device) -> np.ndarray:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float64 of each weight or update on the host (NaN where a layer
    has none)."""
    out = np.full((len(xs), 2), np.nan)
    present = np.array([i for i, x in enumerate(xs) if x is not None and x.numel()], np.int64)
    redo = [i for i, x in enumerate(xs) if x is not None and not x.numel()]
    if len(present):
        st = _reduce([xs[i] for i in present], NORM, device).stats
        m = np.maximum(st["max"], -st["min"])
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            out[present] = np.stack([m, st["sumsq"] / (m * m)], 1)
        redo += list(present[~_devicestats.norm_one_pass_ok(m)])
    for i in redo:  # NaN/Inf or extreme magnitudes; empty tensors
        out[i] = _devicestats.norm_stats(ts.BE, xs[i]).double().cpu().numpy()
    return out


def norms(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float32 of flat float32 tensors (weights or updates)."""
    if not xs or len({x.device for x in xs}) > 1:
        return torch.stack([_devicestats.norm_stats(ts.BE, x) for x in xs]) if xs else torch.zeros((0, 2))
    return torch.from_numpy(_norm_rows(xs, xs[0].device).astype(np.float32)).to(xs[0].device)
