"""The fixes fit the layer: its kind and activation come from a real Keras model (what the Keras writer records,
:func:`tb_gradhealth.layerinfo.model_layer_info`), the records are the same whatever the activation, and the
chain's cause comes first. A tanh or sigmoid layer never reads rectifier advice, a ReLU layer reads the dead-unit
one, a dead tanh/sigmoid layer the saturation one, a layer whose chain began exploding the explosion's fix first."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import record
from tb_gradhealth.health import diagnose_run

pytestmark = pytest.mark.tf
TF_IMPORTS = {"keras": "keras", "layerinfo": "tb_gradhealth.layerinfo"}

RELU_WORDS = ("LeakyReLU", "relu units", "dead ReLU", "behind ReLU")
STEPS = np.arange(14)


def _model(activation: str):
    """A 4-layer Dense stack with ``activation`` in its hidden layers; the names and the kinds come from it."""
    model = keras.Sequential(  # noqa: F821 - bound by TF_IMPORTS
        [keras.Input((8,))]  # noqa: F821
        + [keras.layers.Dense(16, activation=activation, name=f"hidden_{i}") for i in range(3)]  # noqa: F821
        + [keras.layers.Dense(4, name="logits")],  # noqa: F821
        name=f"net_{activation}",
    )
    variables = model.trainable_variables
    names = [v.path for v in variables]
    info = dict(zip(names, layerinfo.model_layer_info(model, variables), strict=True))  # noqa: F821
    return names, [int(np.prod(v.shape)) for v in variables], info


def _records(names, sizes, scale) -> np.ndarray:
    """SGD-like records: ``scale(step, variable index)`` times a Gaussian, 0 for an all-zero gradient."""
    rng = np.random.default_rng(0)
    out = np.empty((STEPS.size, len(names), record.NUM_FIELDS))
    for s in STEPS:
        for i, size in enumerate(sizes):
            g = rng.standard_normal(size) * scale(int(s), i)
            w = rng.standard_normal(size) * 0.1
            out[s, i] = record.compute(g, w, -0.1 * g, hist_sample=None)
    return out


def _dead_first_layer(s: int, i: int) -> float:
    return 0.0 if i < 2 else 1e-2


def _vanishing_first_layer(s: int, i: int) -> float:
    return 1e-9 if i < 2 else 1e-2


def _exploding_then_dead(s: int, i: int) -> float:
    """Every layer grows 10x a step from step 3 (a learning rate far too high); from step 9 the first layer's
    gradient is all zero (its units saturated or died)."""
    if i < 2 and s >= 9:
        return 0.0
    return 1e-3 * 10.0 ** min(max(0, s - 3), 6)


def _layer(h, name):
    return h.by_layer()[name]


@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
def test_a_dead_saturating_layer_gets_the_saturation_fix_never_relu_advice(activation):
    names, sizes, info = _model(activation)
    assert info[names[0]] == ("Dense", activation)  # what the Keras writer records
    h = diagnose_run(names, STEPS, _records(names, sizes, _dead_first_layer), layer_info=info)
    lh = _layer(h, names[0])
    assert lh.status == "dead"
    assert f"{activation} units are saturated" in lh.fixes[0]
    assert not any(w in f for f in lh.fixes for w in RELU_WORDS), lh.fixes
    assert not any("ReLU" in r or "relu" in r for r in lh.reasons), lh.reasons  # nor in the why


def test_a_dead_relu_layer_gets_the_dead_unit_fix():
    names, sizes, info = _model("relu")
    h = diagnose_run(names, STEPS, _records(names, sizes, _dead_first_layer), layer_info=info)
    lh = _layer(h, names[0])
    assert lh.status == "dead" and "relu units are dead" in lh.fixes[0] and "LeakyReLU" in lh.fixes[0]
    assert not any("saturated" in f for f in lh.fixes)


def test_a_vanishing_sigmoid_layer_gets_the_saturating_activation_fix():
    names, sizes, info = _model("sigmoid")
    h = diagnose_run(names, STEPS, _records(names, sizes, _vanishing_first_layer), layer_info=info)
    lh = _layer(h, names[0])
    assert lh.status == "vanishing" and "uses sigmoid, which saturates" in lh.fixes[0]
    assert not any(w in f for f in lh.fixes for w in RELU_WORDS)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_a_chain_that_began_exploding_gets_the_explosions_fix_first(activation):
    names, sizes, info = _model(activation)
    h = diagnose_run(names, STEPS, _records(names, sizes, _exploding_then_dead), layer_info=info)
    lh = _layer(h, names[0])
    assert lh.status == "dead" and lh.episodes[0]["status"] == "exploding", lh.episodes
    assert lh.fixes[0].startswith("lower the learning rate"), lh.fixes
    dead_fix = "tanh units are saturated" if activation == "tanh" else "relu units are dead"
    assert any(dead_fix in f for f in lh.fixes[1:]), lh.fixes
    if activation == "tanh":
        assert not any(w in f for f in lh.fixes for w in RELU_WORDS), lh.fixes
    assert h.answer is not None and h.answer["fixes"] == h.layers[0].fixes


def test_without_layer_info_the_dead_fix_names_both_conditions():
    names, sizes, _ = _model("tanh")
    h = diagnose_run(names, STEPS, _records(names, sizes, _dead_first_layer))
    fix = _layer(h, names[0]).fixes[0]
    assert "rectifiers that died" in fix and "saturated tanh/sigmoid" in fix
