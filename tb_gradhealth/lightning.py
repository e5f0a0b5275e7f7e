"""PyTorch Lightning callback: the gradient-health records of the gradients each optimizer step applies.

:class:`GradHealth` uses Lightning's ``on_before_optimizer_step`` hook, which runs after AMP's unscaling (and after
gradient clipping), just before ``optimizer.step()``: it records the gradients and weights there with
:mod:`tb_gradhealth.torch`, and the applied update once the batch ends. Under DDP every rank holds the same
all-reduced gradient and global rank 0 writes; under FSDP / ZeRO (``sharded=True``) every rank records its shards
and :func:`tb_gradhealth.torch.merge` makes the full gradients' records. On logged steps it also records the loss
``training_step`` returned and, in the tags' metadata, each parameter's layer kind and activation
(:mod:`tb_gradhealth.torch_kinds`): evidence the diagnosis weighs. A parameter with ``requires_grad=False`` or
outside the optimizer is recorded frozen, and a ``.grad`` not produced since the last optimizer step missing, as
under :class:`tb_gradhealth.torch.StepRecorder`. Lightning is imported only by this module.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch

from tb_gradhealth import _storage, _torchparams, record
from tb_gradhealth import torch as tgh
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth.torch_kinds import module_layer_info
from tb_gradhealth.writer import Writer

__all__ = ["GradHealth"]


class GradHealth(pl.Callback):
    """Record every layer's gradient health on the first ``first`` optimizer steps and every ``every``-th after.

    ``log_dir``: the run directory (default: the trainer's ``log_dir``, next to its TensorBoard logger's files).
    ``updates``: also record the applied update ``w_before - w_after`` (a transient copy of the weights on logged
    steps). ``sharded``: the parameters are shards (FSDP / DeepSpeed ZeRO); every rank must then take part.
    A given ``log_dir`` that can never be written (a parent that is a file, permission denied) raises here;
    ``strict``: a failed write raises instead of a warning (:class:`tb_gradhealth.Writer`).
    """

    def __init__(self, log_dir: str | None = None, *, every: int = 100, first: int = 10,
                 hist_sample: int = record.DEFAULT_HIST_SAMPLE, updates: bool = True, sharded: bool = False,
                 name: str = "gradients", strict: bool = False) -> None:
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

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.is_global_zero and self.writer is None:
            log_dir = self.log_dir or os.path.join(trainer.log_dir or trainer.default_root_dir, "gradhealth")
            self.writer = Writer(log_dir, hist_sample=self.hist_sample, strict=self.strict)
        self._kinds = self.failsafe.run("reading the layers' kinds", module_layer_info, pl_module) or {}

    def _logs(self, step: int) -> bool:
        return step < self.first or step % self.every == 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._watch = self.failsafe.run("watching which gradients a step produces", _torchparams.GradWatch,
                                        list(pl_module.named_parameters()))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        step = trainer.global_step
        self._stepping = True
        if not self._logs(step) or not (self.sharded or trainer.is_global_zero):
            return
        params = list(pl_module.named_parameters())
        self._step = step
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
        self._stepping = False
        if self._pending is None:
            return
        params, pending = self._pending
        self._pending = None
        rows = self.failsafe.run("finishing the gradient-health record", tgh.after_step, pending, params, self.sharded,
                                 records=1)
        if self.writer is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.failsafe.run("recording the loss", self.writer.add_loss, self._step, loss.detach())
        if rows is not None:
            names = [n for n, _ in params]
            self.failsafe.run("writing a gradient-health record", self.writer.add_records, self._step, names, rows,
                              name=self.name, layer_info=[self._kinds.get(n, ("", "")) for n in names], records=1)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
