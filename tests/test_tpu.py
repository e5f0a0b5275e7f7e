"""TPU host_call contract: per-shard packed records, concatenated over shards, merged and written on the host.

tf.estimator is gone from TF 2.21, so the contract is simulated: each shard's ``tensors`` come from
``tpu.host_call``, they are concatenated along axis 0 (what TPUEstimator does) and ``host_call_fn`` is called on
the result, in a tf.compat.v1 graph + session (TPUEstimator's way), eagerly, and in ``tf.function``.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.util import tensor_util

from tb_gradhealth import metadata, record

pytestmark = pytest.mark.tf

#: Bound by tests/conftest.py when a test here runs, never at collection: ``tf`` and these names.
TF_IMPORTS = {"tpu": "tb_gradhealth.tpu"}
tf: Any = None
tpu: Any = None

SHAPES = {"dense/kernel": (6, 5), "dense/bias": (5,), "out/kernel": (5, 3)}


def read_events(log_dir: str) -> dict[str, list[tuple[int, np.ndarray, bytes]]]:
    """{tag: [(step, array, plugin content)]} from every event file under ``log_dir``."""
    out: dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for v in event.summary.value:
                arr = tensor_util.make_ndarray(v.tensor)
                out.setdefault(v.tag, []).append((event.step, arr, v.metadata.plugin_data.content))
    return out


def grad_records(log_dir: str) -> tuple[str, tuple[str, ...], list[tuple[int, np.ndarray]]]:
    events = read_events(log_dir)
    tags = [t for t in events if t.startswith(metadata.TAG_PREFIX)]
    assert len(tags) == 1, events.keys()
    content = metadata.decode_content(next(c for _, _, c in events[tags[0]] if c))
    return tags[0], content.layers, [(s, record.from_disk(a)) for s, a, _ in events[tags[0]]]


def make_shards(n_shards: int, seed: int = 0) -> tuple[list[list[tuple[tf.Tensor, tf.Variable]]], list[tf.Variable]]:
    """Per-shard (grad, var) lists: one set of replicated variables, different gradients (and scales) per shard."""
    rng = np.random.default_rng(seed)
    variables = [tf.Variable(rng.normal(size=s).astype(np.float32), name=n) for n, s in SHAPES.items()]
    shards = []
    for _k in range(n_shards):
        grads = [tf.constant((rng.normal(size=s) * 10.0 ** rng.integers(-6, 3)).astype(np.float32))
                 for s in SHAPES.values()]
        shards.append(list(zip(grads, variables, strict=True)))
    return shards, variables


def expected_rows(shards: list, variables: list) -> np.ndarray:
    """record.compute over all shards' gradient values concatenated (weights: one copy per shard, as merged)."""
    rows = []
    for i, v in enumerate(variables):
        g = np.concatenate([np.ravel(s[i][0].numpy()) for s in shards])
        w = np.concatenate([np.ravel(v.numpy())] * len(shards))
        rows.append(record.compute(g, w, hist_sample=None))
    return np.stack(rows)


def assert_same_record(got: np.ndarray, want: np.ndarray) -> None:
    counts = list(record.COUNT_FIELDS) + ["hist_sample", "missing"]
    for f in counts + ["min", "max"]:
        np.testing.assert_array_equal(got[..., record.INDEX[f]], want[..., record.INDEX[f]], err_msg=f)
    np.testing.assert_array_equal(got[..., record.HIST_START:], want[..., record.HIST_START:], err_msg="histogram")
    dg, dw = record.derived(got), record.derived(want)
    for f in ("norm", "rms", "mean", "max_abs", "weight_norm", "grad_to_weight"):
        np.testing.assert_allclose(dg[f], dw[f], rtol=2e-5, atol=1e-30, err_msg=f)


def test_tensors_have_rank_at_least_one_and_leading_dim_one(tmp_path):
    shards, _ = make_shards(1)
    fn, tensors = tpu.host_call(shards[0], tf.constant(3, tf.int64), str(tmp_path),
                                {"loss": tf.constant(1.5), "learning_rate": 0.1})
    assert len(tensors) == 5  # counts, values, step, 2 scalars: never one tensor per statistic per variable
    for t in tensors:
        assert t.shape.rank >= 1 and t.shape[0] == 1, t.shape
    assert tensors[0].shape == (1, 3, record.NUM_COUNTS) and tensors[0].dtype == tf.int32
    assert tensors[1].shape == (1, 3, record.NUM_VALUES + record.HIST_BINS) and tensors[1].dtype == tf.float32
    assert tensors[2].dtype == tf.int64
    assert fn.layers == tuple(SHAPES)


