"""A layer's kind and activation (from its writer's model) in the reasons and the fixes.

The records are the same in every case; only what the metadata says about the layers changes, so each expected
fix follows from the activation the case declares.
"""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import diagnose_run

pytestmark = pytest.mark.unit

NAMES = [f"dense_{i:02d}/{k}" for i in range(6) for k in ("kernel", "bias")]
STEPS = np.arange(1, 11)


def _records(factor: float) -> np.ndarray:
    """SGD records of a 6-layer network whose first three layers' gradient is ``factor`` times the rest's
    (1e-6: starved; 0: cut)."""
    rng = np.random.default_rng(0)
    out = np.empty((STEPS.size, len(NAMES), record.NUM_FIELDS))
    for s in range(STEPS.size):
        for i in range(len(NAMES)):
            g = rng.standard_normal(64) * 1e-2 * (factor if i < 6 else 1.0)
            out[s, i] = record.compute(g, rng.standard_normal(64) * 0.1, 0.1 * g, hist_sample=None)
    return out


def _info(act: str) -> dict[str, tuple[str, str]]:
    return {n: ("Dense", act) for n in NAMES}


def test_vanishing_through_sigmoid_layers_suggests_a_non_saturating_activation():
    h = diagnose_run(NAMES, STEPS, _records(1e-6), layer_info=_info("sigmoid"))
    top = h.layers[0]
    assert top.status == "vanishing" and top.index < 6
    assert "sigmoid" in top.fixes[0] and "ReLU" in top.fixes[0]
    assert any(r == "layer: Dense, activation sigmoid" for r in top.reasons)


def test_vanishing_through_relu_layers_does_not_blame_the_activation():
    top = diagnose_run(NAMES, STEPS, _records(1e-6), layer_info=_info("relu")).layers[0]
    assert top.status == "vanishing"
    assert "does not saturate" in top.fixes[0] and not any("ReLU/GELU" in f for f in top.fixes)


def test_dead_relu_units_get_the_relu_fix():
    top = diagnose_run(NAMES, STEPS, _records(0.0), layer_info=_info("relu")).layers[0]
    assert top.status == "dead" and "relu units are dead" in top.fixes[0]


def test_without_layer_info_the_fix_names_the_condition():
    # A log written without the metadata: the generic suggestion, which names the condition it depends on.
    top = diagnose_run(NAMES, STEPS, _records(1e-6)).layers[0]
    assert top.status == "vanishing" and top.fixes[0].startswith("if the activations saturate")
    assert not any(r.startswith("layer: ") for r in top.reasons)
