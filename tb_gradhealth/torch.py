"""PyTorch writer: gradient-health records computed on the gradients' device, merged across shards, written
without TensorFlow.

* :func:`compute` reduces every layer's gradient (and optionally its weight and applied update) with torch ops on
  the tensor's own device and stacks the records into one small float32 tensor ``[L, NUM_FIELDS]`` (the *packed*
  form: the 5 counts as int32 bit patterns, then the value fields and the 77 histogram bins, 376 bytes a layer).
  No gradient is copied to the host; :func:`to_memory` copies only the packed tensor.
* It is branch-free (no ``.item()``, no data-dependent Python control flow), so it runs under ``torch.compile``
  inside a compiled training step, and ``compile=True`` compiles it on its own (one fused loop a layer).
* :func:`merge` merges the records of gradient shards (FSDP, ZeRO, tensor parallel) with two collectives
  (``all_reduce`` MAX, then SUM), giving the record of the full gradient: counts and histograms add, min/max
  combine, relative sums of squares are rescaled to the global max|g| first.
* :func:`add_gradients` = compute (+ merge) + one host copy + :meth:`Writer.add_records`; under
  ``torch.distributed`` rank 0 writes. :class:`StepRecorder` wraps ``optimizer.step()`` (and ``GradScaler``):
  it records the gradient the optimizer applies, after AMP unscaling, the applied update, and skipped steps.

Numbers agree with :func:`tb_gradhealth.record.compute` (float64 reference): counts, min/max and the exact
histogram are equal; ``ssq_rel``/``mean`` (float32 accumulation) to about 1e-6 relative. Values below float32's
smallest normal number count as zero, as on every other path. The histogram of a tensor larger than
``hist_sample`` is built from ``hist_sample`` positions ``(offset + i * stride) % n`` (the TF path's rule; the
offset comes from ``seed`` and the layer index, or from the data), scaled to the finite nonzero count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from tb_gradhealth import record
from tb_gradhealth.writer import Writer

__all__ = [
    "Delta",
    "StepRecorder",
    "add_gradients",
    "compute",
    "layer_names",
    "merge",
    "named_gradients",
    "to_memory",
]

_VI = {name: record.NUM_COUNTS + i for i, name in enumerate(record.VALUE_FIELDS)}
_NV = record.NUM_VALUES + record.HIST_BINS
_EDGES: dict[torch.device, torch.Tensor] = {}


class Delta(NamedTuple):
    """An update given as the weight ``before`` and ``after`` the optimizer step: recorded as ``before - after``."""

    before: torch.Tensor
    after: torch.Tensor


# --- inputs -------------------------------------------------------------------------------------------------


def named_gradients(
    source: Any, weights: bool = True
) -> tuple[list[str], list[torch.Tensor | None], list[torch.Tensor | None]]:
    """``(names, grads, weights)`` from a module, ``named_parameters()`` pairs, or a ``{name: grad}`` dict.

    A module or ``(name, parameter)`` pairs give each parameter's ``.grad`` (``None`` when no gradient reached it)
    and, with ``weights=True``, the parameter itself; a dict maps names to gradient tensors (no weights).
    """
    if isinstance(source, torch.nn.Module):
        source = source.named_parameters()
    if isinstance(source, Mapping):
        names = [str(k) for k in source]
        return names, list(source.values()), [None] * len(names)
    pairs = list(source)
    names = [str(n) for n, _ in pairs]
    grads = [p.grad for _, p in pairs]
    return names, grads, [p.detach() if weights else None for _, p in pairs]


def layer_names(source: Any) -> list[str]:
    """The row names :func:`compute` gives ``source`` (parameter names or dict keys)."""
    return named_gradients(source, weights=False)[0]


def _local(t: Any) -> Any:
    """A DTensor's local shard (what this rank holds); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _flat(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1)
    return x if x.dtype in (torch.float32, torch.float64) else x.float()  # f16/bf16/ints: exact in float32


# --- the statistics (torch ops, branch-free) ----------------------------------------------------------------


def _edges(device: torch.device) -> torch.Tensor:
    e = _EDGES.get(device)
    if e is None:
        e = _EDGES[device] = torch.from_numpy(record.HIST_EDGES).to(device)
    return e


