"""The TF writer: the same record as the numpy reference on every path (eager, tf.function, XLA), and event files
that TensorBoard's own data provider reads back."""

from __future__ import annotations

import math

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")


from tb_gradhealth import metadata, record, summary, testing  # noqa: E402

RNG = np.random.default_rng(0)


def _cases() -> dict[str, np.ndarray]:
    c = {f"scale_{e}": (RNG.standard_normal(300) * 10.0**e).astype(np.float32) for e in (-37, -25, -12, 0, 19, 37)}
    c["scale_0"][::7] = 0.0
    c["mixed"] = (RNG.standard_normal(300) * 10.0 ** RNG.integers(-36, 36, 300)).astype(np.float32)
    c["nonfinite"] = np.array([1.5, np.nan, np.inf, -np.inf, 0.0, -2.0, 1e-40, np.nan, 3e38], np.float32)
    c["all_nan"] = np.full(4, np.nan, np.float32)
    c["empty"] = np.zeros((0, 3), np.float32)
    c["float16"] = (RNG.standard_normal(50) * 100).astype(np.float16)
    c["float64"] = RNG.standard_normal(40) * 1e-30
    c["big_sampled"] = (RNG.standard_normal(6000) * 10.0 ** RNG.integers(-20, 20, 6000)).astype(np.float32)
    c["big_sampled"][:600] = 0
    return c


CASES = _cases()


def assert_matches_reference(mem: np.ndarray, g: np.ndarray | None, hist_sample: int, w=None) -> None:
    """One row from a TF path against record.compute: exact counts, rel 1e-5 values, histogram rule."""
    ref = record.compute(g, w, hist_sample=None)
    np.testing.assert_array_equal(mem[: record.NUM_COUNTS], ref[: record.NUM_COUNTS])
    for f in ("min", "max", "missing"):
        np.testing.assert_allclose(mem[record.INDEX[f]], ref[record.INDEX[f]], rtol=1e-6, err_msg=f)
    dm, dr = record.derived(mem), record.derived(ref)
    for f in ("max_abs", "norm", "rms", "weight_norm"):
        np.testing.assert_allclose(dm[f], dr[f], rtol=1e-5, err_msg=f)
    # the mean is stored in float32: below its smallest normal (1.2e-38) it flushes to zero like any value
    tiny = float(np.finfo(np.float32).tiny)
    np.testing.assert_allclose(dm["mean"], dr["mean"], rtol=1e-5, atol=1e-6 * float(dr["max_abs"]) + tiny)
    hist, n_nonzero = mem[record.HIST_START:], ref[record.INDEX["hist_sample"]]
    size = 0 if g is None else np.size(g)
    if size <= hist_sample:
        np.testing.assert_array_equal(hist, ref[record.HIST_START:])
        assert mem[record.INDEX["hist_sample"]] == n_nonzero
    else:
        kept = mem[record.INDEX["hist_sample"]]
        assert 0 < kept <= hist_sample
        np.testing.assert_allclose(hist.sum(), n_nonzero, rtol=1e-5)
        units = hist * kept / n_nonzero  # estimated counts = sampled counts x finite_nonzero / hist_sample
        np.testing.assert_allclose(units, np.rint(units), atol=1e-3)
        # close to the exact histogram (40 decades)
        assert np.abs(hist - ref[record.HIST_START:]).sum() / n_nonzero < 0.3
        assert not dm["hist_exact"]


def to_mem(rec: summary.DeviceRecord) -> np.ndarray:
    return record.from_device(np.asarray(rec.counts), np.asarray(rec.values))


@pytest.fixture(scope="module")
def variables():
    return {n: tf.Variable(np.ones(np.shape(g), np.float32) * 0.5, name=n) for n, g in CASES.items()}


