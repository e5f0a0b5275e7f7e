"""GradientHealthCallback: the recorded gradient is the one fit() applies, in every supported set-up.

The core check: with plain SGD (no momentum) at learning rate lr, w_s = w_{s-1} - lr * g_s, so the recorded norm
of the gradient at step s must equal ||w_{s-1} - w_s|| / lr, per layer, measured from the weights a second
callback saw. Records are read back from the event files on disk (TensorBoard's loader + record.from_disk).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tensorboard.backend.event_processing.event_file_loader import EventFileLoader  # noqa: E402
from tensorboard.util import tensor_util  # noqa: E402

from tb_gradhealth import metadata, record  # noqa: E402
from tb_gradhealth._tf import blockstats, compat, gradpack  # noqa: E402
from tb_gradhealth.keras import CaptureError, GradientHealthCallback  # noqa: E402

LR = 0.1


def read_records(log_dir: str, name: str = "gradients") -> tuple[tuple[str, ...], dict[int, np.ndarray]]:
    """(layers, {step: rows [L, F]}) of the records of ``name`` under ``log_dir/train``; asserts one tag."""
    layers: tuple[str, ...] = ()
    out: dict[int, np.ndarray] = {}
    tags = set()
    for path in sorted(glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))):
        for event in EventFileLoader(path).Load():
            for value in event.summary.value:
                if not value.tag.startswith(f"{metadata.TAG_PREFIX}{name}/"):
                    continue
                tags.add(value.tag)
                if value.metadata.plugin_data.content:
                    layers = metadata.decode_content(value.metadata.plugin_data.content).layers
                assert event.step not in out, f"step {event.step} written twice"
                out[event.step] = record.from_disk(tensor_util.make_ndarray(value.tensor))
    assert len(tags) <= 1, tags
    return layers, out


def make_data(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 5)).astype("float32"), rng.standard_normal((n, 2)).astype("float32")


def make_model(seed: int = 0, **compile_kw) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)], name="net"
    )
    compile_kw.setdefault("optimizer", keras.optimizers.SGD(LR))
    model.compile(loss="mse", **compile_kw)
    return model


class WeightLog(keras.callbacks.Callback):
    """The trainable weights before training and after every train call (one entry per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []

    def on_train_begin(self, logs=None):
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])

    def on_train_batch_end(self, batch, logs=None):
        self.weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def assert_applied(rows: np.ndarray, w_before: list[np.ndarray], w_after: list[np.ndarray], rtol: float = 1e-4):
    d = record.derived(rows)
    delta = [np.linalg.norm(a.astype(np.float64) - b) for a, b in zip(w_before, w_after, strict=True)]
    np.testing.assert_allclose(d["norm"], np.array(delta) / LR, rtol=rtol)
    np.testing.assert_allclose(d["update_norm"], delta, rtol=rtol)
    np.testing.assert_allclose(d["weight_norm"], [np.linalg.norm(w.astype(np.float64)) for w in w_before], rtol=1e-5)
    assert np.all(rows[:, record.INDEX["missing"]] == 0)


def assert_records_applied(log_dir, weights: WeightLog, steps: list[int]) -> None:
    """The records under ``log_dir`` are at ``steps``, each the gradient applied at its step."""
    _, recs = read_records(str(log_dir))
    assert sorted(recs) == steps
    for s in recs:
        assert_applied(recs[s], weights.weights[s - 1], weights.weights[s])