@pytest.mark.parametrize("n_shards", [1, 2, 8])
def test_merged_record_equals_record_of_all_shards_values(tmp_path, n_shards):
    shards, variables = make_shards(n_shards, seed=n_shards)
    losses = [{"loss": float(k + 1)} for k in range(n_shards)]
    rows = tpu.simulate_shards(shards, 11, str(tmp_path), losses, hist_sample=None)
    want = expected_rows(shards, variables)
    assert_same_record(rows, want)
    tag, layers, written = grad_records(str(tmp_path))
    assert layers == tuple(SHAPES) and tag == metadata.tag_for(list(SHAPES))
    assert [s for s, _ in written] == [11]
    assert_same_record(written[0][1], want)
    # The record differs from shard 0's alone (the seed's [0]) whenever there is more than one shard.
    if n_shards > 1:
        assert written[0][1][0, record.INDEX["size"]] == n_shards * 30
    loss = read_events(str(tmp_path))["loss"]
    assert loss[0][0] == 11 and loss[0][1] == pytest.approx(np.mean(np.arange(1, n_shards + 1)))


def test_sampled_histograms_still_add_up(tmp_path):
    shards, variables = make_shards(4, seed=3)
    rows = tpu.simulate_shards(shards, 0, str(tmp_path), hist_sample=8, seed=1)
    want = expected_rows(shards, variables)
    finite_nonzero = want[:, record.INDEX["size"]] - want[:, record.INDEX["zero"]]
    np.testing.assert_allclose(rows[:, record.HIST_START:].sum(axis=1), finite_nonzero, rtol=1e-5)
    np.testing.assert_array_equal(rows[:, record.INDEX["hist_sample"]], 4 * np.minimum(8, [30, 5, 15]))
    np.testing.assert_array_equal(rows[:, record.INDEX["max"]], want[:, record.INDEX["max"]])


def test_nan_and_inf_in_one_shard(tmp_path):
    shards, variables = make_shards(4, seed=5)
    g = shards[2][0][0].numpy().copy()
    g[0, 0], g[1, 1], g[2, 2] = np.nan, np.inf, -np.inf
    shards[2][0] = (tf.constant(g), shards[2][0][1])
    rows = tpu.simulate_shards(shards, 2, str(tmp_path), hist_sample=None)
    want = expected_rows(shards, variables)
    assert_same_record(rows, want)
    assert rows[0, record.INDEX["nan"]] == 1 and rows[0, record.INDEX["posinf"]] == 1
    assert rows[0, record.INDEX["neginf"]] == 1 and np.all(rows[1:, record.INDEX["nan"]] == 0)
    assert np.isfinite(record.derived(rows)["norm"]).all()  # finite statistics stay usable


def test_all_reduced_gradients_keep_one_copy(tmp_path):
    shards, variables = make_shards(1, seed=11)
    rows = tpu.simulate_shards(shards * 4, 3, str(tmp_path), hist_sample=None, all_reduced=True)
    assert_same_record(rows, expected_rows(shards, variables))
    _, _, written = grad_records(str(tmp_path))
    assert_same_record(written[0][1], expected_rows(shards, variables))
    assert written[0][1][0, record.INDEX["size"]] == 30


def test_graph_mode_v1_session_writes_merged_record_and_scalar_means(tmp_path):
    shards, variables = make_shards(2, seed=7)
    arrays = [[(g.numpy(), v.numpy(), v.name.split(":")[0]) for g, v in s] for s in shards]
    scalars = [{"loss": 1.0, "learning_rate": 0.5}, {"loss": 3.0, "learning_rate": 0.5}]
    with tf.Graph().as_default():
        # Rebuild the shards as graph tensors/variables, as a model_fn would.
        graph_shards = [{n: tf.constant(g) for g, _, n in s} for s in arrays]
        rows = tpu.simulate_shards(graph_shards, 5, str(tmp_path), scalars, graph=True, hist_sample=None,
                                   record_weights=False)
    want = np.stack([record.compute(np.concatenate([np.ravel(s[i][0]) for s in arrays]), hist_sample=None)
                     for i in range(3)])
    assert_same_record(rows, want)
    _, layers, written = grad_records(str(tmp_path))
    assert layers == tuple(SHAPES)
    assert_same_record(written[0][1], want)
    events = read_events(str(tmp_path))
    assert events["loss"][0][1] == pytest.approx(2.0) and events["learning_rate"][0][1] == pytest.approx(0.5)


