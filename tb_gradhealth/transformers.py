"""Hugging Face ``Trainer`` callback: the gradient-health records of the gradients each optimizer step applies.

:class:`GradHealthCallback` records in ``on_pre_optimizer_step``, which ``Trainer`` calls after it has unscaled
the gradients (mixed precision) and clipped them to ``max_grad_norm``, just before ``optimizer.step()``: the
recorded gradient is the one the optimizer applies, AFTER clipping (``Trainer`` logs the norm before clipping as
``grad_norm``). The callback also writes the scalar ``clip/max_grad_norm`` (``args.max_grad_norm``, 0 when
not clipping) and states the clip in the tags' metadata (``clip_norm``: a step clipped to it is no evidence of a
runaway), and under mixed precision with a loss scaler (``fp16=True``) the scale and
whether the scaler skipped the step (``amp/loss_scale``, ``amp/step_skipped``). The applied update is recorded in
``on_optimizer_step``. The loss ``Trainer`` logs (every ``logging_steps``, its mean since the last log) is recorded
in ``on_log`` at the step of its last batch's record, and each parameter's layer kind and activation
(:mod:`tb_gradhealth.torch_kinds`) and the optimizer in the tags' metadata: evidence the diagnosis weighs; with
``activations=True``, each layer's output in the logged steps' batches. A
parameter with ``requires_grad=False`` (a frozen base model under an adapter) or outside the optimizer is recorded
frozen, and a ``.grad`` not produced since the last optimizer step missing, as under
:class:`tb_gradhealth.torch.StepRecorder`. ``stop_on`` ends training (``control.should_training_stop``) at the
first logged step whose diagnosis shows a watched status (:class:`tb_gradhealth.live.StopCheck`), checked once
that step's loss is written. The main process writes. ``transformers`` is imported only by this module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback

from tb_gradhealth import _storage, _torchparams, metadata, record
from tb_gradhealth import torch as tgh
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth._torchforward import ForwardHooks, release
from tb_gradhealth.live import StopCheck, Stoppable
from tb_gradhealth.progress import SKIPPED_TAG
from tb_gradhealth.torch_kinds import layer_info_for
from tb_gradhealth.writer import Writer

__all__ = ["GradHealthCallback"]

_log = logging.getLogger("tb_gradhealth")


class GradHealthCallback(TrainerCallback, Stoppable):
    """Record every layer's gradient health on the first ``first`` optimizer steps and every ``every``-th after.

    ``log_dir``: the run directory (default: ``gradhealth`` under ``args.logging_dir``, where ``Trainer``'s
    TensorBoard scalars go, or under ``args.output_dir/runs``). ``updates``: also record the applied update (a
    transient copy of the weights). A given ``log_dir`` that can never be written (a parent that is a file,
    permission denied) raises here; ``strict``: a failed write raises instead of a warning
    (:class:`tb_gradhealth.Writer`).

    ``stop_on`` (statuses of :data:`tb_gradhealth.health.FLAGS`, e.g. ``("nonfinite", "exploding")``): at each
    logged step, the diagnosis ``tb-gradhealth report --step S`` gives on the logdir at that step (with
    ``thresholds``); at the first step where a layer's current status is watched, ``control.should_training_stop``
    is set and :attr:`stop_event` says why. A step whose loss ``Trainer`` logs is checked once the loss is written.

    ``activations=True`` (off by default) also records each layer's output in the batches of logged steps (the
    forward record, docs/ACTIVATIONS.md), through forward hooks (:mod:`tb_gradhealth._torchforward`) registered in
    ``on_step_begin`` of a logged step and removed once its update is written: other steps and evaluation run none.
    The batches of one step under gradient accumulation are parts of its batch.
    """

    def __init__(self, log_dir: str | None = None, *, every: int = 100, first: int = 10,
                 hist_sample: int = record.DEFAULT_HIST_SAMPLE, updates: bool = True,
                 name: str = "gradients", strict: bool = False, stop_on: Sequence[str] = (),
                 thresholds: Any = None, activations: bool = False) -> None:
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
        #: what the records' metadata says of the loop (Hugging Face ``Trainer``, the optimizer)
        self.source = metadata.loop_source("transformers")
        self._stop = StopCheck(stop_on, thresholds=thresholds, name=name) if stop_on else None
        #: the logged step written but not yet checked (its loss may still come in ``on_log``)
        self._unchecked: int | None = None
        self.activations = bool(activations)
        #: the layers' outputs in logged steps (``activations=True``, the main process), made when training begins
        self._forward: ForwardHooks | None = None

    def _logs(self, step: int) -> bool:
        return step < self.first or step % self.every == 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.writer is None:
            log_dir = self.log_dir or os.path.join(args.logging_dir or os.path.join(args.output_dir, "runs"),
                                                   "gradhealth")
            self.writer = Writer(log_dir, hist_sample=self.hist_sample, strict=self.strict)
            if self._stop is not None:
                self._stop.watch(self.writer)
        if self._stop is not None:
            self._stop.rearm()  # a new train() may stop again
        optimizer = kwargs.get("optimizer")
        self.source = metadata.with_clip(
            metadata.loop_source("transformers", _unwrapped(optimizer) if optimizer is not None else None),
            args.max_grad_norm)
        if self.writer is not None and kwargs.get("model") is not None:
            self._watch = self.failsafe.run("watching which gradients a step produces", _torchparams.GradWatch,
                                            list(kwargs["model"].named_parameters()))
            if self.activations:
                if self._forward is not None:
                    self._forward.arm(False)
                self._forward = ForwardHooks(kwargs["model"])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._forward is not None:  # before the forwards of optimizer step global_step: hooks if it is logged
            self.failsafe.run("arming the forward hooks", self._forward.arm, self._logs(state.global_step))

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if self.writer is None or not self._logs(step):
            return
        params = list(kwargs["model"].named_parameters())
        scaler = getattr(kwargs.get("optimizer"), "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else None
        selection = self.failsafe.run("selecting the parameters to read", _torchparams.select, params,
                                      kwargs.get("optimizer"), self._watch, records=1)
        pending = None if selection is None else self.failsafe.run(
            "computing the gradient-health record", tgh.before_step, params, step, self.hist_sample, self.updates,
            selection=selection, records=1)
        self._pending = None if pending is None else (step, params, pending, scale)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._watch is not None:  # global_step + 1 is the next optimizer step
            self.failsafe.run("watching which gradients a step produces", self._watch.stepped,
                              self._logs(state.global_step + 1))
        forward = self._forward
        if forward is not None and self._pending is None:  # not logged: what the hooks saw goes
            forward.clear()
            forward.arm(False)
        if self._pending is None or self.writer is None:
            return
        step, params, pending, scale = self._pending
        self._pending = None
        if forward is not None:
            self.failsafe.run("writing the forward records", forward.write, self.writer, step, name=self.name,
                              source=self.source, records=1)
            forward.arm(False)
        rows = self.failsafe.run("finishing the gradient-health record", tgh.after_step, pending, params, records=1)
        if rows is None:
            return
        names = [n for n, _ in params]
        info = self.failsafe.run("reading the layers' kinds", layer_info_for, kwargs["model"], names) or ()
        self.failsafe.run("writing a gradient-health record", self.writer.add_records, step, names, rows,
                          name=self.name, layer_info=info, source=self.source, records=1)
        scalars = {"clip/max_grad_norm": float(args.max_grad_norm or 0.0)}
        skipped = getattr(kwargs.get("optimizer"), "step_was_skipped", None)
        if scale is not None and skipped is not None:
            scalars.update({"amp/loss_scale": scale, SKIPPED_TAG: float(bool(skipped))})
        self.failsafe.run("writing max_grad_norm", self.writer.add_scalars, step, scalars)
        self._unchecked = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer's own flow callback, which runs first, has decided whether this step logs: if it does, its loss
        # is written in on_log, right after; the step is checked then.
        if not control.should_log:
            self._check(control)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        # Logged after the step count moved on: the loss of the batch whose gradient was recorded at step - 1.
        if self.writer is not None and logs and "loss" in logs and state.global_step > 0:
            self.failsafe.run("recording the loss", self.writer.add_loss, state.global_step - 1, logs["loss"])
        self._check(control)

    def _check(self, control: Any) -> None:
        """``stop_on`` at the logged step written last, once its loss is in."""
        step, self._unchecked = self._unchecked, None
        if self._stop is None or step is None:
            return
        event = self.failsafe.run("checking stop_on", self._stop.check, step)
        if event is not None:
            _log.warning("%s; stopping training", event.message())
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._check(control)
        self._forward, self.writer = release(self._forward, self.writer)


def _unwrapped(optimizer: Any) -> Any:
    """The optimizer that applies the updates: the one an ``accelerate`` wrapper holds, else ``optimizer``."""
    try:
        from accelerate.optimizer import AcceleratedOptimizer
    except ImportError:  # pragma: no cover - Trainer itself needs accelerate
        return optimizer
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer
