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

Steps are counted like ``keras.callbacks.TensorBoard``'s batch summaries: the record of the optimizer's ``s``-th
step (``s`` = the raw step count after it, 1-based; with ``gradient_accumulation_steps`` the count of batches) is
written at step ``s``, next to ``batch_loss`` of the same batch; it describes the gradient evaluated at the weights
``w_{s-1}``, those weights, and the update ``w_{s-1} - w_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_gradhealth import _storage, layerinfo, record, summary
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth._stepbook import StepBook, batch_loss, ring_plan
from tb_gradhealth._tf import compat, stepoutputs
from tb_gradhealth._tf.capture import CUSTOM_LOOP_ADVICE, GRADIENTS_KEY, Capture, CaptureError
from tb_gradhealth.writer import Writer

__all__ = ["GradientHealthCallback", "CaptureError", "StopEvent"]

_log = logging.getLogger("tb_gradhealth")

_STOP_CHOICES = ("nonfinite", "exploding")
#: Logging more often than every this many steps compiles the statistics with XLA (a compile of seconds and its
#: memory, for the cheapest logged step); sparser logging computes them as plain TensorFlow ops (nothing to compile;
#: a logged step costs more, paid once per ``update_freq`` steps). docs/PERFORMANCE.md has both.
_COMPILED_BELOW = 10


def _compiled_statistics(update_freq: Any, compile_statistics: bool | None) -> bool:
    """Whether the statistics are an XLA program (asked for, or frequent logging) or plain graph ops."""
    if compile_statistics is not None:
        return bool(compile_statistics)
    return isinstance(update_freq, int) and update_freq < _COMPILED_BELOW

@dataclass(frozen=True)
class StopEvent:
    """Why ``stop_on`` stopped training: the first logged step at which a watched status appeared.

    ``layer`` is the first bad layer in backpropagation order (the deepest one, where the backward pass meets
    it first, so usually where the problem starts); ``layers`` lists every bad layer at that step in network order.
    """

    step: int
    layer: str
    status: str
    layers: tuple[str, ...]
    #: Where the first NaN/Inf was made (a :class:`tb_gradhealth.origin.NanOrigin`), when it was looked for.
    origin: Any = None

    def message(self) -> str:
        others = f" (bad layers at that step: {', '.join(self.layers)})" if len(self.layers) > 1 else ""
        made = f"; {self.origin.message()}" if self.origin is not None else ""
        return f"tb_gradhealth: {self.status} gradient in layer {self.layer!r} at step {self.step}{others}{made}"


def _records_after_step(model: Any, spe: int, period: int) -> bool:
    """Whether the record is computed after the step from the gradients it returns: when some calls log and
    others do not (else the capturing step is the only one traced, and its statistics run beside its update),
    with one step a call, one replica, a step not compiled with XLA (there the statistics fuse into the compiled
    step instead of making it write the gradients out), and an update that does not run inside a conditional
    (``LossScaleOptimizer``, gradient accumulation). A step that still applies its gradients where they cannot
    leave it falls back at its first logged call (:meth:`GradientHealthCallback._record_in_step`)."""
    optimizer = model.optimizer
    return (period != 1 and spe == 1 and model.distribute_strategy.num_replicas_in_sync == 1
            and not getattr(model, "jit_compile", False)
            and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and not getattr(optimizer, "gradient_accumulation_steps", None))


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
    stop_on = (stop_on,) if isinstance(stop_on, str) else tuple(stop_on)
    unknown = [s for s in stop_on if s not in _STOP_CHOICES]
    if unknown:
        raise ValueError(f"stop_on accepts {_STOP_CHOICES}, got {unknown}")
    if stop_on and update_freq is None:
        raise ValueError("stop_on needs recorded training gradients: set update_freq")
    if probe_data is not None and not (isinstance(probe_data, (tuple, list)) and len(probe_data) in (2, 3)):
        raise ValueError("probe_data must be (x, y) or (x, y, sample_weight)")
    return update_freq, stop_on


