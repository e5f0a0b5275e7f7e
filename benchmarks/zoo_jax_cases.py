"""The zoo's JAX loops (``benchmarks/diagnosis_zoo.py``): fine-tuning a head on a frozen backbone with flax and optax,
recorded at every step by :func:`tb_gradhealth.jax.recording` around the optimizer, trained in a child process
(``benchmarks/zoo_child.py``).

The backbone is frozen the optax way: ``optax.multi_transform`` gives its parameters ``optax.set_to_zero()``, so
``jax.grad`` still computes their gradients (live, recorded as such) while the applied update is exactly zero.
Labels come from measurements (``benchmarks/zoo_measure.py``): the frozen weights bitwise unchanged, every head
parameter moved, the loss falls. JAX, flax and optax are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import zoo_cases, zoo_heldout, zoo_measure
from benchmarks.zoo_cases import CLASSES, image_data, teacher_data
from benchmarks.zoo_child import case
from benchmarks.zoo_measure import Trace

FROZEN_RULE = ("healthy: a flax backbone trained for {warm} steps on one task (SGD with momentum), then frozen with "
               "optax.multi_transform (optax.set_to_zero for the backbone: its gradients are computed, its update is "
               "zero) while a new head learns another task under {optimizer}({lr:g}); frozen parameters measured "
               "bitwise unchanged (labelled frozen), every head parameter moved and the loss falls (checked)")


def _model(conv: bool) -> Any:
    from flax import linen as nn

    class Net(nn.Module):
        """A backbone (two Dense layers, or two convolutions pooled to the image's quadrants) and a Dense head."""

        @nn.compact
        def __call__(self, x: Any) -> Any:
            if conv:
                h = nn.relu(nn.Conv(16, (3, 3), name="backbone_0")(x))
                h = nn.relu(nn.Conv(32, (3, 3), name="backbone_1")(h))
                b, hh, ww, c = h.shape
                h = h.reshape(b, 2, hh // 2, 2, ww // 2, c).mean(axis=(2, 4)).reshape(b, -1)
            else:
                h = nn.relu(nn.Dense(64, name="backbone_0")(x))
                h = nn.relu(nn.Dense(64, name="backbone_1")(h))
            return nn.Dense(CLASSES, name="head")(h)

    return Net()


def _flat(tree: Any) -> dict[str, np.ndarray]:
    import jax

    from tb_gradhealth import jax as tgh

    return dict(zip(tgh.layer_names(tree), (np.asarray(v, np.float64) for v in jax.tree_util.tree_leaves(tree)),
                    strict=True))


def _state(g: np.ndarray) -> str:
    return "nonfinite" if not np.isfinite(g).all() else "zero" if not g.any() else "live"


def _finetune(log_dir: str, *, conv: bool, seed: int, data: Callable[[int], tuple[np.ndarray, np.ndarray]],
              optimizer: str, lr: float, warm: int, steps: int, rule: str, batch: int = 32) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    from tb_gradhealth import jax as tgh
    from tb_gradhealth.writer import Writer

    model = _model(conv)
    x0, y0 = data(0)
    params = model.init(jax.random.PRNGKey(seed), jnp.asarray(x0[:1]))

    def loss_fn(p: Any, xb: Any, yb: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    warm_tx = optax.sgd(0.05, momentum=0.9)
    warm_state = warm_tx.init(params)
    for s in range(warm):
        i = (s * batch) % len(x0)
        _, g = grad_fn(params, x0[i:i + batch], y0[i:i + batch])
        upd, warm_state = warm_tx.update(g, warm_state, params)
        params = optax.apply_updates(params, upd)
    # a new head for the new task; the backbone keeps what it learned
    fresh = model.init(jax.random.PRNGKey(seed + 1), jnp.asarray(x0[:1]))
    params = {"params": {**params["params"], "head": fresh["params"]["head"]}}
    labels = jax.tree_util.tree_map_with_path(
        lambda path, _: "train" if any(getattr(k, "key", None) == "head" for k in path) else "freeze", params)
    tx = tgh.recording(optax.multi_transform({"train": getattr(optax, optimizer)(lr), "freeze": optax.set_to_zero()},
                                             labels), every=1)
    state = tx.init(params)
    names = tgh.layer_names(params)
    frozen = [n for n, lab in zip(names, jax.tree_util.tree_leaves(labels), strict=True) if lab == "freeze"]

    @jax.jit
    def step(p: Any, st: Any, xb: Any, yb: Any) -> Any:
        value, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        upd, st = tx.update(g, st, p)
        return optax.apply_updates(p, upd), st, value, g

    x1, y1 = data(1)
    writer = Writer(log_dir)
    trace = Trace(names=names)
    trace.w_start = list(_flat(params).values())
    for s in range(steps):
        i = (s * batch) % len(x1)
        before = _flat(params)
        params, state, value, g = step(params, state, x1[i:i + batch], y1[i:i + batch])
        after = _flat(params)
        at = tgh.write_state(writer, state, names)
        writer.add_loss(at, float(value))
        trace.add(at, float(value), [_state(v) for v in _flat(g).values()],
                  [float(np.linalg.norm(w)) for w in before.values()],
                  [float(np.linalg.norm(after[n] - w) / np.linalg.norm(w)) if np.linalg.norm(w) > 0 else 0.0
                   for n, w in before.items()])
    writer.close()
    trace.w_end = list(_flat(params).values())
    return zoo_measure.healthy_labels(trace, rule, frozen=frozen)


def _finetune_case(half: dict, name: str, *, conv: bool, seed: int, optimizer: str, lr: float, warm: int,
                   steps: int = 120) -> None:
    rule = FROZEN_RULE.format(warm=warm, optimizer=optimizer, lr=lr) + f" ({'conv' if conv else 'MLP'} backbone)"

    def data(task: int) -> tuple[np.ndarray, np.ndarray]:
        if conv:
            x, y = image_data(40 * 32, seed + task, 16)
            return x, (y + task) % CLASSES  # task 1 relabels the quadrants
        return teacher_data(40 * 32, seed + task)

    case(half, name, rule)(lambda log_dir: _finetune(log_dir, conv=conv, seed=seed, data=data, optimizer=optimizer,
                                                     lr=lr, warm=warm, steps=steps, rule=rule))


_finetune_case(zoo_cases.CASES, "jax_frozen_backbone_mlp", conv=False, seed=601, optimizer="adam", lr=1e-2, warm=100)
_finetune_case(zoo_heldout.CASES, "jax_frozen_backbone_conv", conv=True, seed=607, optimizer="adamw", lr=1e-2,
               warm=150)
