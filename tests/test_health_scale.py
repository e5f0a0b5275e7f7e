"""Verdicts that depend only on what they should: the gradient's scale, parameters that grow by design, round-off at
convergence, short runs and cause before consequence, on records built with ``record.compute``.

Every label comes from how the case is built (a factor injected at a known layer, the same training with the loss
times a constant, a parameter initialised near zero on purpose, a learning rate whose updates feed the gradient),
never from the diagnosis' output or its constants.
"""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import FLAGS, diagnose_run

pytestmark = pytest.mark.unit

NAMES = [f"dense_{i:02d}/{k}" for i in range(6) for k in ("kernel", "bias")]


def _records(grad_rms: np.ndarray, weight_rms: np.ndarray, update_rms: np.ndarray, seed: int = 0) -> np.ndarray:
    """``[S, L]`` records of Gaussian gradients, weights and updates of the given RMS (64 elements each)."""
    rng = np.random.default_rng(seed)
    s_count, l_count = grad_rms.shape
    out = np.empty((s_count, l_count, record.NUM_FIELDS))
    for s in range(s_count):
        for i in range(l_count):
            g, w, u = (rng.standard_normal(64) * x for x in (grad_rms[s, i], weight_rms[s, i], update_rms[s, i]))
            out[s, i] = record.compute(g, w, u, hist_sample=None)
    return out


def _statuses(recs: np.ndarray, at: int | None = None) -> list[str]:
    return diagnose_run(NAMES, np.arange(1, recs.shape[0] + 1), recs, at_step=at).statuses()


def _sgd_run(steps: int = 16, starve_from: int | None = None, lr: float = 0.1) -> tuple[np.ndarray, ...]:
    """Gradient, weight and SGD update RMS of a steady 6-layer network; ``starve_from``: from that step (1-based),
    the gradient behind dense_02 is multiplied by 1e-6 (dense_00..dense_02 get it)."""
    grad = np.full((steps, len(NAMES)), 1e-2) * np.exp(np.random.default_rng(3).normal(0, 0.1, (steps, len(NAMES))))
    if starve_from is not None:
        grad[starve_from - 1:, :6] *= 1e-6
    weight = np.full_like(grad, 0.1)
    return grad, weight, lr * grad


@pytest.mark.parametrize("factor", [1e-3, 1e-2, 1e-1, 1e1, 1e2, 1e3])
def test_the_same_training_with_the_loss_times_a_constant_reads_the_same(factor):
    # SGD on the loss times `factor` with the learning rate divided by it: gradients x factor, same weights/updates.
    grad, weight, update = _sgd_run(starve_from=5)
    base = [_statuses(_records(grad, weight, update), at) for at in range(1, 17)]
    scaled = [_statuses(_records(grad * factor, weight, update), at) for at in range(1, 17)]
    assert scaled == base
    # ... and the verdict is the case's: what the injection starves is vanishing, the rest healthy.
    assert base[-1] == ["vanishing"] * 6 + ["healthy"] * 6


@pytest.mark.parametrize("factor", [1e-3, 1e3])
def test_under_adam_the_loss_times_a_constant_reads_the_same(factor):
    # Adam divides the constant out: the same updates (lr-sized) whatever the gradient's scale.
    grad, weight, _ = _sgd_run(starve_from=5)
    update = np.full_like(grad, 1e-3)
    base = [_statuses(_records(grad, weight, update), at) for at in range(1, 17)]
    assert [_statuses(_records(grad * factor, weight, update), at) for at in range(1, 17)] == base
    # The layers the injection does not reach are healthy at every step.
    assert all(st[6:] == ["healthy"] * 6 for st in base)


def test_a_healthy_network_on_unnormalised_targets_is_healthy():
    # Regression on targets in units of ~300: every gradient ~100x the unit-target run's, Adam-sized updates.
    grad, weight, _ = _sgd_run()
    update = np.full_like(grad, 1e-3)
    recs = _records(grad * 3e4, weight, update)
    assert set(_statuses(recs)) == {"healthy"}


