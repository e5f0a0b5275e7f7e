"""The per-layer statistics in torch ops: :mod:`tb_gradhealth._devicestats`' backend for PyTorch (``torch.cond``
when traced, a Python branch eagerly), the histogram sampling rule's positions, and one layer's record.

The batched passes (eager: ``tb_gradhealth._torcheager``; one pass for ``torch.compile``:
``tb_gradhealth._torchfused``) use it for what they leave to one tensor at a time: sparse, missing and empty
gradients, and (eagerly) NaN/Inf or extreme values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tb_gradhealth import _core, _devicestats, record
from tb_gradhealth.record import Delta

_EDGES: dict[torch.device, torch.Tensor] = {}


def flat(t: torch.Tensor) -> torch.Tensor:
    """The values as float32 holds them (the record's definition): f16/bf16 exactly, float64 beyond float32's
    range becomes +-Inf."""
    return t.detach().reshape(-1).float()


def edges(device: torch.device) -> torch.Tensor:
    e = _EDGES.get(device)
    if e is None:
        e = _EDGES[device] = torch.from_numpy(record.HIST_EDGES).to(device)
    return e


def data_offset(x: torch.Tensor, layer: int) -> torch.Tensor:
    """A sampling offset from the data (four probes' float32 bits, mixed with the layer index): no host input."""
    probes = x[torch.tensor(_core.probe_indices(x.numel()), device=x.device)].float().view(torch.int32).long()
    return (_core.probe_hash(probes) ^ record.sample_salt(layer)) & 0x7FFFFFFFFFFF


def seed_offset(seed: int, layer: int) -> int:
    """A sampling offset from ``seed`` (e.g. the step) and the layer index (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (layer + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 2


def histogram(av: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    b = torch.bucketize(av.float(), edges(av.device), right=True)
    return torch.zeros(record.HIST_BINS, device=av.device, dtype=w.dtype).index_add_(0, b, w)


def const(a: np.ndarray, like: Any) -> torch.Tensor:
    return torch.from_numpy(a).to(like.device) if isinstance(like, torch.Tensor) else torch.from_numpy(a)


def sumsq(x: torch.Tensor) -> torch.Tensor:
    """``sum(x * x)`` in one pass, as norms of rows of 1024 (one norm of millions of values drifts by 1e-4)."""
    k = x.numel() - x.numel() % 1024
    if k == 0:
        return x.square().sum()
    s = torch.linalg.vector_norm(x[:k].view(-1, 1024), dim=1).square().sum()
    return s + x[k:].square().sum() if k < x.numel() else s


def cond(pred: torch.Tensor, true_fn: Callable, false_fn: Callable, operands: tuple) -> Any:
    """``torch.cond`` while traced (only the branch taken runs, no graph break); eagerly, a Python branch."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    return true_fn(*operands) if bool(pred) else false_fn(*operands)


BE = _devicestats.Backend(
    torch, lambda t: t.float(), histogram, const, torch.div, cond,
    aminmax=torch.aminmax,
    sumsq=lambda x: sumsq(x),
    count_normal=lambda x: torch.count_nonzero(x.view(torch.int32) & 0x7F800000),  # exponent bits: not 0/subnormal
    wide=lambda t: t.double(),
    count=lambda mask: torch.sum(mask, dtype=torch.int32),  # int32 lanes: vectorised where int64 ones are not
)


def sampler(n: int, hist_sample: int, offset: Any) -> Any:
    """The values at :func:`_core.sample_positions` of a tensor of ``n`` (``None``: the exact histogram is due)."""
    if not hist_sample or n <= hist_sample:
        return None

    def sample(x: torch.Tensor) -> torch.Tensor:
        return x[_core.sample_positions(offset, n, hist_sample, const=lambda a: const(a, x))]

    return sample


def norm_input(t: Any) -> torch.Tensor:
    """The flat float32 values of a weight, or of an update ``Delta(before, after)``: ``before - after``."""
    return flat(t.before) - flat(t.after) if isinstance(t, Delta) else flat(t)


def norm_of(t: Any) -> torch.Tensor:
    return _devicestats.norm_stats(BE, norm_input(t))


def grad_record(g: Any, size: int, hist_sample: int, layer: int, offset: Any,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts int64 [5], _devicestats.grad_stats' vector float32)`` of one gradient (``None``: missing)."""
    if g is None or flat_size(g) == 0:
        counts = torch.tensor([size if g is None else 0, 0, 0, 0, 0], device=device)
        return counts, _devicestats.empty_values(BE, torch.zeros((), device=device))
    if g.is_sparse:
        g = g.coalesce()  # duplicate indices summed, as in the dense gradient
        x = flat(g.values())
        extra = g.numel() - x.numel()
    else:
        x, extra = flat(g), 0
    if offset is None and hist_sample and x.numel() > hist_sample:
        offset = data_offset(x, layer)
    return _devicestats.grad_stats(BE, x, extra, hist_sample, sampler(x.numel(), hist_sample, offset))


def layer_record(
    g: Any, w: Any, u: Any, size: int, hist_sample: int, layer: int, offset: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(counts int64 [5], values float32 [89])`` of one layer, in :data:`record.VALUE_FIELDS` order."""
    device = next(t for t in (g, w, u, torch.zeros(())) if isinstance(t, torch.Tensor)).device
    wr = None if w is None else norm_of(w)
    ur = None if u is None else norm_of(u)
    counts, v = grad_record(g, size, hist_sample, layer, offset, device)
    return counts, _devicestats.assemble(BE, v, wr, ur, g is None)


def flat_size(g: torch.Tensor) -> int:
    return g.numel() if not g.is_sparse else g._nnz() * int(np.prod(g.shape[g.sparse_dim():], dtype=np.int64))
