"""Hugging Face ``Trainer`` callback: the gradient-health records of the gradients each optimizer step applies.

:class:`GradHealthCallback` records in ``on_pre_optimizer_step``, which ``Trainer`` calls after it has unscaled
the gradients (mixed precision) and clipped them to ``max_grad_norm``, just before ``optimizer.step()``: the
recorded gradient is the one the optimizer applies, AFTER clipping (``Trainer`` logs the norm before clipping as
``grad_norm``). The callback also writes the scalar ``clip/max_grad_norm`` (``args.max_grad_norm``, 0 when
not clipping) so a reader can tell. The applied update is recorded in ``on_optimizer_step``. The loss ``Trainer``
logs (every ``logging_steps``, its mean since the last log) is recorded in ``on_log`` at the step of its last
batch's record, and each parameter's layer
kind and activation (:mod:`tb_gradhealth.torch_kinds`) in the tags' metadata: evidence the diagnosis weighs. A
parameter with ``requires_grad=False`` (a frozen base model under an adapter) or outside the optimizer is recorded
frozen, and a ``.grad`` not produced since the last optimizer step missing, as under
:class:`tb_gradhealth.torch.StepRecorder`. The main process writes. ``transformers`` is imported only by this
module.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from tb_gradhealth import _storage, _torchparams, record
from tb_gradhealth import torch as tgh
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth.torch_kinds import layer_info_for
from tb_gradhealth.writer import Writer

__all__ = ["GradHealthCallback"]


class GradHealthCallback(TrainerCallback):
    """Record every layer's gradient health on the first ``first`` optimizer steps and every ``every``-th after.

    ``log_dir``: the run directory (default: ``gradhealth`` under ``args.logging_dir``, where ``Trainer``'s
    TensorBoard scalars go, or under ``args.output_dir/runs``). ``updates``: also record the applied update (a
    transient copy of the weights). A given ``log_dir`` that can never be written (a parent that is a file,
    permission denied) raises here; ``strict``: a failed write raises instead of a warning
    (:class:`tb_gradhealth.Writer`).
    """

    def __init__(self, log_dir: str | None = None, *, every: int = 100, first: int = 10,
                 hist_sample: int = record.DEFAULT_HIST_SAMPLE, updates: bool = True,
                 name: str = "gradients", strict: bool = False) -> None:
        if log_dir is not None:  # one that can never be written fails here, before the trainer starts
            _storage.check_writable(log_dir)
        self.strict = bool(strict)
        self.log_dir, self.every, self.first = log_dir, every, first
        self.hist_sample, self.updates, self.name = hist_sample, updates, name
        self.writer: Writer | None = None
        self._pending: Any = None
        #: whether each ``.grad`` is the step's own (:class:`tb_gradhealth._torchparams.GradWatch`)
        self._watch: _torchparams.GradWatch | None = None
        #: what failed on the host costs a warning and a count, never the training (:mod:`tb_gradhealth._failsafe`)
        self.failsafe = Failsafe()

    def _logs(self, step: int) -> bool:
        return step < self.first or step % self.every == 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.writer is None:
            log_dir = self.log_dir or os.path.join(args.logging_dir or os.path.join(args.output_dir, "runs"),
                                                   "gradhealth")
            self.writer = Writer(log_dir, hist_sample=self.hist_sample, strict=self.strict)
        if self.writer is not None and kwargs.get("model") is not None:
            self._watch = self.failsafe.run("watching which gradients a step produces", _torchparams.GradWatch,
                                            list(kwargs["model"].named_parameters()))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if self.writer is None or not self._logs(step):
            return
        params = list(kwargs["model"].named_parameters())
        selection = self.failsafe.run("selecting the parameters to read", _torchparams.select, params,
                                      kwargs.get("optimizer"), self._watch, records=1)
        pending = None if selection is None else self.failsafe.run(
            "computing the gradient-health record", tgh.before_step, params, step, self.hist_sample, self.updates,
            selection=selection, records=1)
        self._pending = None if pending is None else (step, params, pending)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._watch is not None:  # global_step + 1 is the next optimizer step
            self.failsafe.run("watching which gradients a step produces", self._watch.stepped,
                              self._logs(state.global_step + 1))
        if self._pending is None or self.writer is None:
            return
        step, params, pending = self._pending
        self._pending = None
        rows = self.failsafe.run("finishing the gradient-health record", tgh.after_step, pending, params, records=1)
        if rows is not None:
            names = [n for n, _ in params]
            info = self.failsafe.run("reading the layers' kinds", layer_info_for, kwargs["model"], names) or ()
            self.failsafe.run("writing a gradient-health record", self.writer.add_records, step, names, rows,
                              name=self.name, layer_info=info, records=1)
            self.failsafe.run("writing max_grad_norm", self.writer.add_scalars, step,
                              {"clip/max_grad_norm": float(args.max_grad_norm or 0.0)})

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        # Logged after the step count moved on: the loss of the batch whose gradient was recorded at step - 1.
        if self.writer is not None and logs and "loss" in logs and state.global_step > 0:
            self.failsafe.run("recording the loss", self.writer.add_loss, state.global_step - 1, logs["loss"])

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