@pytest.mark.tf
@pytest.mark.slow
def test_same_record_on_every_path(variables):
    grads = {n: tf.constant(g) for n, g in CASES.items()}
    hs = 4096

    @tf.function
    def in_function(grads):
        return summary.compute(grads, hist_sample=hs)

    @tf.function
    def ops_in_function(grads):
        return summary.compute(grads, hist_sample=hs, jit=False)

    @tf.function(jit_compile=True)
    def in_xla(grads):
        return summary.compute(grads, hist_sample=hs)

    @tf.function(jit_compile=True)
    def ops_in_xla(grads):
        return summary.compute(grads, hist_sample=hs, jit=False)

    paths = {
        "eager_xla": summary.compute(grads, hist_sample=hs, jit=True),
        "eager_graph": summary.compute(grads, hist_sample=hs),
        "eager_ops": summary.compute(grads, hist_sample=hs, jit=False),
        "function": in_function(grads),
        "function_ops": ops_in_function(grads),
        "jit_compile": in_xla(grads),
        "jit_compile_ops": ops_in_xla(grads),
    }
    for path, rec in paths.items():
        assert rec.counts.dtype == tf.int32 and rec.values.dtype == tf.float32
        assert tuple(rec.counts.shape) == (len(CASES), record.NUM_COUNTS)
        assert tuple(rec.values.shape) == (len(CASES), record.NUM_VALUES + record.HIST_BINS)
        mem = to_mem(rec)
        for i, (name, g) in enumerate(CASES.items()):
            try:
                assert_matches_reference(mem[i], g, hs)
            except AssertionError as e:
                raise AssertionError(f"{path} / {name}: {e}") from e


@pytest.mark.tf
@pytest.mark.slow
def test_large_layers_match_the_float64_reference():
    """Layers of 1M-4M values (blocked loop, ragged tail, zeros, both signs): norms within 1e-5 on every path.

    A single running float32 sum over a 1M layer is off by ~2e-4 in the norm (measured): the rows of the blocked
    loop keep it at ~1e-8.
    """
    rng = np.random.default_rng(7)
    grads = {
        "square": rng.standard_normal((1024, 1024)).astype(np.float32),
        "prime": (rng.standard_normal(1_000_003) * 1e-3 + 2e-3).astype(np.float32),
        "wide": rng.standard_normal((2048, 2048)).astype(np.float32) * 1e4,
    }
    grads["square"][::3, 5] = 0.0
    grads["prime"][-5:] = [-7.0, 0.0, 9.5, -0.0, 1e-40]  # extremes and zeros in the ragged tail
    weights = {n: rng.standard_normal(g.shape).astype(np.float32) for n, g in grads.items()}

    @tf.function(jit_compile=True)
    def in_xla(g, w):
        return summary.compute(g, w)

    tg = {n: tf.constant(g) for n, g in grads.items()}
    tw = {n: tf.constant(w) for n, w in weights.items()}
    paths = {"eager_xla": summary.compute(tg, tw, jit=True), "eager_graph": summary.compute(tg, tw),
             "jit_compile": in_xla(tg, tw),
             "eager_ops": summary.compute(tg, tw, jit=False)}
    for path, rec in paths.items():
        mem = to_mem(rec)
        for i, (name, g) in enumerate(grads.items()):
            try:
                assert_matches_reference(mem[i], g, record.DEFAULT_HIST_SAMPLE, w=weights[name])
            except AssertionError as e:
                raise AssertionError(f"{path} / {name}: {e}") from e


@pytest.mark.tf
def test_extreme_norms_in_float32_xla():
    """Norm right from 1e-37 to 1e+38 where a plain float32 sum of squares under/overflows."""
    for e in (-37.5, -30, -19, 19, 30, 37.5):
        g = np.full(1000, 10.0**e, np.float32)
        g[::2] *= -1
        for jit in (True, False):
            d = record.derived(to_mem(summary.compute({"g": g}, jit=jit))[0])
            np.testing.assert_allclose(d["norm"], math.sqrt(1000) * float(g[1]), rtol=1e-5)
            np.testing.assert_allclose(d["rms"], float(g[1]), rtol=1e-5)


@pytest.mark.tf
def test_bfloat16_and_sampling_seed():
    g = (RNG.standard_normal(40) * 3).astype(np.float32)
    rec = to_mem(summary.compute({"b": tf.cast(g, tf.bfloat16)}))[0]
    assert_matches_reference(rec, tf.cast(tf.cast(g, tf.bfloat16), tf.float32).numpy(), 4096)
    big = {"g": tf.constant(CASES["big_sampled"])}
    a = to_mem(summary.compute(big, hist_sample=256, seed=1))
    b = to_mem(summary.compute(big, hist_sample=256, seed=1))
    c = to_mem(summary.compute(big, hist_sample=256, seed=2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0, record.HIST_START:], c[0, record.HIST_START:])
    np.testing.assert_array_equal(a[0, : record.INDEX["hist_sample"]], c[0, : record.INDEX["hist_sample"]])


