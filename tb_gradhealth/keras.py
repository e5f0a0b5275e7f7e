"""``GradientHealthCallback``: records the gradients that ``model.fit`` really applies (Keras 3, TensorFlow backend).

Why a hook and not a probe: recomputing gradients on one fixed batch at epoch end costs a whole extra
forward/backward pass and is not the gradient that training applied. The callback installs optimizer hooks
(:mod:`tb_gradhealth._tf.capture`). With logging sparser than every step, one step a call, one replica and no XLA
step (the usual ``fit`` on a CPU) the train function is traced once and returns the applied gradients beside its
logs when asked; the host, which counts steps, reads the weights before a call that holds a logged step and computes
the record after it. Otherwise a "capture" variant of the train function stores the record in the step, and is
called only for calls that contain a logged step; the other calls run a "plain" variant (the ordinary step), traced
only if such a call comes (not at ``update_freq=1``). Either way, other steps cost nothing, even under XLA. The host
reads the records back in batches and writes them with the TF-free :class:`tb_gradhealth.writer.Writer` under
``log_dir/train``, the directory ``keras.callbacks.TensorBoard`` writes its training scalars to.

The callback's state is one object per concern: the cadence (:class:`tb_gradhealth._stepbook.StepBook`, which
calls hold a logged step, and :class:`tb_gradhealth._stepbook.LossBook`, the batch loss beside them), the capture
path (a :class:`tb_gradhealth._tf.capture.Capture`, chosen once per ``fit`` by :func:`_choose_capture`, which a step
that turns out to update inside a conditional calls once more), where the records go (:class:`_RecordSink`), the
NaN-origin search (:class:`tb_gradhealth._tf.fit_origin.FitOrigin`), ``stop_on`` (a
:class:`tb_gradhealth.live.StopCheck`: the diagnosis ``tb-gradhealth report --step S`` gives, at each logged step
``S`` as it is written) and the probe batch (:class:`_Probe`).

Steps are counted like ``keras.callbacks.TensorBoard``'s batch summaries: the record of the optimizer's ``s``-th
step (``s`` = the raw step count after it, 1-based; with ``gradient_accumulation_steps`` the count of batches) is
written at step ``s``, next to ``batch_loss`` of the same batch; it describes the gradient evaluated at the weights
``w_{s-1}``, those weights, and the update ``w_{s-1} - w_s``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_gradhealth import _storage, layerinfo, metadata, record, summary
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth._stepbook import LossBook, StepBook, ring_plan
from tb_gradhealth._tf import capture, compat
from tb_gradhealth._tf.capture import CUSTOM_LOOP_ADVICE, Capture, CaptureError, CaptureKit, Ring
from tb_gradhealth._tf.fit_origin import FitOrigin
from tb_gradhealth._tf.forward import LayerHooks
from tb_gradhealth.live import StopCheck, StopEvent, Stoppable, check_stop_on
from tb_gradhealth.progress import SKIPPED_TAG
from tb_gradhealth.writer import Writer

__all__ = ["GradientHealthCallback", "CaptureError", "StopEvent"]

_log = logging.getLogger("tb_gradhealth")

#: Logging more often than every this many steps compiles the statistics with XLA (a compile of seconds and its
#: memory, for the cheapest logged step); sparser logging computes them as plain TensorFlow ops (nothing to compile;
#: a logged step costs more, paid once per ``update_freq`` steps). docs/PERFORMANCE.md has both.
_COMPILED_BELOW = 10


def _compiled_statistics(update_freq: Any, compile_statistics: bool | None) -> bool:
    """Whether the statistics are an XLA program (asked for, or frequent logging) or plain graph ops."""
    if compile_statistics is not None:
        return bool(compile_statistics)
    return isinstance(update_freq, int) and update_freq < _COMPILED_BELOW

def _records_after_step(model: Any, spe: int, period: int, conditional_update: bool = False) -> bool:
    """Whether the record is computed after the step from the gradients it returns: when some calls log and
    others do not (else the capturing step is the only one traced, and its statistics run beside its update),
    with one step a call, one replica, a step not compiled with XLA (there the statistics fuse into the compiled
    step instead of making it write the gradients out), and an update that does not run inside a conditional
    (``LossScaleOptimizer``, gradient accumulation, or ``conditional_update``: a step found at its first logged
    call to apply its gradients where they cannot leave it)."""
    optimizer = model.optimizer
    return (not conditional_update and period != 1 and spe == 1
            and model.distribute_strategy.num_replicas_in_sync == 1
            and not getattr(model, "jit_compile", False)
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not getattr(optimizer, "gradient_accumulation_steps", None))


def _choose_capture(kit: CaptureKit, spe: int, *, conditional_update: bool = False) -> Capture:
    """The capture path of a ``fit``, decided here and nowhere else: after the step where
    :func:`_records_after_step` allows it, else in the step. Called when training begins, and once more by a step
    whose first logged call finds its update inside a conditional (``conditional_update``: that update was traced,
    so the step does reach the optimizer)."""
    if _records_after_step(kit.model, spe, kit.ring.period, conditional_update):
        return capture.AfterStep(kit)
    return capture.InStep(kit, traced=conditional_update)


def _innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer that applies the updates: a ``LossScaleOptimizer`` delegates (unscaled) to its inner one."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _check_options(update_freq: Any, probe_data: Any, stop_on: Any) -> tuple[Any, tuple[str, ...]]:
    """``(update_freq, stop_on)`` normalised (``"batch"`` -> 1, a string -> a tuple); bad values raise ValueError."""
    if update_freq == "batch":
        update_freq = 1
    if update_freq is not None and update_freq != "epoch":
        if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
            raise ValueError(f"update_freq must be a positive integer, 'batch', 'epoch' or None, got {update_freq!r}")
    if update_freq is None and probe_data is None:
        raise ValueError("update_freq=None records no training gradients: give probe_data, or an update_freq")
    stop_on = check_stop_on(stop_on)
    if stop_on and update_freq is None:
        raise ValueError("stop_on needs recorded training gradients: set update_freq")
    if probe_data is not None and not (isinstance(probe_data, (tuple, list)) and len(probe_data) in (2, 3)):
        raise ValueError("probe_data must be (x, y) or (x, y, sample_weight)")
    return update_freq, stop_on


class _Probe:
    """``probe_data``: the gradient of the loss on one fixed batch (inference-mode forward), once per epoch."""

    def __init__(self, model: Any, data: tuple[Any, ...], hist_sample: int | None, seed: int | None) -> None:
        self.model, self.data = model, data
        self.variables = list(model.trainable_variables)
        self.layers = summary.variable_names(self.variables)
        variables, hist_sample = self.variables, hist_sample or 0

        @tf.function
        def probe(x: Any, y: Any, sample_weight: Any) -> Any:
            with tf.GradientTape() as tape:
                y_pred = model(x, training=False)
                loss = compat.compute_loss_for_inference(model, x, y, y_pred, sample_weight)
            grads = tape.gradient(loss, variables)
            weights = [tf.convert_to_tensor(v) for v in variables]
            return summary.compute(grads, weights, None, hist_sample=hist_sample, seed=seed)

        self.fn = probe

    def write(self, writer: Writer) -> None:
        x, y, *rest = self.data
        rec = self.fn(x, y, rest[0] if rest else None)
        step = int(compat.optimizer_step_counter(_innermost_optimizer(self.model.optimizer)).numpy())
        rows = record.from_device(rec.counts.numpy(), rec.values.numpy())
        writer.add_records(step, self.layers, rows, name="probe_gradients", kind="gradients")


class _RecordSink:
    """Where the records go: a :class:`Writer` under ``log_dir/train`` for the length of each ``fit``, the layers'
    names and kinds written with them, how far the device's ring buffer has been read, and what was dropped."""

    def __init__(self, train_dir: str, name: str, *, hist_sample: int | None, seed: int | None, strict: bool,
                 failsafe: Failsafe) -> None:
        self.train_dir, self.name = train_dir, name
        self.hist_sample, self.seed, self.strict = hist_sample, seed, strict
        self.failsafe = failsafe
        self.writer: Writer | None = None
        #: The ring buffer's records already read (its count at the last read).
        self.read_upto = 0
        self.layers: Sequence[str] = ()
        #: Each variable's layer kind and activation, kept in the tag's metadata to explain a status.
        self.layer_info: Sequence[Any] = ()
        #: Records the writers of earlier fits dropped.
        self.closed_dropped = 0

    @property
    def is_open(self) -> bool:
        return self.writer is not None

    @property
    def dropped_records(self) -> int:
        """Records not written: by the writers so far (the logdir could not be written for longer than a queue
        holds) and by failed host-side work."""
        writer = self.writer.dropped_records if self.writer is not None else 0
        return self.closed_dropped + writer + self.failsafe.dropped_records

    def open(self, source: Mapping[str, str]) -> None:
        """A fresh writer (stating ``source``, the training loop, in the tags' metadata), and the ring buffer of a
        new fit read from its start."""
        self.writer = Writer(self.train_dir, hist_sample=self.hist_sample, seed=self.seed,
                             filename_suffix=".gradhealth", strict=self.strict, source=source)
        self.read_upto = 0
        self.layers, self.layer_info = (), ()

    def describe(self, model: Any, variables: Sequence[Any], layers: Sequence[str]) -> None:
        """The row names of this fit's records, and each variable's layer kind and activation."""
        self.layers = layers
        self.layer_info = self.failsafe.run("reading the layers' kinds", layerinfo.model_layer_info, model,
                                            variables) or ()

    def read(self, ring: Ring) -> tuple[int, list[tuple[int, np.ndarray, np.ndarray | None]]]:
        """``(records read, [(step, rows, forward rows or None)] new since the last read)`` from the device's ring
        buffer; the records overwritten before this read are said in the log."""
        before = self.read_upto
        read = self.failsafe.run("reading the recorded gradients back from the device", ring.read_new, before)
        if read is None:
            return 0, []
        self.read_upto, new, lost = read
        if lost:
            _log.warning("tb_gradhealth: %d logged steps were overwritten before the host read them", lost)
        return self.read_upto - before, new

    def write(self, step: int, rows: np.ndarray) -> None:
        self.failsafe.run("writing a gradient-health record", self.writer.add_records, step, self.layers, rows,
                          name=self.name, kind="gradients", layer_info=self.layer_info, records=1)

    def write_forward(self, step: int, hooks: LayerHooks, stored: np.ndarray) -> None:
        """The step's forward records (the disk-form rows the step stored), named as its trace called the layers."""
        names, rows, info = hooks.rows_of(stored)
        if names:
            self.failsafe.run("writing the forward records", self.writer.add_records, step, names, rows,
                              name=self.name, kind=record.ACTIVATIONS, layer_info=info, records=1)

    def write_applied(self, step: int) -> None:
        """Under ``LossScaleOptimizer``: that the optimizer applied the logged step (``amp/step_skipped`` 0). A step
        it skips runs no update, so it has no record and no step of its own (the optimizer's step count, which
        numbers the records, does not advance): a recorded step is an applied one."""
        self.failsafe.run("writing the skip flag", self.writer.add_scalars, step, {SKIPPED_TAG: 0.0})

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.failsafe.run("closing the gradient-health writer", self.writer.close)
            self.closed_dropped += self.writer.dropped_records
            self.writer = None


