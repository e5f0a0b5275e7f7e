"""``tb_gradhealth.jax.StepWatch`` on a real optax loop: what it decides at each logged step is ``tb-gradhealth
report --step S`` on the finished logdir; a learning rate growing 1.3x a step is halted at least two logged steps
before the first NaN loss of its twin (the same jitted step without any recording); a healthy loop is never halted;
the tags say which loop and optimizer wrote them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tb_gradhealth import reader
from tb_gradhealth.writer import Writer
from tests.live_replay import assert_live_is_replay, record_checks

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
jgh = pytest.importorskip("tb_gradhealth.jax")

pytestmark = pytest.mark.jax
STEPS, BATCH = 48, 32


def _problem(growth: float):
    """A ReLU MLP on a learnable regression, its data, and SGD (momentum 0.5) at ``1e-3 * growth**step``."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = (x @ rng.standard_normal((16, 1)) / 4 + 0.1 * rng.standard_normal((len(x), 1))).astype("float32")
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    sizes = [16, 32, 32, 32, 32, 1]
    params = {f"dense_{i}": {"kernel": jax.random.normal(keys[i], (a, b)) * jnp.sqrt(2.0 / a), "bias": jnp.zeros(b)}
              for i, (a, b) in enumerate(zip(sizes, sizes[1:], strict=False))}

    def loss_fn(p, xb, yb):
        h = xb
        for i in range(5):
            h = h @ p[f"dense_{i}"]["kernel"] + p[f"dense_{i}"]["bias"]
            h = jax.nn.relu(h) if i < 4 else h
        return jnp.mean((h - yb) ** 2)

    sgd = optax.sgd(lambda step: 1e-3 * growth ** step, momentum=0.5)
    return params, x, y, loss_fn, sgd


def _jitted(loss_fn, opt):
    """One training step of ``opt`` on ``loss_fn``, jitted: ``(params, state, loss)`` after it."""

    @jax.jit
    def step(p, s, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    return step


def _twin_losses(growth: float) -> list[float]:
    params, x, y, loss_fn, sgd = _problem(growth)
    state = sgd.init(params)
    step = _jitted(loss_fn, sgd)
    losses = []
    for i in range(STEPS):
        params, state, loss = step(params, state, x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("growth", [1.3, 1.0], ids=["diverging", "healthy"])
def test_step_watch_decides_as_the_report_reads_and_halts_a_divergence_before_its_nan(tmp_path, monkeypatch,
                                                                                       growth):
    first_nan = next((s for s, v in enumerate(_twin_losses(growth)) if not math.isfinite(v)), None)
    assert (first_nan is not None) == (growth > 1)  # the label: the twin's own loss
    params, x, y, loss_fn, sgd = _problem(growth)
    opt = jgh.recording(sgd, every=1)
    state = opt.init(params)
    step = _jitted(loss_fn, opt)
    seen = record_checks(monkeypatch)
    names = jgh.layer_names(params)
    with Writer(str(tmp_path)) as w:
        watch = jgh.StepWatch(w, names, stop_on=("nonfinite", "exploding"), optimizer="sgd", momentum=0.5)
        for i in range(STEPS):
            params, state, loss = step(params, state, x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH])
            if watch.step(state, loss=loss):
                break
            assert not watch.step(state, loss=loss)  # a record is written once, however often it is handed
    ran = i + 1
    if first_nan is None:
        assert watch.stop_event is None and ran == STEPS
    else:
        assert watch.stop_event is not None and watch.stop_event.step == i <= first_nan - 2, (i, first_nan)
    assert sorted(seen) == list(range(ran))
    assert_live_is_replay(seen, str(tmp_path))
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.steps.tolist() == list(range(ran))
    assert series.source == {"loop": "jax", "optimizer": "sgd", "momentum": "0.5"}


def test_a_stacked_record_needs_its_step(tmp_path):
    with Writer(str(tmp_path)) as w:
        watch = jgh.StepWatch(w, ["g"])
        rec = jgh.compute({"g": jnp.ones(4)})
        with pytest.raises(TypeError, match="step"):
            watch.step(rec)
        assert not watch.step(rec, step=3, loss=0.5) and watch.last_step == 3
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.steps.tolist() == [3] and series.source == {"loop": "jax"}
