"""``StepRecorder(stop_on=...)`` on a real PyTorch loop: what it decides at each logged step is ``tb-gradhealth
report --step S`` on the finished logdir; a learning rate growing 1.3x a step is halted at least two logged steps
before the first NaN loss of its twin (trained without any recording); a healthy loop is never halted;
``raise_on_stop`` raises the event; the tags say which loop and optimizer wrote them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tb_gradhealth import reader  # noqa: E402
from tb_gradhealth.torch import StepRecorder, StopTraining  # noqa: E402
from tb_gradhealth.writer import Writer  # noqa: E402
from tests import live_torch_cases as cases  # noqa: E402
from tests.live_replay import assert_live_is_replay, record_checks  # noqa: E402

pytestmark = pytest.mark.torch


def _train(logdir: str, growth: float, **stop) -> tuple[StepRecorder, int]:
    """The twin's loop with a recorder logging every step; returns it and the steps run."""
    x, y = cases.data()
    model = cases.net()
    opt, sched = cases.optimizer(model, growth)
    with Writer(logdir) as w:
        recorder = StepRecorder(w, model, opt, every=1, **stop)
        for s in range(cases.STEPS):
            loss = torch.nn.functional.mse_loss(model(x[s * cases.BATCH:(s + 1) * cases.BATCH]),
                                                y[s * cases.BATCH:(s + 1) * cases.BATCH])
            opt.zero_grad()
            loss.backward()
            recorder.step(s, loss=loss)
            sched.step()
            if recorder.should_stop:
                return recorder, s + 1
    return recorder, cases.STEPS


@pytest.mark.parametrize("growth", [1.3, 1.0], ids=["diverging", "healthy"])
def test_stop_on_decides_as_the_report_reads_and_halts_a_divergence_before_its_nan(tmp_path, monkeypatch, growth):
    first_nan = cases.first_nan(cases.twin_losses(growth))
    assert (first_nan is not None) == (growth > 1)  # the label: the twin's own loss
    seen = record_checks(monkeypatch)
    recorder, steps = _train(str(tmp_path), growth, stop_on=("nonfinite", "exploding"))
    event = recorder.stop_event
    if first_nan is None:
        assert event is None and steps == cases.STEPS
    else:
        assert event is not None and event.step == steps - 1 <= first_nan - 2, (event, first_nan)
        assert event.status in ("exploding", "nonfinite") and event.layer in event.layers
    assert sorted(seen) == list(range(steps))  # every logged step was checked
    assert_live_is_replay(seen, str(tmp_path))
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.source == {"loop": "torch", "optimizer": "SGD", "momentum": "0.5"}


def test_raise_on_stop_raises_the_event_after_the_optimizer_step(tmp_path):
    with pytest.raises(StopTraining) as raised:
        _train(str(tmp_path), 1.3, stop_on="exploding", raise_on_stop=True)
    event = raised.value.event
    assert event.status == "exploding" and str(raised.value) == event.message()
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.last_step == event.step  # the step that raised was recorded (and applied) first


def test_without_a_writer_nothing_is_checked():
    model = cases.net()
    opt, _ = cases.optimizer(model, 1.0)
    recorder = StepRecorder(None, model, opt, every=1, stop_on="nonfinite")
    x, y = cases.data()
    torch.nn.functional.mse_loss(model(x[:4]), y[:4]).backward()
    assert recorder.step(0) and not recorder.should_stop and recorder.stop_event is None
