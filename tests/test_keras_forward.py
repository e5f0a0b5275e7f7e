"""GradientHealthCallback(activations=True): each layer's output of the steps ``fit`` runs, recorded in the step, equal
to the float64 reference of the outputs computed here from the weights before the step and the step's batch (or
read by a model of the layers' outputs before the step), on every capture path: after the step, in the step
(XLA, several steps a call); Sequential, functional and subclassed models."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

from tb_gradhealth import reader, record  # noqa: E402
from tb_gradhealth._tf import compat  # noqa: E402
from tb_gradhealth.keras import GradientHealthCallback  # noqa: E402
from tests.forward_reference import check_against, edge_outputs, reference  # noqa: E402

pytestmark = pytest.mark.tf

TANH = (-1.0, 1.0)
ACT = {"relu": lambda z: np.maximum(z, 0.0), "tanh": np.tanh, "linear": lambda z: z}


def check_close(rec: np.ndarray, out: np.ndarray, unit_axis: int = -1, bounds=None, rtol: float = 1e-5) -> None:
    """``rec`` is the forward record of ``out`` (float64, computed here as the step did in float32): counts equal,
    the saturated count up to the values within float32 rounding of a bound's edge, the rest to ``rtol``."""
    ref = reference(out, unit_axis, bounds)
    d = record.act_derived(rec)
    for name in ("size", "nonfinite", "units", "dead"):
        assert d[name] == ref[name], name
    assert rec[record.ACT_INDEX["zero"]] == ref["zero"]
    for name in ("min", "max", "rms", "mean"):
        np.testing.assert_allclose(d[name], ref[name], rtol=rtol, atol=rtol * ref["max_abs"], err_msg=name)
    if bounds is not None:
        lo, hi = bounds
        edges = np.array([lo + 0.01 * (hi - lo), hi - 0.01 * (hi - lo)])
        near = int(np.sum(np.abs(np.ravel(out)[:, None] - edges) < 1e-5))
        assert abs(rec[record.ACT_INDEX["saturated"]] - ref["saturated"]) <= near


def make_mlp(**compile_kw) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)], name="net")
    dense = model.layers[0]
    dense.bias.assign(np.r_[np.full(5, -50.0), np.zeros(11)].astype("float32"))  # five units dead for any input
    model.layers[1].kernel.assign(model.layers[1].kernel * 6.0)  # tanh driven towards its bounds
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", **compile_kw)
    return model


def data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 2)).astype("float32")


class Weights(keras.callbacks.Callback):
    """The trainable weights before every train call."""

    def __init__(self) -> None:
        super().__init__()
        self.before: list[list[np.ndarray]] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.before.append([v.numpy().astype(np.float64) for v in self.model.trainable_variables])


def mlp_outputs(weights: list[np.ndarray], x: np.ndarray) -> list[np.ndarray]:
    """The MLP's layer outputs, in float64 from the weights as given."""
    outs, h = [], x.astype(np.float64)
    for (k, b), act in zip(zip(weights[::2], weights[1::2], strict=True), ("relu", "tanh", "linear"), strict=True):
        h = ACT[act](h @ k + b)
        outs.append(h)
    return outs


def fit_mlp(log_dir, *, update_freq, batch=8, epochs=2, weights=None, **compile_kw):
    model = make_mlp(**compile_kw)
    x, y = data()
    callbacks = [GradientHealthCallback(log_dir, update_freq=update_freq, activations=True)]
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
              callbacks=([weights] if weights is not None else []) + callbacks)
    return model, x, reader.read_logdir(str(log_dir)).runs[0]


@pytest.mark.parametrize("path, compile_kw, update_freq",
                         [("after the step", {}, 3), ("in the step, XLA", {"jit_compile": True}, 1)])
def test_the_layers_outputs_of_logged_steps_are_recorded(tmp_path, path, compile_kw, update_freq):
    weights = Weights()
    model, x, run = fit_mlp(tmp_path, update_freq=update_freq, weights=weights, **compile_kw)
    act = run.activations
    assert not run.problems and act.steps.tolist() == run.steps.tolist()
    assert act.steps.tolist() == list(range(update_freq, 17, update_freq))
    paths = [compat.layer_path(layer) for layer in model.layers]  # Keras 3.0's layers have a name and no path
    prefix = "net/dense" if hasattr(model.layers[0], "path") else "dense"
    assert list(act.layers) == paths and paths[0].startswith(prefix)
    assert [act.layer_info[p] for p in paths] == [("Dense", "relu"), ("Dense", "tanh"), ("Dense", "")]
    for k, step in enumerate(act.steps.tolist()):  # step s: the s-th batch, from the weights before it
        b = (step - 1) % 8
        outs = mlp_outputs(weights.before[step - 1], x[b * 8:(b + 1) * 8])
        for j, (out, bounds) in enumerate(zip(outs, (None, TANH, None), strict=True)):
            check_close(act.records[k, j], out, bounds=bounds, rtol=1e-4 if compile_kw else 1e-5)
        assert act.records[k, 0, record.ACT_INDEX["dead"]] >= 5 and act.records[k, 1, record.ACT_INDEX["saturated"]]
    for layer in model.layers:  # the hooks are gone after fit
        assert "call" not in layer.__dict__


