"""Where the first NaN/Inf was made, in a PyTorch loop recorded by ``StepRecorder`` (its own process: no TensorFlow).

The same five injected faults as the TensorFlow tests (tests/nan_cases_torch.py): the answer names the op, the
module, the direction and the marked source line at the faulty step; the weights are left as before that step.
Under ``torch.autocast`` with a ``GradScaler`` a float16 overflow is the scaler's to skip: no origin.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.torch]

torch = pytest.importorskip("torch")

from tb_gradhealth.torch import StepRecorder  # noqa: E402
from tb_gradhealth.torch_origin import OriginFinder  # noqa: E402
from tb_gradhealth.writer import Writer  # noqa: E402
from tests import nan_cases_torch as cases  # noqa: E402


def train(case: cases.Case, log_dir: str) -> OriginFinder:
    model = case.model
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def loss_fn(x, y):
        return case.loss(y, model(x))

    finder = OriginFinder(model, loss_fn)
    with Writer(log_dir) as writer:
        recorder = StepRecorder(writer, model, opt, origin=finder)
        for i, (x, y) in enumerate(cases.batches(case), 1):
            opt.zero_grad()
            loss_fn(x, y).backward()
            recorder.step(i, batch=(x, y))
            if finder.origin is not None:
                break
    return finder


@pytest.mark.parametrize("name", list(cases.CASES))
def test_step_recorder_names_the_origin(name, tmp_path):
    # the input case: the first line of user code is the model's forward that calls the first layer
    case = cases.nan_faults.assert_case_found(cases, name, train, tmp_path)
    assert all(torch.isfinite(p).all() for p in case.model.parameters())  # the update was undone


def test_grad_scaler_overflow_is_not_an_origin(tmp_path):
    """A float16 overflow of the scaled loss (scale 2**16, squared errors ~1e6): the scaler skips the step and lowers
    the scale; the recorder leaves it to the scaler, so nothing is replayed."""
    x, y = cases.nan_faults.data()
    y = y * 1e3
    model = cases.Net({})
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    finder = OriginFinder(model, lambda a, b: cases.mse(b, model(a)))
    with Writer(str(tmp_path)) as writer:
        recorder = StepRecorder(writer, model, opt, scaler=scaler, origin=finder)
        xb, yb = torch.from_numpy(x[:8]), torch.from_numpy(y[:8])
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = cases.mse(yb, model(xb).float())
        scaler.scale(loss.half()).backward()
        applied = recorder.step(1, batch=(xb, yb))
    assert not applied and scaler.get_scale() < 2.0**16  # the overflow happened and was skipped
    assert finder.origin is None
    assert cases.nan_faults.stored(tmp_path) == []
    assert all(np.isfinite(p.detach().numpy()).all() for p in model.parameters())
