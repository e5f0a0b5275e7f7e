"""Each layer's output recorded under JAX: :func:`tb_gradhealth.jax.forward_records` of flax's
``capture_intermediates`` and of ``sow``n values, inside a jitted step, against the float64 reference of the same
arrays read back."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import reader
from tb_gradhealth.writer import Writer
from tests.forward_reference import check_against, reference

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jgh = pytest.importorskip("tb_gradhealth.jax")
nn = pytest.importorskip("flax.linen")

pytestmark = pytest.mark.jax


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(24)(x))
        self.sow("intermediates", "relu", h)
        t = jnp.tanh(nn.Dense(12)(h) * 4.0)
        self.sow("intermediates", "tanh", t)
        c = nn.Conv(5, (3, 3))(jnp.reshape(t[:, :9], (-1, 3, 3, 1)))
        return nn.Dense(2)(jnp.reshape(c, (c.shape[0], -1)))


def test_forward_records_of_flax_intermediates_in_a_jitted_step(tmp_path):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 6)), jnp.float32)
    model = Net()
    params = model.init(jax.random.PRNGKey(0), x)
    params = jax.tree_util.tree_map(lambda p: p, params)
    acts = {"relu": "relu", "tanh": "tanh"}

    @jax.jit
    def logged(p, x):
        _, state = model.apply(p, x, capture_intermediates=True, mutable=["intermediates"])
        return jgh.forward_records(state["intermediates"], activations=acts), state["intermediates"]

    stacked, inter = logged(params, x)
    names = jgh.forward_names(inter)
    assert names == ["Dense_0", "relu", "Dense_1", "tanh", "Conv_0", "Dense_2"]
    with Writer(str(tmp_path)) as w:
        w.add_gradients(3, {"params/Dense_0/kernel": np.ones((6, 24))})
        jgh.add_forward_records(w, 3, names, stacked, activations=acts)
    act = reader.read_logdir(str(tmp_path)).runs[0].activations
    assert act.layers == tuple(names) and act.steps.tolist() == [3]
    assert act.layer_info["tanh"] == ("", "tanh")
    arrays = {n: inter[n][0] if n in ("relu", "tanh") else inter[n]["__call__"][0] for n in names}
    for j, n in enumerate(names):
        bounds = (-1.0, 1.0) if n == "tanh" else None
        check_against(act.records[0, j], reference(np.asarray(arrays[n]), -1, bounds), rtol=2e-6)
    assert act.records[0, 3, 7] > 0  # the tanh driven to its bounds: some saturated


def test_forward_records_of_a_plain_dict_with_unit_axes_and_a_repeated_call():
    rng = np.random.default_rng(1)
    a = np.maximum(rng.normal(size=(4, 7, 3, 3)), 0).astype(np.float32)
    a[:, 2] = 0.0
    outputs = {"block": {"__call__": (a, a * 2)}}
    names = jgh.forward_names(outputs)
    assert names == ["block", "block#1"]
    rows = np.asarray(jgh.forward_records(outputs, unit_axis={"block": 1, "block#1": 1}))
    from tb_gradhealth import record
    mem = record.act_from_disk(rows)
    check_against(mem[0], reference(a, 1), rtol=2e-6)
    check_against(mem[1], reference(a * 2, 1), rtol=2e-6)
    assert mem[0, record.ACT_INDEX["dead"]] >= 1


def test_each_outputs_forward_record_in_a_jitted_function_matches_the_float64_reference():
    """Every edge output (NaN, Inf, huge, tiny, subnormal values, dead units, saturation), whichever branch of the
    conditional it takes inside ``jax.jit``, gets the forward record of the float64 reference."""
    from tb_gradhealth import record
    from tests.forward_reference import edge_outputs

    cases = edge_outputs()
    acts = {name: "sigmoid" for name, (_, _, bounds) in cases.items() if bounds == (0.0, 1.0)}
    axes = {name: axis for name, (_, axis, _) in cases.items()}
    stacked = jax.jit(lambda outs: jgh.forward_records(outs, activations=acts, unit_axis=axes))(
        {name: jnp.asarray(a) for name, (a, _, _) in cases.items()})
    rows = record.act_from_disk(np.asarray(stacked))
    names = jgh.forward_names({name: a for name, (a, _, _) in cases.items()})
    for name, row in zip(names, rows, strict=True):
        a, axis, bounds = cases[name]
        try:
            check_against(row, reference(a, axis, bounds), rtol=2e-6)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