def test_parameters_initialised_near_zero_grow_by_design():
    # LayerScale gammas at 1e-6 under Adam(1e-4): updates of ~1e-4 are 100x the weight at first, then the gamma
    # grows to ~1e-2 and stays; gradients steady. Built healthy: nothing may be flagged at any step.
    steps = 20
    grad, weight, _ = _sgd_run(steps)
    update = np.full_like(grad, 1e-4)
    gamma = [1, 3]  # dense_00/bias and dense_01/bias play the gammas
    weight[:, gamma] = np.minimum(1e-6 * 10.0 ** np.arange(steps), 1e-2)[:, None]
    recs = _records(grad, weight, update)
    for at in range(1, steps + 1):
        assert not set(_statuses(recs, at)) & set(FLAGS), at
    # A weight of ordinary size moved by 20x its norm every step is a blow-up: the update rule still reads it.
    weight[:, gamma] = 0.1
    update[:, 0] = 2.0
    assert _statuses(_records(grad, weight, update))[0] == "exploding"


def test_a_converged_network_at_round_off_is_not_flagged():
    # Training brings every gradient from ~1e-2 down by seven decades in 10 steps (the loss by fourteen, to
    # float32 round-off); from then on it wanders over three decades from step to step.
    steps = 30
    rng = np.random.default_rng(5)
    grad = 1e-9 * 10.0 ** rng.uniform(-1.5, 1.5, (steps, len(NAMES)))
    grad[:10] = 1e-2 * 10.0 ** -np.linspace(0, 7, 10)[:, None]
    weight = np.ones_like(grad)
    recs = _records(grad, weight, 0.05 * grad)
    for at in range(1, steps + 1):
        assert not set(_statuses(recs, at)) & set(FLAGS), at


@pytest.mark.parametrize("logged", [1, 2, 3, 4])
def test_short_runs_flag_an_injected_starvation_and_say_how_sure(logged):
    grad, weight, update = _sgd_run(steps=logged, starve_from=1)
    recs = _records(grad, weight, update)
    h = diagnose_run(NAMES, np.arange(1, logged + 1) * 100, recs)
    assert h.statuses() == ["vanishing"] * 6 + ["healthy"] * 6
    assert h.layers[0].layer == "dense_02/bias" or h.layers[0].layer == "dense_02/kernel"  # deepest starved
    assert any("short run" in r for r in h.layers[0].reasons)


def test_a_learning_rate_that_feeds_the_gradient_is_caught_before_nan_at_any_scale():
    # SGD whose step makes the next gradient ~3x larger from step 6 (weights blown up with it), NaN at step 12.
    steps = 12
    grad, weight, _ = _sgd_run(steps, lr=5.0)
    growth = 3.0 ** np.maximum(np.arange(steps) - 4, 0)[:, None]
    grad, weight = grad * growth, weight * np.sqrt(growth)
    grad[-1] = np.nan
    for factor in (1e-3, 1.0, 1e3):
        recs = _records(grad * factor, weight, 5.0 * grad / factor * factor)  # lr compensates: the same updates
        flagged = [at for at in range(1, steps + 1) if "exploding" in _statuses(recs, at)]
        assert flagged and flagged[0] <= steps - 3, (factor, flagged)  # stop_on would halt >= 3 steps before NaN
        assert flagged[0] >= 6  # not before the rise began


def _lr_kills_relus():
    """A learning rate 100x too high: every layer explodes from step 3, and from step 6 every ReLU is dead (exact
    zeros)."""
    steps = 12
    grad, weight, _ = _sgd_run(steps, lr=5.0)
    grad[2:5] *= 10.0 ** np.arange(1, 4)[:, None]
    weight[3:] *= 100.0
    grad[5:] = 0.0
    return diagnose_run(NAMES, np.arange(1, steps + 1), _records(grad, weight, 5.0 * grad))


