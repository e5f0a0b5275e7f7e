"""``GradientHealthCallback(stop_on=...)`` on real ``fit`` loops: what it decides at each logged step is
``tb-gradhealth report --step S`` on the finished logdir; a learning rate growing 1.3x a step is halted at least two
logged steps before its first NaN loss (measured on a twin run without the callback); a healthy fit is never
halted; under ``LossScaleOptimizer`` every logged step says it was applied; the tags say which loop and optimizer
wrote them."""

from __future__ import annotations

import math

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tb_gradhealth import metadata, progress, reader  # noqa: E402
from tb_gradhealth.keras import GradientHealthCallback  # noqa: E402
from tests.live_replay import assert_live_is_replay, record_checks  # noqa: E402

pytestmark = pytest.mark.tf

STEPS = 48
BATCH = 16


def _data() -> tuple[np.ndarray, np.ndarray]:
    """A learnable regression: a linear map of the inputs plus a little noise."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = (x @ rng.standard_normal((16, 1)) / 4 + 0.1 * rng.standard_normal((len(x), 1))).astype("float32")
    return x, y


class Growing(keras.optimizers.schedules.LearningRateSchedule):
    """A learning rate of ``lr0 * growth**step``."""

    def __init__(self, lr0: float, growth: float) -> None:
        self.lr0, self.growth = lr0, growth

    def __call__(self, step):
        import tensorflow as tf

        return self.lr0 * tf.pow(self.growth, tf.cast(step, tf.float32))

    def get_config(self):
        return {"lr0": self.lr0, "growth": self.growth}


def _model(growth: float) -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((16,))] + [keras.layers.Dense(32, activation="relu") for _ in range(4)]
                             + [keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(Growing(1e-3, growth), momentum=0.5), loss="mse")
    return model


class BatchLosses(keras.callbacks.Callback):
    """Each batch's own loss, from Keras' running mean of the epoch."""

    def on_train_begin(self, logs=None):
        self.means = []

    def on_train_batch_end(self, batch, logs=None):
        self.means.append(float(logs["loss"]))

    def first_nan_step(self) -> int | None:
        """The optimizer step (1-based) whose batch loss is first NaN/Inf."""
        means = self.means
        per = [means[0]] + [(k + 1) * means[k] - k * means[k - 1] for k in range(1, len(means))]
        return next((k + 1 for k, v in enumerate(per) if not math.isfinite(v)), None)


@pytest.mark.parametrize("growth", [1.3, 1.0], ids=["diverging", "healthy"])
def test_stop_on_decides_as_the_report_reads_and_halts_a_divergence_before_its_nan(tmp_path, monkeypatch, growth):
    x, y = _data()
    twin = BatchLosses()
    _model(growth).fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[twin])
    first_nan = twin.first_nan_step()
    assert (first_nan is not None) == (growth > 1)  # the label: the twin's own loss

    seen = record_checks(monkeypatch)
    model = _model(growth)
    cb = GradientHealthCallback(str(tmp_path), update_freq=1, stop_on=("nonfinite", "exploding"))
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
    steps = int(model.optimizer.iterations.numpy())
    if first_nan is None:
        assert cb.stop_event is None and not cb.should_stop and steps == STEPS
    else:
        assert cb.stop_event is not None and cb.stop_event.step == steps <= first_nan - 2, (steps, first_nan)
        assert cb.stop_event.status in ("exploding", "nonfinite")
        assert all(np.isfinite(w).all() for w in model.get_weights())
    assert sorted(seen) == list(range(1, steps + 1))  # every logged step was checked, in order
    assert_live_is_replay(seen, str(tmp_path))
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.source == {"loop": "keras.fit", "optimizer": "SGD", "momentum": "0.5"}


class Seen(keras.callbacks.Callback):
    """After each batch: the updates the wrapped optimizer applied so far and Keras' running mean of the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []
        self.means: list[float] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.steps.append(int(self.model.optimizer.inner_optimizer.iterations.numpy()))
        self.means.append(float(logs["loss"]))


@pytest.mark.parametrize("every", [1, 4])
def test_under_a_loss_scaler_every_logged_step_was_applied(tmp_path, every):
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _data()
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse", jit_compile=False)
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        scale0 = float(model.optimizer.initial_scale)
        y = y * 30  # gradients of ~1e2 times the loss scale (2**15) overflow float16: the first steps are skipped
        seen = Seen()
        model.fit(x[:320], y[:320], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[GradientHealthCallback(str(tmp_path), update_freq=every), seen])
        # The steps that applied an update: the wrapped optimizer's count (Keras 3.0's LossScaleOptimizer keeps an
        # `iterations` of its own that never advances; newer ones forward it to the wrapped optimizer's).
        applied = int(model.optimizer.inner_optimizer.iterations.numpy())
        assert float(model.optimizer.dynamic_scale.numpy()) < scale0 and 0 < applied < 20  # some were skipped
    finally:
        keras.mixed_precision.set_global_policy(previous)
    paths = reader.find_runs(str(tmp_path))["train"]
    found = progress.read_progress(paths)
    (series,) = reader.read_logdir(str(tmp_path)).runs
    # a skipped step has no record, no step
    assert series.steps.tolist() == list(range(every, applied + 1, every))
    assert found.skipped[0].tolist() == series.steps.tolist() and not found.skipped[1].any()
    # Each logged step's loss is the loss of the batch whose update it applied: Keras' running mean after batch b,
    # times b + 1, less the mean before it, times b. A skipped batch's loss has no step of its own, and no loss is
    # refused (the host's count, ahead by the skipped steps, is read again from the device).
    means = [0.0, *seen.means]
    before = [0, *seen.steps]
    applied_loss = {step: (b + 1) * means[b + 1] - b * means[b]
                    for b, step in enumerate(seen.steps) if step > before[b]}
    logged = found.loss[0].tolist()
    assert set(series.steps.tolist()) <= set(logged) <= set(applied_loss)
    np.testing.assert_allclose(found.loss[1], [applied_loss[s] for s in logged], rtol=1e-4)
    if every == 1:
        assert logged == series.steps.tolist() == sorted(applied_loss)
    assert series.source["optimizer"] == "SGD" and metadata.SOURCE_KEYS[0] in series.source