@pytest.mark.tf
def test_none_gradients_and_weights():
    w1 = tf.Variable(RNG.standard_normal((3, 4)).astype(np.float32), name="dense/kernel")
    w2 = tf.Variable(np.array([1e-30, -2e-30], np.float32), name="dense/bias")
    g1 = RNG.standard_normal((3, 4)).astype(np.float32)
    pairs = [(tf.constant(g1), w1), (None, w2)]
    assert summary.layer_names(pairs) == ["dense/kernel", "dense/bias"]

    @tf.function(jit_compile=True)
    def compiled():
        return summary.compute(pairs, weights=True)

    for rec in (summary.compute(pairs, weights=True), compiled()):
        mem = to_mem(rec)
        assert_matches_reference(mem[0], g1, 4096, w1.numpy())
        assert mem[1, record.INDEX["missing"]] == 1 and mem[1, record.INDEX["size"]] == 2
        np.testing.assert_allclose(record.derived(mem[1])["weight_norm"], math.sqrt(5) * 1e-30, rtol=1e-5)
    # a weight with NaN/Inf: its norm is over the finite values (fused with the gradient's loop, and not)
    bad_w = np.array([[3.0, np.nan], [np.inf, -4.0]], np.float32)
    for jit in (True, False):
        mem = to_mem(summary.compute([tf.constant(np.ones((2, 2), np.float32))], weights=[bad_w], jit=jit))[0]
        np.testing.assert_allclose(record.derived(mem)["weight_norm"], 5.0, rtol=1e-6)
        assert mem[record.INDEX["weight_max_abs"]] == 4.0
    # without weights the optional fields stay unknown
    assert math.isnan(to_mem(summary.compute(pairs))[0, record.INDEX["weight_max_abs"]])
    with pytest.raises(ValueError):
        summary.compute({"x": None})  # no variable: the size is unknown


@pytest.mark.tf
def test_indexed_slices_match_the_dense_gradient():
    table = tf.Variable(np.zeros((50, 4), np.float32), name="emb/embeddings")
    values = RNG.standard_normal((6, 4)).astype(np.float32)
    values[2] = 0.0
    cases = {
        "duplicates": tf.IndexedSlices(tf.constant(values), tf.constant([3, 7, 3, 9, 7, 3]), tf.constant([50, 4])),
        # every row touched (no implicit zeros) and duplicates: the padding must not add zeros to min/max
        "all_rows": tf.IndexedSlices(
            tf.constant(np.abs(values[:5]) + 1), tf.constant([0, 1, 0, 2, 1]), tf.constant([3, 4])
        ),
        "nonfinite": tf.IndexedSlices(
            tf.constant(np.array([[np.nan, 1, 2, np.inf]], np.float32)), tf.constant([4]), tf.constant([50, 4])
        ),
        # a table too large to be made dense (more than packed.IN_PLACE_MIN values): the sparse per-layer kernel
        "large_table": tf.IndexedSlices(tf.constant(values), tf.constant([3, 69_999, 3, 9, 7, 3]),
                                        tf.constant([70_000, 4])),
    }
    small = tf.Variable(np.zeros((3, 4), np.float32), name="small")
    large = tf.Variable(np.zeros((70_000, 4), np.float32), name="large")
    for name, sl in cases.items():
        var = {"all_rows": small, "large_table": large}.get(name, table)
        dense = tf.convert_to_tensor(sl).numpy()  # what the gradient stands for: duplicates summed
        # the large table's few values are binned whole (a sample of them is not enough): the exact histogram
        hist_sample = dense.size if name == "large_table" else 4096
        for jit in (True, False, "graph"):
            mem = to_mem(summary.compute([(sl, var)], jit=jit))[0]
            try:
                assert_matches_reference(mem, dense, hist_sample)
            except AssertionError as e:
                raise AssertionError(f"{name} jit={jit}: {e}") from e
    big = tf.IndexedSlices(tf.constant(RNG.standard_normal((300, 4)).astype(np.float32)),
                           tf.constant(RNG.integers(0, 50, 300)), tf.constant([50, 4]))
    mem = to_mem(summary.compute([(big, table)], hist_sample=64))[0]
    assert_matches_reference(mem, tf.convert_to_tensor(big).numpy(), 64)