def test_several_steps_a_call_record_the_trajectory_of_one_step_a_call(tmp_path):
    _, _, one = fit_mlp(tmp_path / "one", update_freq=1, epochs=1, batch=4)
    _, _, four = fit_mlp(tmp_path / "four", update_freq=3, epochs=1, batch=4, steps_per_execution=4)
    assert four.activations.steps.tolist() == [3, 6, 9, 12, 15]
    rows = one.activations.records[[s - 1 for s in four.activations.steps.tolist()]]
    counts = list(range(record.ACT_NUM_COUNTS))
    np.testing.assert_array_equal(four.activations.records[..., counts], rows[..., counts])
    np.testing.assert_allclose(four.activations.records, rows, rtol=1e-4, atol=1e-7)


def _reference_outputs(model: keras.Model, names: list[str]):
    """A model of the layers' outputs (functional), and a callback keeping them before each train call."""
    layers = {layer.name: layer for layer in model.layers}
    taps = keras.Model(model.inputs, [layers[n].output for n in names])
    kept: list[list[np.ndarray]] = []

    class Keep(keras.callbacks.Callback):
        def __init__(self, x):
            super().__init__()
            self.x = x

        def on_train_batch_begin(self, batch, logs=None):
            kept.append([np.asarray(o, np.float64) for o in taps(self.x[batch * 8:(batch + 1) * 8], training=True)])

    return Keep, kept


def test_a_functional_convnet_with_activation_layers(tmp_path):
    keras.utils.set_random_seed(2)
    inp = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3, name="conv")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.Flatten(name="flat")(h)
    out = keras.layers.Dense(3, activation="sigmoid", name="head")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x = np.random.default_rng(3).normal(size=(32, 6, 6, 3)).astype("float32") * 4
    y = np.zeros((32, 3), "float32")
    keep, kept = _reference_outputs(model, ["conv", "bn", "relu", "head"])
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[keep(x), GradientHealthCallback(tmp_path, update_freq=2, activations=True)])
    run = reader.read_logdir(str(tmp_path)).runs[0]
    act = run.activations
    assert act.layers == ("conv", "bn", "relu", "head") and act.steps.tolist() == [2, 4]
    assert dict(act.layer_info)["relu"] == ("ReLU", "relu") and dict(act.layer_info)["head"] == ("Dense", "sigmoid")
    for k, step in enumerate((2, 4)):
        for j, bounds in enumerate((None, None, None, (0.0, 1.0))):
            check_close(act.records[k, j], kept[step - 1][j], bounds=bounds, rtol=1e-4)
    assert act.records[0, 2, record.ACT_INDEX["units"]] == 8


def test_a_subclassed_model_records_the_layers_it_calls_and_the_probe_batch_is_not_recorded(tmp_path):
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(12, activation="tanh")
            self.out = keras.layers.Dense(2)

        def call(self, x):
            return self.out(self.hidden(x) * 3.0)

    keras.utils.set_random_seed(4)
    model = Net()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = data(32)
    model(x[:1])
    weights = Weights()
    cb = GradientHealthCallback(tmp_path, update_freq=2, activations=True, probe_data=(x[:8], y[:8]))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[weights, cb])
    act = reader.read_logdir(str(tmp_path)).runs[0].activations
    names = [compat.layer_path(model.hidden), compat.layer_path(model.out)]
    assert list(act.layers) == names and act.steps.tolist() == [2, 4, 6, 8]
    for k, step in enumerate(act.steps.tolist()):
        k_h, b_h, k_o, b_o = weights.before[step - 1]
        b = (step - 1) % 4
        h = np.tanh(x[b * 8:(b + 1) * 8] @ k_h + b_h)
        check_close(act.records[k, 0], h, bounds=TANH)
        check_close(act.records[k, 1], (h * 3.0) @ k_o + b_o)


