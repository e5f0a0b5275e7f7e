"""A PyTorch loop with ``StepRecorder`` never dies for the recorder's sake: faults injected into a running loop.

A full disk (a tmpfs filled mid-run, then freed), statistics that raise, and a record that fails the readers'
checks: in each case every optimizer step is applied (the weights end equal to those of a loop without the
recorder), a warning says what happened, what was lost is counted, and what could be written is read back.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tb_gradhealth import reader, record  # noqa: E402
from tb_gradhealth import torch as tgh  # noqa: E402
from tb_gradhealth.writer import Writer  # noqa: E402
from tests.write_faults import logged  # noqa: E402

pytestmark = pytest.mark.torch
STEPS = 40


def _train(log_dir: str | None, on_step=None) -> tuple[list[np.ndarray], object]:
    """The weights after ``STEPS`` SGD steps of a small MLP (the same data and init each time), and the recorder."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    rec = tgh.StepRecorder(Writer(log_dir, max_queue=1), model, opt, every=1) if log_dir else None
    for step in range(STEPS):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if on_step is not None:
            on_step(step)
        rec.step(step) if rec is not None else opt.step()
    if rec is not None:
        rec.writer.close()
    return [p.detach().numpy().copy() for p in model.parameters()], rec


@pytest.fixture(scope="module")
def plain_weights() -> list[np.ndarray]:
    return _train(None)[0]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.e2e
def test_a_full_disk_mid_run_costs_a_warning_and_nothing_else(tmpfs, caplog, plain_weights):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    log_dir = str(tmpfs.path / "run")
    weights, rec = _train(log_dir, on_step=lambda s: tmpfs.fill() if s == 3 else tmpfs.free() if s == 35 else None)
    _same(weights, plain_weights)
    assert rec.dropped_records == 0 and len(logged(caplog, "cannot write to")) == 1
    (run,) = reader.read_logdir(log_dir).runs
    assert run.steps.tolist() == list(range(STEPS)) and run.problems == ()


def test_statistics_that_raise_leave_the_optimizer_step_applied(tmp_path, caplog, monkeypatch, plain_weights):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    from tb_gradhealth import _torcheager

    real = _torcheager.compute
    calls = {"n": 0}

    def broken_every_third(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected failure in the statistics")
        return real(*args, **kwargs)

    monkeypatch.setattr(_torcheager, "compute", broken_every_third)
    weights, rec = _train(str(tmp_path))
    _same(weights, plain_weights)
    assert rec.dropped_records > 0
    assert 1 <= len(logged(caplog, "failed (RuntimeError: injected failure")) <= 2  # once per kind of work
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert len(run.steps) == STEPS - rec.dropped_records and run.problems == ()


def test_an_inconsistent_record_is_written_and_read_as_damaged(tmp_path, caplog, monkeypatch, plain_weights):
    caplog.set_level(logging.WARNING, logger="tb_gradhealth")
    real = tgh.to_memory

    def corrupt_first_layer(packed):
        rows = real(packed)
        rows[0, record.INDEX["zero"]] = rows[0, record.INDEX["size"]] + 5
        return rows

    monkeypatch.setattr(tgh, "to_memory", corrupt_first_layer)
    weights, rec = _train(str(tmp_path))
    _same(weights, plain_weights)
    assert rec.dropped_records == 0 and len(logged(caplog, "not consistent")) == 1
    (run,) = reader.read_logdir(str(tmp_path)).runs
    assert run.steps.tolist() == list(range(STEPS)) and len(run.problems) == 1
