"""A model's gradients as a few flat buffers, so that they can leave a traced train step as a handful of outputs.

Why: a function with hundreds of outputs (one per gradient) takes TensorFlow seconds longer to optimise and start
than the same step without them, and a conditional with as many outputs more still; one buffer per dtype and a
vector of the parts' sizes cost nothing measurable. The buffers are written only when a step returns its gradients
(a copy of them, on logged steps); :func:`unpack` cuts them back into the gradients, an ``IndexedSlices`` from its
values and indices, by the :class:`Layout` noted when the step was traced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import tensorflow as tf


@dataclass(frozen=True)
class Layout:
    """Where each gradient's parts are: per part, its buffer and its shape."""

    #: Per gradient: whether it is an ``IndexedSlices`` (two parts: values, indices) or dense (one part).
    sparse: tuple[bool, ...]
    #: Per part: the index of its buffer (one buffer per dtype, in :attr:`dtypes` order).
    buffer: tuple[int, ...]
    #: Per part: its static shape (an ``IndexedSlices``' number of slices ``None`` where the step did not know it).
    shapes: tuple[tuple[int | None, ...], ...]
    #: Per gradient that is an ``IndexedSlices``: its dense shape.
    dense_shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[tf.DType, ...]


def _parts(grads: list[Any]) -> list[tf.Tensor]:
    return [t for g in grads for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]


def layout(grads: list[Any]) -> Layout:
    """The layout of ``grads`` (dense tensors of static shape, or ``IndexedSlices`` of a variable)."""
    parts = _parts(grads)
    dtypes = tuple(dict.fromkeys(t.dtype for t in parts))
    shapes = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):  # the number of slices as static as the step had it
            shapes += [tuple(g.values.shape.as_list()), tuple(g.indices.shape.as_list())]
        else:
            shapes.append(tuple(g.shape.as_list()))
    dense_shapes = tuple(tuple(tf.get_static_value(g.dense_shape).tolist()) for g in grads
                         if isinstance(g, tf.IndexedSlices))
    return Layout(sparse=tuple(isinstance(g, tf.IndexedSlices) for g in grads),
                  buffer=tuple(dtypes.index(t.dtype) for t in parts), shapes=tuple(shapes),
                  dense_shapes=dense_shapes, dtypes=dtypes)


def pack(grads: list[Any], where: Layout) -> list[tf.Tensor]:
    """One flat buffer per dtype, then the parts' sizes (int64)."""
    parts = _parts(grads)
    buffers = [tf.concat([tf.reshape(t, [-1]) for t, b in zip(parts, where.buffer, strict=True) if b == i], 0)
               for i in range(len(where.dtypes))]
    return [*buffers, tf.stack([tf.size(t, out_type=tf.int64) for t in parts])]


def empty(where: Layout) -> list[tf.Tensor]:
    """What a step that does not return its gradients returns instead of :func:`pack`'s buffers."""
    return [tf.zeros([0], d) for d in where.dtypes] + [tf.zeros([0], tf.int64)]


def unpack(packed: Any, where: Layout) -> list[Any]:
    """The gradients of :func:`pack`'s output."""
    *buffers, sizes = packed
    pieces: list[Any] = [None] * len(where.buffer)
    for i in range(len(where.dtypes)):
        mine = [k for k, b in enumerate(where.buffer) if b == i]
        cut = tf.split(buffers[i], tf.gather(sizes, mine), num=len(mine))
        for k, piece in zip(mine, cut, strict=True):
            pieces[k] = tf.reshape(piece, [-1 if d is None else d for d in where.shapes[k]])
    out, k, s = [], 0, 0
    for sparse in where.sparse:
        if sparse:
            out.append(tf.IndexedSlices(pieces[k], pieces[k + 1], tf.constant(where.dense_shapes[s], tf.int64)))
            k, s = k + 2, s + 1
        else:
            out.append(pieces[k])
            k += 1
    return out