class GradientHealthCallback(keras.callbacks.Callback, Stoppable):
    """Record per-layer gradient health of the gradients ``model.fit`` applies, for TensorBoard's Gradient Health tab.

    Args:
        log_dir: the run directory, as for ``keras.callbacks.TensorBoard`` (records go to ``log_dir/train``, next
            to that callback's training scalars; use the same ``log_dir`` for both to see them as one run).
        update_freq: an integer ``N``: record the gradient of every ``N``-th optimizer step (steps ``N, 2N, ...``,
            the steps at which ``TensorBoard(update_freq=N)`` writes ``batch_*`` scalars); or ``"epoch"``: the last
            step of each epoch (the first step of each epoch when the number of steps is unknown); ``"batch"``
            means 1, as in Keras; ``None`` records no training gradients (then ``probe_data`` is required).
            Unlogged steps cost a comparison; a logged step costs the statistics of the gradients, weights and
            updates (docs/KERAS.md has the measured cost of the default, 100, and of every step). Keras'
            TensorBoard defaults to ``"epoch"``, too coarse to see a gradient blow up.
        name: tag name of the records (``gradhealth/<name>/...``).
        record_updates: also record the applied update ``w_before - w_after`` (so the dashboard can show
            update/weight ratios whatever the optimizer). Costs a transient copy of the weights on logged steps;
            with ``False`` the weight norm is taken after the update.
        hist_sample: elements sampled per tensor for the histogram (``0``/``None``: exact); the other fields
            are always exact.
        seed: seed of the histogram sampling.
        probe_data: optional ``(x, y)`` or ``(x, y, sample_weight)`` batch: at each epoch end, the gradient of
            the loss on this fixed batch (inference-mode forward, so no batch-norm statistics change) is recorded
            under ``name="probe_gradients"``: gradients on a constant reference batch. Off by default:
            it costs an extra forward/backward pass and is not the gradient training applied.
        stop_on: statuses that stop training (``model.stop_training``) at the first logged step whose diagnosis
            shows a layer with one of them now: ``"nonfinite"``, ``"exploding"``, or any other flag of
            :data:`tb_gradhealth.health.FLAGS`. The diagnosis is the one ``tb-gradhealth report --step S`` gives on
            the logdir at that step (:class:`tb_gradhealth.live.StopCheck`: with the loss and the layers' kinds,
            from the records as written). The :class:`StopEvent` is logged and kept in :attr:`stop_event`.
        thresholds: a :class:`tb_gradhealth.health.Thresholds` or a mapping of its fields, for ``stop_on``.
        nan_origin: at the first recorded step whose gradient holds a NaN/Inf, put the weights of that step back,
            replay it op by op and store where the first NaN/Inf was made (op, layer, forward or backward, line of
            user code) in :attr:`origin`, the log and the run (docs/NAN_ORIGIN.md). Free until then.
        compile_statistics: compute the statistics of a logged step as one XLA program (``True``: the cheapest
            logged step, after a compile of seconds at the first one, and the compiled program's memory) or as
            plain TensorFlow ops (``False``: nothing to compile and no XLA memory; a logged step costs more; run
            eagerly a block of layers at a time where the record is taken after the step, else in the step).
            ``None`` (default): compiled when ``update_freq`` is below 10, plain ops for sparser logging
            (docs/PERFORMANCE.md, *Real architectures*, has both costs). Inside a ``jit_compile=True`` step the
            statistics are compiled with it either way.
        strict: a failed write raises (:class:`tb_gradhealth._storage.StrictWriteError`, ending ``fit``) instead
            of a warning with the events kept in memory until the fault clears. Either way a local ``log_dir``
            that can never be written (a parent that is a file, permission denied) raises here, at construction.
        activations: also record each layer's output at logged steps (the forward record, docs/ACTIVATIONS.md):
            computed inside the step where the output is made, under a conditional that only logged steps take,
            and stored beside the step's gradient record. Sequential, functional and subclassed models: every
            layer called as ``layer(x)`` that owns weights, and every activation layer. Off by default: a logged
            step reduces every recorded output once more.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike = "logs",
        update_freq: int | str | None = 100,
        *,
        name: str = "gradients",
        record_updates: bool = True,
        hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
        seed: int | None = None,
        probe_data: Sequence[Any] | None = None,
        stop_on: Sequence[str] = (),
        thresholds: Any = None,
        nan_origin: bool = True,
        compile_statistics: bool | None = None,
        strict: bool = False,
        activations: bool = False,
    ) -> None:
        super().__init__()
        if keras.backend.backend() != "tensorflow":  # pragma: no cover - the module imports TensorFlow
            raise CaptureError(
                f"GradientHealthCallback needs the TensorFlow backend of Keras (this is {keras.backend.backend()!r})."
                " With another backend, compute the gradients in your own step and log them with "
                "tb_gradhealth.Writer(log_dir).add_gradients(step, {name: grad}) (no TensorFlow needed)."
            )
        update_freq, stop_on = _check_options(update_freq, probe_data, stop_on)
        self.log_dir = str(log_dir)
        _storage.check_writable(self.train_dir)
        self.strict = bool(strict)
        self.update_freq = update_freq
        self.name = name
        self.record_updates = bool(record_updates)
        self.hist_sample = hist_sample
        self.seed = seed
        self.probe_data = tuple(probe_data) if probe_data is not None else None
        self.stop_on = stop_on
        self.nan_origin = bool(nan_origin)
        self.compile_statistics = compile_statistics
        self.activations = bool(activations)
        self._failsafe = Failsafe()
        # one object per concern, each (re)made for a fit in on_train_begin
        self._sink = _RecordSink(self.train_dir, name, hist_sample=hist_sample, seed=seed, strict=self.strict,
                                 failsafe=self._failsafe)
        self._book: StepBook | None = None
        self._loss = LossBook()
        #: the last step a loss was written at under a loss scaler (:meth:`_record_loss`)
        self._loss_step = 0
        self._capture: Capture | None = None
        self._origin: FitOrigin | None = None
        #: ``stop_on``: the live diagnosis of the records this callback writes, kept across fits as the logdir is
        self._stop = StopCheck(self.stop_on, thresholds=thresholds, name=name) if self.stop_on else None
        self._probe: _Probe | None = None
        self._warned_dropped = False

    @property
    def dropped_records(self) -> int:
        """Logged steps whose records were not written: the logdir could not be written for longer than the
        writer's queue holds, or the host-side work failed (each failure is logged once; training went on)."""
        return self._sink.dropped_records

    @property
    def train_dir(self) -> str:
        """Where the records go: ``log_dir/train``, as ``keras.callbacks.TensorBoard``'s training writer."""
        return os.path.join(self.log_dir, "train")

    @property
    def origin(self) -> Any:
        """Where the first NaN/Inf was made (:class:`tb_gradhealth.origin.NanOrigin`), once one was recorded."""
        return self._origin.origin if self._origin is not None else None

    # --- fit life cycle -----------------------------------------------------------------------------------------

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise CaptureError("GradientHealthCallback needs a compiled model with an optimizer (call compile()).")
        self._capture, self._book, self._origin = None, None, None
        self._sink.open(metadata.loop_source("keras.fit", _innermost_optimizer(model.optimizer)))
        if self._stop is not None:
            self._stop.rearm()  # a new fit may stop again
            self._stop.watch(self._sink.writer)
        if self.update_freq is not None:
            self._start_capture(model)

    def _start_capture(self, model: Any) -> None:
        """The ring buffer, the capture path chosen for this fit and its hooks; ``fit`` then calls
        :meth:`_dispatch` for each train call."""
        spe = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        hooks = self._layer_hooks(model) if self.activations else None
        row_bytes = len(model.trainable_variables) * (record.NUM_FIELDS - 1) * 4
        row_bytes += hooks.capacity * record.ACT_NUM_FIELDS * 4 if hooks is not None else 0
        period, slots, calls_per_read = ring_plan(self.update_freq, spe, row_bytes, bool(self.stop_on))
        self._origin = self._make_origin(model)
        # without the batch there is nothing to replay: leave the weights to the optimizer
        guard = self._origin.guard if self._origin is not None and self._origin.keeps_batches else None
        kit = capture.make_kit(model, _innermost_optimizer(model.optimizer), period=period, slots=slots,
                               record_updates=self.record_updates, hist_sample=self.hist_sample, seed=self.seed,
                               compiled=_compiled_statistics(self.update_freq, self.compile_statistics), guard=guard,
                               hooks=hooks)
        cap = self._capture = _choose_capture(kit, spe)
        cap.install()
        if self._origin is not None:
            self._origin.install()  # the train step returns its batch, for the replay
        self._sink.describe(model, kit.statistics.variables, kit.statistics.layers)
        # The optimizer step as the host predicts it (no device read per batch); a later fit continues the count.
        epoch_steps = self.params.get("steps") if self.params else None
        self._book = StepBook(period, spe, epoch_steps, calls_per_read, host_step=kit.ring.device_step())
        self._loss_step = self._book.host_step
        # fit() made (and may have traced) its train function before this call: the path's fresh ones trace with
        # the hooks in place. Calls that contain no logged step run the plain step, so they cost nothing, even
        # under XLA where a conditional on the gradients would keep them from fusing into the update.
        cap.take_over(self._dispatch)

    @staticmethod
    def _layer_hooks(model: Any) -> LayerHooks | None:
        """The forward hooks of this fit (``activations=True``), None (said in the log) for a model with no layer to
        record."""
        hooks = LayerHooks(model)
        if not hooks.targets:
            _log.warning("tb_gradhealth: activations=True found no layer to record in %s (no layer with weights or "
                         "activation layer is called as layer(x)); recording gradients only. Record outputs "
                         "yourself with tb_gradhealth.Writer.add_activations", type(model).__name__)
            return None
        return hooks

    def _make_origin(self, model: Any) -> FitOrigin | None:
        """The NaN-origin search of this fit (:mod:`tb_gradhealth._tf.fit_origin`), or None when switched off."""
        if not self.nan_origin:
            return None
        return FitOrigin(model, self.train_dir, self.name, stop_after="nonfinite" in self.stop_on,
                         restores=self.record_updates)

    def _dispatch(self, iterator: Any) -> Any:
        """One train call of ``fit``, through the capture path: the capturing call where the book predicts a
        logged step (none once the sink is closed: a fit that ended by an exception left this dispatcher)."""
        book = self._book
        done = self._capture.call(book.next_mode(inert=not self._sink.is_open), iterator)
        if done.failure is not None:
            self._stop_recording(*done.failure)
        if done.conditional_update:
            self._choose_again()
        logs = done.logs
        if self._origin is not None:  # the batch, kept for a replay: out of the logs before fit sees them
            logs = self._origin.take_batch(logs, book.host_step + book.call_steps, keep=book.last_mode == "capture")
        return logs

    def _stop_recording(self, what: str, error: Exception) -> None:
        """The statistics failed: every later call runs the plain step (training goes on), said once."""
        self._book.stop_capturing()
        _log.warning("tb_gradhealth: %s failed (%s: %s); training goes on with the plain step and records nothing "
                     "more in this fit", what, type(error).__name__, error, exc_info=True)

    def _choose_again(self) -> None:
        """The step applied its gradients where they cannot be returned (inside a conditional of a custom
        ``train_step``): the path is chosen again, knowing that, and its train functions take over from the next
        call on (this call's record is lost)."""
        _log.info("tb_gradhealth: the train step's update runs inside a conditional; recording in the step")
        old = self._capture
        old.uninstall()
        self._capture = _choose_capture(old.kit, self._book.spe, conditional_update=True)
        self._capture.install()
        self._capture.take_over(self._dispatch)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._loss.epoch_begin()  # Keras' running mean of the loss restarts with each epoch
        if self._capture is None:
            return
        # One device read per epoch keeps the host's step count exact: Keras can run a step the callbacks never
        # hear of (the call that finds a dataset of unknown length exhausted still advances the optimizer).
        remaining = self._book.epoch_begin(self._capture.kit.ring.device_step())
        if remaining is not None:  # unknown epoch length: record the first step of the epoch
            self._capture.kit.ring.arm(remaining)

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is None:
            return
        remaining = self._book.batch_begin(batch)
        self._loss.call_begin(batch, self._book.call_steps)
        if remaining is not None:  # this call runs the epoch's last step: record its steps
            self._capture.kit.ring.arm(remaining)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        cap, book = self._capture, self._book
        if cap is None:
            return
        first, read = book.batch_end(batch)
        if logs and "loss" in logs:
            if book.last_mode == "capture" and self._sink.is_open:
                # training progress beside the records: this call's batches' loss, from Keras' running mean
                self._failsafe.run("recording the loss", self._record_loss, logs["loss"])
            self._loss.saw(logs["loss"])
        if first and not cap.traced and not book.capture_failed:
            self._teardown()
            raise CaptureError(
                "GradientHealthCallback captured no gradient: the train step never called the model "
                "optimizer's apply()/apply_gradients() (a custom train_step or a non-Keras optimizer?). "
                + CUSTOM_LOOP_ADVICE
            )
        if read:  # else later: the ring buffer holds the records of several calls
            pending = book.pending
            if StepBook.lags(self._flush_captures(), pending):
                # Predicted a logged step in every call but fewer ran: the device's step count lags the host's
                # (e.g. steps skipped by LossScaleOptimizer, or the first call). Re-read it: one device read.
                book.resync(cap.kit.ring.device_step())

    def _record_loss(self, mean: Any) -> None:
        """This call's loss at the step its update was applied as. Under a loss scaler the host's count runs ahead
        of the optimizer's by every step it skipped, so the step is read from the device (one read of a counter,
        after a loss already read): a call that applied no update since the last loss written (its gradients
        overflowed) has no step of its own, and its loss is not written."""
        step = self._book.host_step
        if self._scaled:
            step = self._capture.kit.ring.device_step()
            self._book.resync(step)
            if step <= self._loss_step:
                return
            self._loss_step = step
        self._sink.writer.add_loss(step, self._loss.batch_loss(mean))

    @property
    def _scaled(self) -> bool:
        """The model's optimizer is a loss scaler: a step whose gradients overflow is skipped, not counted."""
        return isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._flush_captures(latest_only=self.update_freq == "epoch")
        if self.probe_data is not None and self._sink.is_open:
            self._failsafe.run("recording the probe batch's gradient", self._write_probe, records=1)
        self._sink.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self._flush_captures(latest_only=self.update_freq == "epoch")
        self._teardown()

    def _teardown(self) -> None:
        if self._origin is not None:
            self._origin.uninstall()
        if self._capture is not None:
            self._capture.close()
        self._sink.close()

    # --- host-side writing ----------------------------------------------------------------------------------

    def _flush_captures(self, latest_only: bool = False) -> int:
        """Write the records the device stored since the last read (``latest_only``: the newest one); each is
        then checked by the NaN-origin search and ``stop_on``. Returns how many were read."""
        if self._capture is None or not self._sink.is_open:
            return 0
        self._book.take_pending()
        read, new = self._sink.read(self._capture.kit.ring)
        scaled = self._scaled
        hooks = self._capture.kit.forward
        for step, rows, forward in new[-1:] if latest_only else new:
            self._sink.write(step, rows)
            if forward is not None and hooks is not None:
                self._sink.write_forward(step, hooks, forward)
            if scaled:
                self._sink.write_applied(step)
            self._check_record(step, rows)
        if hooks is not None and hooks.dropped and not self._warned_dropped:
            self._warned_dropped = True
            _log.warning("tb_gradhealth: a step called recorded layers %d times more than the %d rows kept a step; "
                         "the later calls' outputs are not recorded", hooks.dropped, hooks.capacity)
        return read

    def _check_record(self, step: int, rows: np.ndarray) -> None:
        """A written record, looked at by the NaN-origin search (the first non-finite one is replayed) and by
        ``stop_on`` (the first watched status stops training). The step's loss is written before its record is
        read, so the check sees what the logdir will hold at that step."""
        replayed = None
        if self._origin is not None and self._origin.origin is None:
            replayed = self._failsafe.run("finding where the NaN/Inf was made", self._origin.check, step, rows)
        stop = self._stop
        event = None
        if stop is not None and stop.event is None:
            event = self._failsafe.run("checking stop_on", stop.check, step, self.origin)
            if event is not None:
                _log.warning("%s; stopping training", event.message())
                self.model.stop_training = True
        if replayed is not None and event is None and self._origin.stop_after:
            self._origin.release()  # the diagnosis did not stop there: training and its updates go on

    def _write_probe(self) -> None:
        if self._probe is None:
            self._probe = _Probe(self.model, self.probe_data, self.hist_sample, self.seed)
        self._probe.write(self._sink.writer)
