"""``GradientHealthCallback``: records the gradients that ``model.fit`` really applies (Keras 3, TensorFlow backend).

Why a hook and not a probe: the common Keras recipe (seed 003) recomputes gradients on one fixed batch at epoch
end, which costs a whole extra forward/backward pass and is not the gradient that training applied. Here the
callback wraps two methods *of the model's optimizer instance* before ``fit`` traces its train function:

* ``_all_reduce_sum_gradients`` (TF backend): returns the gradients after the cross-replica all-reduce, i.e. the
  gradient every replica applies (identity without a ``tf.distribute`` strategy);
* ``_backend_update_step(grads, variables, lr)``: runs after the optimizer has unscaled the gradients (base
  ``loss_scale_factor`` and ``LossScaleOptimizer``, whose *inner* optimizer is the one wrapped, so the record is the
  unscaled gradient), clipped them (``clipnorm``/``clipvalue``/``global_clipnorm``) and averaged accumulated ones
  (``gradient_accumulation_steps``); it is where the variables change.

The train function is traced twice: a "plain" variant (the ordinary step) and a "capture" variant; the host, which
counts steps, calls the capture variant only for calls that contain a logged step, so other steps cost nothing,
even under XLA (where a conditional that consumes the gradients would keep them from fusing into the update).
Inside the capture variant (and with ``jit_compile=True``, inside its XLA cluster), on logged steps (a ``tf.cond``
on ``optimizer.iterations``: a call may hold several steps), the wrapper keeps the weights from before the update,
and after it computes the device record (:func:`tb_gradhealth.summary.compute`) of the applied gradients with the
pre-update weights and the applied update ``w_before - w_after`` (a :class:`tb_gradhealth.summary.Delta`: the
subtraction runs inside the loop that reduces the update, so the difference is never written out and read back),
and stores it into a small ring buffer of non-trainable variables stamped with the step. At
``update_freq=1`` no conditional surrounds the statistics. The host reads the buffer after calls that contained a
logged step (when every call logs, once per up to 16 calls, as the buffer's size allows: a device read, decode and
event write per step measured ~1 ms, 6% of the reference step) and writes it with the TF-free
:class:`tb_gradhealth.writer.Writer` under ``log_dir/train``, the directory ``keras.callbacks.TensorBoard`` writes
its training scalars to, so both show as one run. With
``steps_per_execution > 1`` several logged steps may run inside one call: the ring buffer holds each.

Steps are counted like ``keras.callbacks.TensorBoard``'s batch summaries: the record of the optimizer's ``s``-th
step (``s = optimizer.iterations`` after it, 1-based; with ``gradient_accumulation_steps`` the raw count of
batches, of which only every k-th applies an update) is written at step ``s``, next to ``batch_loss`` of the same
batch; it describes the gradient evaluated at the weights ``w_{s-1}``, those weights, and the update
``w_{s-1} - w_s``. With SGD without momentum the recorded norm is therefore ``||w_{s-1} - w_s|| / lr``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tb_gradhealth import record, summary
from tb_gradhealth.writer import Writer

__all__ = ["GradientHealthCallback", "CaptureError", "StopEvent"]

_log = logging.getLogger("tb_gradhealth")

#: Names of the optimizer methods this module wraps (instance attributes shadow the class methods).
_UPDATE_STEP = "_backend_update_step"
_ALL_REDUCE = "_all_reduce_sum_gradients"
_OWNER = "_tb_gradhealth_capture"

_STOP_CHOICES = ("nonfinite", "exploding")
#: The host reads the ring buffer once per this many capturing calls (at most), so that logging every step does
#: not pay a device read, a decode and an event write per step (~1 ms a step on the reference CPU, 6% of it).
_MAX_CALLS_PER_READ = 16
#: ... as long as the ring buffer stays below this size (it is rewritten, whole, by each store).
_MAX_BUFFER_BYTES = 1 << 20


class CaptureError(RuntimeError):
    """The callback cannot see the gradients that training applies (see the message for what to do instead)."""


_CUSTOM_LOOP_ADVICE = (
    "In a custom train_step or training loop, record the gradients yourself with "
    "tb_gradhealth.summary.gradients(zip(grads, model.trainable_variables)) inside a tf.summary writer's "
    "as_default() (or tb_gradhealth.Writer.add_gradients for non-TensorFlow code)."
)


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

    def message(self) -> str:
        others = f" (bad layers at that step: {', '.join(self.layers)})" if len(self.layers) > 1 else ""
        return f"tb_gradhealth: {self.status} gradient in layer {self.layer!r} at step {self.step}{others}"


def _innermost_optimizer(optimizer: Any) -> Any:
    """The optimizer that applies the updates: a ``LossScaleOptimizer`` delegates (unscaled) to its inner one."""
    while isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return optimizer


def _step_counter(optimizer: Any) -> Any:
    """The optimizer's raw step variable ``_iterations`` (one per batch even with gradient accumulation)."""
    raw = getattr(optimizer, "_iterations", None)
    return raw if raw is not None else optimizer.iterations


