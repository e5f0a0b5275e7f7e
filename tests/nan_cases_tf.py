"""Training set-ups with one injected NaN/Inf fault each, for the TensorFlow NaN-origin tests and benchmark.

Each case knows where its fault is: the op type, the layer (None: the loss), the direction, and the line of this
file that holds it (the line ending in its ``# fault: <case>`` marker). The fault fires only on the samples of batch
``FAULT_BATCH`` (0-based), so the first steps train normally and the non-finite gradient appears at step
``FAULT_BATCH + 1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tests import nan_faults
from tests.nan_faults import BATCH, FAULT_BATCH, FAULT_ROWS, FAULT_STEP, NAN_SAMPLE, STEPS, Case  # noqa: F401

fault_line = functools.partial(nan_faults.fault_line, path=__file__)


class L2Norm(keras.layers.Layer):
    """Euclidean norm of each sample: finite at 0, but its gradient there is not."""

    def call(self, x: Any) -> Any:
        return tf.sqrt(tf.reduce_sum(tf.square(x), axis=-1, keepdims=True))  # fault: sqrt


class HandSoftmax(keras.layers.Layer):
    """A softmax written without subtracting the maximum: exp overflows for large logits."""

    def call(self, x: Any) -> Any:
        e = tf.exp(x)  # fault: exp
        return e / tf.reduce_sum(e, axis=-1, keepdims=True)


class HandNorm(keras.layers.Layer):
    """Standardises each sample over its features, dividing by a standard deviation that may be 0."""

    def call(self, x: Any) -> Any:
        centred = x - tf.reduce_mean(x, axis=-1, keepdims=True)
        std = tf.sqrt(tf.reduce_mean(tf.square(centred), axis=-1, keepdims=True))
        return centred / std  # fault: div


def mse(y_true: Any, y_pred: Any) -> Any:
    return tf.reduce_mean(tf.square(y_pred - y_true))


def log_loss(y_true: Any, y_pred: Any) -> Any:
    """A hand-written log loss: log(0) where a prediction is exactly 0."""
    return tf.reduce_mean(tf.math.log(tf.abs(y_pred)) * y_true + tf.square(y_pred - y_true))  # fault: log


def _model(middle: list[Any], out_units: int = 1, name: str = "net") -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(3, use_bias=False, name="dense_in")(inp)
    for layer in middle:
        h = layer(h)
    out = keras.layers.Dense(out_units, name="dense_out")(h)
    return keras.Model(inp, out, name=name)


def log0() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0  # prediction = bias = 0 at the start ...
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    out = keras.layers.Dense(1, use_bias=False, name="dense_out")(inp)  # ... with no bias: exactly 0
    return Case("log", "Log", None, "forward", keras.Model(inp, out, name="net"), log_loss, x, y)


def exp_overflow() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 100.0
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    logits = keras.layers.Dense(3, kernel_initializer="ones", name="logits")(inp)  # 400 for the faulty samples
    out = keras.layers.Dense(1, name="dense_out")(HandSoftmax(name="softmax")(logits))
    model = keras.Model(inp, out, name="net")
    return Case("exp", "Exp", "softmax", "forward", model, mse, x, y)


def sqrt_at_zero() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    return Case("sqrt", "Sqrt", "l2norm", "backward", _model([L2Norm(name="l2norm")]), mse, x, y)


def zero_variance() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    return Case("div", "RealDiv", "norm", "forward", _model([HandNorm(name="norm")]), mse, x, y)


def nan_sample() -> Case:
    x, y = nan_faults.data()
    x = nan_faults.with_nan_sample(x)
    return Case("input", "MatMul", "dense_in", "forward", _model([]), mse, x, y, input_nan=True)


CASES: dict[str, Callable[[], Case]] = {
    "log": log0, "exp": exp_overflow, "sqrt": sqrt_at_zero, "div": zero_variance, "input": nan_sample,
}


def batches(case: Case) -> list[tuple[tf.Tensor, tf.Tensor]]:
    return [(tf.constant(case.x[i * BATCH:(i + 1) * BATCH]), tf.constant(case.y[i * BATCH:(i + 1) * BATCH]))
            for i in range(STEPS)]
