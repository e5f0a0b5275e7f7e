"""Training progress as evidence: the loss read beside the gradient records.

Labels come from how each case is built: a learning rate so small that no weight moves (twin: an ordinary one), a
loss that came down to round-off and stays there, a gradient starved at a known layer while the rest trains.
"""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import FLAGS, diagnose_run

pytestmark = pytest.mark.unit

NAMES = [f"dense_{i:02d}/{k}" for i in range(6) for k in ("kernel", "bias")]
STEPS = np.arange(1, 21) * 10


def _records(lr: float, starve: bool = False, seed: int = 0) -> np.ndarray:
    """SGD records of a 6-layer network with healthy gradients (RMS ~1e-2, weights 0.1) at learning rate ``lr``;
    ``starve``: the gradient of dense_00..dense_02 multiplied by 1e-6 throughout."""
    rng = np.random.default_rng(seed)
    out = np.empty((STEPS.size, len(NAMES), record.NUM_FIELDS))
    for s in range(STEPS.size):
        for i in range(len(NAMES)):
            g = rng.standard_normal(64) * 1e-2 * (1e-6 if starve and i < 6 else 1.0)
            w = rng.standard_normal(64) * 0.1
            out[s, i] = record.compute(g, w, lr * g, hist_sample=None)
    return out


