"""Each layer's output inside the Keras callback's train step: the forward record of a logged step, computed where the
output is made.

The callback's capture path traces the step with these hooks in place (:mod:`tb_gradhealth._tf.compat` wraps each
recorded layer's ``call``, as the optimizer's update is wrapped): a recorded layer's output is reduced, on the
device and under a ``tf.cond`` on whether the step is logged, to its forward record in the disk form
(:func:`tb_gradhealth._forwardstats.output_stats` with TensorFlow's numpy as the backend), and the rows of one
step leave it beside its gradient record (:class:`tb_gradhealth._tf.capture.Ring`). Unlogged steps run the
``tf.cond``'s other branch (a row of zeros); with the plain variant of the in-step path, nothing at all.

Which layers: every leaf layer that owns weights and every activation layer (``Activation``, ``ReLU``,
``Softmax``, ...), found through the model's layers: Sequential, functional and subclassed models alike, as long
as a layer is called through ``layer(x)`` (a subclassed model that calls ``keras.ops.relu`` has no activation
layer there: the output of the layer before it is recorded before the activation). A layer called several
times in one step gets a row per call (``name``, ``name#1``, ...). Outside the train step (the probe batch,
evaluation, prediction) the hooks do nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from tb_gradhealth import _devicestats, _forwardstats, record
from tb_gradhealth._tf import compat

#: Keras activation layers, as the writers name their function (an ``Activation`` layer names its own).
ACTIVATION_LAYERS = {"ReLU": "relu", "Softmax": "softmax", "LeakyReLU": "leaky_relu", "ELU": "elu", "PReLU": "prelu"}


def _divide(x: Any, m: Any) -> Any:
    """``x / m`` for ``m`` up to 3.4e38 (XLA computes ``x * (1 / m)``: both scaled by 2**-64 above 2**100)."""
    c = tf.where(m > 2.0**100, 2.0**-64, 1.0)
    return (x * c) / (m * c)


def _unsupported(*args: Any) -> Any:  # pragma: no cover - the forward statistics need no histogram
    raise NotImplementedError


def _cond(pred: Any, true_fn: Callable, false_fn: Callable, operands: tuple) -> Any:
    return tf.cond(pred, lambda: true_fn(*operands), lambda: false_fn(*operands))


_unit_extremes = _forwardstats.per_unit_extremes(tf.reduce_min, tf.reduce_max)


BE = _devicestats.Backend(tnp, lambda t: tf.cast(t, tf.float32), _unsupported, lambda a, like: tf.constant(a),
                          _divide, _cond)


def output_stats(value: Any, axis: int, bounds: tuple[float, float] | None) -> _forwardstats.OutputStats:
    """The statistics of one output inside the step: a healthy output of known shape takes the few plain passes of
    :func:`_forwardstats.one_pass_output_stats`, any other the masked passes (a ``tf.cond`` on its extremes)."""
    return _forwardstats.output_stats(BE, value, unit_axis=axis, bounds=bounds, unit_extremes=_unit_extremes)


def _bits(counts: Any) -> Any:
    return tf.bitcast(tf.cast(counts, tf.int32), tf.float32)


def activation_of(layer: Any) -> str:
    """A Keras layer's activation by name (``""`` where it has none it states)."""
    name = ACTIVATION_LAYERS.get(type(layer).__name__)
    if name is not None:
        return name
    act = getattr(layer, "activation", None)
    if act is None:
        return ""
    return str(getattr(act, "__name__", None) or getattr(act, "name", None) or type(act).__name__)


class _Target:
    """A recorded layer: its row name, kind, activation, bounds and unit axis (None: the axis of the layer recorded
    before it in the step)."""

    def __init__(self, layer: Any) -> None:
        self.layer = layer
        self.name = compat.layer_path(layer)
        self.kind = type(layer).__name__
        activation = activation_of(layer)
        self.activation = "" if activation == "linear" else activation
        self.bounds = record.activation_bounds(self.activation)
        self.axis: int | None = -1
        if self.kind in ACTIVATION_LAYERS or self.kind == "Activation":
            self.axis = None
        if getattr(layer, "data_format", None) == "channels_first":
            self.axis = 1
        axis = getattr(layer, "axis", None)
        if self.kind == "BatchNormalization" and axis is not None:
            self.axis = int(axis[0] if isinstance(axis, (list, tuple)) else axis)
        if self.kind == "Softmax" and isinstance(axis, int):
            self.axis = axis