@pytest.mark.tf
def test_layer_names_from_pairs_dicts_and_lists():
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d1"), keras.layers.Dense(1, name="d2")])
    vs = model.trainable_variables
    grads = [tf.zeros_like(v) for v in vs]
    expect = [v.path for v in vs]
    assert [n.split("/", 1)[1] for n in expect] == ["d1/kernel", "d1/bias", "d2/kernel", "d2/bias"]
    assert summary.layer_names(zip(grads, vs, strict=False)) == expect
    assert summary.layer_names((grads, vs)) == expect  # parallel lists
    assert summary.layer_names(grads, vs) == expect
    assert summary.layer_names({"a": grads[0], "b": None}) == ["a", "b"]
    assert summary.layer_names([(grads[0], tf.Variable([1.0], name="plain"))]) == ["plain"]
    assert summary.layer_names(grads[:2]) == ["layer_0", "layer_1"]
    rec = summary.compute((grads, vs))
    assert rec.counts.shape[0] == 4 and int(rec.counts[0, 4]) == 6  # all zeros


@pytest.mark.tf
def test_gradients_round_trip_through_event_files(tmp_path):
    vs = [tf.Variable(RNG.standard_normal((20, 30)).astype(np.float32), name=f"layer{i}/kernel") for i in range(2)]
    grads = [tf.constant(CASES["mixed"][:600].reshape(20, 15).repeat(2, 1)), tf.constant(np.full((20, 30), 1e-38 * 5,
                                                                                                 np.float32))]
    writer = tf.summary.create_file_writer(str(tmp_path / "fn"))
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def logged():
        with writer.as_default(step=step):
            ok = summary.gradients(zip(grads, vs, strict=False))
        step.assign_add(1)
        return ok

    for _ in range(3):
        assert bool(logged())
    writer.flush()
    # eager, default step from tf.summary.experimental.get_step()
    eager_writer = tf.summary.create_file_writer(str(tmp_path / "eager"))
    with eager_writer.as_default():
        tf.summary.experimental.set_step(11)
        summary.gradients(list(zip(grads, vs, strict=False)), name="eager", weights=False)
        with tf.summary.record_if(False):
            assert not bool(summary.gradients(list(zip(grads, vs, strict=False)), step=12, name="eager"))
    eager_writer.flush()
    got = testing.read_back(str(tmp_path))
    assert len(got) == 2
    for tag, (raw, points) in got.items():
        content = metadata.decode_content(raw)
        assert content.layers == ("layer0/kernel", "layer1/kernel")
        assert content.version == record.version_of("gradients")
        name = "eager" if "eager" in tag else "gradients"
        assert tag == metadata.tag_for(content.layers, name, step=0)  # every step here is in the first block
        assert [s for s, _ in points] == ([11] if "eager" in tag else [0, 1, 2])
        for _, t in points:
            rows = record.from_disk(t)
            for i in range(2):
                w = None if "eager" in tag else vs[i].numpy()
                assert_matches_reference(rows[i], grads[i].numpy(), 4096, w)


@pytest.mark.tf
@pytest.mark.parametrize("jit", ["cluster", "xla", "True"])
def test_an_unknown_jit_mode_is_refused(jit):
    with pytest.raises(ValueError, match="jit must be one of"):
        summary.compute([tf.ones(4)], jit=jit)


@pytest.mark.tf
def test_compute_in_jit_then_write_outside(tmp_path):
    v = tf.Variable(np.ones((4, 5), np.float32), name="k")
    writer = tf.summary.create_file_writer(str(tmp_path))

    @tf.function(jit_compile=True)
    def step_fn(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(v * x))
        g = tape.gradient(loss, v)
        return summary.compute([(g, v)], weights=True)

    @tf.function(jit_compile=True)
    def bad(x):
        with writer.as_default(step=0):
            summary.gradients([(v * x, v)])
        return x

    rec = step_fn(tf.constant(2.0))
    with writer.as_default(step=3):
        assert bool(summary.write(rec, ["k"]))
    writer.flush()
    with pytest.raises(Exception, match="return .*compute"):
        bad(tf.constant(1.0))
    ((raw, points),) = testing.read_back(str(tmp_path)).values()
    content = metadata.decode_content(raw)
    row = record.from_disk(points[0][1])[0]
    assert content.layers == ("k",) and points[0][0] == 3
    assert_matches_reference(row, np.full((4, 5), 8.0, np.float32), 4096, np.ones((4, 5), np.float32))