def _data_offset(x: torch.Tensor, layer: int) -> torch.Tensor:
    """A sampling offset from the data (four probes' float32 bits, mixed with the layer index): no host input."""
    n = x.numel()
    probes = x[torch.tensor([0, n // 3, n // 2, n - 1], device=x.device)].float().view(torch.int32).long()
    mix = probes[0] ^ (probes[1] * 31) ^ (probes[2] * 131 + probes[3]) ^ (layer * 7919 + 1)
    return mix & 0x7FFFFFFFFFFF


def _seed_offset(seed: int, layer: int) -> int:
    """A sampling offset from ``seed`` (e.g. the step) and the layer index (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (layer + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


def _histogram(
    x: torch.Tensor, nonzero: torch.Tensor, hist_sample: int, offset: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hist float32 [77], hist_sample float32)``: exact when ``x`` is small, else a scaled sample."""
    n = x.numel()
    sampled = bool(hist_sample) and n > hist_sample
    if sampled:
        i = torch.arange(hist_sample, device=x.device, dtype=torch.int64)
        x = x[(offset + i * record.sample_stride(n)) % n]
    a = x.abs()
    ok = (a >= record.FLUSH_BELOW) & (a <= torch.finfo(x.dtype).max)
    # float32 comparison as on every path (float64 beyond float32's range becomes inf: the open top bin)
    b = torch.bucketize(a.float(), _edges(x.device), right=True)
    w = ok.float()
    hist = torch.zeros(record.HIST_BINS, device=x.device, dtype=torch.float32).index_add_(0, b, w)
    kept = w.sum()
    if sampled:
        hist = hist * torch.where(kept > 0, nonzero.float() / kept.clamp_min(1.0), 0.0)
    return hist, kept


def _grad_stats(
    x: torch.Tensor, extra_zeros: int, hist_sample: int, offset: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts int64 ``[5]`` and ``[min, max, mean, ssq_rel, hist_sample, *hist]`` float32 of a flat gradient.

    ``extra_zeros``: implicit zeros beyond ``x`` (a sparse gradient's untouched rows).
    """
    dt = x.dtype
    n = x.numel()
    inf = float("inf")
    a = x.abs()
    finite = a <= torch.finfo(dt).max  # False for NaN and +-Inf
    keep = finite & (a >= record.FLUSH_BELOW)  # finite and not flushed to zero
    nfin = finite.sum()
    nonzero = keep.sum()
    nan = torch.isnan(x).sum()
    posinf = (x == inf).sum()
    neginf = n - nfin - nan - posinf
    xk = torch.where(keep, x, torch.zeros((), dtype=dt, device=x.device))
    mx = torch.where(finite, xk, -inf).amax()
    mn = torch.where(finite, xk, inf).amin()
    if extra_zeros:
        mx, mn = mx.clamp_min(0), mn.clamp_max(0)
    m = torch.maximum(mx, -mn).clamp_min(0)  # no finite value: -inf -> 0
    y = xk / torch.where(m > 0, m, 1.0)
    ssq = (y * y).sum()
    nf = nfin + extra_zeros
    mean = torch.where(nf > 0, y.sum() / nf.clamp_min(1) * m, 0.0)
    hist, kept = _histogram(x, nonzero, hist_sample, offset)
    counts = torch.stack([torch.full_like(nan, n + extra_zeros), nan, posinf, neginf, nfin - nonzero + extra_zeros])
    head = torch.stack([mn, mx, mean, ssq]).float()
    return counts, torch.cat([head, kept.reshape(1), hist])


def _norm_stats(t: Any) -> torch.Tensor:
    """``[max|w|, sum((w / max|w|)^2)]`` float32 over the finite, unflushed values of a weight or update."""
    if isinstance(t, Delta):
        b, a = _flat(t.before), _flat(t.after)
        x = b - a if b.dtype == a.dtype else b.float() - a.float()
    else:
        x = _flat(t)
    if x.numel() == 0:
        return torch.zeros(2, device=x.device)
    a = x.abs()
    af = torch.where((a >= record.FLUSH_BELOW) & (a <= torch.finfo(a.dtype).max), a, 0.0)
    m = af.amax()
    y = af / torch.where(m > 0, m, 1.0)
    return torch.stack([m, (y * y).sum()]).float()


def _layer(
    g: Any, w: Any, u: Any, size: int, hist_sample: int, layer: int, offset: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts int64 [5], values float32 [89])`` of one layer, in :data:`record.VALUE_FIELDS` order."""
    device = next(t for t in (g, w, u, torch.zeros(())) if isinstance(t, torch.Tensor)).device
    nan = torch.full((2,), float("nan"), device=device)
    opt = [_norm_stats(w) if w is not None else nan, _norm_stats(u) if u is not None else nan, nan]
    if g is None or _flat_size(g) == 0:
        missing = 1.0 if g is None else 0.0
        counts = torch.tensor([size if g is None else 0, 0, 0, 0, 0], device=device)
        head = torch.tensor([float("inf"), -float("inf"), 0.0, 0.0], device=device)
        tail = torch.cat([torch.tensor([missing, 0.0], device=device), torch.zeros(record.HIST_BINS, device=device)])
        return counts, torch.cat([head, *opt, tail])
    if g.is_sparse:
        g = g.coalesce()  # duplicate indices summed, as in the dense gradient
        x = _flat(g.values())
        extra = g.numel() - x.numel()
    else:
        x, extra = _flat(g), 0
    if offset is None and hist_sample and x.numel() > hist_sample:
        offset = _data_offset(x, layer)
    counts, v = _grad_stats(x, extra, hist_sample, offset)
    return counts, torch.cat([v[:4], *opt, torch.zeros(1, device=device), v[4:]])


def _flat_size(g: torch.Tensor) -> int:
    return g.numel() if not g.is_sparse else g._nnz() * int(np.prod(g.shape[g.sparse_dim():], dtype=np.int64))


def _pack(counts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[L, 5]`` int counts and ``[L, 89]`` float32 values -> the packed ``[L, 94]`` float32 tensor."""
    return torch.cat([counts.to(torch.int32).view(torch.float32), values.float()], dim=1)


def _unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[:, : record.NUM_COUNTS].contiguous().view(torch.int32).long(), packed[:, record.NUM_COUNTS :]


def _compute_impl(
    grads: Sequence[Any], weights: Sequence[Any], updates: Sequence[Any], sizes: Sequence[int],
    hist_sample: int, offsets: Any,
) -> torch.Tensor:
    rows = []
    for i, (g, w, u, size) in enumerate(zip(grads, weights, updates, sizes, strict=True)):
        rows.append(_layer(g, w, u, size, hist_sample, i, None if offsets is None else offsets[i]))
    if not rows:
        return torch.zeros((0, record.NUM_FIELDS), dtype=torch.float32)
    return _pack(torch.stack([c for c, _ in rows]), torch.stack([v for _, v in rows]))


_compiled: Any = None


def compute(
    grads: Any,
    weights: Any = None,
    updates: Any = None,
    *,
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
    seed: int | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """The packed records ``[L, NUM_FIELDS]`` float32, on the gradients' device, rows in :func:`layer_names` order.

    ``grads``: a module, ``named_parameters()`` pairs, or ``{name: grad}`` (``None`` = missing, sparse COO and
    DTensor shards accepted). ``weights``: ``True`` (the parameters, with a module or pairs) or ``{name: tensor}``;
    ``updates``: ``{name: tensor or Delta(before, after)}``. ``seed`` (e.g. the step) seeds histogram sampling; by
    default it comes from the data. ``compile=True`` runs the statistics through ``torch.compile`` (dense inputs).
    """
    names, glist, wlist = named_gradients(grads, weights is True)
    if isinstance(weights, Mapping):
        wlist = [weights.get(n) for n in names]
    ulist = [updates.get(n) for n in names] if isinstance(updates, Mapping) else [None] * len(names)
    glist = [_local(g) for g in glist]
    wlist = [_local(w) for w in wlist]
    sizes = [_size(g, w) for g, w in zip(glist, wlist, strict=True)]
    hs = int(hist_sample or 0)
    offsets = None if seed is None else [_seed_offset(int(seed), i) for i in range(len(names))]
    if compile and not any(g is not None and g.is_sparse for g in glist):
        global _compiled
        if _compiled is None:
            _compiled = torch.compile(_compute_impl, dynamic=False)
        dev = next((g.device for g in glist if g is not None), torch.device("cpu"))
        _edges(dev)  # filled before tracing: a cache that changes under the compiled code would recompile it
        if offsets is not None:  # a tensor, so that a new seed does not recompile
            offsets = torch.tensor(offsets, dtype=torch.int64, device=dev)
        return _compiled(glist, wlist, ulist, sizes, hs, offsets)
    return _compute_impl(glist, wlist, ulist, sizes, hs, offsets)


def _size(g: Any, w: Any) -> int:
    if g is not None:
        return g.numel()
    return w.numel() if w is not None else 0


# --- merging shards and copying to the host -----------------------------------------------------------------


def merge(packed: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Merge every rank's packed records of its shards into the records of the full tensors (on every rank).

    Two collectives over ``group``: ``all_reduce(MAX)`` of max, -min and the max|.| of gradient, weight and update;
    then, with each relative sum of squares rescaled to the global max|.|, ``all_reduce(SUM)`` of the counts,
    histogram, ``hist_sample``, finite-weighted mean and sums of squares (float64: counts stay exact). The result
    equals :func:`record.merge_all` of the ranks' records.
    """
    import torch.distributed as dist

    counts, v = _unpack(packed)
    v = v.double()
    col = {name: i - record.NUM_COUNTS for name, i in _VI.items()}

    def field(name: str) -> torch.Tensor:
        return v[:, col[name]]

    mn, mx = field("min"), field("max")
    m = torch.maximum(-mn, mx)
    m = torch.where(torch.isfinite(m), m, 0.0)
    scales = [field("weight_max_abs"), field("update_max_abs")]
    maxes = torch.stack([mx, -mn, m] + [torch.nan_to_num(s, nan=-1.0) for s in scales], dim=1)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
    g_mx, g_mn, g_m = maxes[:, 0], -maxes[:, 1], maxes[:, 2]

    def rescaled(ssq: torch.Tensor, s: torch.Tensor, s_all: torch.Tensor) -> torch.Tensor:
        r = torch.where(s_all > 0, s / torch.where(s_all > 0, s_all, 1.0), 0.0)
        return torch.nan_to_num(ssq * r * r)

    nf = (counts[:, 0] - counts[:, 1:4].sum(1)).double()
    sums = torch.cat(
        [
            counts.double(),
            torch.stack(
                [
                    field("mean") * nf,
                    rescaled(field("ssq_rel"), m, g_m),
                    rescaled(field("weight_ssq_rel"), scales[0], maxes[:, 3]),
                    rescaled(field("update_ssq_rel"), scales[1], maxes[:, 4]),
                    field("missing"),
                    field("hist_sample"),
                    torch.ones_like(nf),
                ],
                dim=1,
            ),
            v[:, record.NUM_VALUES :],
        ],
        dim=1,
    )
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    out_counts = sums[:, : record.NUM_COUNTS]
    mean_w, ssq, wssq, ussq, missing, hs, ranks = sums[:, record.NUM_COUNTS : record.NUM_COUNTS + 7].unbind(1)
    g_nf = out_counts[:, 0] - out_counts[:, 1:4].sum(1)
    out = v.clone()
    out[:, col["min"]], out[:, col["max"]] = g_mn, g_mx
    out[:, col["mean"]] = torch.where(g_nf > 0, mean_w / g_nf.clamp_min(1), 0.0)
    out[:, col["ssq_rel"]] = ssq
    nan = torch.full_like(ssq, float("nan"))
    for name, k, q in (("weight", 3, wssq), ("update", 4, ussq)):
        have = maxes[:, k] >= 0
        out[:, col[f"{name}_max_abs"]] = torch.where(have, maxes[:, k], nan)
        out[:, col[f"{name}_ssq_rel"]] = torch.where(have, q, nan)
    out[:, col["missing"]] = (missing == ranks).double()
    out[:, col["hist_sample"]] = hs
    out[:, record.NUM_VALUES :] = sums[:, record.NUM_COUNTS + 7 :]
    return _pack(out_counts.round().long(), out)


def to_memory(packed: torch.Tensor | np.ndarray) -> np.ndarray:
    """Packed records -> memory-form rows ``[L, NUM_FIELDS]`` float64 on the host (the only host copy)."""
    p = packed.detach().cpu().numpy() if isinstance(packed, torch.Tensor) else np.asarray(packed)
    p = np.ascontiguousarray(p, dtype=np.float32)
    return record.from_device(p[:, : record.NUM_COUNTS].copy().view(np.int32), p[:, record.NUM_COUNTS :])


def _rank(group: Any = None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def add_gradients(
    writer: Writer | None,
    step: int,
    grads: Any,
    weights: Any = True,
    updates: Any = None,
    *,
    sharded: bool = False,
    group: Any = None,
    name: str = "gradients",
    hist_sample: int | None = None,
    seed: int | None = None,
    compile: bool = False,
) -> np.ndarray | None:
    """Compute the records on the device, copy only them to the host and write them with ``writer``.

    Not distributed, or DDP (identical gradients on every rank, ``sharded=False``): rank 0 computes and writes;
    other ranks return ``None`` at once (their ``writer`` may be ``None``). ``sharded=True`` (FSDP / ZeRO / tensor
    parallel: each rank holds a shard of each gradient): every rank computes its shard's records, :func:`merge`
    combines them (every rank must call, with the same ``hist_sample``: ``None`` takes the writer's, or the
    default where a rank has no writer), rank 0 writes. Returns the memory-form rows on the writing rank.
    """
    if not sharded and _rank(group) != 0:
        return None
    hs = (writer.hist_sample if writer is not None else record.DEFAULT_HIST_SAMPLE) if hist_sample is None \
        else hist_sample
    packed = compute(grads, weights, updates, hist_sample=hs, seed=step if seed is None else seed, compile=compile)
    if sharded:
        packed = merge(packed, group)
        if _rank(group) != 0:
            return None
    rows = to_memory(packed)
    if writer is not None:
        writer.add_records(step, layer_names(grads), rows, name=name)
    return rows


class StepRecorder:
    """Records the gradient the optimizer applies (after ``GradScaler`` unscaling) and the update it makes.

    Replace ``opt.step()`` (or ``scaler.step(opt); scaler.update()``) with ``recorder.step(step)``. On a logged
    step (``step % every == 0``) it unscales the gradients (unless you already called ``scaler.unscale_``),
    computes their records on the device, snapshots the weights, runs the optimizer step, and records the update
    ``before - after``; one host copy writes it all. With a scaler it also writes the scalars ``amp/loss_scale``
    (the scale this step used) and ``amp/step_skipped`` (1 when the scaler skipped the step because a gradient
    was NaN/Inf: the record then shows those NaN/Inf counts and a zero update). Returns whether the optimizer
    step was applied.
    """

    def __init__(
        self,
        writer: Writer | None,
        model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        every: int = 1,
        updates: bool = True,
        sharded: bool = False,
        group: Any = None,
        name: str = "gradients",
    ) -> None:
        self.writer, self.optimizer, self.scaler = writer, optimizer, scaler
        self.params = list(model.named_parameters() if isinstance(model, torch.nn.Module) else model)
        self.every, self.updates, self.sharded, self.group, self.name = every, updates, sharded, group, name

    def _optimizer_step(self) -> bool:
        if self.scaler is None:
            self.optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return not self.scaler.get_scale() < before  # the scaler backs off exactly when it skips a step

    def step(self, step: int) -> bool:
        if step % self.every:
            return self._optimizer_step()
        if self.scaler is not None:
            try:
                self.scaler.unscale_(self.optimizer)
            except RuntimeError:  # already unscaled this step (e.g. for clipping)
                pass
        if not self.sharded and _rank(self.group) != 0:
            return self._optimizer_step()
        scale = self.scaler.get_scale() if self.scaler is not None else None
        hs = self.writer.hist_sample if self.writer is not None else record.DEFAULT_HIST_SAMPLE
        grads = compute(self.params, True, hist_sample=hs, seed=step)
        before = {n: p.detach().clone() for n, p in self.params} if self.updates else None
        applied = self._optimizer_step()
        if before is not None:
            updates = {n: Delta(before[n], p.detach()) for n, p in self.params}
            u = compute({n: None for n, _ in self.params}, updates=updates, hist_sample=0)
            cols = [_VI["update_max_abs"], _VI["update_ssq_rel"]]
            grads[:, cols] = u[:, cols]
        if self.sharded:
            grads = merge(grads, self.group)
            if _rank(self.group) != 0:
                return applied
        rows = to_memory(grads)
        if self.writer is not None:
            self.writer.add_records(step, [n for n, _ in self.params], rows, name=self.name)
            if scale is not None:
                self.writer.add_scalars(step, {"amp/loss_scale": scale, "amp/step_skipped": float(not applied)})
        return applied