def assert_trained_alike(alone: keras.Model, model: keras.Model) -> None:
    """The weights of a model trained with the callback are those of the same model trained without it, bit for bit."""
    for a, b in zip(alone.trainable_variables, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.tf
@pytest.mark.parametrize("jit, compiled", [(False, None), (True, None), (False, False)])
def test_recorded_gradient_is_the_applied_one(tmp_path, jit, compiled):
    x, y = make_data()
    model = make_model(jit_compile=jit)
    weights = WeightLog()
    cb = GradientHealthCallback(tmp_path, update_freq=1, compile_statistics=compiled)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[weights, cb])
    layers, recs = read_records(str(tmp_path))
    assert layers == tuple(v.path for v in model.trainable_variables)
    assert sorted(recs) == list(range(1, 9))
    for s, rows in recs.items():
        assert_applied(rows, weights.weights[s - 1], weights.weights[s])
    if jit or compiled is not None:
        return  # the life-cycle checks below are backend-independent: run them once (XLA compiles are slow)
    # The hooks are gone after fit: the optimizer is the plain class again and a later fit records nothing.
    opt = model.optimizer
    assert "_backend_update_step" not in opt.__dict__ and "_all_reduce_sum_gradients" not in opt.__dict__
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert len(read_records(str(tmp_path))[1]) == 8
    # A second fit with a new callback captures again (fresh trace), continuing the step count.
    weights2 = WeightLog()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[weights2, GradientHealthCallback(tmp_path / "again", update_freq=2)])
    _, recs2 = read_records(str(tmp_path / "again"))
    assert sorted(recs2) == [14, 16]
    assert_applied(recs2[14], weights2.weights[1], weights2.weights[2])


@pytest.mark.tf
def test_clipped_and_accumulated_gradients_are_the_applied_ones(tmp_path):
    """The record is taken after the optimizer's clipping and gradient accumulation: what w moved by."""
    x, y = make_data(16)
    model = make_model(jit_compile=False, optimizer=keras.optimizers.SGD(LR, clipnorm=0.05))
    weights = WeightLog()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[weights, GradientHealthCallback(tmp_path / "clip", update_freq=1)])
    _, recs = read_records(str(tmp_path / "clip"))
    assert sorted(recs) == [1, 2, 3, 4]
    for s, rows in recs.items():
        assert_applied(rows, weights.weights[s - 1], weights.weights[s])
        assert np.all(record.derived(rows)["norm"] <= 0.05 * (1 + 1e-5))

    model = make_model(jit_compile=False, optimizer=keras.optimizers.SGD(LR, gradient_accumulation_steps=2))
    weights = WeightLog()
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[weights, GradientHealthCallback(tmp_path / "accum", update_freq=1)])
    _, recs = read_records(str(tmp_path / "accum"))
    assert sorted(recs) == [2, 4]  # optimizer steps count micro-batches; updates happen on every second one
    for s, rows in recs.items():
        assert_applied(rows, weights.weights[s - 2], weights.weights[s])


@pytest.mark.tf
@pytest.mark.filterwarnings("ignore:.*(shuffle|ran out of data).*:UserWarning")
def test_update_freq_integer_and_epoch(tmp_path):
    x, y = make_data(40)
    model = make_model(jit_compile=False)
    log_dir = tmp_path / "every3"
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[keras.callbacks.TensorBoard(log_dir, update_freq=3, write_graph=False),
                         GradientHealthCallback(log_dir, update_freq=3)])
    assert sorted(read_records(str(log_dir))[1]) == [3, 6, 9]
    # Keras' TensorBoard callback with the same arguments writes batch_loss into the same run at the same steps
    # (from TensorFlow 2.17 on: under 2.16, Keras' own callback writes its batch scalars at other steps).
    loss_steps = {
        event.step
        for path in glob.glob(os.path.join(log_dir, "train", "events.out.tfevents.*"))
        for event in EventFileLoader(path).Load()
        for value in event.summary.value
        if value.tag == "batch_loss"
    }
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= (2, 17):
        assert loss_steps == {3, 6, 9}

    model = make_model(jit_compile=False)
    weights = WeightLog()
    model.fit(x[:16], y[:16], batch_size=4, epochs=3, shuffle=False, verbose=0,
              callbacks=[weights, GradientHealthCallback(tmp_path / "epoch", update_freq="epoch")])
    _, recs = read_records(str(tmp_path / "epoch"))
    assert sorted(recs) == [4, 8, 12]  # the last step of each epoch
    assert_applied(recs[8], weights.weights[7], weights.weights[8])

    # Unknown epoch length (a filtered dataset): the first step of each epoch. (Keras 3.15 advances the optimizer's
    # step once more in the call that finds such a dataset exhausted: count epoch starts on the device.)
    starts = []
    epoch_start = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: starts.append(int(model.optimizer.iterations.numpy()) + 1))
    ds = tf.data.Dataset.from_tensor_slices((x[:16], y[:16])).filter(lambda a, b: True).batch(4)
    model = make_model(jit_compile=False)
    model.fit(ds, epochs=3, verbose=0,
              callbacks=[epoch_start, GradientHealthCallback(tmp_path / "unknown", update_freq="epoch")])
    assert len(starts) == 3 and sorted(read_records(str(tmp_path / "unknown"))[1]) == starts
    # Integer update_freq on the same data: the host's step prediction stays in line with the device. The steps
    # that trained are those whose batch ended (the call that finds the dataset exhausted may advance the
    # optimizer's count without a batch, at the end of any epoch): every even one of them is recorded.
    model = make_model(jit_compile=False)
    trained = []
    batch_end = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: trained.append(int(model.optimizer.iterations.numpy())))
    model.fit(ds, epochs=3, verbose=0,
              callbacks=[batch_end, GradientHealthCallback(tmp_path / "unknown2", update_freq=2)])
    assert len(trained) == 12
    assert sorted(read_records(str(tmp_path / "unknown2"))[1]) == [s for s in trained if s % 2 == 0]


