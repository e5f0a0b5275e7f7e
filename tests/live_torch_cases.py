"""The PyTorch runs the live tests train: a ReLU MLP on a learnable regression, under SGD whose learning rate grows
``growth``x a step (1.3: a divergence; 1.0: a healthy fit), and the twin's own loss (the label: where it first turns
NaN/Inf). Shared by the ``StepRecorder``, Lightning and Hugging Face tests."""

from __future__ import annotations

import math

import torch

STEPS = 48
BATCH = 32
LR0 = 1e-3


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * BATCH, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) / 4 + 0.1 * torch.randn(len(x), 1, generator=g)
    return x, y


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(4):
        layers += [torch.nn.Linear(16 if i == 0 else 32, 32), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 1))


def optimizer(model: torch.nn.Module, growth: float
              ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """SGD with momentum 0.5 at ``LR0 * growth**step`` (the scheduler steps once per optimizer step)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR0, momentum=0.5)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: growth ** s)


def twin_losses(growth: float) -> list[float]:
    """Each step's loss of the run trained without any recording (batches in order)."""
    x, y = data()
    model = net()
    opt, sched = optimizer(model, growth)
    losses = []
    for s in range(STEPS):
        loss = torch.nn.functional.mse_loss(model(x[s * BATCH:(s + 1) * BATCH]), y[s * BATCH:(s + 1) * BATCH])
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return losses


def first_nan(losses: list[float]) -> int | None:
    """The first step (0-based, as the loops count them) whose loss is NaN/Inf."""
    return next((s for s, v in enumerate(losses) if not math.isfinite(v)), None)
