"""tb_gradhealth.jax: a jitted pure function of the gradient pytree gives records equal to the float64 reference,
named by pytree paths; the optax-style wrapper records the gradient and the applied update; sharded arrays
(jit with NamedSharding, shard_map with a named axis) on 4 simulated CPU devices give the full gradient's record."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tb_gradhealth.writer import Writer
from tests.record_close import assert_records_close, extreme_cases

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jgh = pytest.importorskip("tb_gradhealth.jax")

pytestmark = pytest.mark.jax

REPO = Path(__file__).resolve().parent.parent
CASES = extreme_cases(np.random.default_rng(0))


def test_jitted_records_match_reference_named_by_pytree_paths():
    tree = {"cases": {k: jnp.asarray(v) for k, v in CASES.items()},
            "half": [jnp.asarray(CASES["normal"], jnp.float16), jnp.asarray(CASES["tiny"] * 1e30, jnp.bfloat16)],
            "f64": np.concatenate([np.random.default_rng(1).normal(size=50) * 1e300, [0.0, 1e-300]])}
    names = jgh.layer_names(tree)
    assert names[:2] == ["cases/all_nonfinite", "cases/decade_edges"] and names[-3:] == ["f64", "half/0", "half/1"]
    packed = jax.jit(lambda t: jgh.compute(t, t, hist_sample=0))(tree)
    leaves = [np.asarray(x, np.float64) if n == "f64" else np.asarray(jnp.asarray(x, jnp.float32))
              for n, x in zip(names, jax.tree_util.tree_leaves(tree), strict=True)]
    ref = np.stack([record.compute(v, v, hist_sample=None) for v in leaves])
    assert packed.shape == (len(names), record.NUM_FIELDS) and packed.dtype == jnp.float32
    assert_records_close(ref, jgh.to_memory(packed), names)


def test_a_leaf_of_millions_of_values_matches_reference():
    """A leaf of 2.1 million values whose length leaves a part row and a tail beside the bulk rows: the record of
    the whole, its magnitudes from 1e-20 to 3e30 (the scaled pass), equals the float64 reference."""
    n = 2 * (1 << 20) + 3 * 8192 + 77
    rng = np.random.default_rng(3)
    g = (rng.normal(size=n) * 1e-20).astype(np.float32)
    g[::7], g[5], g[-1] = 0.0, 3e30, -2e30
    w = rng.normal(size=n).astype(np.float32)
    packed = jax.jit(lambda a, b: jgh.compute({"g": a}, {"g": b}, hist_sample=0))(jnp.asarray(g), jnp.asarray(w))
    assert_records_close(record.compute(g, w, hist_sample=None)[None], jgh.to_memory(packed), ["g"])


def test_missing_leaf_and_updates():
    grads = {"a": jnp.arange(6.0) - 2.5, "b": None}
    params = {"a": jnp.ones(6), "b": jnp.ones((2, 3))}
    updates = {"a": -0.1 * grads["a"], "b": jnp.zeros((2, 3))}
    got = jgh.to_memory(jgh.compute(grads, params, updates, hist_sample=0))
    ref = np.stack([record.compute(np.arange(6.0) - 2.5, np.ones(6), -0.1 * (np.arange(6.0) - 2.5), hist_sample=None),
                    record.compute(None, np.ones((2, 3)), np.zeros((2, 3)), hist_sample=None)])
    assert_records_close(ref, got, ["a", "b"])
    assert got[1, record.INDEX["missing"]] == 1 and got[1, record.INDEX["size"]] == 6


def test_sampled_histogram_rule():
    rng = np.random.default_rng(2)
    g = rng.normal(size=30_000).astype(np.float32)
    g[::5] = 0.0
    g[::17] = np.inf
    f = jax.jit(lambda x, s: jgh.compute({"g": x}, hist_sample=300, seed=s))
    a, b, c = (jgh.to_memory(f(g, s))[0] for s in (4, 4, 5))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    exact = record.compute(g, hist_sample=None)
    hs = record.INDEX["hist_sample"]
    assert_records_close(np.concatenate([exact[:hs], a[hs:]]), a)  # every non-histogram field exact
    assert 0 < a[hs] < 300
    np.testing.assert_allclose(a[record.HIST_START:].sum(), exact[record.HIST_START:].sum(), rtol=1e-5)


class _SgdState(NamedTuple):
    count: Any


def _sgd(lr: float) -> Any:
    """A transformation in the optax protocol (what ``optax.sgd`` is), written here so the test needs no optax."""
    def init(params):
        return _SgdState(jnp.zeros([], jnp.int32))

    def update(grads, state, params=None):
        return jax.tree_util.tree_map(lambda g: -lr * g, grads), _SgdState(state.count + 1)

    return jgh.GradientTransformation(init, update)


def test_recording_wrapper_records_gradient_and_applied_update(tmp_path):
    params = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16, 8)), jnp.float32)
    opt = jgh.recording(_sgd(0.1), every=2, hist_sample=0)

    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p)
        u, s = opt.update(g, s, p)
        return jax.tree_util.tree_map(jnp.add, p, u), s, g, u

    names = jgh.layer_names(params)
    state = opt.init(params)
    seen = []
    with Writer(str(tmp_path), hist_sample=0) as w:
        for i in range(3):
            before = params
            params, state, g, u = step(params, state)
            at = jgh.write_state(w, state, names) if i % 2 == 0 else None
            seen.append((i, at, before, g, u))
    assert [at for _, at, *_ in seen] == [0, None, 2]
    run = reader.read_logdir(str(tmp_path)).runs[0]
    assert list(run.steps) == [0, 2] and list(run.layers) == names == ["dense/bias", "dense/kernel"]
    for row, (_, _, before, g, u) in zip(run.records, seen[::2], strict=True):
        flat = [jax.tree_util.tree_leaves(t) for t in (g, before, u)]
        ref = np.stack([record.compute(*(np.asarray(t[k]) for t in flat), hist_sample=None) for k in range(2)])
        assert_records_close(ref, row, names)


SHARDED_SCRIPT = r"""
import os, sys
import numpy as np
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tb_gradhealth import record
from tb_gradhealth import jax as jgh
from tests.record_close import assert_records_close