@pytest.mark.tf
def test_nothing_of_the_statistics_is_built_before_the_first_logged_step(tmp_path):
    """update_freq=3: the calls of steps 1 and 2 run the plain step; the statistics are traced (and so compiled)
    only in the call of step 3, the first that logs."""
    x, y = make_data(16)
    model = make_model(jit_compile=False)
    cb = GradientHealthCallback(tmp_path, update_freq=3)
    seen = []

    class Peek(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            cap = cb._capture
            seen.append((cb._book.last_mode, cap.kit.statistics.built, int(cap.kit.ring.count.numpy())))

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Peek()])
    assert seen == [("plain", 0, 0), ("plain", 0, 0), ("capture", 1, 1), ("plain", 1, 1)]
    assert sorted(read_records(str(tmp_path))[1]) == [3]


class TraceCount(keras.layers.Layer):
    """An identity layer that counts its Python calls: once per trace of a step that runs the model."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.traces = 0

    def call(self, x):
        self.traces += 1
        return x


def _counted_model(**compile_kw) -> tuple[keras.Model, TraceCount]:
    keras.utils.set_random_seed(0)
    counter = TraceCount()
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), counter,
                              keras.layers.Dense(2)], name="net")
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(LR), jit_compile=False, **compile_kw)
    return model, counter


@pytest.mark.tf
@pytest.mark.parametrize("large", [False, True], ids=["packed", "kernels_alone_in_blocks"])
def test_the_model_is_traced_once_and_fit_never_sees_the_gradients(tmp_path, large, monkeypatch):
    """One step a call: the train step is traced as often as without the callback (not a second time for the
    statistics); the records are still the applied gradients', and the logs that reach ``fit`` and the other
    callbacks hold only the model's metrics. ``large``: the kernels count as large gradients (they leave the
    step as they are, the biases packed) and the statistics run in blocks of a layer or two."""
    if large:
        monkeypatch.setattr(gradpack, "ALONE_MIN", 8)
        monkeypatch.setattr(blockstats, "BLOCK", 10)
    x, y = make_data(48)
    alone, alone_counter = _counted_model()
    alone.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model, counter = _counted_model()
    weights = WeightLog()
    seen_keys = set()
    keys = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen_keys.update(logs or {}))
    # logging every third step compiles the statistics unless told not to: the blocks are the plain-op path
    cb = GradientHealthCallback(tmp_path, update_freq=3, compile_statistics=False if large else None)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[weights, keys, cb])
    assert counter.traces == alone_counter.traces
    assert cb._capture.after_step and cb._capture.compiled is not large
    assert cb._capture.step_layout.alone == ((0, -1, 1, -1) if large else (-1,) * 4)  # kernel, bias, kernel, bias
    assert seen_keys == {"loss"}
    assert_records_applied(tmp_path, weights, [3, 6, 9, 12])
    assert_trained_alike(alone, model)


@pytest.mark.tf
def test_run_eagerly_records_the_applied_gradients(tmp_path):
    x, y = make_data(16)
    model = make_model(run_eagerly=True)
    weights = WeightLog()
    cb = GradientHealthCallback(tmp_path, update_freq=2)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[weights, cb])
    assert cb._capture.after_step
    assert_records_applied(tmp_path, weights, [2, 4])


@pytest.mark.tf
@pytest.mark.parametrize("vocabulary", [50, 80_000], ids=["small_table", "large_table"])
def test_an_embedding_gradient_comes_out_of_the_step_whole(tmp_path, vocabulary):
    """An ``IndexedSlices`` gradient (repeated tokens: duplicate slices) leaves the step as its values and indices
    and is put back together: its record is the applied gradient's, as for the dense layers beside it (the
    statistics make a 50-row table's gradient dense and keep an 80,000-row one's sparse kernel)."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 8, size=(16, 6)).astype("int32")  # few distinct tokens: many duplicate slices
    y = rng.standard_normal((16, 2)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(vocabulary, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2)])
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(LR), jit_compile=False)
    weights = WeightLog()
    cb = GradientHealthCallback(tmp_path, update_freq=2)
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[weights, cb])
    assert cb._capture.after_step and cb._capture.step_layout.sparse == (True, False, False)
    assert_records_applied(tmp_path, weights, [2, 4])