def test_cause_comes_first_exploding_then_dead():
    # The first row and the cause: the explosion that began it, on the deepest layer, then dead. Every layer rises
    # together, so the chain starts where a rule first fires (the whole network's gradients rising by a decade is
    # also what a healthy run's first steps can look like: no onset on its own).
    h = _lr_kills_relus()
    assert set(h.statuses()) == {"dead"}
    assert h.cause["status"] == "exploding" and h.cause["now"] == "dead" and h.cause["step"] <= 4
    assert h.layers[0].layer == h.cause["layer"] == h.first_bad["layer"] == NAMES[-1]
    assert h.cause["story"].startswith(f"exploding from step {h.cause['step']} -> dead from step")


def test_fixes_follow_the_evidence_cause_first():
    # The chain exploding -> dead (a learning rate too high) is fixed at its cause: the learning rate comes first.
    h = _lr_kills_relus()
    assert "learning rate" in h.layers[0].fixes[0] and "LeakyReLU" in " ".join(h.layers[0].fixes)
    assert h.cause["fixes"] == h.layers[0].fixes
    # A starved layer under SGD: an activation/initialisation fix and the optimizer's part.
    grad, weight, update = _sgd_run(starve_from=1)
    h = diagnose_run(NAMES, np.arange(1, 17), _records(grad, weight, update)).by_layer()
    assert "ReLU/GELU with He" in h["dense_00/kernel"].fixes[0] and "Adam" in h["dense_00/kernel"].fixes[1]
    assert h["dense_05/kernel"].fixes == []  # healthy


def test_clipping_and_layerwise_adaptive_updates_are_stated():
    # Per-variable clipping to norm 0.05: the recorded gradient of a layer whose raw gradient is larger sits at the
    # clip at every step; under LAMB every update is lr x ||w|| (here 1e-3 of the weights), whatever the gradient.
    steps = 8
    grad, weight, _ = _sgd_run(steps)
    rng = np.random.default_rng(9)
    recs = np.empty((steps, len(NAMES), record.NUM_FIELDS))
    for s in range(steps):
        for i in range(len(NAMES)):
            g = rng.standard_normal(64) * grad[s, i]
            if i == 0:
                g *= 0.05 / np.linalg.norm(g)  # clipped
            w = rng.standard_normal(64) * 0.1 * 3.0 ** (i // 2)  # weight scales differ by layer
            u = rng.standard_normal(64)
            u *= 1e-3 * np.linalg.norm(w) / np.linalg.norm(u)
            recs[s, i] = record.compute(g, w, u, hist_sample=None)
    h = diagnose_run(NAMES, np.arange(1, steps + 1), recs).by_layer()
    assert any("clipped" in r for r in h["dense_00/kernel"].reasons)
    assert not any("clipped" in r for r in h["dense_03/kernel"].reasons)
    assert all(any("layer-wise adaptive" in r for r in lh.reasons) for lh in h.values())
    # SGD's updates (lr x gradient) are not one fraction of the weights: no such note.
    plain = diagnose_run(NAMES, np.arange(1, steps + 1), _records(*_sgd_run(steps))).by_layer()
    assert not any("layer-wise" in r or "clipped" in r for lh in plain.values() for r in lh.reasons)


def test_sick_layers_next_to_the_loss_do_not_make_the_body_exploding():
    # The last two layers' gradient is starved by 1e-6, SGD: they barely move. The body (dense_00..dense_03) is
    # untouched: healthy, read against the median layer where the layers nearest the loss barely learn. The output
    # layer is vanishing; dense_04 is not, as the layer before it gets a sound gradient (the backward pass went
    # through it, so its small gradient is not one that vanished on its way back).
    grad, weight, _ = _sgd_run()
    grad[:, 8:] *= 1e-6
    h = diagnose_run(NAMES, np.arange(1, 17), _records(grad, weight, 0.1 * grad))
    assert h.statuses() == ["healthy"] * 10 + ["vanishing"] * 2
    # Without the updates the records cannot tell this from a body that explodes through depth: it says nothing
    # about the head and reads the body against it, as before.
    no_updates = _records(grad, weight, np.full_like(grad, np.nan))
    assert "vanishing" not in diagnose_run(NAMES, np.arange(1, 17), no_updates).statuses()