assert len(jax.devices()) == 4, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(5)
grads = {
    "normal": rng.normal(size=(64, 33)).astype(np.float32),
    "magnitudes": (10.0 ** rng.uniform(-38, 38, 4000) * rng.choice([-1, 1], 4000)).astype(np.float32),
    "nonfinite": np.array([1.0, np.nan, np.inf, -np.inf, 0.0, 1e-40, -2.5, 3e38, np.nan, 0.0, 7.0, -1e-30],
                          np.float32),
    "zeros_then_subnormals": np.concatenate([np.zeros(8), np.full(8, 1e-39)]).astype(np.float32),
    "big_sampled": (rng.normal(size=(400, 40)) * 1e-3).astype(np.float32),
}
grads["big_sampled"][::9, ::7] = np.nan
weights = {k: 1.0 - 2.0 * v for k, v in grads.items()}
names = jgh.layer_names(grads)
ref = np.stack([record.compute(grads[n], weights[n], hist_sample=None) for n in names])
hs = record.INDEX["hist_sample"]

# 1. jit over arrays sharded along their first axis (NamedSharding): XLA combines the shards' reductions
sharded = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in grads.items()}
wsharded = {k: jax.device_put(v, NamedSharding(mesh, P("data"))) for k, v in weights.items()}
assert all(len(v.sharding.device_set) == 4 for v in sharded.values())
got = jax.jit(lambda g, w: jgh.compute(g, w, hist_sample=0))(sharded, wsharded)
assert_records_close(ref, jgh.to_memory(got), names)

# 2. shard_map with a named axis: each device records its shard, lax.pmax/psum merge them
def local(g, w, hist_sample):
    return jgh.compute(g, w, hist_sample=hist_sample, seed=3, axis_name="data")
