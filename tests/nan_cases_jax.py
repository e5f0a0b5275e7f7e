"""JAX training set-ups with one injected NaN/Inf fault each (the twins of tests/nan_cases_tf.py): pure functions of
a params dict; a "layer" is a ``jax.named_scope``. Each case's source line ends in its ``# fault: <case>`` marker."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tests import nan_faults
from tests.nan_faults import BATCH, FAULT_ROWS, STEPS, Case, mse

fault_line = functools.partial(nan_faults.fault_line, path=__file__)


def _init(shapes: dict[str, tuple[int, ...]], ones: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {k: jnp.asarray(np.ones(s) if k in ones else rng.uniform(-0.5, 0.5, s), jnp.float32)
            for k, s in shapes.items()}


def dense(params: dict, x: jax.Array, name: str, bias: bool = True) -> jax.Array:
    with jax.named_scope(name):
        y = x @ params[f"{name}/kernel"]  # fault: input
        return y + params[f"{name}/bias"] if bias else y


def l2norm(h: jax.Array) -> jax.Array:
    with jax.named_scope("l2norm"):
        return jnp.sqrt(jnp.sum(jnp.square(h), axis=-1, keepdims=True))  # fault: sqrt


def softmax(h: jax.Array) -> jax.Array:
    with jax.named_scope("softmax"):
        e = jnp.exp(h)  # fault: exp
        return e / jnp.sum(e, axis=-1, keepdims=True)


def norm(h: jax.Array) -> jax.Array:
    with jax.named_scope("norm"):
        centred = h - jnp.mean(h, axis=-1, keepdims=True)
        std = jnp.sqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True))
        return centred / std  # fault: div


def log_loss(y: jax.Array, p: jax.Array) -> jax.Array:
    return jnp.mean(jnp.log(jnp.abs(p)) * y + jnp.square(p - y))  # fault: log


def _net(middle: Callable[[jax.Array], jax.Array] | None, width: int = 3, first: str = "dense_in",
         first_bias: bool = False) -> tuple[dict, Callable[[dict, jax.Array], jax.Array]]:
    out_in = 1 if middle is l2norm else width
    shapes = {f"{first}/kernel": (4, width), "dense_out/kernel": (out_in, 1), "dense_out/bias": (1,)}
    if first_bias:
        shapes[f"{first}/bias"] = (width,)

    def model(params: dict, x: jax.Array) -> jax.Array:
        h = dense(params, x, first, bias=first_bias)
        if middle is not None:
            h = middle(h)
        return dense(params, h, "dense_out")

    return _init(shapes, ones=(f"{first}/kernel",) if first == "logits" else ()), model


def _case(name: str, op: str, layer: str | None, direction: str, net: tuple, loss: Callable, x: np.ndarray,
          y: np.ndarray, input_nan: bool = False) -> Case:
    params, model = net
    case = Case(name, op, layer, direction, model, loss, x, y, input_nan)
    case.params = params
    return case


def log0() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    params = _init({"dense_out/kernel": (4, 1)})

    def model(p: dict, a: jax.Array) -> jax.Array:
        return dense(p, a, "dense_out", bias=False)

    return _case("log", "log", None, "forward", (params, model), log_loss, x, y)


def exp_overflow() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 100.0
    return _case("exp", "exp", "softmax", "forward", _net(softmax, first="logits", first_bias=True), mse, x, y)


def sqrt_at_zero() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    return _case("sqrt", "sqrt", "l2norm", "backward", _net(l2norm), mse, x, y)


def zero_variance() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    return _case("div", "div", "norm", "forward", _net(norm), mse, x, y)


def nan_sample() -> Case:
    x, y = nan_faults.data()
    return _case("input", "dot_general", "dense_in", "forward", _net(None), mse, nan_faults.with_nan_sample(x), y,
                 input_nan=True)


CASES: dict[str, Callable[[], Case]] = {
    "log": log0, "exp": exp_overflow, "sqrt": sqrt_at_zero, "div": zero_variance, "input": nan_sample,
}


def batches(case: Case) -> list[tuple[Any, Any]]:
    return [(jnp.asarray(case.x[i * BATCH:(i + 1) * BATCH]), jnp.asarray(case.y[i * BATCH:(i + 1) * BATCH]))
            for i in range(STEPS)]
