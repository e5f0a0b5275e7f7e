"""The PyTorch loop of the zoo's child-process cases (``benchmarks/zoo_torch_cases.py``,
``benchmarks/zoo_trainer_cases.py``): the everyday loop recorded with :class:`tb_gradhealth.torch.StepRecorder` at
every step, and a :class:`Probe` that measures each step with torch beside the recorder (what the labels are made
of, ``benchmarks/zoo_measure.py``). Torch is imported inside the functions."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from benchmarks.zoo_measure import Trace


class Probe:
    """Measures, beside the recorder, what each parameter's gradient is when the optimizer receives it and what the
    step did to its weight; call :meth:`before` just before the optimizer step and :meth:`after` just after."""

    def __init__(self, named: Sequence[tuple[str, Any]]) -> None:
        self.named = list(named)
        self.trace = Trace(names=[n for n, _ in self.named])
        self.trace.w_start = [_numpy(p) for _, p in self.named]
        self._before: list[Any] = []
        self._states: list[str] = []

    def before(self) -> None:
        import torch

        self._states = [_grad_state(p.grad) for _, p in self.named]
        self._before = [p.detach().clone() for _, p in self.named]
        self._wnorm = [float(torch.linalg.vector_norm(w.double())) for w in self._before]

    def after(self, step: int, loss: float) -> None:
        import torch

        moved = []
        for w0, (_, p) in zip(self._before, self.named, strict=True):
            d = float(torch.linalg.vector_norm((p.detach() - w0).double()))
            n = float(torch.linalg.vector_norm(w0.double()))
            moved.append(0.0 if torch.equal(p.detach(), w0) else d / n if n > 0 else math.inf)
        self.trace.add(step, loss, self._states, self._wnorm, moved)

    def finish(self) -> Trace:
        self.trace.w_end = [_numpy(p) for _, p in self.named]
        return self.trace


def _numpy(p: Any) -> np.ndarray:
    return p.detach().double().cpu().numpy().copy()


def _grad_state(g: Any) -> str:
    import torch

    if g is None:
        return "none"
    if not bool(torch.isfinite(g).all()):
        return "nonfinite"
    return "zero" if not bool(g.any()) else "live"


def batches(x: np.ndarray, y: np.ndarray, batch: int) -> Iterator[tuple[Any, Any]]:
    """Endless consecutive batches of ``(x, y)`` as tensors (wrapping around the data)."""
    import torch

    xt, yt = torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(np.ascontiguousarray(y))
    i = 0
    while True:
        idx = torch.arange(i, i + batch) % len(xt)
        yield xt[idx], yt[idx]
        i += batch


def recorder(log_dir: str, model: Any, optimizer: Any, **kw: Any) -> Any:
    """A :class:`StepRecorder` that logs every step into ``log_dir``."""
    from tb_gradhealth.torch import StepRecorder
    from tb_gradhealth.writer import Writer

    return StepRecorder(Writer(log_dir), model, optimizer, every=1, **kw)


def plain_loop(log_dir: str | None, model: Any, optimizer: Any, data: Iterator[tuple[Any, Any]], *, steps: int,
               loss_fn: Callable[[Any, Any], Any], set_to_none: bool = True, scheduler: Any = None,
               stop_after_nan: int | None = None) -> Trace:
    """The everyday loop (zero_grad, forward, backward, step) recorded at every step into ``log_dir`` (None:
    unrecorded, a twin whose trace alone is kept); steps count from 1. ``stop_after_nan``: stop that many steps
    after the first non-finite loss."""
    named = list(model.named_parameters())
    rec = recorder(log_dir, model, optimizer) if log_dir is not None else None
    probe = Probe(named)
    nan_at = None
    for s in range(1, steps + 1):
        xb, yb = next(data)
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_fn(model(xb), yb) + getattr(model, "aux_loss", 0.0)
        loss.backward()
        probe.before()
        if rec is not None:
            rec.step(s, loss=loss)
        else:
            optimizer.step()
        probe.after(s, float(loss.detach()))
        if scheduler is not None:
            scheduler.step()
        if nan_at is None and not math.isfinite(float(loss.detach())):
            nan_at = s
        if stop_after_nan is not None and nan_at is not None and s - nan_at >= stop_after_nan:
            break
    if rec is not None:
        rec.writer.close()
    return probe.finish()


def ce(logits: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.cross_entropy(logits, y.long())


def mse(pred: Any, y: Any) -> Any:
    import torch

    return torch.nn.functional.mse_loss(pred, y)