def test_host_call_fn_inside_tf_function(tmp_path):
    shards, variables = make_shards(2, seed=9)
    built = [tpu.host_call(s, tf.constant(4), str(tmp_path), hist_sample=None) for s in shards]
    concat = [tf.concat(list(p), axis=0) for p in zip(*(t for _, t in built), strict=True)]
    tf.function(built[0][0])(*concat)
    tpu.flush(str(tmp_path))
    _, _, written = grad_records(str(tmp_path))
    assert written[0][0] == 4
    assert_same_record(written[0][1], expected_rows(shards, variables))


def test_shard_side_compiles_under_xla(tmp_path):
    """On a TPU the shard side runs inside an XLA computation: build it in jit_compile=True, merge outside."""
    shards, variables = make_shards(2, seed=13)
    fns = []

    @tf.function(jit_compile=True)
    def shard_step(gs, loss):
        fn, tensors = tpu.host_call(list(zip(gs, variables, strict=True)), tf.constant(9, tf.int64), str(tmp_path),
                                    {"loss": loss}, hist_sample=None)
        fns.append(fn)
        return tensors

    per_shard = [shard_step([g for g, _ in s], tf.constant(float(i))) for i, s in enumerate(shards)]
    concat = [tf.concat(list(p), axis=0) for p in zip(*per_shard, strict=True)]
    fns[0](*concat)
    tpu.flush(str(tmp_path))
    _, _, written = grad_records(str(tmp_path))
    assert_same_record(written[0][1], expected_rows(shards, variables))
    assert read_events(str(tmp_path))["loss"][0][1] == pytest.approx(0.5)


def test_bad_input_fails_at_build_time(tmp_path):
    shards, variables = make_shards(1)
    gv = shards[0]
    d = str(tmp_path)
    with pytest.raises(ValueError, match="log_dir"):
        tpu.host_call(gv, 0, None)
    with pytest.raises(ValueError, match="log_dir"):
        tpu.host_call(gv, 0, "")
    with pytest.raises(ValueError, match="empty|no gradients"):
        tpu.host_call([], 0, d)
    with pytest.raises(ValueError, match="step"):
        tpu.host_call(gv, tf.constant([1, 2]), d)
    with pytest.raises(ValueError, match="step"):
        tpu.host_call(gv, tf.constant(1.5), d)
    with pytest.raises(ValueError, match="layer names"):
        tpu.host_call(gv, 0, d, layers=["a", "b"])
    with pytest.raises(ValueError, match="unique"):
        tpu.host_call(gv, 0, d, layers=["a", "a", "b"])
    with pytest.raises(ValueError, match="mismatched"):
        tpu.host_call(([g for g, _ in gv], [v for _, v in gv][:2]), 0, d)
    with pytest.raises(ValueError, match="loss"):
        tpu.host_call(gv, 0, d, {"loss": tf.zeros([3])})
    with pytest.raises(ValueError, match="mapping"):
        tpu.host_call(gv, 0, d, [tf.constant(1.0)])
    with tf.Graph().as_default():
        step = tf.compat.v1.placeholder(tf.int64, shape=[None])
        g = tf.constant(np.ones((2, 2), np.float32))
        with pytest.raises(ValueError, match="step"):
            tpu.host_call({"w": g}, step, d)
        fn, tensors = tpu.host_call({"w": g}, tf.constant(1, tf.int64), d)
        with pytest.raises(ValueError, match="scalar tensors"):
            fn(*tensors, tf.constant([1.0]))
        with pytest.raises(ValueError, match="records"):
            fn(tensors[0][:, :0], tensors[1][:, :0], tensors[2])
    with pytest.raises(ValueError, match="same layers"):
        tpu.simulate_shards([{"a": tf.ones([2])}, {"b": tf.ones([2])}], 0, d)


def test_distribute_helpers_are_also_reachable_from_tpu():
    from tb_gradhealth import distribute
    from tb_gradhealth._tf import shards

    for name in ("replica_record", "applied_record", "merge_replicas", "merge_and_write"):
        assert getattr(tpu, name) is getattr(distribute, name)
    assert tpu.merge_shards is shards.merge_shards and tpu.flush is shards.flush
