"""A model's record computed eagerly, a block of layers at a time: the statistics of a logged step after it ran.

Why: the plain-ops statistics of every layer (:mod:`tb_gradhealth._tf.packed`) traced as one function hold, while
they run, temporaries the size of the whole model (the gradients packed, their squares in float64, the weights and
updates packed), and the traced function then stays in memory with the process. Run eagerly on blocks of at most
:data:`BLOCK` values, the same ops hold one block's temporaries at a time, nothing is traced and nothing stays.
The record is the same: a layer's values are reduced by the same rows whatever else shares its block, and its
histogram sample is salted by its index in the model (``LayerInputs.ids``), not in the block.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tb_gradhealth._core import LayerInputs
from tb_gradhealth._tf import packed
from tb_gradhealth._tf.kernels import DeviceRecord

#: Values per block: the temporaries of one block are a few times its float32 size.
BLOCK = 1 << 20

#: ``inputs_of(layers)``: the gradients, weights and updates of those layers (each a sequence in their order).
InputsOf = Callable[[list[int]], tuple[Sequence[Any], Sequence[Any], Sequence[Any]]]


def blocks(sizes: Sequence[int], limit: int = BLOCK) -> list[list[int]]:
    """Consecutive layers grouped into blocks of at most ``limit`` values in all (a larger layer is a block alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        n = max(int(n), 0)
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def compute(sizes: Sequence[int], inputs_of: InputsOf, *, hist_sample: int, seed: Any,
            limit: int = BLOCK) -> DeviceRecord:
    """The :class:`DeviceRecord` of layers of ``sizes`` values, block by block (call it eagerly: in a traced
    function the blocks would share one graph, and its memory)."""
    counts, values = [], []
    seed = None if seed is None else tf.convert_to_tensor(seed)
    for layers in blocks(sizes, limit):
        grads, weights, updates = inputs_of(layers)
        rec = packed.compute(LayerInputs(
            grads=tuple(grads), weights=tuple(weights), updates=tuple(updates),
            sizes=tuple(int(sizes[i]) for i in layers), hist_sample=int(hist_sample or 0),
            seed=seed, ids=tuple(layers),
        ))
        counts.append(rec.counts)
        values.append(rec.values)
    if not counts:
        return packed.compute(LayerInputs((), (), (), (), 0, None))
    return DeviceRecord(tf.concat(counts, 0), tf.concat(values, 0))
