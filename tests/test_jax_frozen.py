"""Frozen parameters under JAX: ``compute(..., frozen=)`` and ``add_records(..., frozen=)`` give the named leaves
the frozen record; ``recording`` finds the leaves its optax optimizer never updates from the optimizer's structure
(flax's recipe: ``multi_transform`` with ``set_to_zero``), not from an update that happens to be zero."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import cli, reader, record
from tb_gradhealth.writer import Writer
from tests.record_close import assert_records_close
from tests.test_jax import flax_mlp

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jgh = pytest.importorskip("tb_gradhealth.jax")

pytestmark = pytest.mark.jax

MISSING = record.INDEX["missing"]


def _tree() -> tuple[dict, dict]:
    rng = np.random.default_rng(0)
    params = {"backbone": {"kernel": rng.normal(size=(6, 5)), "bias": rng.normal(size=5)},
              "head": {"kernel": rng.normal(size=(5, 1)), "bias": np.zeros(1)}}
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), params)
    grads = jax.tree_util.tree_map(lambda a: a * 1e-2 - 3e-3, params)
    return params, grads


@pytest.mark.parametrize("frozen", [{"backbone": True}, {"backbone": {"kernel": True, "bias": True}},
                                    lambda name: name.startswith("backbone/")],
                         ids=["prefix_mask", "leaf_mask", "predicate"])
def test_compute_gives_the_masked_leaves_the_frozen_record(frozen):
    params, grads = _tree()
    names = jgh.layer_names(grads)
    got = jgh.to_memory(jax.jit(lambda g, p: jgh.compute(g, p, hist_sample=0, frozen=frozen))(grads, params))
    ref = np.stack([record.frozen(np.size(params[a][b])) if a == "backbone"
                    else record.compute(np.asarray(grads[a][b]), np.asarray(params[a][b]), hist_sample=None)
                    for a, b in (n.split("/") for n in names)])
    assert_records_close(ref, got, names)
    assert got[:, MISSING].tolist() == [record.FROZEN, record.FROZEN, 0, 0]


def test_frozen_must_be_a_static_mask_or_a_predicate_of_bools():
    params, grads = _tree()
    with pytest.raises(TypeError, match="predicate must return a bool.*'backbone/bias'"):
        jgh.compute(grads, frozen=lambda name: name)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda g, m: jgh.compute(g, frozen=m))(grads, {"backbone": jnp.asarray(True)})


def test_add_records_fills_frozen_rows_on_the_host(tmp_path):
    params, grads = _tree()
    names = jgh.layer_names(grads)
    stacked = jgh.compute(grads, params, hist_sample=0)
    with Writer(str(tmp_path), hist_sample=0) as w:
        jgh.add_records(w, 3, names, stacked, frozen={"head": {"bias": True}})
    got = reader.read_logdir(str(tmp_path)).runs[0].records[0]
    ref = jgh.to_memory(stacked)
    ref[names.index("head/bias")] = record.frozen(1)
    assert_records_close(ref, got, names)


def _flax_finetune(tmp_path, tx_for_labels):
    """A flax.linen MLP whose first layer is frozen by the optimizer ``tx_for_labels(labels)`` (labels from flax's
    ``traverse_util.path_aware_map``), trained under ``recording`` for 6 logged steps; returns the reference rows by
    step, the logdir's run and the params before and after."""
    optax = pytest.importorskip("optax")
    traverse_util = pytest.importorskip("flax.traverse_util")
    model, params, x, y = flax_mlp()
    labels = traverse_util.path_aware_map(lambda path, _: "frozen" if "Dense_0" in path else "trainable", params)
    opt = jgh.recording(tx_for_labels(optax, labels), every=1, hist_sample=0)
    loss_fn = jax.jit(lambda q: jnp.mean((model.apply(q, x) - y) ** 2))

    @jax.jit
    def step(p, s):
        g = jax.grad(loss_fn)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g, u

    names = jgh.layer_names(params)
    state, start, refs = opt.init(params), params, []
    with Writer(str(tmp_path), hist_sample=0) as w:
        for i in range(6):
            before = params
            params, state, g, u = step(params, state)
            jgh.write_state(w, state, names)
            w.add_loss(i, float(loss_fn(before)))
            flat = [jax.tree_util.tree_leaves(t) for t in (g, before, u)]
            refs.append(np.stack([record.frozen(flat[0][k].size) if "Dense_0" in n else
                                  record.compute(*(np.asarray(t[k]) for t in flat), hist_sample=None)
                                  for k, n in enumerate(names)]))
    return refs, reader.read_logdir(str(tmp_path)).runs[0], start, params


def test_recording_finds_flax_frozen_layers_from_the_optimizer_and_reports_ok(tmp_path, capsys):
    def tx(optax, labels):  # flax's recipe for frozen layers, behind a clipping transformation
        return optax.chain(optax.clip_by_global_norm(1.0),
                           optax.multi_transform({"trainable": optax.adam(1e-2), "frozen": optax.set_to_zero()},
                                                 labels))

    refs, run, start, end = _flax_finetune(tmp_path, tx)
    assert not run.problems and list(run.steps) == list(range(6))
    for ref, rows in zip(refs, run.records, strict=True):
        assert_records_close(ref, rows, list(run.layers))
    frozen = {n for n, r in zip(run.layers, run.records[-1], strict=True) if r[MISSING] == record.FROZEN}
    assert frozen == {"params/Dense_0/bias", "params/Dense_0/kernel"}
    for layer in ("Dense_0", "Dense_1"):  # measured: the frozen layer never moved, the other did
        moved = [not np.array_equal(start["params"][layer][k], end["params"][layer][k]) for k in ("kernel", "bias")]
        assert moved == [layer == "Dense_1"] * 2, layer
    assert cli.main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ok, 0 of 4 layers flagged (2 frozen)" in out, out


@pytest.mark.parametrize("case, frozen", [
    ("freeze", True), ("masked_zero", True), ("zero_then_schedule", True), ("partition", True),
    ("masked_adam", False), ("adam", False), ("zero_learning_rate", False),
])
def test_recording_reads_frozen_from_the_optimizer_structure(case, frozen):
    """optax's ways to freeze a subtree are found; a transformation that passes the gradient through, or a zero
    learning rate (a value, not the structure), freezes nothing."""
    optax = pytest.importorskip("optax")
    params, grads = _tree()
    mask = {"backbone": {"kernel": True, "bias": True}, "head": {"kernel": False, "bias": False}}
    labels = jax.tree_util.tree_map(lambda m: "frozen" if m else "train", mask)
    zero_lr = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    tx = {
        "freeze": lambda: optax.transforms.freeze(mask),
        "masked_zero": lambda: optax.chain(optax.adam(1e-3), optax.masked(optax.set_to_zero(), mask)),
        "zero_then_schedule": lambda: optax.chain(
            optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels),
            optax.scale_by_schedule(lambda count: 0.1 / (1 + count))),
        "partition": lambda: optax.partition({"train": optax.sgd(1e-2), "frozen": optax.set_to_zero()}, labels),
        "masked_adam": lambda: optax.masked(optax.adam(1e-3), mask),  # the unmasked leaves take the raw gradient
        "adam": lambda: optax.adam(1e-3),
        "zero_learning_rate": lambda: zero_lr,
    }[case]()
    opt = jgh.recording(tx, hist_sample=0)
    _, state = jax.jit(opt.update)(grads, opt.init(params), params)
    got = jgh.to_memory(state.record)[:, MISSING]
    assert got.tolist() == ([record.FROZEN] * 2 if frozen else [0, 0]) + [0, 0]
