"""Records of all of a model's layers from a fixed number of XLA loops: small tensors packed, large ones in place.

Why: a real model has hundreds of variables, most of them tiny (biases, batch-norm parameters), and XLA:CPU pays a
compile time for each reduction loop and each compiled function, so statistics made per layer (or per distinct
layer size) cost much of the first step, and a launch per layer every step (docs/DEVELOPMENT.md, *Why the
writers' statistics are built as they are*, has the figures). Here:

* every tensor of at most :data:`IN_PLACE_MIN` elements (and every tensor whose histogram is exact) is copied
  into ONE padded buffer of rows of :data:`PACK_ROW` values (a few MB for a ResNet), reduced row by row in one
  variadic loop; a larger tensor is viewed as rows of :data:`ROW` values where it lies (a free reshape of its
  prefix, no copy) and reduced in a loop of its own, its ragged tail going to the packed buffer;
* the per-row results are folded into layers with segment reductions (sums, max, min of a few thousand rows);
* one loop per tensor kind: squares summed in float64 (no square of a float32 value under- or overflows there, so
  any magnitude is right without a scaled second pass), the extremes as int32 order keys, and a NaN/Inf count (one
  float sum and int reductions: the shape XLA:CPU runs fast);
* layers whose count is not 0 are redone over their finite values in a ``tf.cond`` branch (on such steps only);
* the histogram bins the exact layers' packed values and a gathered sample of each sampled layer in one pass; a
  layer whose sample is not enough (a sparse tensor) is binned whole in a ``tf.cond`` branch (on such steps only).

Outside XLA the same layout runs as plain TensorFlow ops (``summary.compute(jit="graph")``): each row reduction a
reduction kernel of its own, squares summed in float32 (a layer whose squares could under- or overflow is redone
in float64 in the ``tf.cond`` branch): nothing to compile, a few passes over the data instead of one loop.

The numbers are those of :func:`tb_gradhealth.record.compute`; docs/PERFORMANCE.md has the measured costs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tb_gradhealth import _core, record
from tb_gradhealth._core import LayerInputs
from tb_gradhealth._tf import compat, histogram, kernels, precompile
from tb_gradhealth._tf.kernels import Delta, DeviceRecord

__all__ = ["compute", "compute_jit", "IN_PLACE_MIN"]

#: Values per row of a large tensor's in-place view.
ROW = 1024
#: Values per row of the packed buffer (each piece pads to whole rows; as wide as ROW: measured faster than 256).
PACK_ROW = 1024
#: Tensors with more elements than this (and a sampled histogram) are reduced in place, without a copy.
IN_PLACE_MIN = 1 << 18

_EXP_BITS = 0x7F800000  # |x| bits of +Inf: below are finite values, above NaN
_I32_MIN, _I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


@dataclass(frozen=True)
class Layout:
    """Where each layer's values are reduced: copied pieces of the packed buffer, or an in-place row view.

    ``pieces`` are ``(layer, lo, hi)`` element ranges copied in order into the packed buffer, ``piece_rows`` the
    rows each one fills; ``in_place`` are ``(layer, rows)`` views ``[rows, ROW]`` of a tensor's prefix;
    ``row_layer`` gives the layer of every packed row, then of every in-place row, in that order.
    """

    pieces: tuple[tuple[int, int, int], ...]
    piece_rows: tuple[int, ...]
    in_place: tuple[tuple[int, int], ...]
    row_layer: np.ndarray
    row_valid: np.ndarray  # values in each packed row (the rest is zero padding)

    @property
    def packed_rows(self) -> int:
        return int(sum(self.piece_rows))

    def only(self, layers: Sequence[int]) -> Layout:
        """This layout restricted to ``layers``: their pieces and views as they are, in the same order (so each of
        their rows holds the same values)."""
        keep = {int(i) for i in layers}
        return _layout_of([p for p in self.pieces if p[0] in keep], [v for v in self.in_place if v[0] in keep])

    def whole_piece_starts(self) -> dict[int, int]:
        """Where each layer packed whole starts in the flattened packed buffer (its first value's index)."""
        starts = np.concatenate([[0], np.cumsum(self.piece_rows)[:-1]]) * PACK_ROW if self.pieces else []
        return {i: int(at) for (i, lo, _), at in zip(self.pieces, starts, strict=True) if lo == 0}


def layout(sizes: Sequence[int | None], in_place: Sequence[bool], first: Sequence[bool] | None = None) -> Layout:
    """The layout of tensors of ``sizes`` (``None``: absent). Layers with ``first`` set come first in the buffer."""
    first = first or [False] * len(sizes)
    order = [i for i, n in enumerate(sizes) if n and first[i]] + [i for i, n in enumerate(sizes) if n and not first[i]]
    pieces, views = [], []
    for i in order:
        n = sizes[i]
        if in_place[i] and n >= ROW:
            views.append((i, n // ROW))
            if n % ROW:
                pieces.append((i, n - n % ROW, n))
        else:
            pieces.append((i, 0, n))
    return _layout_of(pieces, views)


def _layout_of(pieces: Sequence[tuple[int, int, int]], views: Sequence[tuple[int, int]]) -> Layout:
    """The :class:`Layout` of these pieces, packed in this order, and these in-place views."""
    rows = tuple(-(-(hi - lo) // PACK_ROW) for _, lo, hi in pieces)
    row_layer = [np.full(r, i, np.int32) for (i, _, _), r in zip(pieces, rows, strict=True)]
    valid = [
        np.minimum(PACK_ROW, (hi - lo) - PACK_ROW * np.arange(r)).astype(np.int32)
        for (_, lo, hi), r in zip(pieces, rows, strict=True)
    ]
    row_layer += [np.full(r, i, np.int32) for i, r in views]
    return Layout(
        tuple(pieces), rows, tuple(views),
        np.concatenate(row_layer) if row_layer else np.zeros(0, np.int32),
        np.concatenate(valid) if valid else np.zeros(0, np.int32),
    )


def _pack(flat: Sequence[Any], lay: Layout) -> tf.Tensor:
    """The packed buffer ``[rows, PACK_ROW]`` float32: each piece, zero-padded to whole rows, one after another.

    One concatenation of the tensors as they are (and zero constants): an op per piece (a pad, a cast, a
    subtraction) would be a loop of its own for XLA to compile, hundreds of them. A :class:`Delta` is packed as its
    two sides, subtracted once on the packed buffers; a cast happens once per dtype.
    """
    if not lay.pieces:
        return tf.zeros([0, PACK_ROW], tf.float32)
    deltas = [isinstance(flat[i], Delta) for i, _, _ in lay.pieces]
    if all(deltas):
        before, after = ([getattr(t, side, None) for t in flat] for side in ("before", "after"))
        return _pack(before, lay) - _pack(after, lay)
    if any(deltas):  # some updates given as tensors: subtract the others layer by layer
        return _pack([t if t is None else _as_float32(t) for t in flat], lay)
    parts, zeros = [], {}
    for (i, lo, hi), r in zip(lay.pieces, lay.piece_rows, strict=True):
        x = flat[i]
        parts.append(x if (lo, hi) == (0, x.shape[0]) else x[lo:hi])
        pad = r * PACK_ROW - (hi - lo)
        for bit in range(PACK_ROW.bit_length()):  # padding from at most log2(PACK_ROW) shared zero blocks
            if pad >> bit & 1:
                key = (x.dtype, bit)
                if key not in zeros:
                    zeros[key] = tf.zeros([1 << bit], x.dtype)
                parts.append(zeros[key])
    if len({p.dtype for p in parts}) > 1:
        parts = [tf.cast(p, tf.float32) for p in parts]
    return tf.reshape(tf.cast(tf.concat(parts, 0), tf.float32), [-1, PACK_ROW])


def _views(flat: Sequence[Any], lay: Layout) -> list[tf.Tensor]:
    """Each in-place tensor's prefix as rows ``[rows, ROW]`` float32 (a free reshape; a cast or a
    :class:`Delta`'s subtraction fuses into the loop that reads it)."""
    out = []
    for i, r in lay.in_place:
        x = _as_float32(flat[i])
        out.append(tf.reshape(x[: r * ROW] if r * ROW < x.shape[0] else x, [r, ROW]))
    return out


def _magnitude_bits(b: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    bits = tf.bitcast(b, tf.int32)
    return bits, tf.bitwise.bitwise_and(bits, 0x7FFFFFFF)


#: Per-layer results of the gradient's rows: each :data:`record.GRAD_SUMS` term's sum, then the fast rows' zero
#: count, max and min keys and NaN/Inf count, or the exact rows' zero count, keys and NaN, +Inf, -Inf counts.
_SUMS = len(record.GRAD_SUMS)
_FAST_KINDS = ("sum",) * _SUMS + ("sum", "max", "min", "sum")
_EXACT_KINDS = ("sum",) * _SUMS + ("sum", "max", "min", "sum", "sum", "sum")


def _term_rows(b: tf.Tensor, d: tf.Tensor, e: tf.Tensor | None) -> tuple[list[tf.Tensor], Any]:
    """The one evaluation of :data:`record.GRAD_SUMS` on rows ``b`` (float32): ``(operands of the rows' loop,
    finish)``, ``finish(their loop results)`` giving each term's per-row sum in the table's order. The squares
    are of ``d`` (``b`` flushed, float64: none under- or overflows) in the loop; the other terms are loop sums of
    ``e`` (float64), or without ``e`` float32 row sums of ``b`` of their own (a layer where one is not finite is
    redone by the exact rows, which pass ``e``)."""
    looped = [s for s in record.GRAD_SUMS if s.term is record.square or e is not None]
    operands = [s.term(tf, d if s.term is record.square else e) for s in looped]

    def finish(results: list[tf.Tensor]) -> list[tf.Tensor]:
        by_name = dict(zip([s.name for s in looped], results, strict=True))
        return [by_name[s.name] if s.name in by_name else tf.reduce_sum(s.term(tf, b), 1) for s in record.GRAD_SUMS]

    return operands, finish


def _flushed_square_sum_operand(b: tf.Tensor, keep: tf.Tensor) -> tf.Tensor:
    # A scalar zero, not zeros_like: XLA's bridge would fold that into a constant the size of the data.
    return tf.cast(tf.where(keep, b, tf.zeros([], b.dtype)), tf.float64)


def _inside(valid: np.ndarray | None) -> tf.Tensor | None:
    """``[rows, PACK_ROW]``: which entries of packed rows holding ``valid`` values each are values, not padding
    (``None`` for a view of one tensor: no padding)."""
    return None if valid is None else tf.range(PACK_ROW)[None, :] < tf.constant(valid)[:, None]


def _fast_gradient_rows(b: tf.Tensor, valid: np.ndarray | None) -> list[tf.Tensor]:
    """Per row, one loop: ``[*term sums (:func:`_term_rows`), zeros, max key, min key, NaN/Inf count]``.

    Right when the row holds no NaN/Inf; a layer whose count is not 0 is redone by :func:`_exact_gradient_rows`.
    """
    inside = _inside(valid)
    bits, mag = _magnitude_bits(b)
    small = tf.abs(b) < tf.constant(record.FLUSH_BELOW, tf.float32)  # flushed to zero
    key = kernels._flip(bits)
    kmax, kmin, zero = key, key, small
    if inside is not None:  # padding: not a value
        kmax, kmin, zero = tf.where(inside, key, _I32_MIN), tf.where(inside, key, _I32_MAX), small & inside
    terms, finish = _term_rows(b, _flushed_square_sum_operand(b, ~small), None)
    rows = kernels._variadic([*terms, tf.cast(zero, tf.int32), kmax, kmin, tf.cast(mag >= _EXP_BITS, tf.int32)],
                             ("sum",) * len(terms) + _FAST_KINDS[_SUMS:], 1)
    return finish(rows[: len(terms)]) + rows[len(terms):]


def _exact_gradient_rows(b: tf.Tensor, valid: np.ndarray | None) -> list[tf.Tensor]:
    """Per row: ``[*finite term sums, zeros, finite max key, min key, NaN, +Inf, -Inf]``."""
    inside = _inside(valid)
    bits, mag = _magnitude_bits(b)
    finite = mag < _EXP_BITS
    inf = tf.equal(mag, _EXP_BITS)
    small = tf.abs(b) < tf.constant(record.FLUSH_BELOW, tf.float32)
    use = finite if inside is None else finite & inside
    zero = small if inside is None else small & inside
    key = kernels._flip(bits)
    as_int = lambda m: tf.cast(m, tf.int32)  # noqa: E731
    # Two float64 sums in one loop run slower than one (a scalar loop), but this runs only on steps with NaN/Inf,
    # and a separate sum of a float64 operand would be written out whole first.
    terms, finish = _term_rows(b, _flushed_square_sum_operand(b, finite & ~small),
                               _flushed_square_sum_operand(b, finite))
    rows = kernels._variadic(
        [*terms, as_int(zero), tf.where(use, key, _I32_MIN), tf.where(use, key, _I32_MAX),
         as_int(mag > _EXP_BITS), as_int(inf & (bits > 0)), as_int(inf & (bits < 0))],
        ("sum",) * len(terms) + _EXACT_KINDS[_SUMS:],
        1,
    )
    return finish(rows[: len(terms)]) + rows[len(terms):]


def _fast_norm_rows(b: tf.Tensor, valid: np.ndarray | None = None) -> list[tf.Tensor]:
    """Per row: ``[sum of squares (f64), max |x| bits]`` (bits at or above +Inf's: redo by the exact rows)."""
    _, mag = _magnitude_bits(b)
    keep = tf.abs(b) >= tf.constant(record.FLUSH_BELOW, tf.float32)
    return kernels._variadic([tf.square(_flushed_square_sum_operand(b, keep)), mag], ("sum", "max"), 1)


def _exact_norm_rows(b: tf.Tensor, valid: np.ndarray | None = None) -> list[tf.Tensor]:
    """Per row: ``[sum of finite squares (f64), max |x| bits over finite values]``."""
    _, mag = _magnitude_bits(b)
    keep = (mag < _EXP_BITS) & (tf.abs(b) >= tf.constant(record.FLUSH_BELOW, tf.float32))
    return kernels._variadic([tf.square(_flushed_square_sum_operand(b, keep)), tf.where(keep, mag, 0)],
                             ("sum", "max"), 1)


#: Below this max|x| of a layer, float32 squares may lose underflowed values: the layer is redone in float64.
_GRAPH_FAST_MIN = 1e-10


def _padding_fixed(r: tf.Tensor, b: tf.Tensor, valid: np.ndarray | None, reduce: Any, fill: float) -> tf.Tensor:
    """Per-row ``r = reduce(b, 1)`` with the rows that hold zero padding reduced again over their values only (one
    gather of those rows: the last row of each packed piece)."""
    if valid is None:
        return r
    ragged = np.flatnonzero(valid < PACK_ROW).astype(np.int32)
    if not len(ragged):
        return r
    fixed = reduce(tf.where(_inside(valid[ragged]), tf.gather(b, ragged), tf.constant(fill, b.dtype)), 1)
    return tf.tensor_scatter_nd_update(r, ragged[:, None], fixed)


def _graph_gradient_rows(b: tf.Tensor, valid: np.ndarray | None) -> list[tf.Tensor]:
    """:func:`_fast_gradient_rows` as plain TensorFlow reductions (no XLA): a few passes over the data, each one
    reduction kernel, instead of one fused loop. Squares are summed in float32 (per row, then in float64); a row
    whose sums are not finite (a NaN/Inf, or a square beyond float32) counts as bad, and so does a layer whose
    max|g| is below :data:`_GRAPH_FAST_MIN` (:func:`compute`): those are redone by the exact rows."""
    sums = [tf.reduce_sum(s.term(tf, b), 1) for s in record.GRAD_SUMS]  # float32, added up in float64
    zero = tf.reduce_sum(tf.cast(tf.abs(b) < tf.constant(record.FLUSH_BELOW, tf.float32), tf.int32), 1)
    if valid is not None:  # the zero padding counted as zeros
        zero = zero - tf.constant((PACK_ROW - valid).astype(np.int32))
    mx = _padding_fixed(tf.reduce_max(b, 1), b, valid, tf.reduce_max, -np.inf)
    mn = _padding_fixed(tf.reduce_min(b, 1), b, valid, tf.reduce_min, np.inf)
    bad = tf.cast(~functools.reduce(tf.logical_and, [tf.math.is_finite(t) for t in sums]), tf.int32)
    return [*sums, zero, kernels._order_key(mx), kernels._order_key(mn), bad]


def _graph_norm_rows(b: tf.Tensor, valid: np.ndarray | None = None) -> list[tf.Tensor]:
    """:func:`_fast_norm_rows` as plain TensorFlow reductions: float32 squares; a row whose sum of squares is not
    finite reports +Inf's bits as its max (redone by the exact rows, as a NaN/Inf is)."""
    q = tf.reduce_sum(tf.square(b), 1)
    m_bits = tf.bitcast(tf.reduce_max(tf.abs(b), 1), tf.int32)  # zero padding: no effect on max|x|
    return [tf.cast(q, tf.float64), tf.where(tf.math.is_finite(q), m_bits, _EXP_BITS)]


_SEGMENT = {"sum": tf.math.unsorted_segment_sum, "max": tf.math.unsorted_segment_max,
            "min": tf.math.unsorted_segment_min}


def _per_layer(row_results: list[list[tf.Tensor]], kinds: Sequence[str], lay: Layout, n_layers: int) -> list[tf.Tensor]:
    """Fold per-row results (packed rows, then each view's rows) into ``[n_layers]`` per result."""
    ids = tf.constant(lay.row_layer)
    out = []
    for j, kind in enumerate(kinds):
        col = tf.concat([r[j] for r in row_results], 0) if len(row_results) > 1 else row_results[0][j]
        if col.dtype == tf.float32:  # per-row float32 sums, added up in float64
            col = tf.cast(col, tf.float64)
        out.append(_SEGMENT[kind](col, ids, n_layers))
    return out


def _reduce_layers(flat: Sequence[Any], lay: Layout, n: int, rows_of: Any, kinds: Sequence[str],
                   buf: tf.Tensor | None = None) -> list[tf.Tensor]:
    """``[n]`` per result of ``rows_of``: the packed buffer's rows (``buf`` if already packed) and each view's."""
    buf = _pack(flat, lay) if buf is None else buf
    results = [rows_of(buf, lay.row_valid)] + [rows_of(v, None) for v in _views(flat, lay)]
    return _per_layer(results, kinds, lay, n)


def _redo_where(bad: tf.Tensor, fast: list[tf.Tensor], flat: Sequence[Any], lay: Layout, n: int, rows_of: Any,
                kinds: Sequence[str], buf: tf.Tensor) -> list[tf.Tensor]:
    """``fast``, with the layers flagged ``bad`` taken from the exact reduction ``rows_of`` of the same data.

    In a graph the exact pass reads the same layout as the fast pass (the packed buffer ``buf`` and the in-place
    views), inside a conditional that only steps with a flagged layer run: packing every tensor there instead
    compiles a little faster but makes XLA reserve a copy of the whole model as temporary buffer
    (docs/DEVELOPMENT.md) for a branch that healthy steps never run. Eagerly (the record after the step, a block
    at a time) the flags are known: the flagged layers alone are packed again and redone, a few small tensors
    where the whole block was (a network whose gradients vanish flags layers at every step). Each of their rows
    holds the same values in either layout, so their results are the same, bit for bit.
    """
    if tf.executing_eagerly():
        only = np.flatnonzero(bad.numpy())
        if not len(only):
            return fast
        redo = _reduce_layers(flat, lay.only(only), n, rows_of, kinds)
    else:
        redo = tf.cond(tf.reduce_any(bad), lambda: _reduce_layers(flat, lay, n, rows_of, kinds, buf), lambda: fast)
    return [tf.where(bad, r, f) for r, f in zip(redo, fast, strict=True)]


def _from_key(k: tf.Tensor, empty: float) -> tf.Tensor:
    """A max/min key as float32, flushed to zero below float32's smallest normal (``empty`` where none)."""
    x = kernels._from_order_key(k, empty)
    return tf.where(tf.abs(x) < tf.constant(record.FLUSH_BELOW, tf.float32), tf.zeros_like(x), x)


def _norm_fields(flat: Sequence[Any], n: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(max|x|, sum((x / max|x|)^2))`` float32 ``[n]`` of weights or updates (``None``: absent, NaN)."""
    sizes = [_length(t) for t in flat]
    lay = layout(sizes, [z is not None and z > IN_PLACE_MIN for z in sizes])
    buf = _pack(flat, lay)
    graph = not compat.in_xla_context()
    q, m_bits = _reduce_layers(flat, lay, n, _graph_norm_rows if graph else _fast_norm_rows, ("sum", "max"), buf)
    bad = m_bits >= _EXP_BITS
    if graph:  # float32 squares: a layer of tiny values is redone in float64
        bad |= (m_bits > 0) & (tf.bitcast(m_bits, tf.float32) < _GRAPH_FAST_MIN)
    q, m_bits = _redo_where(bad, [q, m_bits], flat, lay, n, _exact_norm_rows, ("sum", "max"), buf)
    m = tf.cast(tf.bitcast(m_bits, tf.float32), tf.float64)
    ssq = tf.where(m > 0, q / tf.where(m > 0, m * m, tf.ones_like(m)), tf.zeros_like(m))
    present = tf.constant(np.array([z is not None for z in sizes], bool))
    nan = tf.fill([n], np.float32(np.nan))
    return tf.where(present, tf.cast(m, tf.float32), nan), tf.where(present, tf.cast(ssq, tf.float32), nan)


def _flat(t: Any) -> Any:
    """A tensor flattened, in its own dtype (a :class:`Delta`: both sides flattened)."""
    if t is None:
        return None
    if isinstance(t, Delta):
        before, after = _flat(t.before), _flat(t.after)
        if before.dtype != after.dtype or before.dtype == tf.float64:
            return kernels._delta_flat(t)  # float64: subtract before rounding to float32
        return Delta(before, after)
    t = tf.convert_to_tensor(t)
    return t if t.shape.rank == 1 else tf.reshape(t, [-1])


def _as_float32(t: Any) -> tf.Tensor:
    if isinstance(t, Delta):
        return _as_float32(t.before) - _as_float32(t.after)
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def _length(t: Any) -> int | None:
    if t is None:
        return None
    return (t.before if isinstance(t, Delta) else t).shape[0]


def _mix32(x: tf.Tensor) -> tf.Tensor:
    """A 32-bit integer hash (lowbias32), in int32 with wrap-around: 31 uniform bits out."""
    def shr(v: tf.Tensor, k: int) -> tf.Tensor:
        return tf.bitwise.bitwise_and(tf.bitwise.right_shift(v, k), (1 << (32 - k)) - 1)

    x = tf.bitwise.bitwise_xor(x, shr(x, 16)) * tf.constant(0x7FEB352D, tf.int32)
    x = tf.bitwise.bitwise_xor(x, shr(x, 15)) * tf.constant(np.int32(0x846CA68B - (1 << 32)), tf.int32)
    return tf.bitwise.bitwise_and(tf.bitwise.bitwise_xor(x, shr(x, 16)), 0x7FFFFFFF)


def _offsets(layers: np.ndarray, ids: np.ndarray, seed: Any, s: tf.Tensor, q: tf.Tensor) -> tf.Tensor:
    """int64 ``[k]`` uniform offsets in ``[0, 2^62)``, one per sampled layer: from ``seed`` and the layer's index in
    the model (``ids``), or (no seed) from the layer's sums, so that they change from step to step with the data."""
    salt = tf.constant(record.sample_salt(ids.astype(np.int32)))
    if seed is not None:
        base = tf.fill(tf.shape(salt), tf.cast(seed, tf.int32))
    else:
        sb = tf.bitcast(tf.cast(tf.gather(s, layers), tf.float32), tf.int32)
        qb = tf.bitcast(tf.cast(tf.gather(q, layers), tf.float32), tf.int32)
        base = tf.bitwise.bitwise_xor(sb, qb * 31)
    hi = _mix32(tf.bitwise.bitwise_xor(base, _mix32(salt)))
    lo = _mix32(hi + salt)
    return tf.cast(hi, tf.int64) * (1 << 31) + tf.cast(lo, tf.int64)


def _repeat(layers: np.ndarray, k: int) -> tf.Tensor:
    """Each layer index ``k`` times, flat (a broadcast, not a constant of that size in the compiled program)."""
    return tf.reshape(tf.broadcast_to(tf.constant(layers.astype(np.int32))[:, None], [len(layers), k]), [-1])


class _Sampling(NamedTuple):
    """The layers whose histogram is sampled, and what their sample and its check need from the fast pass."""

    layers: np.ndarray  # indices of the sampled layers
    ids: np.ndarray  # their indices in the whole model (what salts the sample)
    hist_sample: int
    seed: Any
    s: tf.Tensor  # per-layer sums and sums of squares: a data-dependent seed when none is given
    q: tf.Tensor
    n_nonzero: tf.Tensor  # int32 [L]: finite nonzero values of each layer


def _bin_into(hist: tf.Tensor | None, v: tf.Tensor, ids: tf.Tensor | int, n_layers: int) -> tf.Tensor:
    """``hist`` (flat ``[n_layers * bins]``, or None) plus the decade bins of the finite nonzero values ``v``,
    each counted in the layer ``ids`` gives (one int: all of them; zeros, padding and NaN/Inf are left out).

    One layer's ids are a scalar offset, never a tensor of ``v``'s size: XLA's bridge would fold that into a
    constant as large as the data while lowering.
    """
    bins = record.HIST_BINS
    v = tf.reshape(v, [-1])
    av = tf.abs(v)
    ok = (av >= tf.constant(record.FLUSH_BELOW, tf.float32)) & (av <= tf.float32.max)
    b = histogram.bin_index(tf.where(ok, av, 1.0))
    out = tf.math.unsorted_segment_sum(tf.cast(ok, tf.float32), ids * bins + b, n_layers * bins)
    return out if hist is None else hist + out


def _packed_rows_binned(hist: tf.Tensor | None, buf_rows: tf.Tensor, lay: Layout, lo: int, hi: int,
                        n_layers: int) -> tf.Tensor | None:
    """:func:`_bin_into` of the packed buffer's rows ``[lo, hi)`` (each row in its layer, padding left out)."""
    if hi <= lo:
        return hist
    v = tf.where(_inside(lay.row_valid[lo:hi]), buf_rows[lo:hi], 0.0)
    return _bin_into(hist, v, _repeat(lay.row_layer[lo:hi], PACK_ROW), n_layers)


def _sampled_whole(plan: _Plan, buf_rows: tf.Tensor, whole: tf.Tensor, n_layers: int) -> tf.Tensor:
    """Exact histograms ``[n_layers, bins]`` of the sampled layers flagged ``whole`` (others: zeros), each binned
    from its packed rows and its in-place view: the branch a step runs only when some layer's sample is not enough.

    Each in-place view is binned under a condition of its own and the packed rows under one for all of them, so a
    step pays for the tensors that need it, not for the whole model.
    """
    lay, exact_rows = plan.layout, plan.exact_rows
    size = n_layers * record.HIST_BINS
    zeros = lambda: tf.zeros([size], tf.float32)  # noqa: E731
    packed = np.unique(lay.row_layer[exact_rows : lay.packed_rows])
    hist = zeros()
    if len(packed):
        hist += tf.cond(tf.reduce_any(tf.gather(whole, packed)),
                        lambda: _packed_rows_binned(None, buf_rows, lay, exact_rows, lay.packed_rows, n_layers), zeros)
    for (i, _), view in zip(lay.in_place, _views(plan.flat, lay), strict=True):
        hist += tf.cond(whole[i], lambda view=view, i=i: _bin_into(None, view, i, n_layers), zeros)
    return tf.reshape(hist, [n_layers, record.HIST_BINS])


def _sample_values(flat: Sequence[Any], sizes: Sequence[int | None], lay: Layout, buf_rows: tf.Tensor,
                   sampling: _Sampling) -> tuple[list[tf.Tensor], list[tf.Tensor]]:
    """``hist_sample`` values gathered from each sampled layer (a Weyl sequence of positions from a per-layer
    random offset), and their layer ids: one gather from the packed buffer, one per in-place layer."""
    layers, k = sampling.layers, sampling.hist_sample
    ns = np.array([sizes[i] for i in layers], np.int64)
    offsets = _offsets(layers, sampling.ids, sampling.seed, sampling.s, sampling.q)
    pos = _core.sample_positions(offsets[:, None], ns, k)
    starts = lay.whole_piece_starts()
    base = np.array([starts.get(int(i), 0) for i in layers], np.int64)
    pos = tf.cast(pos + base[:, None], tf.int32)
    in_packed = np.array([int(i) in starts for i in layers])
    values, ids = [], []
    if in_packed.any():
        values.append(tf.gather(tf.reshape(buf_rows, [-1]), tf.gather(pos, np.flatnonzero(in_packed))))
        ids.append(_repeat(layers[in_packed], k))
    for j in np.flatnonzero(~in_packed):  # in place: a gather from the layer's own buffer
        values.append(tf.gather(_as_float32(flat[layers[j]]), pos[j]))
        ids.append(_repeat(layers[j : j + 1], k))
    return values, ids


class _Plan(NamedTuple):
    """Where each gradient's values are reduced and how its histogram is made (static: from shapes alone)."""

    flat: list[Any]  # flattened gradients (``None``: absent, or an ``IndexedSlices`` done by the one-layer kernel)
    sizes: list[int | None]
    exact: list[bool]  # histogram of every value (at most hist_sample of them)
    layout: Layout
    sampled: np.ndarray  # layers whose histogram comes from a sample

    @property
    def exact_rows(self) -> int:
        """Packed rows of the exact layers (they come first in the buffer)."""
        lay = self.layout
        return sum(r for (i, _, _), r in zip(lay.pieces, lay.piece_rows, strict=True) if self.exact[i])


def _plan(grads: Sequence[Any], hist_sample: int) -> _Plan:
    flat = [None if (g is None or isinstance(g, tf.IndexedSlices)) else _flat(g) for g in grads]
    for g in flat:
        if g is not None and g.shape[0] is None:
            raise ValueError("gradients need a static shape for the histogram (XLA-safe sampling)")
    sizes = [None if g is None else int(g.shape[0]) for g in flat]
    exact = [g is not None and (not hist_sample or sz <= hist_sample) for g, sz in zip(flat, sizes, strict=True)]
    in_place = [sz is not None and sz > IN_PLACE_MIN and not e for sz, e in zip(sizes, exact, strict=True)]
    sampled = np.array([i for i, g in enumerate(flat) if g is not None and not exact[i]], np.int64)
    return _Plan(flat, sizes, exact, layout(sizes, in_place, first=exact), sampled)


def _histograms(plan: _Plan, buf_rows: tf.Tensor, sampling: _Sampling, n_layers: int
                ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
    """``(hist float32 [L, 77], kept float32 [L], whole bool [L] or None)``: exact layers from the packed buffer,
    sampled layers from their sample; ``whole`` flags the sampled layers whose sample is not enough
    (:func:`tb_gradhealth.record.sample_is_enough`): their histogram is to be binned whole (:func:`_with_whole`)."""
    bins = record.HIST_BINS
    hist = _packed_rows_binned(None, buf_rows, plan.layout, 0, plan.exact_rows, n_layers)
    if len(sampling.layers):
        for v, ids in zip(*_sample_values(plan.flat, plan.sizes, plan.layout, buf_rows, sampling), strict=True):
            hist = _bin_into(hist, v, ids, n_layers)
    if hist is None:
        return tf.zeros([n_layers, bins], tf.float32), tf.zeros([n_layers], tf.float32), None
    hist = tf.reshape(hist, [n_layers, bins])
    kept = tf.reduce_sum(hist, 1)
    if not len(sampling.layers):
        return hist, kept, None
    is_sampled = np.zeros(n_layers, bool)
    is_sampled[sampling.layers] = True
    nz = tf.cast(sampling.n_nonzero, tf.float32)
    enough = (nz > sampling.hist_sample) & (kept >= record.sample_min_kept(sampling.hist_sample))
    scaled = hist * tf.where(enough & is_sampled, nz / tf.maximum(kept, 1.0), 1.0)[:, None]
    return scaled, kept, is_sampled & ~enough


_KEPT = record.VALUE_FIELDS.index("hist_sample")


def _with_whole(values: tf.Tensor, whole: tf.Tensor, plan: _Plan, buf_rows: tf.Tensor) -> tf.Tensor:
    """``values`` with the histogram and ``hist_sample`` of the layers flagged ``whole`` binned whole."""
    n = len(plan.flat)
    hist = _sampled_whole(plan, buf_rows, whole, n)
    kept = tf.reduce_sum(hist, 1, keepdims=True)
    binned = tf.concat([values[:, :_KEPT], kept, values[:, _KEPT + 1 : record.NUM_VALUES], hist], 1)
    return tf.where(whole[:, None], binned, values)


def whole_histograms(grads: Sequence[Any], hist_sample: int, values: tf.Tensor, whole: tf.Tensor) -> tf.Tensor:
    """``values`` of :func:`compute` (``deferred=True``) with the flagged layers' histograms binned whole: compiled
    on its own, so a model whose samples are always enough never compiles it."""
    plan = _plan(grads, hist_sample)
    return _with_whole(values, whole, plan, _pack(plan.flat, plan.layout))


def compute(inputs: LayerInputs, deferred: bool = False) -> Any:
    """The :class:`DeviceRecord` of all layers (dense or ``None`` gradients; see :mod:`tb_gradhealth._tf.kernels` for
    ``IndexedSlices``). Under XLA (its loops are variadic reduces), or as plain TensorFlow ops outside it (the
    ``_graph_*_rows`` reductions: no compile, a few more passes over the data).

    A layer whose sample is not enough is binned whole in a ``tf.cond`` branch; ``deferred=True`` leaves that to
    the caller instead (:func:`compute_deferring`) and returns ``(record, whole flags or None)``.
    """
    inputs = _small_slices_dense(inputs)
    grads, sizes, hist_sample = inputs.grads, inputs.sizes, inputs.hist_sample
    n = len(grads)
    if not n:
        rec = kernels.compute_layers(inputs)
        return (rec, None) if deferred else rec
    plan = _plan(grads, hist_sample)
    lay = plan.layout
    buf = _pack(plan.flat, lay)
    sums, zero, kmax, kmin, nan, posinf, neginf = _gradient_reductions(plan, buf, n)
    size = tf.constant(np.array([max(int(z if g is None else g), 0) for z, g in zip(sizes, plan.sizes, strict=True)],
                                np.int32))
    nonfinite = nan + posinf + neginf
    mx, mn = _from_key(kmax, -np.inf), _from_key(kmin, np.inf)
    m = tf.cast(tf.maximum(tf.maximum(mx, -mn), 0.0), tf.float64)
    fields = _sum_fields(sums, m, tf.cast(size - nonfinite, tf.float64))
    s, q = sums[record.GRAD_SUM_NAMES.index("mean")], sums[record.GRAD_SUM_NAMES.index("ssq_rel")]
    ids = plan.sampled if inputs.ids is None else np.asarray(inputs.ids, np.int64)[plan.sampled]
    sampling = _Sampling(plan.sampled, ids, hist_sample, inputs.seed, s, q, size - nonfinite - zero)
    hist, kept, whole = _histograms(plan, buf, sampling, n)
    counts, values = _stacked(inputs, {"size": size, "nan": nan, "posinf": posinf, "neginf": neginf, "zero": zero},
                              {"min": mn, "max": mx, **fields, "hist_sample": kept}, hist)
    if whole is not None and not deferred:
        values = tf.cond(tf.reduce_any(whole), lambda: _with_whole(values, whole, plan, buf), lambda: values)
    if any(isinstance(g, tf.IndexedSlices) for g in grads):
        counts, values = _with_sparse_rows(counts, values, inputs)
    rec = DeviceRecord(counts, values)
    return (rec, whole) if deferred else rec


def _gradient_reductions(plan: _Plan, buf: tf.Tensor, n: int) -> tuple[list[tf.Tensor], ...]:
    """``(term sums [n] each, zero, max key, min key, NaN, +Inf, -Inf)`` of every layer: the fast rows (or their
    plain TensorFlow form outside XLA), the layers with a NaN/Inf or a sum not finite redone by the exact rows."""
    lay = plan.layout
    graph = not compat.in_xla_context()
    *sums, zero, kmax, kmin, bad = _reduce_layers(plan.flat, lay, n, _graph_gradient_rows if graph else
                                                  _fast_gradient_rows, _FAST_KINDS, buf)
    redo = functools.reduce(tf.logical_or, [~tf.math.is_finite(t) for t in sums], bad > 0)
    if graph:  # float32 squares: a layer of tiny values is redone in float64
        m0 = tf.maximum(_from_key(kmax, -np.inf), -_from_key(kmin, np.inf))
        redo |= (m0 > 0) & (m0 < _GRAPH_FAST_MIN)
    z = tf.zeros_like(zero)
    *sums, zero, kmax, kmin, nan, posinf, neginf = _redo_where(
        redo, [*sums, zero, kmax, kmin, z, z, z], plan.flat, lay, n, _exact_gradient_rows, _EXACT_KINDS, buf
    )
    return sums, zero, kmax, kmin, nan, posinf, neginf


def _sum_fields(sums: Sequence[tf.Tensor], m: tf.Tensor, nf: tf.Tensor) -> dict[str, tf.Tensor]:
    """The :data:`record.GRAD_SUMS` fields float32 from the layers' sums ``sum(term(x))`` float64, their max|g|
    ``m`` and finite counts ``nf``: a mean over ``nf``, a relative sum over ``m**power`` (0 where ``m`` is)."""
    out = {}
    for s, t in zip(record.GRAD_SUMS, sums, strict=True):
        if s.mean:
            v = tf.where((m > 0) & (nf > 0), t / tf.maximum(nf, 1.0), tf.zeros_like(m))
        else:
            v = tf.where(m > 0, t / tf.where(m > 0, record.power_of(m, s.power), tf.ones_like(m)), tf.zeros_like(m))
        out[s.name] = tf.cast(v, tf.float32)
    return out


def _stacked(inputs: LayerInputs, counts: dict[str, tf.Tensor], grad: dict[str, tf.Tensor],
             hist: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The record's counts ``[L, 5]`` and values ``[L, 89]``: the count fields, the gradient's value fields and
    histogram, the norms of the weights and updates of ``inputs``, and which layers had no gradient."""
    n = len(inputs.grads)
    wm, wq = _norm_fields([_flat(w) for w in inputs.weights], n)
    um, uq = _norm_fields([_flat(u) for u in inputs.updates], n)
    fields = {**grad, "weight_max_abs": wm, "weight_ssq_rel": wq, "update_max_abs": um, "update_ssq_rel": uq,
              "missing": tf.constant(np.array([g is None for g in inputs.grads], np.float32))}
    return (tf.stack([counts[name] for name in record.COUNT_FIELDS], 1),
            tf.concat([kernels.stack_values(fields, [n]), hist], 1))


def _small_slices_dense(inputs: LayerInputs) -> LayerInputs:
    """``inputs`` with each ``IndexedSlices`` gradient of at most :data:`IN_PLACE_MIN` dense values made dense (its
    duplicate slices summed, as the optimizer applies them): it is then packed and reduced with the others, instead
    of by a per-layer kernel of its own (hundreds of ops to trace and compile for a small embedding table)."""
    small = [i for i, g in enumerate(inputs.grads)
             if isinstance(g, tf.IndexedSlices) and 0 <= inputs.sizes[i] <= IN_PLACE_MIN]
    if not small:
        return inputs
    grads = list(inputs.grads)
    for i in small:
        g = grads[i]
        grads[i] = tf.math.unsorted_segment_sum(g.values, g.indices, kernels.size_rows(g, inputs.sizes[i]))
    return inputs._replace(grads=tuple(grads))


def _with_sparse_rows(counts: tf.Tensor, values: tf.Tensor, inputs: LayerInputs) -> tuple[tf.Tensor, tf.Tensor]:
    """Replace the rows of ``IndexedSlices`` gradients by the per-layer kernel's (sorted, deduplicated slices)."""
    idx = [i for i, g in enumerate(inputs.grads) if isinstance(g, tf.IndexedSlices)]
    rows = [kernels.layer_record(inputs, i) for i in idx]
    at = tf.constant(np.array(idx, np.int32)[:, None])
    counts = tf.tensor_scatter_nd_update(counts, at, tf.stack([c for c, _ in rows]))
    values = tf.tensor_scatter_nd_update(values, at, tf.stack([v for _, v in rows]))
    return counts, values


#: One compiled function per model signature (outside a user's ``jit_compile`` function).
compute_jit = compat.quiet_retracing(tf.function(compute, jit_compile=True, autograph=False))
#: Compiled the first time a step has a layer whose sample is not enough (:func:`whole_histograms`).
whole_histograms_jit = compat.quiet_retracing(tf.function(whole_histograms, jit_compile=True, autograph=False))


def compute_deferring(inputs: LayerInputs) -> DeviceRecord:
    """:func:`compute`, compiled, with the whole binning of sparse layers in a function of its own that compiles
    only when a step first needs it (outside a user's ``jit_compile`` step, where everything compiles at once).

    Called while a graph is traced, the compiled function's XLA program starts compiling on a background thread at
    once (:mod:`tb_gradhealth._tf.precompile`), not when the graph's call first runs."""
    precompile.compile_ahead(compute_jit, (inputs,), {"deferred": True})
    rec, whole = compute_jit(inputs, deferred=True)
    if whole is None:
        return rec
    grads = _small_slices_dense(inputs).grads  # as compute packed them: a small embedding's slices made dense
    values = tf.cond(tf.reduce_any(whole),
                     lambda: whole_histograms_jit(grads, inputs.hist_sample, rec.values, whole),
                     lambda: rec.values)
    return DeviceRecord(rec.counts, values)
