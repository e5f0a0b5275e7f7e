"""GradientHealthCallback records the loss Keras reports and each layer's kind beside the records, read back without
TensorFlow."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from tb_gradhealth import layerinfo, progress, reader  # noqa: E402
from tb_gradhealth.keras import GradientHealthCallback  # noqa: E402

pytestmark = pytest.mark.tf


class LossLog(keras.callbacks.Callback):
    """The loss Keras reports after each batch, by optimizer step (1-based)."""

    def __init__(self) -> None:
        super().__init__()
        self.loss: dict[int, float] = {}

    def on_train_batch_end(self, batch, logs=None):
        self.loss[int(self.model.optimizer.iterations.numpy())] = float(logs["loss"])


@pytest.mark.parametrize("update_freq", [1, 3])
def test_the_loss_is_recorded_at_the_logged_steps(tmp_path, update_freq):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 5)).astype("float32"), rng.standard_normal((64, 1)).astype("float32")
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    seen = LossLog()
    model.fit(x, y, batch_size=8, epochs=2, verbose=0,
              callbacks=[GradientHealthCallback(str(tmp_path), update_freq=update_freq), seen])
    runs = reader.find_runs(str(tmp_path))
    steps, loss = progress.read_loss(runs["train"])
    data = reader.read_logdir(str(tmp_path))
    logged = set(data.runs[0].steps.tolist())
    assert set(steps.tolist()) <= set(seen.loss) and len(steps) >= 16 // update_freq
    assert set(steps.tolist()) - {1} <= logged  # besides the first call (always captured), at logged steps
    np.testing.assert_allclose(loss, [seen.loss[int(s)] for s in steps], rtol=1e-6)


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
