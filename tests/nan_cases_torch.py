"""PyTorch training set-ups with one injected NaN/Inf fault each (the twins of tests/nan_cases_tf.py).

Each case knows where its fault is: the op, the module path (None: the loss), the direction, and the line of this
file ending in its ``# fault: <case>`` marker. The fault fires only on samples of batch ``FAULT_BATCH``, so the
non-finite gradient appears at step ``FAULT_BATCH + 1``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tests import nan_faults
from tests.nan_faults import BATCH, FAULT_BATCH, FAULT_ROWS, FAULT_STEP, NAN_SAMPLE, STEPS, Case, mse  # noqa: F401

fault_line = functools.partial(nan_faults.fault_line, path=__file__)


class L2Norm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.sum(torch.square(x), dim=-1, keepdim=True))  # fault: sqrt


class HandSoftmax(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)  # fault: exp
        return e / torch.sum(e, dim=-1, keepdim=True)


class HandNorm(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(dim=-1, keepdim=True)
        std = torch.sqrt(torch.mean(torch.square(centred), dim=-1, keepdim=True))
        return centred / std  # fault: div


def log_loss(y_true: torch.Tensor, y_pred: torch.Tensor) -> torch.Tensor:
    return torch.mean(torch.log(torch.abs(y_pred)) * y_true + torch.square(y_pred - y_true))  # fault: log


class Net(torch.nn.Module):
    def __init__(self, middle: dict[str, torch.nn.Module], first: torch.nn.Module | None = None,
                 width: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense_in = first if first is not None else torch.nn.Linear(4, width, bias=False)
        self.middle = torch.nn.ModuleDict(middle)
        self.dense_out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense_in(x)  # fault: input
        for layer in self.middle.values():
            h = layer(h)
        return self.dense_out(h)


def log0() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("dense_out", torch.nn.Linear(4, 1, bias=False))
    return Case("log", "log", None, "forward", model, log_loss, x, y)


def exp_overflow() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 100.0
    logits = torch.nn.Linear(4, 3)
    with torch.no_grad():
        logits.weight.fill_(1.0)
    return Case("exp", "exp", "middle.softmax", "forward", Net({"softmax": HandSoftmax()}, first=logits), mse, x, y)


def sqrt_at_zero() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    model = Net({"l2norm": L2Norm()})
    model.dense_out = torch.nn.Linear(1, 1)
    return Case("sqrt", "sqrt", "middle.l2norm", "backward", model, mse, x, y)


def zero_variance() -> Case:
    x, y = nan_faults.data()
    x[FAULT_ROWS] = 0.0
    return Case("div", "div", "middle.norm", "forward", Net({"norm": HandNorm()}), mse, x, y)


def nan_sample() -> Case:
    x, y = nan_faults.data()
    x = nan_faults.with_nan_sample(x)
    return Case("input", "linear", "dense_in", "forward", Net({}), mse, x, y, input_nan=True)


CASES: dict[str, Callable[[], Case]] = {
    "log": log0, "exp": exp_overflow, "sqrt": sqrt_at_zero, "div": zero_variance, "input": nan_sample,
}


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.from_numpy(case.x[i * BATCH:(i + 1) * BATCH]), torch.from_numpy(case.y[i * BATCH:(i + 1) * BATCH]))
            for i in range(STEPS)]