class _StopWatch:
    """``stop_on``: checks each written record for the watched statuses (the dashboard's rule for exploding)."""

    def __init__(self, stop_on: tuple[str, ...], thresholds: Any) -> None:
        self.stop_on = stop_on
        self.thresholds = self._make_thresholds(thresholds) if "exploding" in stop_on else None
        self.history: list[tuple[int, np.ndarray]] = []

    @staticmethod
    def _make_thresholds(thresholds: Any) -> Any:
        from tb_gradhealth import health

        if thresholds is None:
            return health.Thresholds()
        if isinstance(thresholds, Mapping):
            return health.Thresholds.from_mapping({str(k): str(v) for k, v in thresholds.items()})
        return thresholds

    def check(self, layers: Sequence[str], step: int, rows: np.ndarray) -> StopEvent | None:
        """The stop event of this step's record, or ``None`` when no watched status shows."""
        bad: dict[str, str] = {}
        if "nonfinite" in self.stop_on:
            for i in np.flatnonzero(record.nonfinite_count(rows) > 0):
                bad[layers[i]] = "nonfinite"
        if "exploding" in self.stop_on:
            bad.update({k: v for k, v in self._exploding(layers, step, rows).items() if k not in bad})
        if not bad:
            return None
        ordered = tuple(n for n in layers if n in bad)
        first = ordered[-1]  # deepest: the backward pass reaches it first
        return StopEvent(step=step, layer=first, status=bad[first], layers=ordered)

    def _exploding(self, layers: Sequence[str], step: int, rows: np.ndarray) -> dict[str, str]:
        from tb_gradhealth import health

        self.history.append((step, rows))
        del self.history[:-256]
        steps = np.array([s for s, _ in self.history], dtype=np.int64)
        records = np.stack([r for _, r in self.history])
        run = health.diagnose_run(list(layers), steps, records, self.thresholds)
        return {lh.layer: lh.status for lh in run.layers if lh.status == "exploding" and lh.step == step}


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


