"""A real ``fit`` with the callback never dies for the recorder's sake: each fault injected into a running fit.

A full disk (a tmpfs filled from inside the fit, then freed), a record that fails the readers' checks, a host-side
write that raises (a bug of ours), statistics that cannot even be traced: in each case ``fit`` runs every epoch to
the end, the loss it reports is the loss of a model trained without the callback, a warning names what happened,
what was lost is counted in ``dropped_records``, and the records that could be written are read back.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tests.write_faults import logged

pytestmark = pytest.mark.tf
#: Bound by tests/conftest.py when a test here runs, never at collection: ``tf`` and these names.
TF_IMPORTS = {"keras": "keras", "capture": "tb_gradhealth._tf.capture", "records": "tb_gradhealth._tf.records",
              "GradientHealthCallback": "tb_gradhealth.keras:GradientHealthCallback"}
tf: Any = None
keras: Any = None
capture: Any = None
records: Any = None
GradientHealthCallback: Any = None

EPOCHS, STEPS = 4, 8


def _fit(callbacks: list, steps_per_execution: int = 1) -> list[float]:
    """Loss per epoch of a small MLP trained for ``EPOCHS`` x ``STEPS`` steps (the same data and init each time)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * 16, 8)).astype("float32")
    y = (x @ rng.standard_normal((8, 1))).astype("float32")
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=steps_per_execution)
    history = model.fit(x, y, batch_size=16, epochs=EPOCHS, verbose=0, shuffle=False, callbacks=callbacks)
    return history.history["loss"]


@pytest.fixture(scope="module")
def plain_loss() -> list[float]:
    return _fit([])


def _at_epoch_end(actions: dict[int, Any]):
    """A Keras callback that runs ``actions[epoch]()`` at the end of that epoch (before the recorder's, which
    comes after it in the list)."""
    class Hook(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch in actions:
                actions[epoch]()

    return Hook()


@pytest.mark.e2e
def test_fit_goes_on_through_a_full_disk_and_writes_everything_once_space_is_back(tmpfs, caplog, plain_loss):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    log_dir = str(tmpfs.path / "logs")
    cb = GradientHealthCallback(log_dir, update_freq=1, seed=0)
    # the hook fills the disk at the end of epoch 0, before the recorder flushes that epoch, and frees it at the end
    # of epoch 2
    loss = _fit([_at_epoch_end({0: tmpfs.fill, 2: tmpfs.free}), cb])
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert cb.dropped_records == 0 and len(logged(caplog, "cannot write to")) == 1
    (run,) = reader.read_logdir(log_dir).runs
    assert run.steps.tolist() == list(range(1, EPOCHS * STEPS + 1)) and run.problems == ()


def test_fit_goes_on_through_an_inconsistent_record_and_a_failing_write(tmp_path, caplog, monkeypatch, plain_loss):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    real_read = capture.Ring.read_new

    def corrupt_step_5(self, already):
        count, new, lost = real_read(self, already)
        for step, rows, _forward in new:
            if step == 5:
                rows[0, record.INDEX["zero"]] = rows[0, record.INDEX["size"]] + 3  # more zeros than values
        return count, new, lost

    monkeypatch.setattr(capture.Ring, "read_new", corrupt_step_5)
    from tb_gradhealth import writer as writer_module

    real_add = writer_module.Writer.add_records

    def fail_at_step_9(self, step, *args, **kwargs):
        if step == 9:
            raise RuntimeError("injected failure while writing")
        return real_add(self, step, *args, **kwargs)

    monkeypatch.setattr(writer_module.Writer, "add_records", fail_at_step_9)
    cb = GradientHealthCallback(str(tmp_path), update_freq=1, seed=0)
    loss = _fit([cb])
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert cb.dropped_records == 1
    assert len(logged(caplog, "writing a gradient-health record failed")) == 1
    inconsistent = logged(caplog, "not consistent")
    assert len(inconsistent) == 1 and "step 5" in inconsistent[0], inconsistent
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.steps.tolist() == [s for s in range(1, EPOCHS * STEPS + 1) if s != 9]
    assert len(run.problems) == 1 and "step 5" in run.problems[0], run.problems


@pytest.mark.parametrize(("update_freq", "steps_per_execution"), [(2, 1), (1, 1), (1, 2)],
                         ids=["after_the_step", "in_the_step", "in_the_step_of_several"])
def test_fit_falls_back_to_the_plain_step_when_the_statistics_cannot_be_built(tmp_path, caplog, monkeypatch,
                                                                            plain_loss, update_freq,
                                                                            steps_per_execution):
    """Statistics computed after the step (one step a call, not every call logged) or in a second variant of the
    step (every step logged, or several steps a call)."""
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")

    def broken(*args, **kwargs):
        raise ValueError("injected failure while tracing the statistics")

    monkeypatch.setattr(records, "compute", broken)
    cb = GradientHealthCallback(str(tmp_path), update_freq=update_freq, seed=0)
    loss = _fit([cb], steps_per_execution)
    np.testing.assert_allclose(loss, plain_loss, rtol=1e-6)
    assert cb._capture.after_step is (update_freq == 2)
    warned = logged(caplog, "records nothing more in this fit")
    assert len(warned) == 1 and "injected failure" in warned[0], warned
    assert reader.read_logdir(str(tmp_path)).runs == []
