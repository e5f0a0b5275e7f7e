"""Optimizers that change what a gradient's size means.

A layer-wise adaptive optimizer (LAMB, LARS) moves every layer by the same fraction of its weights whatever its
gradient: a gradient of 1e-12, which carries no direction above Adam's epsilon, must still be flagged. Global
gradient clipping scales every update by one factor that shrinks as the whole gradient grows: it is stated.

Labels from how each case is built (a gradient injected at 1e-12, a clip applied in the update), beside twins
without them.
"""
from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import FLAGS, diagnose_run

pytestmark = pytest.mark.unit

NAMES = [f"dense_{i:02d}/{k}" for i in range(6) for k in ("kernel", "bias")]
STEPS = np.arange(1, 13)


def _lamb(starved_grad: float | None) -> np.ndarray:
    """Every variable's update is 1e-3 of its weights (kernels of RMS 0.1, biases 0.01: scales differ); gradients
    RMS 1e-2, dense_00's at ``starved_grad`` when given."""
    rng = np.random.default_rng(0)
    out = np.empty((STEPS.size, len(NAMES), record.NUM_FIELDS))
    for s in range(STEPS.size):
        for i, name in enumerate(NAMES):
            g = rng.standard_normal(64) * (starved_grad if starved_grad and i < 2 else 1e-2)
            w = rng.standard_normal(64) * (0.1 if name.endswith("kernel") else 0.01)
            d = rng.standard_normal(64)  # LAMB: lr x ||w|| x a unit direction
            u = 1e-3 * np.linalg.norm(w) * d / np.linalg.norm(d)
            out[s, i] = record.compute(g, w, u, hist_sample=None)
    return out


def test_a_1e_12_gradient_under_lamb_is_vanishing():
    h = diagnose_run(NAMES, STEPS, _lamb(1e-12))
    by = {lh.layer: lh for lh in h.layers}
    assert by["dense_00/kernel"].status == "vanishing" and by["dense_00/bias"].status == "vanishing"
    assert all(by[n].status == "healthy" for n in NAMES[2:])
    assert any("LAMB" in r for r in by["dense_00/kernel"].reasons)


def test_its_twin_with_an_ordinary_gradient_is_healthy():
    assert not set(diagnose_run(NAMES, STEPS, _lamb(None)).statuses()) & set(FLAGS)


def _sgd(clip: float | None, per_variable: bool = False) -> np.ndarray:
    """SGD(lr 0.02) records whose whole gradient's norm wanders around 3 (as in a small MLP); ``clip``: global norm
    clipping at it (``per_variable``: each variable's gradient clipped to it, as recorded after clipping)."""
    rng = np.random.default_rng(1)
    out = np.empty((STEPS.size, len(NAMES), record.NUM_FIELDS))
    for s in range(STEPS.size):
        grads = [rng.standard_normal(64) * 0.1 * np.exp(rng.normal(0, 0.3)) for _ in NAMES]
        if per_variable and clip:
            grads = [g * min(1.0, clip / np.linalg.norm(g)) for g in grads]
        total = np.sqrt(sum(float(np.sum(g**2)) for g in grads))
        factor = 0.02 * (min(1.0, clip / total) if clip and not per_variable else 1.0)
        for i, g in enumerate(grads):
            out[s, i] = record.compute(g, rng.standard_normal(64) * 0.1, factor * g, hist_sample=None)
    return out


def _notes(recs: np.ndarray) -> list[str]:
    return [r for lh in diagnose_run(NAMES, STEPS, recs).layers for r in lh.reasons if "global gradient clip" in r]


def test_global_clipping_is_recognised_from_the_updates():
    notes = _notes(_sgd(0.05))
    assert len(notes) == len(NAMES) and "= 0.001)" in notes[0]  # lr 0.02 x clip 0.05, one note per layer
    assert not _notes(_sgd(None))  # its twin without clipping
    assert not _notes(_sgd(0.05, per_variable=True))  # per-variable clipping is a different thing