class GradientHealthCallback(keras.callbacks.Callback):
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
        stop_on: statuses that stop training at the first logged step showing them: ``"nonfinite"`` (a NaN or
            Inf in a gradient) and/or ``"exploding"`` (as diagnosed by :mod:`tb_gradhealth.health` with
            ``thresholds``, the dashboard's rule). The layer and step are logged and kept in :attr:`stop_event`.
        thresholds: a :class:`tb_gradhealth.health.Thresholds` or a mapping of its fields (for ``"exploding"``).
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
        self._thresholds = thresholds
        #: Set when ``stop_on`` stopped training (else ``None``).
        self.stop_event: StopEvent | None = None
        self._capture: Capture | None = None
        self._writer: Writer | None = None
        self._probe: _Probe | None = None
        self._stop_watch = _StopWatch(self.stop_on, thresholds) if self.stop_on else None
        self.nan_origin = bool(nan_origin)
        self.compile_statistics = compile_statistics
        #: Where the first NaN/Inf was made (:class:`tb_gradhealth.origin.NanOrigin`), once one was recorded.
        self.origin: Any = None
        self._origin: Any = None
        self._failsafe = Failsafe()
        self._loss_seen: tuple[int, Any] = (0, 0.0)  # (batches of this epoch so far, Keras' mean loss over them)
        self._call_batches = 0
        self._writer_dropped = 0

    @property
    def dropped_records(self) -> int:
        """Logged steps whose records were not written: the logdir could not be written for longer than the
        writer's queue holds, or the host-side work failed (each failure is logged once; training went on)."""
        writer = self._writer.dropped_records if self._writer is not None else 0
        return self._writer_dropped + writer + self._failsafe.dropped_records

    @property
    def train_dir(self) -> str:
        """Where the records go: ``log_dir/train``, as ``keras.callbacks.TensorBoard``'s training writer."""
        return os.path.join(self.log_dir, "train")

    # --- fit life cycle -----------------------------------------------------------------------------------------

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise CaptureError("GradientHealthCallback needs a compiled model with an optimizer (call compile()).")
        self.stop_event = None
        self.origin = None
        if self._stop_watch is not None:
            self._stop_watch = _StopWatch(self.stop_on, self._thresholds)
        self._capture = None
        self._writer = Writer(self.train_dir, hist_sample=self.hist_sample, seed=self.seed,
                              filename_suffix=".gradhealth", strict=self.strict)
        self._read_upto = 0  # captures already written
        self._book: StepBook | None = None
        if self.update_freq is not None:
            self._start_capture(model)

    def _start_capture(self, model: Any) -> None:
        """Install the hooks and two fresh train functions; ``fit`` then calls :meth:`_dispatch` for each step."""
        spe = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        row_bytes = len(model.trainable_variables) * (record.NUM_FIELDS - 1) * 4
        period, slots, calls_per_read = ring_plan(self.update_freq, spe, row_bytes, bool(self.stop_on))
        cap = self._capture = Capture(
            model,
            _innermost_optimizer(model.optimizer),
            period=period,
            slots=slots,
            record_updates=self.record_updates,
            hist_sample=self.hist_sample,
            seed=self.seed,
            compiled=_compiled_statistics(self.update_freq, self.compile_statistics),
            after_step=_records_after_step(model, spe, period),
        )
        cap.install()
        self._origin = self._start_origin(model, cap)
        # each variable's layer kind and activation, kept in the tag's metadata to explain a status
        self._layer_info = self._failsafe.run("reading the layers' kinds", layerinfo.model_layer_info, model,
                                              cap.variables) or ()
        # The optimizer step as the host predicts it (no device read per batch); a later fit continues the count.
        epoch_steps = self.params.get("steps") if self.params else None
        self._book = StepBook(period, spe, epoch_steps, calls_per_read, host_step=int(cap.steps.numpy()))
        # fit() made (and may have traced) its train function before this call. Fresh ones trace with the hooks in
        # place: after the step, one that returns the applied gradients; in the step, "capture" computes and stores
        # the statistics on logged steps and "plain" is the ordinary step. Calls that contain no logged step run
        # "plain", so they cost nothing, even under XLA where a conditional on the gradients would keep them from
        # fusing into the update.
        self._functions = compat.train_functions(model, ("plain",) if cap.after_step else ("plain", "capture"))
        compat.set_train_function(model, self._dispatch)

    def _dispatch(self, iterator: Any) -> Any:
        book = self._book
        # a fit that ended by an exception left this dispatcher in place (no writer): stay inert
        mode = self._capture.mode = book.next_mode(inert=self._writer is None)  # read when the call traces
        logs = self._run(mode, iterator)
        if self._origin is not None:  # the batch, kept for a replay: out of the logs before fit sees them
            logs = self._origin.take_batch(logs, book.host_step + book.call_steps, keep=book.last_mode == "capture")
        return logs

    def _run(self, mode: str, iterator: Any) -> Any:
        """One call of the ``mode`` train function; the plain one instead if the capturing one fails for the
        statistics' sake (then for the rest of this fit)."""
        book = self._book
        if self._capture.after_step:
            return self._run_then_record(mode, iterator)
        if mode == "plain":
            return self._functions[mode](iterator)
        try:
            out = self._functions[mode](iterator)
        except Exception as e:  # noqa: BLE001 - sorted out by _is_ours
            if not self._is_ours(e):
                raise
            self._stop_recording("the step that records gradient health", e)
            return self._functions["plain"](iterator)
        book.capture_ran = True
        return out

    def _run_then_record(self, mode: str, iterator: Any) -> Any:
        """One call of the train function; on a capturing call, the weights read before it and the record of
        the gradients it returned computed after it. A failure of the record is the statistics' alone (the step
        has run): it is logged and the rest of this fit records nothing."""
        cap = self._capture
        cap.want(mode == "capture")
        before = cap.weights_now() if mode == "capture" else None
        logs, applied = stepoutputs.take(self._functions["plain"](iterator), GRADIENTS_KEY)
        if mode != "capture":
            return logs
        if applied is None:
            if cap.traced:
                self._record_in_step()
            return logs
        try:
            cap.record_after(applied, before)
            self._book.capture_ran = True
        except Exception as e:  # noqa: BLE001 - the step itself has run: only the record is lost
            self._stop_recording("recording gradient health after the step", e)
        return logs

    def _stop_recording(self, what: str, error: Exception) -> None:
        """The statistics failed: every later call runs the plain step (training goes on), said once."""
        self._book.capture_failed = True
        self._capture.mode = self._book.last_mode = "plain"
        _log.warning("tb_gradhealth: %s failed (%s: %s); training goes on with the plain step and records nothing "
                     "more in this fit", what, type(error).__name__, error, exc_info=True)

    def _record_in_step(self) -> None:
        """The step applied its gradients where they cannot be returned (inside a conditional of a custom
        ``train_step``): from the next call on, the two train-function variants record in the step instead
        (this call's record is lost)."""
        _log.info("tb_gradhealth: the train step's update runs inside a conditional; recording in the step")
        self._capture.record_in_step()
        self._functions = compat.train_functions(self.model, ("plain", "capture"))
        compat.set_train_function(self.model, self._dispatch)

    def _is_ours(self, error: Exception) -> bool:
        """Whether an exception of the capturing step may come from the statistics (then ``fit`` goes on with the
        plain step): any error while it is built (traced, compiled: its first run), and later a Python error or
        running out of memory; never the end of the data (Keras ends the epoch on it) nor an op's error at run time
        (the user's model raises it in the plain step too)."""
        if isinstance(error, (StopIteration, tf.errors.OutOfRangeError)):
            return False
        if not self._book.capture_ran:
            return True
        return not isinstance(error, tf.errors.OpError) or isinstance(error, tf.errors.ResourceExhaustedError)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._loss_seen = (0, 0.0)  # Keras' running mean of the loss restarts with each epoch
        if self._capture is None:
            return
        # One device read per epoch keeps the host's step count exact: Keras can run a step the callbacks never
        # hear of (the call that finds a dataset of unknown length exhausted still advances the optimizer).
        remaining = self._book.epoch_begin(int(self._capture.steps.numpy()))
        if remaining is not None:  # unknown epoch length: record the first step of the epoch
            self._capture.remaining.assign(remaining)

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is None:
            return
        remaining = self._book.batch_begin(batch)
        # the epoch's batches once this call is done (the batch passed to on_train_batch_end is the call's first on
        # Keras 3.0 and its last on later versions; the first, passed here, is the same on both)
        self._call_batches = batch + self._book.call_steps
        if remaining is not None:  # this call runs the epoch's last step: record its steps
            self._capture.remaining.assign(remaining)

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        cap = self._capture
        if cap is None:
            return
        first, read = self._book.batch_end(batch)
        if logs and "loss" in logs:
            if self._book.last_mode == "capture" and self._writer is not None:
                # training progress beside the records: this call's batches' loss, from Keras' running mean
                self._failsafe.run("recording the loss", self._record_loss, self._call_batches, logs["loss"])
            self._loss_seen = (self._call_batches, logs["loss"])  # kept as given: read only when the next call logs
        if first and not cap.traced and not self._book.capture_failed:
            self._teardown()
            raise CaptureError(
                "GradientHealthCallback captured no gradient: the train step never called the model "
                "optimizer's apply()/apply_gradients() (a custom train_step or a non-Keras optimizer?). "
                + CUSTOM_LOOP_ADVICE
            )
        if read:  # else later: the ring buffer holds the records of several calls
            before, pending = self._read_upto, self._book.pending
            self._flush_captures()
            if StepBook.lags(self._read_upto - before, pending):
                # Predicted a logged step in every call but fewer ran: the device's step count lags the host's
                # (e.g. steps skipped by LossScaleOptimizer, or the first call). Re-read it: one device read.
                self._book.host_step = int(cap.steps.numpy())

    def _record_loss(self, batches: int, mean: Any) -> None:
        seen, before = self._loss_seen
        try:
            value = batch_loss((seen, float(before)), (batches, float(mean)))
        except (TypeError, ValueError):
            value = mean  # not a number: add_loss says so (once) and writes nothing
        self._writer.add_loss(self._book.host_step, value)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is not None:
            self._flush_captures(latest_only=self.update_freq == "epoch")
        if self.probe_data is not None and self._writer is not None:
            self._failsafe.run("recording the probe batch's gradient", self._write_probe, records=1)
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is not None:
            self._flush_captures(latest_only=self.update_freq == "epoch")
        self._teardown()

    def _teardown(self) -> None:
        if self._origin is not None:
            self._origin.uninstall()
        if self._capture is not None:
            self._capture.uninstall()
            # Drop the traced functions that hold the hooks: later fit() calls without this callback pay nothing.
            compat.set_train_function(self.model, None)
        if self._writer is not None:
            self._failsafe.run("closing the gradient-health writer", self._writer.close)
            self._writer_dropped += self._writer.dropped_records
            self._writer = None

    # --- host-side writing ----------------------------------------------------------------------------------

    def _flush_captures(self, latest_only: bool = False) -> None:
        cap = self._capture
        if cap is None or self._writer is None:
            return
        self._book.take_pending()
        read = self._failsafe.run("reading the recorded gradients back from the device", cap.read_new, self._read_upto)
        if read is None:
            return
        self._read_upto, new, lost = read
        if lost:
            _log.warning("tb_gradhealth: %d logged steps were overwritten before the host read them", lost)
        if latest_only and new:
            new = new[-1:]
        for step, rows in new:
            self._failsafe.run("writing a gradient-health record", self._writer.add_records, step, cap.layers, rows,
                               name=self.name, kind="gradients", layer_info=self._layer_info, records=1)
            if self._origin is not None and self.origin is None:
                self.origin = self._failsafe.run("finding where the NaN/Inf was made", self._origin.check, step, rows)
            if self._stop_watch is not None and self.stop_event is None:
                self.stop_event = self._failsafe.run("checking stop_on", self._stop_watch.check, cap.layers, step, rows)
                if self.stop_event is not None and self.origin is not None:
                    self.stop_event = dataclasses.replace(self.stop_event, origin=self.origin)
                if self.stop_event is not None:
                    _log.warning("%s; stopping training", self.stop_event.message())
                    self.model.stop_training = True

    def _start_origin(self, model: Any, cap: Capture) -> Any:
        """The NaN-origin search of this fit (:mod:`tb_gradhealth._tf.fit_origin`), or None when switched off."""
        if not self.nan_origin:
            return None
        from tb_gradhealth._tf.fit_origin import FitOrigin

        found = FitOrigin(model, self.train_dir, self.name, stop_after="nonfinite" in self.stop_on,
                          restores=self.record_updates)
        found.install()  # the train step returns its batch, for the replay
        if found.keeps_batches:  # without the batch there is nothing to replay: leave the weights to the optimizer
            cap.guard = found.guard
        return found

    def _write_probe(self) -> None:
        if self._probe is None:
            self._probe = _Probe(self.model, self.probe_data, self.hist_sample, self.seed)
        self._probe.write(self._writer)
