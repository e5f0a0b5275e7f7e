"""Device records of a model's layers from gradients in any accepted form: the inputs put in one
:class:`LayerInputs`, then the path that computes them (every layer in one XLA function, the same layout as plain
graph ops, or layer by layer).

:func:`tb_gradhealth.summary.compute` is this function for users; the Keras callback's capture and the shard merge
call it here, below the public module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import record
from tb_gradhealth._core import LayerInputs
from tb_gradhealth._tf import compat, kernels, packed
from tb_gradhealth._tf.kernels import DeviceRecord
from tb_gradhealth._tf.naming import is_variable, normalize
from tb_gradhealth.record import Delta


def _static_size(g: Any, var: Any, w: Any) -> int:
    """The layer's element count from the first of variable, weight and gradient whose shape is static (-1: none)."""
    for t in (var, w, g):
        if t is None:
            continue
        if isinstance(t, tf.IndexedSlices):
            dense = tf.get_static_value(t.dense_shape)
            if dense is not None:
                return int(np.prod(dense))
            continue
        shape = getattr(t, "shape", None)
        if shape is not None:
            n = tf.TensorShape(shape).num_elements()
            if n is not None:
                return int(n)
    return -1


def _as_tensor(t: Any) -> Any:
    """``t`` as a tensor (a Keras 3 variable as its ``tf.Variable``'s value; ``None``, slices and deltas kept)."""
    if t is None or isinstance(t, tf.IndexedSlices):
        return t
    if isinstance(t, Delta):
        return Delta(_as_tensor(t.before), _as_tensor(t.after))
    value = getattr(t, "value", None)  # Keras 3 variable -> its tf.Variable
    if is_variable(t) and isinstance(value, tf.Variable):
        t = value
    return tf.convert_to_tensor(t)


def layer_inputs(grads: Any, weights: Any, updates: Any, hist_sample: int, seed: Any) -> LayerInputs:
    """The :class:`LayerInputs` of ``grads`` (pairs, dict or lists: see :func:`normalize`), with the weights and
    updates aligned to them; a ``None`` gradient needs its variable (or weight) for the layer's size."""
    names, glist, wlist, variables = normalize(grads, weights)
    if isinstance(updates, Mapping):
        ulist = [updates.get(n) for n in names]
    elif updates is None:
        ulist = [None] * len(glist)
    else:
        ulist = list(updates)
    sizes = tuple(_static_size(g, v, w) for g, v, w in zip(glist, variables, wlist, strict=True))
    for g, size in zip(glist, sizes, strict=True):
        if g is None and size < 0:
            raise ValueError("a None gradient needs its variable (or weight) to know the layer's size")
    return LayerInputs(
        grads=tuple(_as_tensor(g) for g in glist),
        weights=tuple(_as_tensor(w) for w in wlist),
        updates=tuple(_as_tensor(u) for u in ulist),
        sizes=sizes,
        hist_sample=int(hist_sample or 0),
        seed=None if seed is None else tf.convert_to_tensor(seed),
    )


#: The ways :func:`compute` may compute the statistics: ``"graph"``, ``True`` (XLA), ``False`` (layer by layer).
JIT_MODES = ("graph", True, False)


@tf.autograph.experimental.do_not_convert
def compute(grads: Any, weights: Any = None, updates: Any = None, *, hist_sample: int = record.DEFAULT_HIST_SAMPLE,
            seed: Any = None, jit: bool | str = "graph") -> DeviceRecord:
    """Device records of ``grads``, rows in :func:`tb_gradhealth._tf.naming.layer_names` order: the arguments and
    the ``jit`` modes of :func:`tb_gradhealth.summary.compute`."""
    if jit not in JIT_MODES:
        raise ValueError(f"jit must be one of {JIT_MODES}, got {jit!r}")
    inputs = layer_inputs(grads, weights, updates, hist_sample, seed)
    xla = compat.in_xla_context()
    if jit == "graph" and not xla:  # the all-layer statistics as plain graph ops
        return packed.compute(inputs)
    if not jit or not kernels.fused_reductions_available():
        return kernels.compute_layers(inputs)
    if xla:  # inside a compiled function: inline into its cluster
        return packed.compute(inputs)
    return packed.compute_deferring(inputs)