class SkipNonFinite(keras.Model):
    """A user's train step that applies its gradients inside a ``tf.cond`` (skips a non-finite step): the
    tensors of that branch cannot leave the step."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

        def apply():
            self.optimizer.apply(grads, self.trainable_variables)
            return tf.constant(True)

        tf.cond(finite, apply, lambda: tf.constant(False))
        return {"loss": loss}


@pytest.mark.tf
def test_an_update_inside_a_conditional_is_recorded_in_the_step(tmp_path, caplog):
    """The first logged call finds no gradients returned: from the next call on, the step's second variant records
    (the first logged step's record is lost, said in the log), and the records are the applied gradients'. (On
    Keras 3.0 the update's tensors are in the step's own graph: they come out, and every logged step is recorded.)"""
    x, y = make_data(32)
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    model = SkipNonFinite(inp, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inp)))
    model.compile(loss="mse", optimizer=keras.optimizers.SGD(LR), jit_compile=False)
    weights = WeightLog()
    cb = GradientHealthCallback(tmp_path, update_freq=2)
    with caplog.at_level("INFO", logger="tb_gradhealth"):
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[weights, cb])
    if cb._capture.after_step:  # Keras 3.0 runs this update in the step's own graph: its gradients come out
        assert keras.__version__.startswith("3.0.")
        assert_records_applied(tmp_path, weights, [2, 4, 6, 8])
        return
    assert any("inside a conditional" in r.getMessage() for r in caplog.records)
    assert_records_applied(tmp_path, weights, [4, 6, 8])


@pytest.mark.tf
def test_sparse_logging_computes_the_statistics_as_plain_graph_ops(tmp_path):
    """update_freq=10: nothing compiled with XLA; each record is still the applied gradient's, and training is
    exactly what it is without the callback."""
    x, y = make_data(64)
    model = make_model(jit_compile=False)
    weights = WeightLog()
    cb = GradientHealthCallback(tmp_path, update_freq=10)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[weights, cb])
    assert cb._capture.compiled is False
    assert_records_applied(tmp_path, weights, [10, 20, 30])
    alone = make_model(jit_compile=False)
    alone.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_trained_alike(alone, model)


@pytest.mark.tf
def test_steps_per_execution(tmp_path):
    x, y = make_data(48)
    reference = make_model(jit_compile=False)
    reference.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientHealthCallback(tmp_path / "ref", update_freq=1)])
    _, ref = read_records(str(tmp_path / "ref"))
    # Several logged steps inside one call (XLA while loop), and logged steps straddling call boundaries.
    for freq, expected, jit in ((1, list(range(1, 13)), True), (3, [3, 6, 9, 12], False)):
        model = make_model(jit_compile=jit, steps_per_execution=4)
        model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientHealthCallback(tmp_path / f"spe{freq}", update_freq=freq)])
        _, recs = read_records(str(tmp_path / f"spe{freq}"))
        assert sorted(recs) == expected
        for s in expected:  # same data, same initial weights: the same trajectory step by step
            np.testing.assert_allclose(record.derived(recs[s])["norm"], record.derived(ref[s])["norm"], rtol=1e-4)


@pytest.mark.tf
def test_mixed_precision_records_unscaled_gradient(tmp_path):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = make_data()
        model = make_model(jit_compile=False)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        assert float(model.optimizer.scale_loss(1.0)) > 1000  # the loss really is scaled
        weights = WeightLog()
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
                  callbacks=[weights, GradientHealthCallback(tmp_path, update_freq=1)])
    finally:
        keras.mixed_precision.set_global_policy(previous)
    _, recs = read_records(str(tmp_path))
    assert sorted(recs) == [1, 2, 3, 4]
    for s, rows in recs.items():
        assert_applied(rows, weights.weights[s - 1], weights.weights[s], rtol=1e-3)


_MIRRORED_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from tb_gradhealth import record
    from tb_gradhealth.keras import GradientHealthCallback
    sys.path.insert(0, sys.argv[2])
    from test_keras import WeightLog, make_data, read_records
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    x, y = make_data(32)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    weights = WeightLog()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[weights, GradientHealthCallback(sys.argv[1], update_freq=1)])
    _, recs = read_records(sys.argv[1])
    out = {}
    for s, rows in recs.items():
        delta = [float(np.linalg.norm(a.astype(np.float64) - b)) for a, b in zip(weights.weights[s - 1],
                 weights.weights[s])]
        out[s] = {"norm": record.derived(rows)["norm"].tolist(), "delta": delta}
    print("RESULT" + json.dumps({"replicas": strategy.num_replicas_in_sync, "records": out}))
    """
)