def targets(model: Any) -> list[_Target]:
    """The layers of ``model`` whose outputs are recorded: leaf layers that own weights, and activation layers."""
    out = []
    for layer in compat.leaf_layers(model):
        kind = type(layer).__name__
        if layer.weights or kind in ACTIVATION_LAYERS or kind == "Activation":
            out.append(_Target(layer))
    return out


class _Trace(threading.local):
    """What one trace of the train step has recorded so far (per thread: replicas may trace in parallel)."""

    def __init__(self) -> None:
        self.active = False
        #: ``tf.cond`` predicate of the step being traced (a boolean tensor), or True (every step is logged)
        self.logged: Any = True
        self.rows: list[Any] = []
        self.names: list[str] = []
        self.targets: list[_Target] = []
        self.calls: dict[int, int] = {}
        self.last_axis = -1


class LayerHooks:
    """The hooks of one ``fit``: installed on the recorded layers' ``call`` (instance attributes, undone by
    :meth:`uninstall`); :meth:`begin` opens a trace of the train step with the predicate of a logged step (None:
    this trace records nothing), :meth:`end` closes it and gives its rows ``[capacity, ACT_NUM_FIELDS]`` (zero
    rows past the layers called)."""

    def __init__(self, model: Any) -> None:
        self.targets = targets(model)
        #: rows a step holds: twice the recorded layers (a layer called again gets a row per call), at least 8
        self.capacity = max(8, 2 * len(self.targets))
        #: the rows' names, kinds and activations, as the last trace of the step called them
        self.names: list[str] = []
        self.info: list[tuple[str, str]] = []
        #: calls beyond the capacity, left out (said once)
        self.dropped = 0
        self._trace = _Trace()

    def install(self) -> None:
        for target in self.targets:
            compat.unwrap_layer_call(target.layer)  # hooks a fit that ended by an exception left behind
            compat.wrap_layer_call(target.layer, self._wrapped(target))

    def uninstall(self) -> None:
        for target in self.targets:
            compat.unwrap_layer_call(target.layer)

    def begin(self, logged: Any) -> None:
        """A trace of the train step starts: record its layers' outputs under ``logged`` (a boolean tensor, or True:
        every step), or nothing (``None``)."""
        t = self._trace
        t.active, t.logged = logged is not None, logged
        t.rows, t.names, t.targets, t.calls, t.last_axis = [], [], [], {}, -1

    def end(self) -> Any:
        """The traced step's rows ``[capacity, ACT_NUM_FIELDS]`` float32 (the disk form), or None when this trace
        recorded nothing."""
        t = self._trace
        if not t.active:
            return None
        t.active = False
        rows, names = t.rows[: self.capacity], t.names[: self.capacity]
        self.dropped = max(self.dropped, len(t.rows) - len(rows))
        self.names = names
        self.info = [(target.kind, target.activation) for target in t.targets[: self.capacity]]
        pad = tf.zeros([self.capacity - len(rows), record.ACT_NUM_FIELDS], tf.float32)
        return tf.concat([tf.stack(rows), pad], 0) if rows else pad

    def _wrapped(self, target: _Target) -> Callable[..., Any]:
        call = target.layer.call

        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            if self._trace.active:
                self._record(target, out)
            return out

        return hooked

    def _record(self, target: _Target, out: Any) -> None:
        t = self._trace
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, tf.Tensor) or not out.dtype.is_floating:
            return
        k = t.calls.get(id(target), 0)
        t.calls[id(target)] = k + 1
        axis = t.last_axis if target.axis is None else target.axis
        ndim = out.shape.rank or 0
        if not -ndim <= axis < ndim:
            axis = -1
        t.last_axis = axis
        value = tf.stop_gradient(out)

        def row() -> Any:
            stats = output_stats(value, axis, target.bounds)
            return _forwardstats.disk_row(BE, stats, target.bounds, _bits)

        if t.logged is True:
            t.rows.append(row())
        else:
            t.rows.append(tf.cond(t.logged, row, lambda: tf.zeros([record.ACT_NUM_FIELDS], tf.float32)))
        t.names.append(target.name if k == 0 else f"{target.name}#{k}")
        t.targets.append(target)

    def rows_of(self, stored: np.ndarray) -> tuple[list[str], np.ndarray, list[tuple[str, str]]]:
        """``(names, memory-form rows, (kind, activation) per row)`` of a step's stored rows (the disk form)."""
        n = len(self.names)
        return list(self.names), record.act_from_disk(np.asarray(stored, np.float32)[:n]), list(self.info)
