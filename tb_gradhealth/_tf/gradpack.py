"""A model's gradients as a few outputs of a traced train step: the largest as they are, the rest in flat buffers.

Why: a function with hundreds of outputs (one per gradient) takes TensorFlow seconds longer to optimise and start
than the same step without them, and a conditional with as many outputs more still; one buffer per dtype and a
vector of the parts' sizes cost nothing measurable, but the buffers are a copy. So the few largest gradients (most
of a model's values: at most :data:`ALONE_MAX` of at least :data:`ALONE_MIN` values) leave the step as they are,
and the others are packed: :func:`pack`, behind the caller's conditional, on the calls that return their gradients
(:func:`empty` on the others, so that the gradients live no longer than in the plain step). :func:`unpack` cuts the
gradients back out, an ``IndexedSlices`` from its values and indices, by the :class:`Layout` noted when the step
was traced.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

#: A dense gradient of at least this many values may leave the step as it is, ...
ALONE_MIN = 1 << 18
#: ... the largest this many of them.
ALONE_MAX = 32


@dataclass(frozen=True)
class Layout:
    """Where each gradient's parts are: per part, its output or buffer and its shape."""

    #: Per gradient: whether it is an ``IndexedSlices`` (two parts: values, indices) or dense (one part).
    sparse: tuple[bool, ...]
    #: Per part: its position among the outputs that leave as they are (the first of :func:`pack`), or ``-1``: packed.
    alone: tuple[int, ...]
    #: Per part: the index of its buffer (one buffer per dtype, in :attr:`dtypes` order); ``-1``: alone.
    buffer: tuple[int, ...]
    #: Per part: its static shape (an ``IndexedSlices``' number of slices ``None`` where the step did not know it).
    shapes: tuple[tuple[int | None, ...], ...]
    #: Per gradient that is an ``IndexedSlices``: its dense shape.
    dense_shapes: tuple[tuple[int, ...], ...]
    #: The buffers' dtypes.
    dtypes: tuple[tf.DType, ...]
    #: Per part: its dtype.
    part_dtypes: tuple[tf.DType, ...]

    @property
    def packed(self) -> list[int]:
        """The parts that go into the buffers, in order (their sizes are :func:`pack`'s last output)."""
        return [k for k, a in enumerate(self.alone) if a < 0]


def _parts(grads: list[Any]) -> list[tf.Tensor]:
    return [t for g in grads for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]


def _alone(grads: list[Any], shapes: list[tuple[int | None, ...]]) -> list[int]:
    """Each part's position among those leaving as they are (``-1``: packed): the largest dense gradients."""
    dense = [d for g in grads for d in ((False, False) if isinstance(g, tf.IndexedSlices) else (True,))]
    sizes = [int(np.prod(s)) if d and None not in s else 0 for s, d in zip(shapes, dense, strict=True)]
    large = sorted((k for k, n in enumerate(sizes) if n >= ALONE_MIN), key=lambda k: -sizes[k])[:ALONE_MAX]
    at = {k: i for i, k in enumerate(sorted(large))}
    return [at.get(k, -1) for k in range(len(sizes))]


def layout(grads: list[Any]) -> Layout:
    """The layout of ``grads`` (dense tensors of static shape, or ``IndexedSlices`` of a variable)."""
    parts = _parts(grads)
    shapes = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):  # the number of slices as static as the step had it
            shapes += [tuple(g.values.shape.as_list()), tuple(g.indices.shape.as_list())]
        else:
            shapes.append(tuple(g.shape.as_list()))
    alone = _alone(grads, shapes)
    dtypes = tuple(dict.fromkeys(t.dtype for t, a in zip(parts, alone, strict=True) if a < 0))
    dense_shapes = tuple(tuple(tf.get_static_value(g.dense_shape).tolist()) for g in grads
                         if isinstance(g, tf.IndexedSlices))
    return Layout(sparse=tuple(isinstance(g, tf.IndexedSlices) for g in grads), alone=tuple(alone),
                  buffer=tuple(-1 if a >= 0 else dtypes.index(t.dtype) for t, a in zip(parts, alone, strict=True)),
                  shapes=tuple(shapes), dense_shapes=dense_shapes, dtypes=dtypes,
                  part_dtypes=tuple(t.dtype for t in parts))


