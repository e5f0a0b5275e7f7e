"""Where the first NaN/Inf was made, in a PyTorch training loop: the op, its ``nn.Module``, forward or backward, the
line of user code.

:class:`OriginFinder` is given to :class:`tb_gradhealth.torch.StepRecorder` (``origin=``), and the batch to each
``recorder.step(step, batch=(x, y))`` (a reference, nothing is copied). At the first recorded step whose gradient
holds a NaN/Inf (the record counts them exactly; the recorder reads it anyway), the finder puts back the weights the
recorder copied before the update (``updates=True``), then replays the loss of that step on the same batch:

* forward, under a ``TorchFunctionMode`` that sees every torch function with its ``nn.Module`` (global forward
  hooks) and user frame: the first call whose output is not finite while its inputs are;
* backward (when the loss is finite), with a hook on every node of the autograd graph: the first node whose
  gradient outputs are finite but whose gradient inputs are not, named by the forward call that made it.

With a ``GradScaler`` a non-finite gradient is the scaler's to skip (an overflow of the scaled loss): nothing is
replayed. Costs nothing before the first NaN/Inf.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tb_gradhealth import _frames, origin
from tb_gradhealth.origin import NanOrigin, nonfinite_samples

__all__ = ["OriginFinder", "replay", "NanOrigin"]

_log = logging.getLogger("tb_gradhealth")
#: Operator names as users write them (``x / y`` is ``Tensor.__truediv__``).
_ALIASES = {"truediv": "div", "rtruediv": "div", "radd": "add", "rsub": "sub", "rmul": "mul", "rpow": "pow",
            "matmul": "matmul", "getitem": "getitem"}


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", str(func)).strip("_")
    return _ALIASES.get(name, name)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nonfinite(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all())


@dataclass
class _Call:
    index: int
    op: str
    module: str | None
    frame: _frames.Frame | None
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    bad_out: bool
    bad_in: bool


class _Recorder(TorchFunctionMode):
    """Every torch function call of the forward pass, with its module path; maps autograd nodes to calls."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.calls: list[_Call] = []
        self.nodes: dict[Any, _Call] = {}
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self) -> _Recorder:
        def pre(module: Any, args: Any) -> None:
            self.stack.append(self.names.get(module, type(module).__name__))

        def post(module: Any, args: Any, out: Any) -> None:
            if self.stack:
                self.stack.pop()

        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                        torch.nn.modules.module.register_module_forward_hook(post)]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if not outs:
            return out
        module = next((m for m in reversed(self.stack) if m), None)
        call = _Call(len(self.calls), _op_name(func), module, _frames.user_frame(sys._getframe(1)),
                     tuple(tuple(t.shape) for t in ins), tuple(tuple(t.shape) for t in outs),
                     any(_nonfinite(t) for t in outs), any(_nonfinite(t) for t in ins))
        self.calls.append(call)
        for t in outs:
            if t.grad_fn is not None:
                self.nodes.setdefault(t.grad_fn, call)
        return out


def _result(step: int, call: _Call, direction: str, **kw: Any) -> NanOrigin:
    f = call.frame
    return NanOrigin(step=step, found=True, framework="torch", op=call.op, layer=call.module, direction=direction,
                     input_shapes=call.input_shapes, output_shapes=call.output_shapes, file=f.file if f else "",
                     line=f.line if f else 0, function=f.function if f else "", code=f.code if f else "", **kw)


def _graph(root: Any) -> list[Any]:
    seen, todo, out = set(), [root], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        out.append(node)
        todo.extend(n for n, _ in node.next_functions)
    return out


def _backward(step: int, loss: torch.Tensor, rec: _Recorder) -> NanOrigin | None:
    first: list[Any] = []

    def hook(node: Any) -> Callable[..., None]:
        def check(grad_inputs: Any, grad_outputs: Any) -> None:
            if first or not any(_nonfinite(g) for g in grad_inputs if g is not None):
                return
            if not any(_nonfinite(g) for g in grad_outputs if g is not None):
                first.append(node)
        return check

    handles = [node.register_hook(hook(node)) for node in _graph(loss.grad_fn)]
    try:
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not first:
        return None
    node = first[0]
    call = rec.nodes.get(node)
    if call is None:  # a node made inside a call the mode saw as one (e.g. the loss criterion)
        return NanOrigin(step=step, found=True, framework="torch", op=node.name(), direction="backward",
                         nonfinite="NaN/Inf in its gradient", extra={"gradient_op": node.name()})
    return _result(step, call, "backward", nonfinite="NaN/Inf in its gradient",
                   extra={"gradient_op": node.name()})