def _loss(kind: str, scale: float = 1.0, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A loss per logged step with 1% minibatch noise: ``flat`` at 0.69, ``falling`` from 0.69 to 0.07,
    ``converged``: from 1 down to 1e-8 in five steps, then flat."""
    noise = np.exp(np.random.default_rng(seed).normal(0, 0.01, STEPS.size))
    if kind == "flat":
        loss = np.full(STEPS.size, 0.69)
    elif kind == "falling":
        loss = 0.69 * 10.0 ** -np.linspace(0, 1, STEPS.size)
    else:
        loss = np.full(STEPS.size, 1e-8)
        loss[:5] = 10.0 ** -np.linspace(0, 8, 5)
    return STEPS, scale * loss * noise


def test_a_learning_rate_too_small_to_move_the_weights_with_a_flat_loss_is_flagged():
    # lr 1e-6: every weight moves by ~1e-7 of itself per step; the loss does not move. Nothing learns.
    h = diagnose_run(NAMES, STEPS, _records(1e-6), progress=_loss("flat"))
    assert h.statuses() == ["vanishing"] * len(NAMES)
    assert any("loss did not move" in r for r in h.layers[0].reasons)
    assert h.layers[0].fixes and "learning rate" in h.layers[0].fixes[0]
    # The twin at an ordinary learning rate with the same flat loss: its layers learn, so they are not flagged here.
    assert not set(diagnose_run(NAMES, STEPS, _records(0.1), progress=_loss("flat")).statuses()) & set(FLAGS)


def _layers(lr: float, bias: float, seed: int = 0) -> np.ndarray:
    """SGD records of the same network with 64-value kernels (weights 0.1) and 8-value biases whose weights are all
    ``bias``, every gradient of RMS ~1e-2, at learning rate ``lr``."""
    rng = np.random.default_rng(seed)
    out = np.empty((STEPS.size, len(NAMES), record.NUM_FIELDS))
    for s in range(STEPS.size):
        for i, name in enumerate(NAMES):
            n = 8 if name.endswith("bias") else 64
            g = rng.standard_normal(n) * 1e-2
            w = np.full(n, bias) if name.endswith("bias") else rng.standard_normal(n) * 0.1
            out[s, i] = record.compute(g, w, lr * g, hist_sample=None)
    return out


def test_whether_a_layer_barely_learns_is_read_from_its_kernel():
    # lr 1e-2 with a flat loss: each kernel moves by ~1e-3 of itself a step, a bias set at 40 by ~2.5e-6 of itself.
    # The layers learn: none is flagged, whatever a bias far from zero says of itself.
    records = _layers(1e-2, bias=40.0)
    d = record.derived(records[-1])
    assert (d["update_to_weight"][1::2] < 1e-5).all() and (d["update_to_weight"][::2] > 1e-4).all()
    assert not set(diagnose_run(NAMES, STEPS, records, progress=_loss("flat")).statuses()) & set(FLAGS)
    # lr 1e-6: the kernels move by ~1e-7 of themselves; biases near zero (1e-6) move by ~1e-2 of themselves. Nothing
    # learns: every variable is flagged, its bias with its kernel.
    records = _layers(1e-6, bias=1e-6)
    assert (record.derived(records[-1])["update_to_weight"][1::2] > 1e-3).all()
    assert diagnose_run(NAMES, STEPS, records, progress=_loss("flat")).statuses() == ["vanishing"] * len(NAMES)


@pytest.mark.parametrize("bias", [40.0, 1e-6])
def test_the_ratio_notes_read_the_layers_figures(bias):
    # At lr 1e-2 each kernel moves by ~1e-3 of itself a step: no note. A bias at 40 moves by ~2.5e-6 of itself, one
    # near zero by ~100x itself; neither says its layer barely learns, or learns too fast.
    records = _layers(1e-2, bias=bias)
    own = record.derived(records[-1])["update_to_weight"][1::2]
    assert (own < 1e-5).all() if bias > 1 else (own > 0.1).all()
    h = diagnose_run(NAMES, STEPS, records)
    assert not [r for lh in h.layers for r in lh.reasons if "update/weight" in r]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_the_loss_times_a_constant_reads_the_same(scale):
    assert diagnose_run(NAMES, STEPS, _records(1e-6), progress=_loss("flat", scale)).statuses() == \
        ["vanishing"] * len(NAMES)


@pytest.mark.parametrize("kind", ["falling", "converged"])
def test_a_loss_that_falls_or_has_converged_is_not_stuck(kind):
    # The same tiny updates, but the network got somewhere: the loss falls, or it came down to round-off.
    h = diagnose_run(NAMES, STEPS, _records(1e-6), progress=_loss(kind))
    assert not set(h.statuses()) & set(FLAGS), h.statuses()


def test_without_a_recorded_loss_the_gradients_alone_decide():
    # A log written before the loss was recorded: no progress evidence, and tiny updates alone are not a flag.
    assert not set(diagnose_run(NAMES, STEPS, _records(1e-6)).statuses()) & set(FLAGS)


def test_a_falling_loss_is_stated_beside_a_starved_layer():
    # dense_00..02 starved by 1e-6 while the rest trains and the loss falls: still vanishing (the injection), with
    # the falling loss stated as evidence that the network learns.
    h = diagnose_run(NAMES, STEPS, _records(0.1, starve=True), progress=_loss("falling"))
    by = {lh.layer: lh for lh in h.layers}
    assert [by[n].status for n in NAMES] == ["vanishing"] * 6 + ["healthy"] * 6
    assert all(any("the loss falls" in r for r in by[n].reasons) for n in NAMES[:6])
    # at a step before the loss had fallen, no such note
    early = diagnose_run(NAMES, STEPS, _records(0.1, starve=True), progress=_loss("flat"))
    assert not any("the loss falls" in r for lh in early.layers for r in lh.reasons)


def test_a_loss_that_went_nan_is_not_a_flat_loss():
    # The same tiny updates, the loss flat and then NaN at the last step (a divergence): no "not learning" flag.
    steps, loss = _loss("flat")
    loss[-1] = np.nan
    h = diagnose_run(NAMES, STEPS, _records(1e-6), progress=(steps, loss))
    assert not set(h.statuses()) & set(FLAGS)


def test_a_loss_that_ran_away_to_nan_says_from_when_and_how_far_it_had_risen():
    # Planted: the loss rises 10x per logged step from 0.69 over the steps 10-120, then is Inf/NaN from step 130.
    steps, _ = _loss("flat")
    loss = 0.69 * 10.0 ** np.arange(steps.size, dtype=np.float64)
    loss[12] = np.inf
    loss[13:] = np.nan
    h = diagnose_run(NAMES, STEPS, _records(1e-3), progress=(steps, loss)).to_json()["summary"]
    assert h["loss_trend"] is None
    blowup = h["loss_nonfinite"]
    assert blowup["step"] == 130 and blowup["last_finite_step"] == 120
    assert blowup["last_finite"] == pytest.approx(0.69e11)
    early = np.median(loss[:3])  # the first quarter of the 12 finite values
    assert blowup["ratio"] == pytest.approx(0.69e11 / early)
    # A loss that is finite at the diagnosed step has no blow-up, even after an earlier NaN it recovered from.
    loss[13:] = 0.5
    assert diagnose_run(NAMES, STEPS, _records(1e-3), progress=(steps, loss)).to_json()["summary"][
        "loss_nonfinite"] is None