for hist_sample in (0, 256):
    f = jax.jit(jax.shard_map(lambda g, w: local(g, w, hist_sample), mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=P(), check_vma=False))
    got = jgh.to_memory(f(sharded, wsharded))
    if hist_sample == 0:
        assert_records_close(ref, got, names)
    else:
        mixed = np.concatenate([ref[:, :hs], got[:, hs:]], axis=1)
        assert_records_close(mixed, got, names)
        np.testing.assert_allclose(got[:, record.HIST_START:].sum(1), ref[:, record.HIST_START:].sum(1), rtol=1e-5)
        big = names.index("big_sampled")
        assert 0 < got[big, hs] <= 4 * 256, got[big, hs]

# frozen rows merge to the frozen record of the full size (missing merges to its least value, FROZEN everywhere)
f = jax.jit(jax.shard_map(lambda g, w: jgh.compute(g, w, hist_sample=0, axis_name="data", frozen={"normal": True}),
                          mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P(), check_vma=False))
got = jgh.to_memory(f(sharded, wsharded))
frozen_ref = ref.copy()
frozen_ref[names.index("normal")] = record.frozen(64 * 33)
assert_records_close(frozen_ref, got, names)
print("OK", names)
"""


@pytest.mark.e2e
def test_sharded_on_four_simulated_devices(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    assert proc.stdout.startswith("OK")


def test_recording_default_cadence_logs_the_first_steps_then_every_hundredth():
    params = {"w": jnp.ones(3)}
    opt = jgh.recording(_sgd(0.1), hist_sample=0)
    update = jax.jit(opt.update)
    state, seen = opt.init(params), []
    for _ in range(202):
        _, state = update(params, state, params)
        seen.append(int(state.recorded_at))
    assert sorted(set(seen)) == [*range(10), 100, 200]
    assert seen[15] == 9 and seen[150] == 100


def flax_mlp() -> tuple[Any, Any, Any, Any]:
    """``(model, params, x, y)``: a flax.linen MLP (Dense 16, tanh, Dense 1) and a regression batch."""
    nn = pytest.importorskip("flax.linen")

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(jnp.tanh(nn.Dense(16)(x)))

    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(32, 8)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 1)), jnp.float32)
    model = Mlp()
    return model, model.init(jax.random.PRNGKey(0), x), x, y


def test_recording_wraps_real_optax_on_a_flax_model():
    optax = pytest.importorskip("optax")
    model, params, x, y = flax_mlp()
    opt = jgh.recording(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), every=3, first=1,
                        hist_sample=0)

    @jax.jit
    def step(p, s):
        g = jax.grad(lambda q: jnp.mean((model.apply(q, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, g, u

    state = opt.init(params)
    names = jgh.layer_names(params)
    for i in range(4):
        before = params
        params, state, g, u = step(params, state)
        if i in (0, 3):
            assert int(state.recorded_at) == i
            flat = [jax.tree_util.tree_leaves(t) for t in (g, before, u)]
            ref = np.stack([record.compute(*(np.asarray(t[k]) for t in flat), hist_sample=None)
                            for k in range(len(names))])
            assert_records_close(ref, jgh.to_memory(state.record), names)
    assert names == ["params/Dense_0/bias", "params/Dense_0/kernel", "params/Dense_1/bias", "params/Dense_1/kernel"]


def test_one_nan_among_unit_values_is_counted_wherever_it_sits():
    """XLA:CPU's fast min/max may skip a NaN; the record must still count it (and not call it a zero)."""
    compute = jax.jit(lambda g: jgh.compute({"g": g}, hist_sample=4096))
    signs = np.where(np.random.default_rng(0).random(4096) < 0.5, -1.0, 1.0).astype(np.float32)
    for at in (0, 1, 7, 8, 15, 16, 31, 1000, 4095):
        x = signs.copy()
        x[at] = np.nan
        got = jgh.to_memory(compute(jnp.asarray(x)))[0]
        want = record.compute(x, hist_sample=None)
        assert got[record.INDEX["nan"]] == 1 and got[record.INDEX["zero"]] == 0, at
        assert_records_close(got, want)
