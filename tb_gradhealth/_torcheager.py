"""The eager PyTorch record: a few device passes over each dense tensor, one host copy for the whole model, the
rest on the host.

On the device each tensor of more than :data:`_SMALL` values is read a piece at a time (:func:`chunk`: one that
stays in a CPU core's L2 cache, larger on an accelerator), every pass of a piece before the next piece: its
extremes (``aminmax``), its count of normal values (the exponent bits masked into a scratch buffer kept from call
to call, clamped at the smallest normal number and summed: exact), its sum and the norms of its rows of
:data:`_ROW` values (a weight or an update: its extremes and row norms); its histogram sample is gathered and
every sample binned at once. The small tensors are concatenated. One copy brings the pieces' numbers, the row
norms, the bins and the small tensors' values to the host, where numpy adds up the sums of squares in float64,
reduces the small tensors, and assembles the records: a tensor whose extremes are not finite or leave
:mod:`tb_gradhealth._devicestats`' safe range is computed again by the scaled per-layer passes of
``tb_gradhealth._torchstats``, and a sample that does not describe its tensor gives way to the exact histogram.
The numbers are those of :func:`_devicestats.grad_stats` and :func:`_devicestats.norm_stats`.

On a CPU where :mod:`tb_gradhealth._cpustats` loads, every tensor is read once by its compiled loop instead of the
passes, its sample gathered in place, and an update ``before - after`` (or the weights being copied into the
snapshot) read without a temporary: the same numbers within the record's float32 tolerance.

Why so (docs/DEVELOPMENT.md, *Why the writers' statistics are built as they are*): on a CPU each such pass costs
about what ``torch._foreach_norm`` costs, a fresh temporary the size of a tensor costs more than the pass that
writes it, a comparison that writes booleans costs several passes, and every device op has a fixed cost that
small tensors and device-side bookkeeping would pay many times over.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from tb_gradhealth import _core, _cpustats, _devicestats, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth._core import LayerInputs
from tb_gradhealth.record import Delta

#: Values a pass reads at a time on an accelerator, where every op is a kernel launch: its scratch (4 MB of
#: float32) is reused from piece to piece, and the float32 sum of a piece's normal-value flags stays exact (below
#: 2**24).
CHUNK = 1 << 20
#: Values a pass reads at a time on a CPU: a piece and the scratch its count writes (1 MB together) stay in one
#: core's L2 cache through the piece's six passes, which then read it from there rather than from memory or L3.
CPU_CHUNK = 1 << 17
#: Tensors of at most this many values are reduced on the host (their values come with the one copy).
_SMALL = 1 << 13
#: Values a sum of squares adds in float32 before the host adds the rows in float64 (the norm of a row of them:
#: one norm of millions of values drifts by 1e-4).
_ROW = 1024
#: The exponent bits of a float32 (zero exactly for zeros and subnormals, what the record counts as zero), and of
#: two of them in an int64 word (one op masks two values).
_EXPONENT = 0x7F800000
_EXPONENTS = 0x7F8000007F800000
#: Each normal value's flag once clamped: the smallest normal float32 (2**-126); their float32 sum is exact.
_FLAG = record.FLUSH_BELOW
_UNFLAG = 2.0**126

_local = threading.local()


def chunk(device: torch.device) -> int:
    """The values a pass reads at a time on ``device`` (:data:`CPU_CHUNK` on a CPU, else :data:`CHUNK`)."""
    return CPU_CHUNK if device.type == "cpu" else CHUNK


class _Scratch(NamedTuple):
    """A buffer kept per thread and device, written and read within one pass: ``flat`` float32 values and the same
    memory as int64 ``words`` (views made once, not at every piece)."""

    flat: torch.Tensor
    words: torch.Tensor


def _scratch(device: torch.device) -> _Scratch:
    """The :class:`_Scratch` of ``device``, :func:`chunk` values long."""
    buffers = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(device)
    if buf is None:
        flat = torch.empty(chunk(device), device=device)
        buf = buffers[device] = _Scratch(flat, flat.view(torch.int64))
    return buf


def _as_words(x: torch.Tensor, pieces: Sequence[torch.Tensor]) -> Sequence[torch.Tensor | None]:
    """The ``pieces`` of the flat ``x`` (consecutive, of an even size but the last) as int64 words (two values
    each), where its length and offset allow; else ``None`` for each piece."""
    if x.numel() and x.numel() % 2 == 0 and x.storage_offset() % 2 == 0:
        return x.view(torch.int64).split(pieces[0].numel() // 2)
    return [None] * len(pieces)


def _normal_flags(c: torch.Tensor, word: torch.Tensor | None, buf: _Scratch) -> torch.Tensor:
    """The float32 sum of ``_FLAG`` for each normal value (or Inf/NaN) of the piece ``c``, 0 for each zero or
    subnormal: its exponent bits masked into ``buf`` (as int64 words, two values an op, where ``word``, the piece's
    words, is given), read as float32 (0 or a power of two at least ``_FLAG``) and clamped at ``_FLAG``."""
    n = c.numel()
    whole = n == buf.flat.numel()
    flags = buf.flat if whole else buf.flat[:n]
    if word is not None:
        torch.bitwise_and(word, _EXPONENTS, out=buf.words if whole else buf.words[: n // 2])
    else:
        torch.bitwise_and(c.view(torch.int32), _EXPONENT, out=flags.view(torch.int32))
    return torch.clamp_max_(flags, _FLAG).sum()


def count_normal(x: torch.Tensor) -> torch.Tensor:
    """The number of normal values (neither zero nor subnormal) of a flat float32 ``x``, as int64."""
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    size, buf = chunk(x.device), _scratch(x.device)
    pieces = x.split(size)
    for c, word in zip(pieces, _as_words(x, pieces), strict=True):
        total += (_normal_flags(c, word, buf) * _UNFLAG).long()
    return total


class _Kind(NamedTuple):
    """What the device reduces of each piece beside its extremes: ``scalars`` names the 0-d results of
    ``piece(c, word, buf)`` (in its order), ``rows`` whether the row norms of the piece follow (a sum of squares)."""

    scalars: tuple[str, ...]
    piece: Any
    rows: bool

    @property
    def counts(self) -> bool:
        """Whether ``piece`` counts normal values (reads the piece's int64 words)."""
        return "normal" in self.scalars


def _grad_piece(c: torch.Tensor, word: torch.Tensor | None, buf: _Scratch) -> list[torch.Tensor]:
    out = [_normal_flags(c, word, buf)]
    for s in record.GRAD_SUMS:
        if s.term is record.identity:
            out.append(c.sum())
        elif s.term is not record.square:  # squares: the row norms
            out.append(torch.sum(s.term(torch, c)))
    return out


#: A gradient: its count of normal values and each :data:`record.GRAD_SUMS` term's sum but the squares'; a weight
#: or an update: its extremes and row norms only.
GRAD = _Kind(("normal", *(s.name for s in record.GRAD_SUMS if s.term is not record.square)), _grad_piece, True)
NORM = _Kind((), lambda c, word, buf: [], True)
#: The record's name of the sum of squares (:data:`record.GRAD_SUMS`), filled from the row norms.
_SQUARES = next(s.name for s in record.GRAD_SUMS if s.term is record.square)


class _Plan(NamedTuple):
    """Where each tensor's numbers lie in the host copy: the pieces' scalars ``[pieces, 3 + len(kind.scalars)]``
    (min, max, the tail's norm, the kind's scalars), the row norms (``piece_rows`` of each piece, in piece order),
    the gathered samples (of ``sampled``, in order), then the small tensors' values (of ``small``)."""

    piece_owner: np.ndarray  # the tensor of each piece
    piece_rows: np.ndarray  # rows of each piece
    sampled: list[int]  # the large tensors whose sample was gathered on the device
    whole: list[int]  # the large tensors binned whole on the device (no sample: every value)
    small: list[int]  # the tensors reduced on the host


class _Device(NamedTuple):
    """What the device computed, in :class:`_Plan`'s order."""

    scalars: list[torch.Tensor]
    rows: list[torch.Tensor]
    samples: list[torch.Tensor]


def _device_pass(xs: Sequence[torch.Tensor], kind: _Kind, device: torch.device,
                 positions: Sequence[np.ndarray | None] | None) -> tuple[_Plan, _Device]:
    """Every piece's device numbers of the nonempty flat float32 ``xs`` of more than :data:`_SMALL` values, and
    (``positions`` given) their samples, each gathered right after its tensor's pieces (in cache)."""
    big = [i for i, x in enumerate(xs) if x.numel() > _SMALL]
    sampled = [i for i in big if positions is not None and positions[i] is not None]
    index = dict(zip(sampled, _indices([positions[i] for i in sampled], device), strict=True)) if sampled else {}
    out = _Device([], [], [])
    owner, nrows = [], []
    zero = _zero(device)
    size, buf = chunk(device), _scratch(device)
    for i in big:
        x = xs[i]
        whole = x.numel() - x.numel() % _ROW
        rows = x[:whole].view(-1, _ROW).split(size // _ROW)  # each piece's rows (none in a last piece of a tail)
        pieces = x.split(size)
        words = _as_words(x, pieces) if kind.counts else [None] * len(pieces)
        for c, word, r in itertools.zip_longest(pieces, words, rows):
            n = c.numel()
            k = 0 if r is None else r.shape[0] * _ROW
            mn, mx = torch.aminmax(c)
            tail = torch.linalg.vector_norm(c[k:]) if k < n else zero
            out.scalars.extend([mn, mx, tail, *kind.piece(c, word, buf)])
            if k:
                out.rows.append(torch.linalg.vector_norm(r, dim=1))
            owner.append(i)
            nrows.append(k // _ROW)
        if i in index:
            out.samples.append(xs[i].index_select(0, index[i]))
    plan = _Plan(np.asarray(owner, np.int64), np.asarray(nrows, np.int64), sampled,
                 [i for i in big if positions is not None and positions[i] is None],
                 [i for i, x in enumerate(xs) if x.numel() <= _SMALL])
    return plan, out


def _indices(positions: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The position arrays as index tensors on ``device`` (one copy for all)."""
    index = torch.from_numpy(np.concatenate(positions)).to(device)
    return list(index.split([p.size for p in positions]))


@functools.lru_cache(maxsize=8)
def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), device=device)


class _Host(NamedTuple):
    """The one host copy, read: each tensor's ``min``, ``max``, sum of squares and the kind's scalars (pieces
    combined, float64), and the bins of each tensor's histogram sample (``None`` when none was asked for)."""

    stats: dict[str, np.ndarray]
    bins: np.ndarray | None


def _reduce(xs: Sequence[torch.Tensor], kind: _Kind, device: torch.device, sample: _Sample | None = None) -> _Host:
    """Every statistic of the nonempty flat float32 tensors ``xs`` and (``sample`` given) the bins of their
    histogram samples, through one copy to the host (on a CPU with the compiled statistics: one read of each
    tensor, :func:`_reduce_cpu`)."""
    if device.type == "cpu" and _CPU_SUMS is not None and _plain(xs) and _cpustats.library() is not None:
        return _reduce_cpu(xs, kind, sample)
    positions = None if sample is None else sample.positions()
    plan, dev = _device_pass(xs, kind, device, positions)
    small_values = [xs[i] for i in plan.small]
    parts = []
    if plan.whole:  # first: the int64 bit patterns (exact at any count) stay 8-byte aligned
        whole = _binned([xs[i] for i in plan.whole], device)
        parts.append(whole.reshape(-1).view(torch.float32))
    if dev.scalars:
        parts.append(torch.stack(dev.scalars))
    host = torch.cat(parts + dev.rows + dev.samples + small_values).cpu().numpy()
    at = 2 * len(plan.whole) * record.HIST_BINS
    whole_bins = host[:at].view(np.int64).reshape(len(plan.whole), record.HIST_BINS)
    piece = host[at: at + len(dev.scalars)].astype(np.float64).reshape(-1, 3 + len(kind.scalars))
    at += len(dev.scalars)
    row_norms = host[at: at + int(plan.piece_rows.sum())].astype(np.float64)
    at += row_norms.size
    samples = _split(host[at:], [t.numel() for t in dev.samples])
    small = _split(host[at + sum(t.numel() for t in dev.samples):], [x.numel() for x in small_values])
    stats = _combine(len(xs), plan, piece, row_norms, kind)
    _small_stats(stats, plan.small, small, kind)
    if positions is None:
        return _Host(stats, None)
    binned = dict(zip(plan.sampled, samples, strict=True))
    binned |= {i: v if positions[i] is None else v[positions[i]] for i, v in zip(plan.small, small, strict=True)}
    bins = _host_bins(binned, len(xs))
    bins[plan.whole] = whole_bins
    return _Host(stats, bins)


def _cpu_sums() -> dict[str, str] | None:
    """Which column of :data:`_cpustats.FIELDS` holds each :data:`record.GRAD_SUMS` field, or ``None`` where a term
    is neither a plain sum nor a sum of squares (then the framework ops compute it)."""
    columns = {record.identity: "sum", record.square: "squares"}
    if any(s.term not in columns for s in record.GRAD_SUMS):
        return None
    return {s.name: columns[s.term] for s in record.GRAD_SUMS}


_CPU_SUMS = _cpu_sums()


def _plain(xs: Sequence[torch.Tensor | None]) -> bool:
    """Whether every tensor given is a plain CPU tensor, whose memory the compiled loop may read (not a subclass,
    a sparse or a meta tensor)."""
    return all(x is None or (type(x) is torch.Tensor and x.device.type == "cpu" and x.layout == torch.strided)
               for x in xs)


def _readable(xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The values as they are, in memory the compiled loop can read: views where they already are (a negated view
    or a strided one is copied)."""
    return [x.resolve_neg().contiguous() for x in xs]


def _reduce_cpu(xs: Sequence[torch.Tensor], kind: _Kind, sample: _Sample | None) -> _Host:
    """:func:`_reduce` of CPU tensors: their statistics from one read of each (:func:`_cpu_stats`), their samples
    read and binned in place (:func:`_cpustats.bins`)."""
    xs = _readable(xs)
    stats = _cpu_stats(xs, kind)
    if sample is None:
        return _Host(stats, None)
    sizes = np.array([x.numel() for x in xs], np.int64)
    steps, offsets, samples = np.zeros(len(xs), np.uint64), np.zeros(len(xs), np.int64), sizes.copy()
    if sample.big:
        table = _steps64(sample.sizes, sample.steps.shape[1])
        steps[sample.big] = table.ctypes.data + np.arange(len(sample.big), dtype=np.uint64) * np.uint64(
            table.strides[0])
        offsets[sample.big] = sample.offsets
        samples[sample.big] = table.shape[1]
    width = record.HIST_BINS + 2
    bins = _cpustats.bins(np.array([x.data_ptr() for x in xs], np.uint64), sizes, steps, offsets, samples,
                          _core.EXPONENT_BASE, _core.EXPONENT_EDGE_BITS, width)
    return _Host(stats, bins[:, : record.HIST_BINS])


@functools.lru_cache(maxsize=64)
def _steps64(ns: tuple[int, ...], k: int) -> np.ndarray:
    """:func:`_reduced_steps` as int64 (kept, read-only: the compiled binning reads int64)."""
    out = np.ascontiguousarray(_reduced_steps(ns, k), np.int64)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _layout(sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(owner, byte offset, size, each tensor's first run)`` of the runs of float32 tensors of ``sizes`` values
    (:func:`_cpustats.runs`; kept, read-only: a model's sizes come back at every logged step)."""
    owner, offset, size = _cpustats.runs(np.array(sizes, np.int64))
    out = (owner, (offset * 4).astype(np.uint64), size, np.flatnonzero(np.diff(owner, prepend=-1)))
    for a in out:
        a.flags.writeable = False
    return out


def _cpu_stats(xs: Sequence[torch.Tensor], kind: _Kind, minus: Sequence[torch.Tensor] | None = None,
               copy_to: Sequence[torch.Tensor] | None = None) -> dict[str, np.ndarray]:
    """``min``, ``max``, the sum of squares and ``kind``'s scalars (float64) of each nonempty flat float32 CPU
    tensor (:func:`_readable`), or of ``xs[i] - minus[i]`` (never written), from one read of each
    (:mod:`tb_gradhealth._cpustats`, on as many threads as torch's); ``copy_to``: contiguous float32 tensors the
    values are copied into as they are read."""
    owner, offset, size, first = _layout(tuple(x.numel() for x in xs))

    def addresses(ts: Sequence[torch.Tensor]) -> np.ndarray:
        return np.array([t.data_ptr() for t in ts], np.uint64)[owner] + offset

    second = copies = None
    if minus is not None:
        minus = _readable(minus)
        second = addresses(minus)
    if copy_to is not None:
        copies = addresses(copy_to)
    out = _cpustats.stats(addresses(xs), size, torch.get_num_threads(), second, copies)
    col = {name: out[:, j] for j, name in enumerate(_cpustats.FIELDS)}
    stats = {"min": np.minimum.reduceat(col["min"], first), "max": np.maximum.reduceat(col["max"], first),
             _SQUARES: np.add.reduceat(col["squares"], first)}
    for name in kind.scalars:
        stats[name] = np.add.reduceat(col["normal" if name == "normal" else _CPU_SUMS[name]], first)
    return stats


def _split(a: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """The first ``sum(sizes)`` values of ``a`` as consecutive arrays of ``sizes``."""
    ends = np.cumsum(sizes)
    return [a[e - k: e] for e, k in zip(ends, sizes, strict=True)]


def _combine(n: int, plan: _Plan, piece: np.ndarray, row_norms: np.ndarray, kind: _Kind) -> dict[str, np.ndarray]:
    """Each large tensor's statistics from its pieces' (float64; the small ones' are filled by
    :func:`_small_stats`)."""
    stats = {"min": np.full(n, np.inf), "max": np.full(n, -np.inf), _SQUARES: np.zeros(n)}
    stats |= {name: np.zeros(n) for name in kind.scalars}
    if not len(plan.piece_owner):
        return stats
    owner = plan.piece_owner
    first = np.flatnonzero(np.diff(owner, prepend=-1))  # each large tensor's pieces lie together
    with np.errstate(invalid="ignore", over="ignore"):
        stats["min"][owner[first]] = np.minimum.reduceat(piece[:, 0], first)  # a NaN wins, as in aminmax
        stats["max"][owner[first]] = np.maximum.reduceat(piece[:, 1], first)
        row_owner = np.repeat(owner, plan.piece_rows)
        stats[_SQUARES] = (np.bincount(row_owner, row_norms * row_norms, minlength=n)
                           + np.bincount(owner, piece[:, 2] * piece[:, 2], minlength=n))
        for j, name in enumerate(kind.scalars):
            stats[name] = np.bincount(owner, piece[:, 3 + j], minlength=n)
    if "normal" in stats:
        stats["normal"] = stats["normal"] * _UNFLAG
    return stats


def _small_stats(stats: dict[str, np.ndarray], small: list[int], values: list[np.ndarray], kind: _Kind) -> None:
    """The small tensors' statistics (float64 sums of their float32 values), into ``stats``."""
    if not small:
        return
    starts = np.cumsum([0, *(v.size for v in values[:-1])])
    f32 = np.concatenate(values)
    v = f32.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        stats["min"][small] = np.minimum.reduceat(v, starts)
        stats["max"][small] = np.maximum.reduceat(v, starts)
        stats[_SQUARES][small] = np.add.reduceat(v * v, starts)
        if "normal" in stats:
            stats["normal"][small] = np.add.reduceat(np.abs(f32) >= record.FLUSH_BELOW, starts)
        for s in record.GRAD_SUMS:
            if s.name in kind.scalars:
                stats[s.name][small] = np.add.reduceat(s.term(np, v), starts)


# --- the histogram -------------------------------------------------------------------------------------------


class _Sample(NamedTuple):
    """Which of ``count`` tensors have a sampled histogram and where: ``big`` (their indices), their ``sizes``, each
    one's offset modulo its size (int64) and the steps of its size modulo it (``[len(big), k]``,
    :func:`_reduced_steps`): the sampling rule's positions ``(offset + i * stride) % n``. The others bin every
    value."""

    count: int
    big: list[int]
    sizes: tuple[int, ...]
    offsets: np.ndarray
    steps: np.ndarray

    def positions(self) -> list[np.ndarray | None]:
        """Each tensor's sample positions, ``None`` where every value is binned."""
        out: list[np.ndarray | None] = [None] * self.count
        if not self.big:
            return out
        n = np.array(self.sizes, self.steps.dtype)[:, None]
        pos = self.steps + self.offsets[:, None].astype(self.steps.dtype)  # both terms below n
        np.subtract(pos, n, out=pos, where=pos >= n)
        for row, j in zip(pos, self.big, strict=True):
            out[j] = row
        return out

    def sampled(self) -> np.ndarray:
        """Whether each tensor's histogram is sampled."""
        out = np.zeros(self.count, bool)
        out[self.big] = True
        return out


def _sample(xs: Sequence[torch.Tensor], layers: np.ndarray, offsets: Sequence[int] | None,
            hist_sample: int) -> _Sample:
    """Where each tensor's histogram sample lies by the sampling rule (every value of a tensor of at most
    ``hist_sample``). The offsets from ``offsets`` (the seed's), else from each tensor's four probes
    (:func:`_torchstats.data_offset`'s rule, on the host: one small copy for all)."""
    big = [j for j, x in enumerate(xs) if hist_sample and x.numel() > hist_sample]
    if not big:
        return _Sample(len(xs), [], (), np.zeros(0, np.int64), np.zeros((0, 0), np.int64))
    ids = np.asarray(layers)[big]
    if offsets is None:
        probes = torch.stack([xs[j].index_select(0, torch.tensor(_core.probe_indices(xs[j].numel()),
                                                                  device=xs[j].device)) for j in big])
        bits = probes.view(torch.int32).cpu().numpy().astype(np.int64).T
        offs = (_core.probe_hash(list(bits)) ^ record.sample_salt(ids)) & 0x7FFFFFFFFFFF
    else:
        offs = np.array([offsets[i] for i in ids], np.int64)
    ns = tuple(xs[j].numel() for j in big)
    return _Sample(len(xs), big, ns, offs % np.array(ns, np.int64), _reduced_steps(ns, hist_sample))


@functools.lru_cache(maxsize=64)
def _reduced_steps(ns: tuple[int, ...], k: int) -> np.ndarray:
    """:func:`_core.sample_steps` of each size modulo it, ``[len(ns), k]`` (kept: a model's sizes come back at
    every logged step; read-only), int32 where a sum of two positions stays below 2**31."""
    out = _core.sample_steps(np.array(ns, np.int64), k) % np.array(ns, np.int64)[:, None]
    out = out.astype(np.int32) if max(ns) < 2**30 else out
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


def _binned(xs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """``[len(xs), HIST_BINS]`` int64: every finite nonzero value of each tensor counted in its decade bin, on the
    device (:func:`_core.exponent_bins`; zeros, subnormals and NaN/Inf are left out)."""
    width = record.HIST_BINS + 2
    rows = []
    for x in xs:
        bins = _core.exponent_bins(x.view(torch.int32) & 0x7FFFFFFF, _take, lambda t, k: t >> k)
        rows.append(torch.bincount(bins, minlength=width)[: record.HIST_BINS])
    return torch.stack(rows)


def _host_bins(values: dict[int, np.ndarray], n: int) -> np.ndarray:
    """``[n, HIST_BINS]`` int64: the finite nonzero float32 ``values[i]`` counted in the decade bins of row ``i``,
    all at once on the host (:func:`_core.exponent_bins`)."""
    width = record.HIST_BINS + 2
    if not values:
        return np.zeros((n, record.HIST_BINS), np.int64)
    v = np.concatenate(list(values.values()))
    bins = _core.exponent_bins(v.view(np.int32) & 0x7FFFFFFF, np.take, lambda t, k: t >> k)
    rows = _row_starts(tuple(values), tuple(a.size for a in values.values()), width)
    return np.bincount(rows + bins, minlength=n * width).reshape(n, width)[:, : record.HIST_BINS]


@functools.lru_cache(maxsize=64)
def _row_starts(owners: tuple[int, ...], sizes: tuple[int, ...], width: int) -> np.ndarray:
    """``owner * width`` of each value of arrays of ``sizes`` laid end to end (kept: the same layout comes back at
    every logged step; read-only)."""
    out = np.repeat(np.array(owners, np.int64) * width, sizes)
    out.flags.writeable = False
    return out


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
    given = [t for t in inputs.updates if t is not None]
    parts = [x for t in given for x in ((t.before, t.after) if isinstance(t, Delta) else (t,))]
    tensors = [x for x in (*dense, *weights, *parts) if x is not None]
    if len({x.device for x in tensors}) > 1:
        return None
    device = tensors[0].device if tensors else torch.device("cpu")
    counts, gvec = _grad_rows(inputs, dense, device)
    missing = np.array([g is None for g in inputs.grads], np.float32)
    values = _devicestats.assemble_table(_HOST, gvec, _norm_rows(weights, device),
                                         _update_rows(inputs.updates, device), missing)
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
        sample = _sample(xs, rows, offsets, hs)
        red = _reduce(xs, GRAD, device, sample)
        st = red.stats
        n = np.array([x.numel() for x in xs], np.float64)
        ok = _devicestats.one_pass_ok(np, st["min"], st["max"])
        sampled = sample.sampled()
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


def _norm_rows(xs: Sequence[torch.Tensor | None], device: torch.device,
               minus: Sequence[torch.Tensor | None] | None = None,
               copy_to: Sequence[torch.Tensor] | None = None) -> np.ndarray:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float64 of each weight or update on the host (NaN where a layer
    has none). CPU tensors and the compiled statistics only: with ``minus``, of each update ``xs[i] - minus[i]``;
    with ``copy_to`` (no ``None`` in ``xs``), copying each ``xs[i]`` into ``copy_to[i]`` as it is read."""
    out = np.full((len(xs), 2), np.nan)
    present = np.array([i for i, x in enumerate(xs) if x is not None and x.numel()], np.int64)
    redo = [i for i, x in enumerate(xs) if x is not None and not x.numel()]
    if len(present):
        if minus is None and copy_to is None:
            st = _reduce([xs[i] for i in present], NORM, device).stats
        else:
            st = _cpu_stats(_readable([xs[i] for i in present]), NORM,
                            None if minus is None else [minus[i] for i in present],
                            None if copy_to is None else [copy_to[i] for i in present])
        m = np.maximum(st["max"], -st["min"])
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            out[present] = np.stack([m, st[_SQUARES] / (m * m)], 1)
        redo += list(present[~_devicestats.norm_one_pass_ok(m)])
    for i in redo:  # NaN/Inf or extreme magnitudes; empty tensors
        x = xs[i] if minus is None else xs[i] - minus[i]
        out[i] = _devicestats.norm_stats(ts.BE, x).double().cpu().numpy()
    return out


def _update_rows(updates: Sequence[Any], device: torch.device) -> np.ndarray:
    """:func:`_norm_rows` of each update (a tensor, a :class:`Delta` or ``None``): where every given one is a
    ``Delta`` of CPU tensors and the compiled statistics load, from one read of ``before`` and ``after``."""
    deltas = [t for t in updates if t is not None]
    if deltas and device.type == "cpu" and all(isinstance(t, Delta) for t in deltas):
        rows = _difference_rows([None if t is None else t.before for t in updates],
                                [None if t is None else t.after for t in updates])
        if rows is not None:
            return rows
    return _norm_rows([None if t is None else ts.norm_input(t) for t in updates], device)


def _difference_rows(befores: Sequence[torch.Tensor | None],
                     afters: Sequence[torch.Tensor | None]) -> np.ndarray | None:
    """:func:`_norm_rows` of each ``before - after`` (``None``: a layer without one) from one read of both, where
    they are plain CPU tensors of equal sizes and the compiled statistics load; else ``None``."""
    if _cpustats.library() is None:
        return None
    xs = [None if b is None else ts.flat(b) for b in befores]
    ys = [None if a is None else ts.flat(a) for a in afters]
    if not (_plain(xs) and _plain(ys)) or any(x is not None and x.numel() != y.numel()
                                              for x, y in zip(xs, ys, strict=True)):
        return None
    return _norm_rows(xs, torch.device("cpu"), ys)


def copies_on_cpu(weights: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`copy_norms` can read ``weights`` into ``buffers``: plain float32 CPU tensors, each buffer
    contiguous and of its weight's size, and the compiled statistics loaded."""
    if not weights or not (_plain(weights) and _plain(buffers)) or _cpustats.library() is None:
        return False
    return all(w.dtype == b.dtype == torch.float32 and b.is_contiguous() and w.numel() == b.numel()
               for w, b in zip(weights, buffers, strict=True))


def copy_norms(weights: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float32 of each weight, copying it into its buffer in the same
    read (the snapshot of the weights before a step); only where :func:`copies_on_cpu`."""
    xs = [ts.flat(w) for w in weights]
    return torch.from_numpy(_norm_rows(xs, torch.device("cpu"), copy_to=[b.view(-1) for b in buffers])
                            .astype(np.float32))


def difference_norms(befores: Sequence[torch.Tensor], afters: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float32 of each update ``before - after`` from one read of both
    and no tensor written, where every tensor is on the CPU and the compiled statistics load; else ``None`` (the
    caller subtracts and calls :func:`norms`)."""
    rows = _difference_rows(befores, afters) if befores else None
    return None if rows is None else torch.from_numpy(rows.astype(np.float32))


def norms(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """:func:`_devicestats.norm_stats` ``[L, 2]`` float32 of flat float32 tensors (weights or updates)."""
    if not xs or len({x.device for x in xs}) > 1:
        return torch.stack([_devicestats.norm_stats(ts.BE, x) for x in xs]) if xs else torch.zeros((0, 2))
    return torch.from_numpy(_norm_rows(xs, xs[0].device).astype(np.float32)).to(xs[0].device)
