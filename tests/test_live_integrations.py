"""``stop_on`` in the Lightning and Hugging Face ``Trainer`` callbacks, on real trainers: what each decides at a
logged step is ``tb-gradhealth report --step S`` on the finished logdir; a learning rate growing 1.3x a step is
halted at least two logged steps before the first NaN loss of its twin; a healthy fit is never halted; under a loss
scaler each logged step says whether it was applied (the label: whether the weights moved); the tags say which loop
and optimizer wrote them."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tb_gradhealth import progress, reader  # noqa: E402
from tests import live_torch_cases as cases  # noqa: E402
from tests.live_replay import assert_live_is_replay, record_checks  # noqa: E402

pytestmark = pytest.mark.torch
STOP_ON = ("nonfinite", "exploding")


def _loader() -> torch.utils.data.DataLoader:
    x, y = cases.data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=cases.BATCH)


def _lightning(growth: float, callbacks: list, precision: object = None):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = cases.net()

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_optimizers(self):
            opt, sched = cases.optimizer(self, growth)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    trainer = pl.Trainer(max_steps=cases.STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1, callbacks=callbacks,
                         plugins=[precision] if precision is not None else None)
    module = Module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's worker count, the small data
        trainer.fit(module, _loader())
    return trainer, module


@pytest.mark.parametrize("growth", [1.3, 1.0], ids=["diverging", "healthy"])
def test_lightning_stops_as_the_report_reads_before_the_nan(tmp_path, monkeypatch, growth):
    from tb_gradhealth.lightning import GradHealth

    first_nan = cases.first_nan(cases.twin_losses(growth))
    assert (first_nan is not None) == (growth > 1)
    seen = record_checks(monkeypatch)
    cb = GradHealth(str(tmp_path), every=1, stop_on=STOP_ON)
    trainer, _ = _lightning(growth, [cb])
    if first_nan is None:
        assert cb.stop_event is None and trainer.global_step == cases.STEPS
    else:
        assert cb.stop_event is not None and cb.stop_event.step <= first_nan - 2, (cb.stop_event, first_nan)
        assert trainer.should_stop and trainer.global_step == cb.stop_event.step + 1  # it stopped at that step
    assert sorted(seen) == list(range(trainer.global_step))
    assert_live_is_replay(seen, str(tmp_path))
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.source == {"loop": "lightning", "optimizer": "SGD", "momentum": "0.5"}


def test_lightning_under_a_loss_scaler_says_which_steps_were_skipped(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.plugins.precision import MixedPrecision

    from tb_gradhealth.lightning import GradHealth

    moved: dict[int, bool] = {}

    class Moved(pl.Callback):  # the label: whether the optimizer step changed the weights
        def on_before_optimizer_step(self, trainer, module, optimizer):
            self.before = [p.detach().clone() for p in module.parameters()]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            after = list(module.parameters())
            moved[trainer.global_step - 1] = any(not torch.equal(a, b) for a, b in zip(after, self.before,
                                                                                       strict=True))

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # float16 gradients overflow at first
    _lightning(1.0, [Moved(), GradHealth(str(tmp_path), every=1)], MixedPrecision("16-mixed", "cpu", scaler))
    found = progress.read_progress(reader.find_runs(str(tmp_path))["."])
    steps, skipped = found.skipped
    assert steps.tolist() == sorted(moved) and any(skipped) and not all(skipped)
    assert skipped.tolist() == [float(not moved[s]) for s in steps.tolist()]


def _hf(tmp_path, growth: float, callbacks: list, logging_steps: int):
    transformers = pytest.importorskip("transformers")

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = cases.net()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    x, y = cases.data()
    data = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]
    model = Regression()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=cases.BATCH, max_steps=cases.STEPS,
        logging_steps=logging_steps, logging_nan_inf_filter=False, max_grad_norm=0.0, report_to=[],
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=cases.optimizer(model.net, growth), callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return trainer


def test_hugging_face_stops_as_the_report_reads_before_the_nan(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from tb_gradhealth.transformers import GradHealthCallback

    losses: dict[int, float] = {}

    class Losses(transformers.TrainerCallback):  # the twin's loss, one step a log
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step - 1] = logs["loss"]

    _hf(tmp_path / "twin", 1.3, [Losses()], logging_steps=1)
    first_nan = next((s for s in sorted(losses) if not math.isfinite(losses[s])), None)
    assert first_nan is not None
    seen = record_checks(monkeypatch)
    cb = GradHealthCallback(str(tmp_path / "run"), every=1, stop_on=STOP_ON)
    trainer = _hf(tmp_path, 1.3, [cb], logging_steps=1)
    assert cb.stop_event is not None and cb.stop_event.step <= first_nan - 2, (cb.stop_event, first_nan)
    assert trainer.state.global_step == cb.stop_event.step + 1  # training ended at that step
    assert sorted(seen) == list(range(trainer.state.global_step))
    assert_live_is_replay(seen, str(tmp_path / "run"))
    (series,) = reader.read_logdir(str(tmp_path / "run")).runs
    assert series.source == {"loop": "transformers", "optimizer": "SGD", "momentum": "0.5"}


def test_hugging_face_checks_a_step_once_its_loss_is_in_and_leaves_a_healthy_fit_alone(tmp_path, monkeypatch):
    from tb_gradhealth.transformers import GradHealthCallback

    seen = record_checks(monkeypatch)
    cb = GradHealthCallback(str(tmp_path), every=1, stop_on=STOP_ON)
    trainer = _hf(tmp_path, 1.0, [cb], logging_steps=3)  # a loss every third step: the others checked at once
    assert cb.stop_event is None and trainer.state.global_step == cases.STEPS
    assert sorted(seen) == list(range(cases.STEPS))
    assert_live_is_replay(seen, str(tmp_path))
    steps, _ = progress.read_loss(reader.find_runs(str(tmp_path))["."])
    assert steps.tolist() == list(range(2, cases.STEPS, 3))
    np.testing.assert_array_equal(reader.read_logdir(str(tmp_path)).runs[0].steps, np.arange(cases.STEPS))
