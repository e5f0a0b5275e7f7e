"""A small numpy MLP trained by hand (forward, backprop, SGD or Adam), written with the numpy ``Writer``: gradients,
the layers' outputs and the loss (under Adam, the weights and the applied updates too), so tests of the diagnosis
read a real network's records. What a test plants (a bias shift that kills units, an init scale that saturates or
blows up the activations) is measured on the outputs this module returns, never taken from the diagnosis."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from tb_gradhealth import Writer

ACTS = {
    "relu": (lambda z: np.maximum(z, 0.0), lambda z, h: (z > 0).astype(z.dtype)),
    "tanh": (np.tanh, lambda z, h: 1.0 - h * h),
    "sigmoid": (lambda z: 1.0 / (1.0 + np.exp(-z)), lambda z, h: h * (1.0 - h)),
    "linear": (lambda z: z, lambda z, h: np.ones_like(z)),
}


class Run(NamedTuple):
    """What the loop measured: ``outputs[step][layer]`` each layer's output (after its activation) and
    ``grads[step][variable]`` the gradients, as written."""

    outputs: list[dict[str, np.ndarray]]
    grads: list[dict[str, np.ndarray]]


def train(logdir: str | None, *, widths: list[int], act: str, scale: float = 1.0, steps: int = 12,
          lr: float = 0.01, batch: int = 64, shift: dict[int, tuple[int, float]] | None = None,
          seed: int = 0, record_outputs: bool = True, watch: Callable[[Writer], None] | None = None,
          adam: bool = False) -> Run:
    """Train ``Dense(widths[i] -> widths[i+1], act)`` layers and a linear head on a fixed linear teacher, by SGD
    or (``adam``) by Adam (Keras' defaults: betas 0.9 and 0.999, epsilon 1e-7; the weights before each step and
    the applied update are written beside the gradients). Weights start at ``scale`` times He (ReLU) or Glorot
    (tanh, sigmoid) scale; ``shift``: ``{layer: (units, value)}`` adds ``value``
    to the bias of that layer's first ``units`` units at the start. Layers are named ``dense_1``... and ``head``.
    ``watch``: called with the writer before the first step (a live run that reads its events)."""
    rng = np.random.default_rng(seed)
    f, df = ACTS[act]
    sizes = [*widths, 1]
    Ws, bs = [], []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        std = np.sqrt(2.0 / a) if act == "relu" else np.sqrt(2.0 / (a + b))
        Ws.append(rng.standard_normal((a, b)) * std * (scale if k < len(sizes) - 2 else 1.0))
        bs.append(np.zeros(b))
    for layer, (units, value) in (shift or {}).items():
        bs[layer - 1][:units] += value
    names = [f"dense_{k + 1}" for k in range(len(Ws) - 1)] + ["head"]
    teacher = rng.standard_normal((widths[0], 1))
    run = Run([], [])
    moments = {}
    writer = Writer(logdir) if logdir else None
    if watch is not None and writer is not None:
        watch(writer)
    for step in range(steps):
        x = rng.standard_normal((batch, widths[0]))
        y = x @ teacher
        hs, zs = [x], []
        for k, (W, b) in enumerate(zip(Ws, bs, strict=True)):
            z = hs[-1] @ W + b
            zs.append(z)
            hs.append(z if k == len(Ws) - 1 else f(z))
        out = hs[-1]
        loss = float(np.mean((out - y) ** 2))
        d = 2.0 * (out - y) / batch
        grads: dict[str, np.ndarray] = {}
        for k in range(len(Ws) - 1, -1, -1):
            grads[f"{names[k]}/kernel"] = hs[k].T @ d
            grads[f"{names[k]}/bias"] = d.sum(axis=0)
            if k:
                d = (d @ Ws[k].T) * df(zs[k - 1], hs[k])
        grads = {n: grads[n] for k in range(len(Ws)) for n in (f"{names[k]}/kernel", f"{names[k]}/bias")}
        outputs = dict(zip(names, hs[1:], strict=True))
        run.outputs.append(outputs)
        run.grads.append(grads)
        params = {n: p for k in range(len(Ws)) for n, p in ((f"{names[k]}/kernel", Ws[k]), (f"{names[k]}/bias", bs[k]))}
        steps_taken = {n: _adam(moments, n, g, step + 1, lr) if adam else lr * g for n, g in grads.items()}
        if writer is not None:
            if adam:
                writer.add_gradients(step, grads, weights={n: p.copy() for n, p in params.items()}, updates=steps_taken)
            else:
                writer.add_gradients(step, grads)
            if record_outputs:
                writer.add_activations(step, outputs, activations={n: act for n in names[:-1]})
            writer.add_loss(step, loss)
        for n, p in params.items():
            p -= steps_taken[n]
    if writer is not None:
        writer.close()
    return run


def _adam(moments: dict[str, tuple[np.ndarray, np.ndarray]], name: str, g: np.ndarray, t: int, lr: float
          ) -> np.ndarray:
    """Adam's step for ``name`` at its ``t``-th update (bias-corrected moments kept in ``moments``)."""
    m, v = moments.get(name, (np.zeros_like(g), np.zeros_like(g)))
    m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    moments[name] = (m, v)
    return lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-7)