def test_off_by_default_and_a_model_without_layers_to_record(tmp_path, caplog):
    model, _, run = fit_mlp(tmp_path / "on", update_freq=4, epochs=1)
    assert run.activations is not None
    model = make_mlp()
    x, y = data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[GradientHealthCallback(tmp_path / "off",
                                                                                          update_freq=4)])
    assert reader.read_logdir(str(tmp_path / "off")).runs[0].activations is None

    class Bare(keras.Model):
        def __init__(self):
            super().__init__()
            self.w = self.add_weight(shape=(6, 2), initializer="ones")

        def call(self, x):
            return keras.ops.relu(x @ self.w)

    bare = Bare()
    bare.compile(optimizer="sgd", loss="mse")
    with caplog.at_level("WARNING", logger="tb_gradhealth"):
        bare.fit(x, y, batch_size=8, epochs=1, verbose=0,
                 callbacks=[GradientHealthCallback(tmp_path / "bare", update_freq=4, activations=True)])
    assert "found no layer to record" in caplog.text
    assert reader.read_logdir(str(tmp_path / "bare")).runs[0].activations is None


def test_batches_of_a_size_known_only_when_the_step_runs(tmp_path):
    model = make_mlp()
    x, y = data(60)  # batches of 8, the last of 4: the step is traced for a batch of unknown size
    weights = Weights()
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0,
              callbacks=[weights, GradientHealthCallback(tmp_path, update_freq=4, activations=True)])
    act = reader.read_logdir(str(tmp_path)).runs[0].activations
    assert act.steps.tolist() == [4, 8]
    for k, step in enumerate((4, 8)):
        outs = mlp_outputs(weights.before[step - 1], x[(step - 1) * 8:step * 8])
        assert act.records[k, 0, record.ACT_INDEX["size"]] == outs[0].size == (16 * 8 if step == 4 else 16 * 4)
        for j, bounds in enumerate((None, TANH, None)):
            check_close(act.records[k, j], outs[j], bounds=bounds)


@pytest.mark.parametrize("dead", [40, 0])
def test_the_diagnosis_reads_dead_units_of_a_relu_layer_after_a_linear_dense(tmp_path, dead):
    """A ``ReLU`` layer speaks for the ``Dense`` before it (whose own metadata says "linear"): 40 of its 64 biases at
    -50 make its units dead for every input, measured on the model's own outputs; its variables are then dead with
    relu wording while their gradient flows, and the twin without the shift stays healthy."""
    from tb_gradhealth import _payloads, health

    keras.utils.set_random_seed(0)
    init = keras.initializers.Constant(np.r_[np.full(dead, -50.0), np.zeros(64 - dead)])
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(64, bias_initializer=init, name="hidden"), keras.layers.ReLU(),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x = np.random.default_rng(0).standard_normal((256, 8)).astype("float32")
    model.fit(x, x[:, :1], batch_size=32, epochs=1, verbose=0,
              callbacks=[GradientHealthCallback(str(tmp_path), update_freq=1, activations=True)])
    probe = keras.Model(model.inputs, model.layers[2].output)
    measured = float(np.mean(~np.any(np.asarray(probe(x[-32:])) != 0, axis=0)))  # the last batch's units
    (series,) = reader.read_logdir(str(tmp_path)).runs
    by = {lj["layer"]: lj for lj in _payloads.health_payload(series, health.Thresholds(), None)["layers"]}
    kernel = next(n for n in by if n.endswith("hidden/kernel"))
    if dead:
        assert measured >= 0.5
        assert by[kernel]["status"] == "dead"
        assert f"{measured:.0%} of its relu units output 0 for every input of the batch" in by[kernel]["reasons"][0]
        assert by[kernel]["forward"]["activation"] == "relu" and "LeakyReLU" in by[kernel]["fixes"][0]
    else:
        assert measured < 0.5 and all(lj["status"] == "healthy" for lj in by.values())


@pytest.mark.parametrize("jit", [False, True], ids=["graph", "xla"])
def test_each_outputs_statistics_in_a_compiled_step_match_the_float64_reference(jit):
    """The statistics a recorded layer's output gets inside a traced step (graph and XLA, whose maximum skips a
    NaN), whichever branch each output takes, equal the float64 reference: every edge output in one function."""
    from tb_gradhealth import _forwardstats
    from tb_gradhealth._tf import forward

    cases = edge_outputs()

    @tf.function(jit_compile=jit)
    def stats(*xs):
        return [forward.output_stats(x, axis, bounds) for x, (_, axis, bounds) in zip(xs, cases.values(), strict=True)]

    got = stats(*[tf.constant(a) for a, _, _ in cases.values()])
    for (name, (a, axis, bounds)), s in zip(cases.items(), got, strict=True):
        rec = _forwardstats.row(s.counts.numpy(), s.values.numpy().astype(np.float64), s.alive.numpy(), bounds)
        try:
            check_against(rec, reference(a, axis, bounds), rtol=2e-6)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from e