class _Capture:
    """Device-side state of one ``fit``: the ring buffer variables and the two optimizer-method wrappers.

    All variables are created under the model's distribution strategy as ``ON_READ`` /
    ``ONLY_FIRST_REPLICA``: each replica writes its own copy locally (no cross-replica traffic in the step) and
    the host reads the first replica's, which is right because every replica applies the same all-reduced
    gradient.
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        *,
        period: int,
        slots: int,
        record_updates: bool,
        hist_sample: int | None,
        seed: int | None,
    ) -> None:
        self.optimizer = optimizer
        #: The optimizer's step counter: its raw ``_iterations`` (batches, which ``iterations`` divides by
        #: ``gradient_accumulation_steps``), so steps line up with keras.callbacks.TensorBoard's batch steps.
        self.steps = _step_counter(optimizer)
        self.variables = list(model.trainable_variables)
        self.layers = summary.variable_names(self.variables)
        self.period = period
        self.slots = slots
        self.hist_sample = hist_sample
        self.seed = seed
        self.record_updates = record_updates
        self.traced = False
        #: Which train-function variant is being traced: "capture" (with the statistics) or "plain" (without).
        self.mode = "capture"
        self._local = threading.local()  # replica functions may trace in parallel threads (MirroredStrategy)
        self._rows = {id(v): i for i, v in enumerate(self.variables)}
        n = len(self.variables)
        kw = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        with model.distribute_strategy.scope():
            self.counts = tf.Variable(tf.zeros([slots, n, record.NUM_COUNTS], tf.int32), name="gh_counts", **kw)
            self.values = tf.Variable(
                tf.zeros([slots, n, record.NUM_VALUES + record.HIST_BINS], tf.float32), name="gh_values", **kw
            )
            self.stamps = tf.Variable(tf.zeros([slots], tf.int64), name="gh_stamps", **kw)
            self.count = tf.Variable(tf.constant(0, tf.int64), name="gh_count", **kw)
            self.remaining = tf.Variable(tf.constant(0, tf.int32), name="gh_remaining", **kw)
            #: 1 until the statistics have run once: the first capturing call computes them even on an unlogged
            #: step (and stores nothing), so that without jit_compile their per-layer XLA clusters compile at
            #: the start of fit with the rest, not at the first logged step (a ~2 s step, measured).
            self.warm = tf.Variable(tf.constant(1, tf.int32), name="gh_warm", **kw)

    # --- optimizer wrappers (run at trace time, inside the train step) ----------------------------------------

    def install(self) -> None:
        opt = self.optimizer
        stale = opt.__dict__.get(_OWNER)
        if stale is not None:  # a previous fit ended by an exception: drop its hooks first
            stale.uninstall()
        if not hasattr(opt, _UPDATE_STEP):
            raise CaptureError(
                f"{type(opt).__name__} has no {_UPDATE_STEP}: this Keras version's optimizer is not supported. "
                + _CUSTOM_LOOP_ADVICE
            )
        original_update = getattr(opt, _UPDATE_STEP)
        original_reduce = getattr(opt, _ALL_REDUCE, None)

        def update_step(grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
            return self._update_step(original_update, grads, trainable_variables, learning_rate)

        def all_reduce(grads_and_vars: Any) -> Any:
            reduced = original_reduce(grads_and_vars)
            self._local.reduced = list(reduced)
            return reduced

        setattr(opt, _UPDATE_STEP, update_step)
        if original_reduce is not None:
            setattr(opt, _ALL_REDUCE, all_reduce)
        opt.__dict__[_OWNER] = self

    def uninstall(self) -> None:
        opt = self.optimizer
        if opt.__dict__.get(_OWNER) is not self:
            return
        for attr in (_UPDATE_STEP, _ALL_REDUCE, _OWNER):
            opt.__dict__.pop(attr, None)

    def _should_capture(self) -> tf.Tensor:
        step = tf.cast(tf.convert_to_tensor(self.steps), tf.int64) + 1
        armed = self.remaining > 0
        if self.period <= 0:
            return armed
        return tf.logical_or(tf.equal(step % self.period, 0), armed)

    def _update_step(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        self.traced = True
        if self.mode != "capture":
            return original(grads, trainable_variables, learning_rate)
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        rows = [self._row_of(v) for v in trainable_variables]
        logged = self._should_capture() if self.period != 1 else None
        # The weights before the update. A read that stays alive across the update makes TensorFlow (and XLA) copy
        # the variable's buffer when the update writes it: the one copy this costs, only in the capture variant's
        # calls, and no lasting memory (the tensors die with the step).
        before = [tf.identity(tf.convert_to_tensor(v)) for v in trainable_variables] if self.record_updates else None
        self._local.reduced = None
        result = original(grads, trainable_variables, learning_rate)
        reduced = self._local.reduced
        self._local.reduced = None
        applied = [g for g, _ in reduced] if reduced is not None else grads
        if self.period == 1:  # every step is logged: no conditional around the statistics
            self._store(self._compute(rows, applied, before))
        else:

            def compute_then_store_if_logged() -> tf.Tensor:
                rec = self._compute(rows, applied, before)  # an input of the inner cond: it runs either way
                stored = tf.cond(logged, lambda: self._store(rec), lambda: tf.constant(False))
                self.warm.assign(0)
                return stored

            tf.cond(logged | (self.warm > 0), compute_then_store_if_logged, lambda: tf.constant(False))
        return result

    def _row_of(self, variable: Any) -> int:
        row = self._rows.get(id(variable))
        if row is None:
            raise CaptureError(
                f"the optimizer updates variable {getattr(variable, 'path', variable)!r}, which is not among the "
                "model's trainable_variables when training began. " + _CUSTOM_LOOP_ADVICE
            )
        return row

    def _compute(self, rows: list[int], applied: list[Any], before: list[Any] | None) -> summary.DeviceRecord:
        n = len(self.variables)
        grads: list[Any] = [None] * n
        for row, g in zip(rows, applied, strict=True):
            grads[row] = g
        weights = [tf.convert_to_tensor(v) for v in self.variables]  # after the update
        updates = None
        if before is not None:  # variables the optimizer did not touch (no gradient) keep weights, update unknown
            updates = [None] * n
            for row, w in zip(rows, before, strict=True):
                # before - after, subtracted inside the statistics' loop over the update (never written out).
                updates[row] = summary.Delta(w, weights[row])
                weights[row] = w
        return summary.compute(grads, weights, updates, hist_sample=self.hist_sample or 0, seed=self.seed)

    def _store(self, rec: summary.DeviceRecord) -> tf.Tensor:
        step = tf.cast(tf.convert_to_tensor(self.steps), tf.int64) + 1
        count = self.count.read_value()
        slot = tf.reshape(tf.cast(count % self.slots, tf.int32), [1, 1])
        self.counts.assign(tf.tensor_scatter_nd_update(self.counts.read_value(), slot, rec.counts[None]))
        self.values.assign(tf.tensor_scatter_nd_update(self.values.read_value(), slot, rec.values[None]))
        self.stamps.assign(tf.tensor_scatter_nd_update(self.stamps.read_value(), slot, step[None]))
        self.count.assign(count + 1)
        self.remaining.assign(tf.maximum(self.remaining.read_value() - 1, 0))
        return tf.constant(True)

    # --- host side ----------------------------------------------------------------------------------------------

    def read_new(self, already: int) -> tuple[int, list[tuple[int, np.ndarray]], int]:
        """Records captured since the first ``already``: ``(count, [(step, rows [L, F])] by step, lost)``."""
        count = int(self.count.numpy())
        if count <= already:
            return count, [], 0
        lost = max(0, count - already - self.slots)
        counts, values, stamps = self.counts.numpy(), self.values.numpy(), self.stamps.numpy()
        out = []
        for i in range(max(already, count - self.slots), count):
            slot = i % self.slots
            out.append((int(stamps[slot]), record.from_device(counts[slot], values[slot])))
        out.sort(key=lambda item: item[0])
        return count, out, lost


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
            updates (see docs/KERAS.md for measured figures). The default, 100, keeps the average cost within 2%
            of a step (Keras' TensorBoard defaults to ``"epoch"``, too coarse to see a gradient blow up).
        name: tag name of the records (``gradhealth/<name>/...``).
        record_updates: also record the applied update ``w_before - w_after`` (so the dashboard can show
            update/weight ratios whatever the optimizer). Costs a transient copy of the weights on logged steps;
            with ``False`` the weight norm is taken after the update.
        hist_sample: elements sampled per tensor for the histogram (``0``/``None``: exact); the other fields
            are always exact.
        seed: seed of the histogram sampling.
        probe_data: optional ``(x, y)`` or ``(x, y, sample_weight)`` batch: at each epoch end, the gradient of
            the loss on this fixed batch (inference-mode forward, so no batch-norm statistics change) is recorded
            under ``name="probe_gradients"``: the seed-003 recipe, for a constant reference batch. Off by default:
            it costs an extra forward/backward pass and is not the gradient training applied.
        stop_on: statuses that stop training at the first logged step showing them: ``"nonfinite"`` (a NaN or
            Inf in a gradient) and/or ``"exploding"`` (as diagnosed by :mod:`tb_gradhealth.health` with
            ``thresholds``, the dashboard's rule). The layer and step are logged and kept in :attr:`stop_event`.
        thresholds: a :class:`tb_gradhealth.health.Thresholds` or a mapping of its fields (for ``"exploding"``).
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
    ) -> None:
        super().__init__()
        if keras.backend.backend() != "tensorflow":
            raise CaptureError(
                f"GradientHealthCallback needs the TensorFlow backend of Keras (this is {keras.backend.backend()!r})."
                " With another backend, compute the gradients in your own step and log them with "
                "tb_gradhealth.Writer(log_dir).add_gradients(step, {name: grad}) (no TensorFlow needed)."
            )
        if update_freq == "batch":
            update_freq = 1
        if update_freq is not None and update_freq != "epoch":
            if isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1:
                raise ValueError(
                    f"update_freq must be a positive integer, 'batch', 'epoch' or None, got {update_freq!r}"
                )
        if update_freq is None and probe_data is None:
            raise ValueError("update_freq=None records no training gradients: give probe_data, or an update_freq")
        if isinstance(stop_on, str):
            stop_on = (stop_on,)
        unknown = [s for s in stop_on if s not in _STOP_CHOICES]
        if unknown:
            raise ValueError(f"stop_on accepts {_STOP_CHOICES}, got {unknown}")
        if stop_on and update_freq is None:
            raise ValueError("stop_on needs recorded training gradients: set update_freq")
        if probe_data is not None and not (isinstance(probe_data, (tuple, list)) and len(probe_data) in (2, 3)):
            raise ValueError("probe_data must be (x, y) or (x, y, sample_weight)")
        self.log_dir = str(log_dir)
        self.update_freq = update_freq
        self.name = name
        self.record_updates = bool(record_updates)
        self.hist_sample = hist_sample
        self.seed = seed
        self.probe_data = tuple(probe_data) if probe_data is not None else None
        self.stop_on = tuple(stop_on)
        self._thresholds = self._make_thresholds(thresholds) if "exploding" in self.stop_on else None
        #: Set when ``stop_on`` stopped training (else ``None``).
        self.stop_event: StopEvent | None = None
        self._capture: _Capture | None = None
        self._writer: Writer | None = None
        self._probe_fn: Any = None
        self._history: list[tuple[int, np.ndarray]] = []

    @staticmethod
    def _make_thresholds(thresholds: Any) -> Any:
        from tb_gradhealth import health

        if thresholds is None:
            return health.Thresholds()
        if isinstance(thresholds, Mapping):
            return health.Thresholds.from_mapping({str(k): str(v) for k, v in thresholds.items()})
        return thresholds

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
        self._history = []
        self._capture = None
        self._writer = Writer(self.train_dir, hist_sample=self.hist_sample, seed=self.seed,
                              filename_suffix=".gradhealth")
        self._spe = max(1, int(getattr(model, "steps_per_execution", 1) or 1))
        self._steps = self.params.get("steps") if self.params else None
        self._read_upto = 0  # captures already written
        self._checked_capture = False
        self._arm = False  # the next train-function call must run the capturing variant (epoch mode)
        self._last_mode = "plain"
        self._epoch_batch_end = -1
        if self.update_freq is None:
            return
        self._pending = 0  # capturing calls since the host last read the ring buffer
        self._calls_per_read = 1
        if self.update_freq == "epoch":
            period, slots = 0, self._spe + 1
        else:
            period = int(self.update_freq)
            per_call = math.ceil(self._spe / period)  # logged steps one call may hold
            row_bytes = len(model.trainable_variables) * (record.NUM_FIELDS - 1) * 4
            # Batch the reads only when every call logs (period <= steps per call), where the host's step
            # prediction picks nothing; stop_on reads after every call, to stop at the very step.
            if period <= self._spe and not self.stop_on:
                self._calls_per_read = max(1, min(_MAX_CALLS_PER_READ, _MAX_BUFFER_BYTES // (per_call * row_bytes)))
            slots = per_call * self._calls_per_read + 2
        cap = self._capture = _Capture(
            model,
            _innermost_optimizer(model.optimizer),
            period=period,
            slots=slots,
            record_updates=self.record_updates,
            hist_sample=self.hist_sample,
            seed=self.seed,
        )
        cap.install()
        #: The optimizer step as the host predicts it (no device read per batch); a later fit continues the count.
        self._host_step = int(cap.steps.numpy())
        # fit() made (and may have traced, in an earlier fit) its train function before this call. Make two fresh
        # ones that trace with the hooks in place: "capture" computes and stores the statistics on logged steps;
        # "plain" is the ordinary step (the hook only notes that it was traced). Calls that contain no logged
        # step run "plain", so they cost exactly nothing, even under XLA where a conditional on the gradients
        # would keep them from fusing into the update.
        self._functions = {}
        for mode in ("plain", "capture"):
            model.make_train_function(force=True)
            self._functions[mode] = model.train_function
        model.train_function = self._dispatch

    def _call_logs(self) -> bool:
        """Whether the next train-function call (up to ``steps_per_execution`` steps) may contain a logged step."""
        if self._arm:
            return True
        period = self._capture.period
        return period > 0 and (self._host_step + self._spe) // period > self._host_step // period

    def _dispatch(self, iterator: Any) -> Any:
        # The first call always runs (so traces and compiles) the capture variant: its one-time cost lands at the
        # start of fit with the usual first-step compile, not at the first logged step (on an unlogged first step
        # the statistics still run once, storing nothing: `warm`), and a step that cannot be captured is reported
        # after the first batch.
        first = not self._checked_capture
        mode = "capture" if first or self._call_logs() else "plain"
        if self._writer is None:  # a fit that ended by an exception left this dispatcher in place: stay inert
            mode = "plain"
        self._arm = False
        self._capture.mode = mode  # read when the call traces (on its first use), in this thread or replicas'
        self._last_mode = mode
        return self._functions[mode](iterator)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch_batch_end = -1
        self._epoch_armed = False
        if self._capture is None:
            return
        # One device read per epoch keeps the host's step count exact: Keras can run a step the callbacks never
        # hear of (the call that finds a dataset of unknown length exhausted still advances the optimizer).
        self._host_step = int(self._capture.steps.numpy())
        if self.update_freq == "epoch" and not self._steps:
            self._capture.remaining.assign(1)  # unknown epoch length: record the first step of the epoch
            self._arm = True

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is None or self.update_freq != "epoch" or not self._steps or self._epoch_armed:
            return
        if batch + self._spe >= self._steps:  # this call runs the epoch's last step: record its steps
            self._capture.remaining.assign(self._steps - batch)
            self._arm = self._epoch_armed = True

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        cap = self._capture
        if cap is None:
            return
        self._host_step += batch - self._epoch_batch_end
        self._epoch_batch_end = batch
        if not self._checked_capture:
            self._checked_capture = True
            if not cap.traced:
                self._teardown()
                raise CaptureError(
                    "GradientHealthCallback captured no gradient: the train step never called the model "
                    "optimizer's apply()/apply_gradients() (a custom train_step or a non-Keras optimizer?). "
                    + _CUSTOM_LOOP_ADVICE
                )
        if self._last_mode == "capture" and cap.period > 0:
            self._pending += 1
            if self._pending < self._calls_per_read:
                return  # read later: the ring buffer holds the records of `_calls_per_read` calls
            before, pending = self._read_upto, self._pending
            self._flush_captures()
            if self._read_upto - before < pending:
                # Predicted a logged step in every call but fewer ran: the device's step count lags the host's
                # (e.g. steps skipped by LossScaleOptimizer, or the first call). Re-read it: one device read.
                self._host_step = int(cap.steps.numpy())

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is not None:
            self._flush_captures(latest_only=self.update_freq == "epoch")
        if self.probe_data is not None:
            self._write_probe()
        if self._writer is not None:
            self._writer.flush()

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        if self._capture is not None:
            self._flush_captures(latest_only=self.update_freq == "epoch")
        self._teardown()

    def _teardown(self) -> None:
        if self._capture is not None:
            self._capture.uninstall()
            # Drop the traced functions that hold the hooks: later fit() calls without this callback pay nothing.
            self.model.make_train_function(force=True)
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # --- host-side writing ----------------------------------------------------------------------------------

    def _flush_captures(self, latest_only: bool = False) -> None:
        cap = self._capture
        if cap is None or self._writer is None:
            return
        self._pending = 0
        self._read_upto, new, lost = cap.read_new(self._read_upto)
        if lost:
            _log.warning("tb_gradhealth: %d logged steps were overwritten before the host read them", lost)
        if latest_only and new:
            new = new[-1:]
        for step, rows in new:
            self._writer.add_records(step, cap.layers, rows, name=self.name, kind="gradients")
            if self.stop_on and self.stop_event is None:
                self._check_stop(step, rows)

    def _check_stop(self, step: int, rows: np.ndarray) -> None:
        cap = self._capture
        bad: dict[str, str] = {}
        if "nonfinite" in self.stop_on:
            nonfinite = rows[:, record.INDEX["nan"]] + rows[:, record.INDEX["posinf"]] + rows[:, record.INDEX["neginf"]]
            for i in np.flatnonzero(nonfinite > 0):
                bad[cap.layers[i]] = "nonfinite"
        if "exploding" in self.stop_on:
            bad.update({k: v for k, v in self._exploding(step, rows).items() if k not in bad})
        if not bad:
            return
        ordered = tuple(n for n in cap.layers if n in bad)
        first = ordered[-1]  # deepest: the backward pass reaches it first
        self.stop_event = StopEvent(step=step, layer=first, status=bad[first], layers=ordered)
        _log.warning("%s; stopping training", self.stop_event.message())
        self.model.stop_training = True

    def _exploding(self, step: int, rows: np.ndarray) -> dict[str, str]:
        from tb_gradhealth import health

        self._history.append((step, rows))
        del self._history[:-256]
        steps = np.array([s for s, _ in self._history], dtype=np.int64)
        records = np.stack([r for _, r in self._history])
        run = health.diagnose_run(self._capture.layers, steps, records, self._thresholds)
        return {lh.layer: lh.status for lh in run.layers if lh.status == "exploding" and lh.step == step}

    # --- probe mode (seed 003) --------------------------------------------------------------------------------

    def _write_probe(self) -> None:
        model = self.model
        variables = list(model.trainable_variables)
        layers = summary.variable_names(variables)
        if self._probe_fn is None:
            hist_sample, seed = self.hist_sample or 0, self.seed

            @tf.function
            def probe(x: Any, y: Any, sample_weight: Any) -> Any:
                with tf.GradientTape() as tape:
                    y_pred = model(x, training=False)
                    loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
                grads = tape.gradient(loss, variables)
                weights = [tf.convert_to_tensor(v) for v in variables]
                return summary.compute(grads, weights, None, hist_sample=hist_sample, seed=seed)

            self._probe_fn = probe
        x, y, *rest = self.probe_data
        rec = self._probe_fn(x, y, rest[0] if rest else None)
        optimizer = _innermost_optimizer(model.optimizer)
        step = int(_step_counter(optimizer).numpy())
        rows = record.from_device(rec.counts.numpy(), rec.values.numpy())
        self._writer.add_records(step, layers, rows, name="probe_gradients", kind="gradients")