def _batch_names(batch: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, b in enumerate(batch):
        flat = _tensors(b)
        for j, t in enumerate(flat):
            out.append((f"batch[{i}]" + (f"[{j}]" if len(flat) > 1 else ""), t))
    return out


def replay(model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], batch: Sequence[Any], *,
           step: int) -> NanOrigin:
    """Replay ``loss_fn(*batch)`` (with ``model``'s current weights) and name the first op that made a NaN/Inf.
    Never raises: a replay that fails or meets no NaN/Inf is a :class:`NanOrigin` with ``found`` False."""
    start = time.perf_counter()

    def not_found(reason: str) -> NanOrigin:
        return NanOrigin(step=step, found=False, framework="torch", reason=reason,
                         seconds=time.perf_counter() - start)

    bad_weights = [n for n, p in model.named_parameters() if _nonfinite(p)]
    if bad_weights:
        return not_found(f"the weights already hold NaN/Inf ({', '.join(bad_weights[:3])}): they were made at an "
                         "earlier step, whose update was applied before it was recorded")
    bad_inputs = [nonfinite_samples(n, t.detach().cpu().numpy()) for n, t in _batch_names(batch)
                  if _nonfinite(t)]
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    found: NanOrigin | None = None
    try:
        rec = _Recorder(model)
        with torch.enable_grad(), rec:
            loss = loss_fn(*batch)
        if _nonfinite(loss) or bad_inputs:
            call = next((c for c in rec.calls if c.bad_out and (not c.bad_in or bad_inputs)), None)
            if call is not None:
                found = _result(step, call, "forward", input_nonfinite=tuple(bad_inputs) if call.bad_in else (),
                                nonfinite="NaN/Inf in its output")
        elif loss.requires_grad:
            found = _backward(step, loss, rec)
    except Exception as e:  # noqa: BLE001 - the answer says why; training goes on
        return not_found(f"the replay failed: {type(e).__name__}: {e}")
    finally:
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in buffers:
                    b.copy_(buffers[n])
            for n, p in model.named_parameters():
                p.grad = grads[n]
    if found is None:
        return not_found("the replay of the step produced no NaN/Inf (a random op such as dropout drew other "
                         "values, or a non-deterministic kernel): not reproduced")
    return NanOrigin(**{**found.__dict__, "seconds": time.perf_counter() - start})


class OriginFinder(origin.OriginSearch):
    """The NaN-origin search of a :class:`~tb_gradhealth.torch.StepRecorder`; the answer in :attr:`origin`.

    ``loss_fn(*batch)`` computes the step's loss (forward pass included) with the current weights; ``log_dir``
    (default: the recorder's writer's) is where the answer is stored for TensorBoard and ``tb-gradhealth report``.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[..., torch.Tensor], log_dir: str | None = None,
                 *, name: str = "gradients") -> None:
        super().__init__(log_dir, name)
        self.model, self.loss_fn = model, loss_fn

    def after_step(self, step: int, rows: np.ndarray, params: Sequence[tuple[str, torch.nn.Parameter]],
                   before: Mapping[str, torch.Tensor] | None, batch: Sequence[Any] | None,
                   log_dir: str | None = None) -> NanOrigin | None:
        """Called by the recorder with the record it read: on the first NaN/Inf, undo the update and replay."""
        return self.find(step, rows, log_dir=log_dir, params=params, before=before, batch=batch)

    def replay(self, step: int, *, params: Sequence[tuple[str, torch.nn.Parameter]],
               before: Mapping[str, torch.Tensor] | None, batch: Sequence[Any] | None) -> NanOrigin:
        """The update undone (the weights ``before`` it put back, as a GradScaler skips a step), then the step
        replayed op by op on ``batch`` (:func:`replay`)."""
        if before is None:
            return NanOrigin(step=step, found=False, framework="torch", reason="the step's update was applied "
                             "(updates=False keeps no copy of the weights to put back)")
        with torch.no_grad():
            for n, p in params:
                if n in before:  # a frozen parameter was neither copied nor updated
                    p.copy_(before[n])
        if batch is None:
            return NanOrigin(step=step, found=False, framework="torch",
                             reason="no batch was given to recorder.step(step, batch=...)")
        return replay(self.model, self.loss_fn, tuple(batch), step=step)