def pack(grads: list[Any], where: Layout) -> list[tf.Tensor]:
    """The parts that leave as they are (flattened: no copy), then one flat buffer per dtype of the others, then
    their sizes (int64)."""
    parts = _parts(grads)
    alone = [tf.reshape(t, [-1]) for t, a in zip(parts, where.alone, strict=True) if a >= 0]
    packed = where.packed
    buffers = [tf.concat([tf.reshape(parts[k], [-1]) for k in packed if where.buffer[k] == i], 0)
               for i in range(len(where.dtypes))]
    sizes = [tf.size(parts[k], out_type=tf.int64) for k in packed]
    return [*alone, *buffers, tf.stack(sizes) if sizes else tf.zeros([0], tf.int64)]


def empty(where: Layout) -> list[tf.Tensor]:
    """What a step that does not return its gradients returns instead of :func:`pack`'s outputs."""
    alone = [tf.zeros([0], d) for d, a in zip(where.part_dtypes, where.alone, strict=True) if a >= 0]
    return alone + [tf.zeros([0], d) for d in where.dtypes] + [tf.zeros([0], tf.int64)]


def _starts(sizes: tf.Tensor, where: Layout) -> tuple[dict[int, Any], dict[int, Any]]:
    """Each packed part's start in its buffer and its size: Python ints when the sizes are known (eagerly: no op
    per part), else tensors."""
    known = tf.get_static_value(sizes)
    starts, size_of = {}, {}
    packed = where.packed
    for i in range(len(where.dtypes)):
        mine = [j for j, k in enumerate(packed) if where.buffer[k] == i]
        if known is not None:
            at = np.cumsum([0] + [int(known[j]) for j in mine])[:-1].tolist()
        else:
            at = tf.unstack(tf.cumsum(tf.gather(sizes, mine), exclusive=True), num=len(mine))
        for j, start in zip(mine, at, strict=True):
            k = packed[j]
            starts[k], size_of[k] = start, (int(known[j]) if known is not None else sizes[j])
    return starts, size_of


def unpack(out: Any, where: Layout, which: Sequence[int] | None = None, *, flat: bool = False) -> list[Any]:
    """The gradients of :func:`pack`'s outputs: all of them, or those at the indices ``which`` (each cut out of its
    buffer alone, so that a caller working through them a few at a time holds no copy of the rest). ``flat``: a
    dense gradient stays flattened, as the statistics read it (run eagerly, each reshape is an op to dispatch)."""
    n_alone = sum(a >= 0 for a in where.alone)
    kept, (*buffers, sizes) = list(out[:n_alone]), out[n_alone:]
    starts, size_of = _starts(sizes, where)
    first = np.cumsum([0] + [2 if sparse else 1 for sparse in where.sparse])

    def piece(k: int, shaped: bool = True) -> tf.Tensor:
        if where.alone[k] >= 0:
            cut = kept[where.alone[k]]
        else:
            cut = tf.slice(buffers[where.buffer[k]], tf.stack([starts[k]]), tf.stack([size_of[k]]))
        return tf.reshape(cut, [-1 if d is None else d for d in where.shapes[k]]) if shaped else cut

    grads = []
    for g in range(len(where.sparse)) if which is None else which:
        k = int(first[g])
        if where.sparse[g]:
            dense = where.dense_shapes[int(np.sum(where.sparse[:g]))]
            grads.append(tf.IndexedSlices(piece(k), piece(k + 1), tf.constant(dense, tf.int64)))
        else:
            grads.append(piece(k, shaped=not flat))
    return grads
