"""What every writer's statistics share, whatever the framework: the inputs of a model's records, the histogram
sample's positions and its data-dependent seed, the stacked record's layout, and the nonfinite counts.

Each is written once here, as a pure integer formula on its operands or with the backend's conversion passed in,
so that TensorFlow (:mod:`tb_gradhealth._tf`), PyTorch (:mod:`tb_gradhealth._torchstats`,
:mod:`tb_gradhealth._torcheager`) and JAX (:mod:`tb_gradhealth.jax`) compute them with their own ops and get the
same numbers. Imports numpy only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth import record

#: The counts of values that are not finite, and their columns in a record (memory form, device counts alike).
NONFINITE: tuple[str, ...] = ("nan", "posinf", "neginf")
NONFINITE_COLUMNS: list[int] = [record.INDEX[k] for k in NONFINITE]


class LayerInputs(NamedTuple):
    """What the records of ``L`` layers are computed from: one entry per layer in each sequence, then the sampling.

    The TF writers pass it whole to the compiled functions of :mod:`tb_gradhealth._tf.packed` (the sequences'
    tensors are their arguments, ``sizes`` and ``hist_sample`` part of their signature); the PyTorch and JAX
    writers to their eager, traced and per-layer passes.
    """

    grads: Sequence[Any]  # dense tensors, sparse ones (``IndexedSlices``, COO), or None (the missing record)
    weights: Sequence[Any]  # each variable's value, or None (weight fields not recorded)
    updates: Sequence[Any]  # each applied update, a tensor or a :class:`record.Delta` ``(before, after)``, or None
    sizes: Sequence[int]  # each variable's element count (static; what a missing gradient's record states)
    hist_sample: int  # values sampled for a large tensor's histogram (0: every value)
    seed: Any  # None (seed from the data) or a scalar integer (tensor), e.g. the step
    #: Each layer's index in the whole model, which salts its histogram sample (``None``: its position here), so
    #: that a record computed a few layers at a time samples as the whole model's would.
    ids: Sequence[int] | None = None
    #: Each layer's sampling offset already derived from the seed on the host (PyTorch: ints, or an int64 tensor
    #: ``[L]`` so that a new seed does not recompile), in place of ``seed``; ``None``: from ``seed`` or the data.
    offsets: Any = None


# --- the histogram sample --------------------------------------------------------------------------------------


def sample_steps(n: int | np.ndarray, k: int) -> np.ndarray:
    """``i * stride`` for ``i < k`` (:func:`record.sample_stride` of ``n``), int64 ``[k]`` on the host; for an
    array of sizes ``n``, ``[len(n), k]``, each row with its size's stride. (No numpy call on a scalar: traced
    by ``torch.compile``, one would not return a plain int.)"""
    if isinstance(n, np.ndarray):
        rows = [sample_steps(int(m), k) for m in n.reshape(-1)]
        return np.stack(rows) if rows else np.zeros((0, k), np.int64)
    return np.arange(k, dtype=np.int64) * record.sample_stride(int(n))


def _same(a: np.ndarray) -> np.ndarray:
    return a


def sample_positions(offset: Any, n: int | np.ndarray, k: int, *, const: Callable[[np.ndarray], Any] = _same,
                     length: Any = None) -> Any:
    """The sampling rule: the ``k`` positions ``(offset + i * stride) % n`` a large tensor's histogram bins.

    ``offset``: a non-negative integer, numpy array or the backend's integer tensor (for sizes ``n`` an array,
    a column ``[len(n), 1]``); ``const`` turns the host steps into the backend's constant (its dtype and
    device). The steps are reduced on the host, so no product leaves a 32-bit integer type. ``length``: a
    shorter length known only on the device (a sparse gradient's values): positions modulo it instead, the
    stride still that of ``n``.
    """
    steps = sample_steps(n, k)
    if length is not None:
        return (offset % length + const(steps) % length) % length
    size = n.astype(np.int64).reshape(-1, 1) if isinstance(n, np.ndarray) else int(n)
    return (offset % size + const(steps % size)) % size


def probe_indices(n: int) -> list[int]:
    """The positions of the four values whose bits seed a tensor's sample when no seed is given: the first, a
    third in, the middle and the last."""
    return [0, n // 3, n // 2, n - 1]


def probe_hash(bits: Sequence[Any], xor: Callable[[Any, Any], Any] = operator.xor) -> Any:
    """``b0 ^ (b1 * 31) ^ (b2 * 131 + b3)`` of the four probes' float32 bit patterns (:func:`probe_indices`), in
    the backend's integer type and its wrap-around; ``xor``: the backend's bitwise xor where ``^`` is not it."""
    return xor(xor(bits[0], bits[1] * 31), bits[2] * 131 + bits[3])


# --- the histogram's bins ------------------------------------------------------------------------------------

#: A column past the histogram's bins, where :func:`exponent_bins` sends zeros, subnormals, Inf and NaN (and one
#: more past it for NaN with every mantissa bit set): a histogram row ``[HIST_BINS + 2]`` drops both.
OUT_OF_HISTOGRAM = record.HIST_BINS


def _exponent_tables() -> tuple[np.ndarray, np.ndarray]:
    base = np.full(256, OUT_OF_HISTOGRAM, np.int32)
    edge_bits = np.full(256, np.iinfo(np.int32).max, np.int32)
    edges = record.HIST_EDGES
    for e in range(1, 255):
        lo = np.float32(2.0 ** (e - 127))
        base[e] = np.searchsorted(edges, lo, side="right")
        inside = edges[(edges > lo) & ((edges.view(np.int32) >> 23) == e)]
        edge_bits[e] = inside[0].view(np.int32) if len(inside) else (e + 1) << 23
    return base, edge_bits


#: Per float32 exponent field ``e``: the histogram bin of the binade's bottom, and the magnitude bits of the one
#: decade edge inside the binade (its top where it has none). See :func:`exponent_bins`.
EXPONENT_BASE, EXPONENT_EDGE_BITS = _exponent_tables()


def exponent_bins(magnitude_bits: Any, take: Callable[[np.ndarray, Any], Any], shift: Callable[[Any, int], Any]
                  ) -> Any:
    """The histogram bin of each float32 from its magnitude bits (int32, sign cleared), as
    :func:`record.hist_bin` bins it: ``base[e] + 1 + ((bits - edge_bits[e]) >> 31)``, two look-ups in a table of
    256 by the exponent field ``e`` instead of a binary search over the 76 edges (a decade edge never shares a
    binade with another). ``take(table, e)``: the backend's gather from a host table; ``shift(x, k)``: its
    arithmetic right shift. Zeros, subnormals, Inf and NaN get :data:`OUT_OF_HISTOGRAM` (or one more)."""
    e = shift(magnitude_bits, 23)
    return take(EXPONENT_BASE, e) + 1 + shift(magnitude_bits - take(EXPONENT_EDGE_BITS, e), 31)


# --- the stacked record ---------------------------------------------------------------------------------------


def stacked_column(name: str) -> int:
    """The column of the value field ``name`` in a stacked record (after the counts' bit patterns)."""
    return record.NUM_COUNTS + record.VALUE_FIELDS.index(name)


def stack(counts_bits: Any, values: Any, concat: Callable[[list[Any]], Any]) -> Any:
    """The stacked records ``[L, NUM_FIELDS]`` float32 of one device array: the counts' int32 bit patterns as
    float32 (``counts_bits``, the backend's bitcast), then the value fields and histogram bins."""
    return concat([counts_bits, values])


def unstack(stacked: Any) -> tuple[Any, Any]:
    """``(the counts' float32 bit patterns [L, NUM_COUNTS], the values [L, NUM_VALUES + HIST_BINS])``."""
    return stacked[:, : record.NUM_COUNTS], stacked[:, record.NUM_COUNTS :]


def frozen_stacked(sizes: Sequence[int]) -> np.ndarray:
    """The stacked rows (float32 ``[len(sizes), NUM_FIELDS]``) of frozen layers of these sizes
    (:func:`record.frozen`), built on the host: what a device path puts where it reads no gradient by the user's
    choice, so that a shard merge adds their sizes and keeps them frozen."""
    rows = np.stack([record.frozen(int(s)) for s in sizes]) if len(sizes) else np.zeros((0, record.NUM_FIELDS))
    counts = np.ascontiguousarray(rows[:, : record.NUM_COUNTS]).astype(np.int32).view(np.float32)
    return np.concatenate([counts, rows[:, record.NUM_COUNTS :].astype(np.float32)], axis=1)


def with_frozen(live: np.ndarray, frozen: Sequence[bool], sizes: Sequence[int]) -> np.ndarray:
    """Memory-form rows of every layer: ``live``'s rows, in order, where ``frozen`` is False, and
    :func:`record.frozen` of the layer's size where it is True (filled on the host: no device work)."""
    frozen = np.asarray(frozen, bool).reshape(-1)
    out = np.empty((frozen.size, record.NUM_FIELDS), np.float64)
    out[~frozen] = live
    for i in np.flatnonzero(frozen):
        out[i] = record.frozen(int(sizes[i]))
    return out


def decode_stacked(stacked: Any) -> np.ndarray:
    """Stacked records on the host (float32 ``[L, NUM_FIELDS]``) -> memory-form rows float64 (the one decode of
    the PyTorch and JAX records)."""
    p = np.ascontiguousarray(stacked, dtype=np.float32)
    bits, values = unstack(p)
    return record.from_device(bits.copy().view(np.int32), values)