@pytest.mark.tf
@pytest.mark.parametrize("mode", ["eager_jit", "plain_ops", "tf_function", "xla_step"])
def test_update_as_delta_equals_the_explicit_difference(mode):
    """``Delta(before, after)`` (fused into the gradient's loop) records the same update norm as the difference
    passed as a tensor, and as the float64 reference, in every compute mode."""
    g = (RNG.standard_normal((64, 33)) * 1e-3).astype(np.float32)
    before = RNG.standard_normal((64, 33)).astype(np.float32)
    after = (before - 0.1 * g).astype(np.float32)
    diff = before - after
    ref = record.compute(g, before, diff, hist_sample=None)

    def run(update):
        kwargs = dict(weights=[before], updates=[update])
        if mode == "plain_ops":
            return summary.compute({"w": g}, jit=False, **kwargs)
        if mode == "tf_function":
            return tf.function(lambda: summary.compute({"w": g}, **kwargs))()
        if mode == "xla_step":
            return tf.function(lambda: summary.compute({"w": g}, **kwargs), jit_compile=True)()
        return summary.compute({"w": g}, **kwargs)

    fused = to_mem(run(summary.Delta(tf.constant(before), tf.constant(after))))[0]
    explicit = to_mem(run(tf.constant(diff)))[0]
    for name in ("update_max_abs", "update_ssq_rel", "weight_max_abs", "weight_ssq_rel"):
        np.testing.assert_allclose(fused[record.INDEX[name]], ref[record.INDEX[name]], rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(explicit[record.INDEX[name]], ref[record.INDEX[name]], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(record.derived(fused)["update_norm"], np.linalg.norm(diff.astype(np.float64)),
                               rtol=1e-5)


@pytest.mark.tf
def test_unknown_length_gradient_gets_a_clear_error():
    """A gradient of unknown static length (XLA needs fixed shapes) is refused with a message naming the cause."""
    f = tf.function(lambda g: summary.compute({"a": g}), input_signature=[tf.TensorSpec([None], tf.float32)])
    with pytest.raises(ValueError, match="static shape"):
        f(tf.ones([5000]))


#: A custom loop with the summary in a plain ``tf.function``; then (after the marker) the same with ``jit=True``.
#: TensorFlow logs "Compiled cluster using XLA!" once per process, at the first XLA compile: before the marker it
#: would mean the plain function compiled XLA.
_XLA_PROBE = """
import sys
import numpy as np
import tensorflow as tf
import tb_gradhealth

def loop(logdir, **options):
    v = tf.Variable(np.ones((64, 32), np.float32))
    writer = tf.summary.create_file_writer(logdir)

    @tf.function
    def step(s):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(v))
        grads = tape.gradient(loss, [v])
        with writer.as_default(step=s):
            tb_gradhealth.summary.gradients(zip(grads, [v]), **options)
        return loss

    for s in range(3):
        step(tf.constant(s, tf.int64))
    writer.flush()

loop(sys.argv[1] + "/plain")
sys.stderr.flush()
print("MARKER: jit=True from here", file=sys.stderr, flush=True)
loop(sys.argv[1] + "/jit", jit=True)
"""


@pytest.mark.tf
def test_the_summary_in_a_plain_tf_function_compiles_no_xla_unless_asked(tmp_path):
    import os
    import subprocess
    import sys

    from tb_gradhealth import reader

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _XLA_PROBE, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, marker, after = proc.stderr.partition("MARKER: jit=True from here")
    assert marker, proc.stderr[-3000:]
    assert "Compiled cluster using XLA" not in before, "a plain tf.function compiled XLA"
    assert "Compiled cluster using XLA" in after, "jit=True did not compile XLA (the log line is not there)"
    for run in ("plain", "jit"):  # both recorded every step
        assert reader.read_logdir(str(tmp_path / run)).runs[0].steps.tolist() == [0, 1, 2]


@pytest.mark.tf
def test_tf_entry_points_that_take_a_log_dir_refuse_one_that_can_never_be_written(tmp_path):
    import tb_gradhealth.tpu

    afile = tmp_path / "passwd"
    afile.write_text("x")
    shards = [{"dense/kernel": np.ones((4, 4), np.float32)} for _ in range(2)]
    with pytest.raises(NotADirectoryError, match="not a directory") as e:
        tb_gradhealth.tpu.simulate_shards(shards, 0, str(afile / "gradlogs"))
    assert str(afile / "gradlogs") in str(e.value)
    rows = tb_gradhealth.tpu.simulate_shards(shards, 0, str(tmp_path / "ok"))  # a writable one still works
    tb_gradhealth.tpu.flush(str(tmp_path / "ok"))
    assert rows.shape[0] == 1 and (tmp_path / "ok").is_dir()
