"""Keras 3 on the JAX backend, where the Keras callback cannot see the gradients: a custom ``train_step`` computes
the record with ``tb_gradhealth.jax.compute`` and ``tb_gradhealth.jax.keras_callback`` writes it. Run in a fresh
interpreter with ``KERAS_BACKEND=jax`` (the rest of the suite imports Keras on TensorFlow)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import layerinfo, progress, reader, record

pytest.importorskip("jax")
pytest.importorskip("keras")

REPO = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import numpy as np
import jax
import keras
import tb_gradhealth.jax
from tb_gradhealth import Writer

assert keras.backend.backend() == "jax"


class GradHealthModel(keras.Model):
    def train_step(self, state, data):
        trainable, non_trainable, opt_vars, metric_vars = state
        x, y = data

        def loss_fn(tv, ntv):
            y_pred, ntv = self.stateless_call(tv, ntv, x, training=True)
            return self.compute_loss(x, y, y_pred), ntv

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable)
        new_trainable, opt_vars = self.optimizer.stateless_apply(opt_vars, grads, trainable)
        updates = [b - a for b, a in zip(trainable, new_trainable)]
        logs = {"loss": loss, "gradhealth": tb_gradhealth.jax.compute(grads, trainable, updates, hist_sample=0)}
        return logs, (new_trainable, non_trainable, opt_vars, metric_vars)


keras.utils.set_random_seed(0)
inputs = keras.Input((8,))
model = GradHealthModel(inputs, keras.layers.Dense(1)(keras.layers.Dense(16, activation="tanh")(inputs)))
model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
np.savez("initial.npz", **{v.path.replace("/", "."): np.asarray(v) for v in model.trainable_variables})
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
losses = []


class LossLog(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["loss"]))


with Writer("logs/keras_jax", hist_sample=0) as w:
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[tb_gradhealth.jax.keras_callback(w), LossLog()])
np.save("losses.npy", np.array(losses))
"""


@pytest.mark.jax
@pytest.mark.e2e
def test_keras_jax_backend_custom_train_step(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    run = reader.read_logdir(str(tmp_path / "logs")).runs[0]
    assert list(run.steps) == list(range(8))
    assert set(run.layers) == {"dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"}
    # beside the records: the model's layer kinds and the loss of each batch. The output Dense(1) is made first, so
    # it is "dense" (linear) and the hidden tanh layer "dense_1".
    paths = reader.find_runs(str(tmp_path / "logs"))["keras_jax"]
    assert layerinfo.read_layer_info(paths) == {"dense/kernel": ("Dense", "linear"), "dense/bias": ("Dense", "linear"),
                                                "dense_1/kernel": ("Dense", "tanh"),
                                                "dense_1/bias": ("Dense", "tanh")}
    loss_steps, loss = progress.read_loss(paths)
    assert loss_steps.tolist() == list(range(8))
    np.testing.assert_allclose(loss, np.load(tmp_path / "losses.npy"), rtol=1e-6)
    rec = run.records
    # SGD without momentum: the applied update is 0.01 x the gradient, recorded independently of it
    np.testing.assert_allclose(rec[..., record.INDEX["update_max_abs"]], 0.01 * record.max_abs(rec), rtol=1e-5)
    np.testing.assert_allclose(rec[..., record.INDEX["update_ssq_rel"]], rec[..., record.INDEX["ssq_rel"]], rtol=1e-4)
    # the first step's weights are the initial weights
    initial = np.load(tmp_path / "initial.npz")
    for i, layer in enumerate(run.layers):
        ref = record.compute(None, initial[layer.replace("/", ".")], hist_sample=None)
        for f in ("weight_max_abs", "weight_ssq_rel"):
            np.testing.assert_allclose(rec[0, i, record.INDEX[f]], ref[record.INDEX[f]], rtol=2e-6, err_msg=layer)
