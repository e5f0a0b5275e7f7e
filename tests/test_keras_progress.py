"""GradientHealthCallback records the loss Keras reports and each layer's kind beside the records, read back without
TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tb_gradhealth import layerinfo, progress, reader  # noqa: E402
from tb_gradhealth.keras import GradientHealthCallback  # noqa: E402

pytestmark = pytest.mark.tf


class BatchLoss(keras.callbacks.Callback):
    """Each batch's own loss, by optimizer step (1-based): the MSE of the batch at the weights the step starts from,
    computed here (no dropout, no batch norm: what the train step computes), not read from Keras' logs."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, per_call: int) -> None:
        super().__init__()
        self.x, self.y, self.batch_size, self.per_call = x, y, batch_size, per_call
        self.loss: dict[int, float] = {}

    def on_train_batch_begin(self, batch, logs=None):
        # a call of several steps is heard of once, at its start: its batches' losses at these weights are right
        # only with a learning rate of 0 (the test uses one then)
        step = int(self.model.optimizer.iterations.numpy()) + 1
        for j in range(self.per_call):
            xb = self.x[(batch + j) * self.batch_size:][: self.batch_size]
            yb = self.y[(batch + j) * self.batch_size:][: self.batch_size]
            pred = np.asarray(self.model(xb, training=False), dtype=np.float64)
            self.loss[step + j] = float(np.mean((pred - yb) ** 2))


@pytest.mark.parametrize("update_freq,steps_per_execution", [(1, 1), (3, 1), (1, 4)])
def test_each_logged_step_records_its_own_batch_loss(tmp_path, update_freq, steps_per_execution):
    # Keras reports the loss as a running mean over the epoch; the record holds the logged batch's own loss (with
    # several steps per call, the mean of the call's batches).
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 5)).astype("float32"), rng.standard_normal((64, 1)).astype("float32")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    lr = 0.05 if steps_per_execution == 1 else 0.0
    model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse", steps_per_execution=steps_per_execution)
    seen = BatchLoss(x, y, 8, steps_per_execution)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
              callbacks=[seen, GradientHealthCallback(str(tmp_path), update_freq=update_freq)])
    runs = reader.find_runs(str(tmp_path))
    steps, loss = progress.read_loss(runs["train"])
    data = reader.read_logdir(str(tmp_path))
    logged = set(data.runs[0].steps.tolist())
    assert len(steps) >= 16 // max(update_freq, steps_per_execution)
    assert set(steps.tolist()) - {1, steps_per_execution} <= logged  # besides the first call (always captured)
    # the batches of the call that ran step s (older Keras numbers the first call's record step 1, not its last)
    spe = steps_per_execution
    calls = [range((s - 1) // spe * spe + 1, (s - 1) // spe * spe + spe + 1) for s in steps.tolist()]
    np.testing.assert_allclose(loss, [np.mean([seen.loss[t] for t in c]) for c in calls], rtol=1e-4)
    # not Keras' running mean: by the last batch of an epoch that is the mean of all eight
    running = np.mean([seen.loss[t] for t in range(9, 17)])
    assert abs(loss[-1] - running) > 1e-3 * running


def test_each_variable_carries_its_layer_kind_and_activation(tmp_path):
    # The model says what each layer is; the metadata read back (without TensorFlow) says the same.
    keras.utils.set_random_seed(0)
    x, y = np.zeros((16, 5), "float32"), np.zeros((16, 1), "float32")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="sigmoid", name="squash"),
                              keras.layers.LayerNormalization(name="norm"),
                              keras.layers.Dense(3, activation="relu", name="rect"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[GradientHealthCallback(str(tmp_path), update_freq=1)])
    info = layerinfo.read_layer_info(reader.find_runs(str(tmp_path))["train"])
    by_layer = {name.split("/")[-2]: kind for name, kind in info.items()}
    assert by_layer == {"squash": ("Dense", "sigmoid"), "norm": ("LayerNormalization", ""),
                        "rect": ("Dense", "relu"), "out": ("Dense", "linear")}
    assert len(info) == len(model.trainable_variables)
