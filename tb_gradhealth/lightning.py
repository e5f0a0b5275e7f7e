"""PyTorch Lightning callback: the gradient-health records of each optimizer step's gradients.

:class:`GradHealth` uses Lightning's ``on_before_optimizer_step`` hook, which runs after AMP's unscaling and before
Lightning clips the gradients (``gradient_clip_val``): it records the gradients as backprop made them and the
weights there with :mod:`tb_gradhealth.torch`, and the update once the batch ends (where a clip acted, the update
shows it). Under DDP every rank holds the same all-reduced gradient and global rank 0 writes; under FSDP / ZeRO
(``sharded=True``) every rank records its shards and :func:`tb_gradhealth.torch.merge` makes the full gradients'
records. On logged steps it also records the loss ``training_step`` returned, under AMP with a loss scaler
(``precision="16-mixed"``) the scale and whether the scaler skipped the step (``amp/loss_scale``,
``amp/step_skipped``), and in the tags' metadata each parameter's layer kind and activation
(:mod:`tb_gradhealth.torch_kinds`), the optimizer and the clip (``gradient_clip_val`` as ``clip_norm``): evidence
the diagnosis weighs; with ``activations=True``, each
layer's output in the logged steps' batches. A parameter with ``requires_grad=False`` or outside the optimizer is
recorded frozen, and a ``.grad`` not produced since the last optimizer step missing, as under
:class:`tb_gradhealth.torch.StepRecorder`. ``stop_on`` stops the trainer at the first logged step whose diagnosis
shows a watched status (:class:`tb_gradhealth.live.StopCheck`).
Lightning is imported only by this module.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from tb_gradhealth import _storage, _torchparams, metadata, record
from tb_gradhealth import torch as tgh
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth._torchforward import ForwardHooks, release
from tb_gradhealth.live import StopCheck, Stoppable
from tb_gradhealth.progress import SKIPPED_TAG
from tb_gradhealth.torch_kinds import module_layer_info
from tb_gradhealth.writer import Writer

__all__ = ["GradHealth"]

_log = logging.getLogger("tb_gradhealth")


class GradHealth(pl.Callback, Stoppable):
    """Record every layer's gradient health on the first ``first`` optimizer steps and every ``every``-th after.

    ``log_dir``: the run directory (default: the trainer's ``log_dir``, next to its TensorBoard logger's files).
    ``updates``: also record the applied update ``w_before - w_after`` (a transient copy of the weights on logged
    steps). ``sharded``: the parameters are shards (FSDP / DeepSpeed ZeRO); every rank must then take part.
    A given ``log_dir`` that can never be written (a parent that is a file, permission denied) raises here;
    ``strict``: a failed write raises instead of a warning (:class:`tb_gradhealth.Writer`).

    ``stop_on`` (statuses of :data:`tb_gradhealth.health.FLAGS`, e.g. ``("nonfinite", "exploding")``): at each
    logged step, the diagnosis ``tb-gradhealth report --step S`` gives on the logdir at that step (with
    ``thresholds``); at the first step where a layer's current status is watched, ``trainer.should_stop`` is set
    (on every rank: the writing rank's decision is shared) and :attr:`stop_event` says why.

    ``activations=True`` (off by default) also records each layer's output in the training batches of logged steps
    (the forward record, docs/ACTIVATIONS.md), through forward hooks (:mod:`tb_gradhealth._torchforward`) that the
    writing rank registers when such a batch starts and removes once its optimizer step is written: other batches,
    validation and prediction run none. Accumulated batches of one optimizer step are parts of its batch.
    """

    def __init__(self, log_dir: str | None = None, *, every: int = 100, first: int = 10,
                 hist_sample: int = record.DEFAULT_HIST_SAMPLE, updates: bool = True, sharded: bool = False,
                 name: str = "gradients", strict: bool = False, stop_on: Sequence[str] = (),
                 thresholds: Any = None, activations: bool = False) -> None:
        super().__init__()
        if log_dir is not None:  # one that can never be written fails here, before the trainer starts
            _storage.check_writable(log_dir)
        self.strict = bool(strict)
        self.log_dir, self.every, self.first = log_dir, every, first
        self.hist_sample, self.updates, self.sharded, self.name = hist_sample, updates, sharded, name
        self.writer: Writer | None = None
        self._pending: Any = None
        self._step = 0
        #: whether each ``.grad`` is the step's own; whether an optimizer step ran since the batch began
        self._watch: _torchparams.GradWatch | None = None
        self._stepping = False
        self._kinds: dict[str, tuple[str, str]] = {}
        #: what failed on the host costs a warning and a count, never the training (:mod:`tb_gradhealth._failsafe`)
        self.failsafe = Failsafe()
        #: what the records' metadata says of the loop (Lightning, the optimizer), known once training starts
        self.source = metadata.loop_source("lightning")
        #: the loss scale the logged step began with, under AMP with a scaler (else None)
        self._scale: float | None = None
        self._stop = StopCheck(stop_on, thresholds=thresholds, name=name) if stop_on else None
        #: a logged step whose stop decision every rank takes at the end of its batch
        self._decide = False
        self.activations = bool(activations)
        #: the layers' outputs in logged steps' batches (``activations=True``, the writing rank), made at setup
        self._forward: ForwardHooks | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero and self.writer is None:
            log_dir = self.log_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "gradhealth")
            self.writer = Writer(log_dir, hist_sample=self.hist_sample, strict=self.strict)
            if self._stop is not None:
                self._stop.watch(self.writer)
        self._kinds = self.failsafe.run("reading the layers' kinds", module_layer_info, pl_module) or {}
        if self.activations and self.writer is not None and self._forward is None:
            self._forward = ForwardHooks(pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self._forward is not None:  # this batch's optimizer step is global_step: hooks for its forward if logged
            self.failsafe.run("arming the forward hooks", self._forward.arm, self._logs(trainer.global_step))
            self._forward.begin()  # training_step may call the module's parts rather than its forward

    def _logs(self, step: int) -> bool:
        return step < self.first or step % self.every == 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        self.source = metadata.loop_source("lightning", optimizers[0] if optimizers else None)
        algorithm = trainer.gradient_clip_algorithm
        if getattr(algorithm, "value", algorithm) in (None, "norm"):  # clip_grad_norm_, after the record
            self.source = metadata.with_clip(self.source, trainer.gradient_clip_val)
        self._watch = self.failsafe.run("watching which gradients a step produces", _torchparams.GradWatch,
                                        list(pl_module.named_parameters()))
        if self._stop is not None:
            self._stop.rearm()  # a new fit may stop again

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        self._stepping = True
        logged = self._logs(step)
        self._decide = logged and self._stop is not None
        if not logged or not (self.sharded or trainer.is_global_zero):
            return
        params = list(pl_module.named_parameters())
        self._step = step
        scaler = _scaler(trainer)
        self._scale = float(scaler.get_scale()) if scaler is not None else None
        selection = self.failsafe.run("selecting the parameters to read", _torchparams.select, params, optimizer,
                                      self._watch, records=1)
        pending = None if selection is None else self.failsafe.run(
            "computing the gradient-health record", tgh.before_step, params, step, self.hist_sample, self.updates,
            selection=selection, records=1)
        self._pending = None if pending is None else (params, pending)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._stepping and self._watch is not None:  # global_step is now the next optimizer step's
            self.failsafe.run("watching which gradients a step produces", self._watch.stepped,
                              self._logs(trainer.global_step))
        stepped, self._stepping = self._stepping, False
        if self._pending is not None:
            self._write(trainer, outputs)
        if stepped and self._forward is not None:  # what a step not written saw goes; no hook until a logged batch
            self._forward.clear()
            self._forward.arm(False)
        if self._decide:
            self._decide = False
            self._stop_if_asked(trainer)

    def _write(self, trainer: pl.Trainer, outputs: Any) -> None:
        """The logged step's update, then its loss, records and loss-scaler scalars; then ``stop_on``'s check."""
        params, pending = self._pending
        self._pending = None
        rows = self.failsafe.run("finishing the gradient-health record", tgh.after_step, pending, params, self.sharded,
                                 records=1)
        if self.writer is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.failsafe.run("recording the loss", self.writer.add_loss, self._step, loss.detach())
        if rows is None:
            return
        names = [n for n, _ in params]
        self.failsafe.run("writing a gradient-health record", self.writer.add_records, self._step, names, rows,
                          name=self.name, layer_info=[self._kinds.get(n, ("", "")) for n in names],
                          source=self.source, records=1)
        if self._forward is not None:
            self.failsafe.run("writing the forward records", self._forward.write, self.writer, self._step,
                              name=self.name, source=self.source, records=1)
        scaler = _scaler(trainer)
        if self._scale is not None and scaler is not None:  # the scaler backs off exactly when it skips a step
            skipped = float(scaler.get_scale()) < self._scale
            self.failsafe.run("writing the loss scale", self.writer.add_scalars, self._step,
                              {"amp/loss_scale": self._scale, SKIPPED_TAG: float(skipped)})
        if self._stop is not None:
            event = self.failsafe.run("checking stop_on", self._stop.check, self._step)
            if event is not None:
                _log.warning("%s; stopping the trainer", event.message())

    def _stop_if_asked(self, trainer: pl.Trainer) -> None:
        """Every rank, at the end of a logged step: stop when the writing rank's check asked to."""
        if trainer.strategy.reduce_boolean_decision(self.should_stop, all=False):
            trainer.should_stop = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._forward, self.writer = release(self._forward, self.writer)


def _scaler(trainer: pl.Trainer) -> Any:
    """The loss scaler of the trainer's mixed precision (``precision="16-mixed"``), or None."""
    return getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