@pytest.mark.tf
@pytest.mark.slow
def test_mirrored_strategy(tmp_path):
    """Two logical CPU devices must be configured before TF initialises devices: run in a fresh process."""
    script = tmp_path / "mirrored.py"
    script.write_text(_MIRRORED_SCRIPT)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "logs"), os.path.dirname(__file__)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    result = json.loads(line[len("RESULT"):])
    assert result["replicas"] == 2
    records = {int(k): v for k, v in result["records"].items()}
    assert sorted(records) == [1, 2, 3, 4]
    for rec in records.values():
        np.testing.assert_allclose(rec["norm"], np.array(rec["delta"]) / LR, rtol=1e-4)


@pytest.mark.tf
def test_stop_on_nonfinite_stops_at_the_injected_step(tmp_path):
    x, y = make_data(40)
    x[5 * 4 + 1, 2] = np.nan  # a NaN in batch index 5: optimizer step 6
    model = make_model(jit_compile=False)
    cb = GradientHealthCallback(tmp_path, update_freq=1, stop_on=("nonfinite",))
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    assert int(model.optimizer.iterations.numpy()) == 6  # stopped right after the bad step
    layers, recs = read_records(str(tmp_path))
    assert sorted(recs) == list(range(1, 7))
    assert cb.stop_event is not None and cb.stop_event.step == 6 and cb.stop_event.status == "nonfinite"
    # where the replay found the NaN made (the first layer's MatMul of the NaN input), named by its largest
    # variable as the answer names it (without a replay: the deepest bad layer, which backprop meets first)
    assert cb.origin is not None and cb.origin.layer and cb.origin.direction == "forward"
    assert cb.stop_event.layer == layers[0] and layers[0].endswith(f"{cb.origin.layer}/kernel")
    assert record.derived(recs[6])["nan"].sum() > 0 and record.derived(recs[5])["nan"].sum() == 0


@pytest.mark.tf
def test_stop_on_exploding_uses_the_thresholds(tmp_path):
    x, y = make_data(40)
    y[7 * 4 : 8 * 4] = 1e5  # a huge target in batch 7: a gradient RMS far above the backstop at step 8
    model = make_model(jit_compile=False)
    cb = GradientHealthCallback(tmp_path, update_freq=1, stop_on=("exploding",),
                                thresholds={"explode_rms_above": 1e3, "explode_decades": 30, "growth_decades": 30})
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.stop_event is not None and cb.stop_event.step == 8 and cb.stop_event.status == "exploding"
    assert int(model.optimizer.iterations.numpy()) == 8
    with pytest.raises(ValueError, match="no_such_threshold"):
        GradientHealthCallback(tmp_path, stop_on=("exploding",), thresholds={"no_such_threshold": 1})


@pytest.mark.tf
def test_probe_mode_writes_at_epoch_ends_only(tmp_path):
    x, y = make_data(16)
    probe = (x[:8], y[:8])
    model = make_model(jit_compile=False)
    cb = GradientHealthCallback(tmp_path, update_freq=None, probe_data=probe)
    model.fit(x, y, batch_size=4, epochs=3, shuffle=False, verbose=0, callbacks=[cb])
    layers, recs = read_records(str(tmp_path), name="probe_gradients")
    assert sorted(recs) == [4, 8, 12]
    assert read_records(str(tmp_path))[1] == {}  # no training-gradient records with update_freq=None
    # The last probe is the gradient of the fixed batch at the final weights.
    with tf.GradientTape() as tape:
        loss = compat.compute_loss_for_inference(model, probe[0], probe[1], model(probe[0], training=False), None)
    grads = tape.gradient(loss, model.trainable_variables)
    np.testing.assert_allclose(record.derived(recs[12])["norm"], [np.linalg.norm(g.numpy()) for g in grads], rtol=1e-5)


@pytest.mark.tf
def test_custom_train_step_that_bypasses_the_optimizer_raises(tmp_path):
    class Manual(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
            for g, v in zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables, strict=True):
                v.assign_sub(0.1 * g)
            return {"loss": loss}

    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,))
    model = Manual(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse", jit_compile=False)
    x, y = make_data(16)
    with pytest.raises(CaptureError, match="summary.gradients"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[GradientHealthCallback(tmp_path)])
    assert "_backend_update_step" not in model.optimizer.__dict__


@pytest.mark.tf
def test_other_backend_and_bad_arguments_raise(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="update_freq"):
        GradientHealthCallback(tmp_path, update_freq=0)
    with pytest.raises(ValueError, match="probe_data"):
        GradientHealthCallback(tmp_path, update_freq=None)
    with pytest.raises(ValueError, match="stop_on"):
        GradientHealthCallback(tmp_path, stop_on=("healthy",))  # not a flag of the diagnosis
    assert GradientHealthCallback(tmp_path, stop_on="vanishing").stop_on == ("vanishing",)
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    with pytest.raises(CaptureError, match="Writer"):
        GradientHealthCallback(tmp_path)


@pytest.mark.tf
def test_a_log_dir_that_can_never_be_written_is_refused_at_construction(tmp_path):
    afile = tmp_path / "passwd"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory") as e:
        GradientHealthCallback(log_dir=str(afile / "gradlogs"))
    assert str(afile / "gradlogs") in str(e.value)


@pytest.mark.tf
@pytest.mark.parametrize("strict", [False, True])
def test_strict_ends_fit_on_a_failed_write_and_default_trains_on(tmp_path, monkeypatch, strict):
    from tb_gradhealth import _eventfile
    from tb_gradhealth._storage import StrictWriteError

    real_write = _eventfile.EventFile._write

    def full_disk_after_the_first_write(self, data):
        if self._started:  # the file-version record is written, then the disk is full
            raise OSError(28, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(_eventfile.EventFile, "_write", full_disk_after_the_first_write)
    x, y = make_data()
    callback = GradientHealthCallback(str(tmp_path), update_freq=1, strict=strict)
    fit = lambda: make_model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])  # noqa: E731
    if strict:
        with pytest.raises(StrictWriteError, match="No space left on device"):
            fit()
    else:
        fit()
        assert callback.dropped_records == 8  # the 4 logged steps: a record and a loss each; training went on


