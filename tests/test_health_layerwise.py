"""A layer-wise adaptive optimizer (LAMB, LARS) moves every layer by the same fraction of its weights whatever its
gradient: a gradient of 1e-12, which carries no direction above Adam's epsilon, must still be flagged.

Labels from how the case is built: one layer's gradient injected at 1e-12, beside its twin with an ordinary one.
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