#: The modules of the callback's parts (a Writer, the thresholds and the like are other modules' to check).
PART_MODULES = {"keras.py": "tb_gradhealth.keras", "_tf/capture.py": "tb_gradhealth._tf.capture",
                "_stepbook.py": "tb_gradhealth._stepbook", "_tf/fit_origin.py": "tb_gradhealth._tf.fit_origin",
                "_failsafe.py": "tb_gradhealth._failsafe", "origin.py": "tb_gradhealth.origin",
                "live.py": "tb_gradhealth.live"}


def _own_objects(root) -> list:
    """Every object of the parts' classes reachable from ``root`` through attributes, lists, tuples and dicts."""
    seen, todo, out = set(), [root], []
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, np.ndarray)):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif type(obj).__module__ in PART_MODULES.values() and hasattr(obj, "__dict__"):
            out.append(obj)
            todo.extend(vars(obj).values())
    return out


@pytest.mark.tf
@pytest.mark.parametrize("setup", ["after_the_step", "conditional_update", "in_the_step"])
def test_after_a_fit_every_part_holds_only_the_attributes_its_init_sets(tmp_path, setup):
    """The callback and every object of its own it holds after a ``fit`` (the capture path, its kit, ring and
    statistics, the books, the sink, the NaN-origin search, the stop check and its live run, the probe) have the
    attributes their ``__init__`` sets, read from the source, and no others. ``after_the_step``: with a probe batch and
    ``stop_on``; ``conditional_update``: the path chosen again mid-fit (after the step, then in the step);
    ``in_the_step``: several steps a call."""
    from tb_gradhealth import keras as gh_keras
    from tests.attributes import ROOT, classes_of, init_names

    classes = {}
    for part in PART_MODULES:
        classes.update(classes_of(ROOT / part))
    x, y = make_data(32)
    if setup == "conditional_update":
        keras.utils.set_random_seed(0)
        inp = keras.Input((5,))
        model = SkipNonFinite(inp, keras.layers.Dense(2)(keras.layers.Dense(4, activation="tanh")(inp)))
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(LR), jit_compile=False)
        cb = GradientHealthCallback(tmp_path, update_freq=2)
    elif setup == "after_the_step":
        model = make_model(jit_compile=False)
        cb = GradientHealthCallback(tmp_path, update_freq=3, probe_data=(x[:4], y[:4]), stop_on="exploding")
    else:
        model = make_model(jit_compile=False, steps_per_execution=2)
        cb = GradientHealthCallback(tmp_path, update_freq=1)
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[cb])
    keras_base = keras.callbacks.Callback()
    keras_base.set_model(model)
    keras_base.set_params({"epochs": 2})
    objects = _own_objects(cb)
    kinds = {type(o).__name__ for o in objects}
    assert {"GradientHealthCallback", "CaptureKit", "Ring", "Statistics", "StepBook", "LossBook", "_RecordSink",
            "FitOrigin", "Failsafe", "_Trace"} <= kinds, kinds
    path = {"after_the_step": "AfterStep", "conditional_update": "InStep", "in_the_step": "InStep"}[setup]
    assert path in kinds or keras.__version__.startswith("3.0.")  # 3.0: that conditional's gradients come out
    assert {"StopCheck", "LiveRun", "_Rows", "_Probe"} <= kinds or setup != "after_the_step"
    for obj in objects:
        allowed = init_names(classes, type(obj).__name__)
        if isinstance(obj, keras.callbacks.Callback):
            allowed |= set(vars(keras_base))
        assert set(vars(obj)) <= allowed, (type(obj).__name__, set(vars(obj)) - allowed)
    # the path held is the one the decision function gives for this set-up (Keras 3.0 never reports the conditional
    # update: its gradients come out, so the first choice stands)
    conditional = setup == "conditional_update" and not keras.__version__.startswith("3.0.")
    again = gh_keras._choose_capture(cb._capture.kit, 2 if setup == "in_the_step" else 1,
                                     conditional_update=conditional)
    assert type(cb._capture) is type(again)
