"""The device side of ``GradientHealthCallback``: optimizer hooks and a ring buffer of records.

The hooks wrap two methods of the model's optimizer *instance* (through :mod:`tb_gradhealth._tf.compat`) before
``fit`` traces its train function:

* ``_all_reduce_sum_gradients`` (TF backend): the gradients after the cross-replica all-reduce, i.e. the gradient
  every replica applies (identity without a ``tf.distribute`` strategy);
* ``_backend_update_step(grads, variables, lr)``: runs after the optimizer has unscaled the gradients
  (``loss_scale_factor``, ``LossScaleOptimizer``: its inner optimizer is the one wrapped), clipped them and
  averaged accumulated ones; it is where the variables change.

The record (:func:`tb_gradhealth._tf.records.compute` of the applied gradient, the weights from before the update and
the update ``w_before - w_after``, a :class:`tb_gradhealth.record.Delta`) is stored with its step into a ring
buffer of non-trainable variables that the host reads (:meth:`Capture.read_new`). It is computed in one of two
places:

* **after the step** (``after_step``; one step a call, one replica, no XLA step): the train step returns the
  applied gradients beside its logs on the calls the host asked for (:attr:`Capture.wanted`; empty tensors on other
  calls; :mod:`tb_gradhealth._tf.stepoutputs`, :mod:`tb_gradhealth._tf.gradpack`: the largest as they are, the
  others packed into one buffer per dtype), the host reads the weights before a logged call (the
  update then writes new buffers, as it does for any read that stays alive) and computes the record after it. The
  train step is traced once, with nothing added but those outputs. The statistics run eagerly, a block of layers
  at a time (:mod:`tb_gradhealth._tf.blockstats`): nothing of them is traced, so nothing stays in memory after
  them, and they hold one block's temporaries at a time; or, asked to be compiled (frequent logging), as one XLA
  program.
* **in the step**: a second variant of the train function computes and stores the record in the update hook, on
  logged steps only (several steps a call, a distribution strategy, an XLA step, whose compiled program the
  statistics join, or an update applied inside a conditional such as ``LossScaleOptimizer``'s, where nothing made
  can leave the step but through variables).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import record
from tb_gradhealth._tf import blockstats, compat, gradpack, records, stepoutputs
from tb_gradhealth._tf.kernels import DeviceRecord
from tb_gradhealth._tf.naming import variable_names
from tb_gradhealth.record import Delta

#: Marks the optimizer instance that carries this module's hooks.
_OWNER = "_tb_gradhealth_capture"
#: The key under which the train step returns the applied gradients (taken out before ``fit`` sees the logs).
GRADIENTS_KEY = "_tb_gradhealth_gradients"

CUSTOM_LOOP_ADVICE = (
    "In a custom train_step or training loop, record the gradients yourself with "
    "tb_gradhealth.summary.gradients(zip(grads, model.trainable_variables)) inside a tf.summary writer's "
    "as_default() (or tb_gradhealth.Writer.add_gradients for non-TensorFlow code)."
)


class CaptureError(RuntimeError):
    """The callback cannot see the gradients that training applies (see the message for what to do instead)."""


class Capture:
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
        compiled: bool = True,
        after_step: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        #: Statistics computed after the step from the gradients it returns (True) or in the step (False).
        self.after_step = after_step
        #: After the step: the rows of the variables the optimizer updates, in its order, and where their
        #: gradients are in the buffers the step returns (:mod:`tb_gradhealth._tf.gradpack`); set when it traces.
        self.step_rows: list[int] | None = None
        self.step_layout: gradpack.Layout | None = None
        self._wanted_now = 0
        #: Statistics in one XLA program (True) or as plain graph ops in the step (``summary.compute(jit="graph")``).
        self.compiled = compiled
        #: The optimizer's step counter: its raw ``_iterations`` (batches, which ``iterations`` divides by
        #: ``gradient_accumulation_steps``), so steps line up with keras.callbacks.TensorBoard's batch steps.
        self.steps = compat.optimizer_step_counter(optimizer)
        self.variables = list(model.trainable_variables)
        self.layers = variable_names(self.variables)
        self.period = period
        self.slots = slots
        self.hist_sample = hist_sample
        self.seed = seed
        self.record_updates = record_updates
        self.traced = False
        #: Times the statistics were built: traced into a capturing step, or run after one (none until a call holds
        #: a logged step).
        self.statistics_built = 0
        #: Which train-function variant is being traced: "capture" (with the statistics) or "plain" (without).
        self.mode = "capture"
        #: ``guard(record, variables, weights_before)``, called in captured steps that copied the weights: the
        #: NaN-origin search's (tb_gradhealth._tf.fit_origin), which puts them back after a non-finite gradient.
        self.guard: Any = None
        self._local = threading.local()  # replica functions may trace in parallel threads (MirroredStrategy)
        self._rows = {id(v): i for i, v in enumerate(self.variables)}
        self._make_buffers(model.distribute_strategy, slots, len(self.variables))
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        #: Every trainable variable read and flattened, in one call (eagerly, one op instead of two per variable).
        self._read_weights = tf.function(lambda: [tf.reshape(v, [-1]) for v in self.variables], autograph=False)

    def _make_buffers(self, strategy: Any, slots: int, n: int) -> None:
        """The ring buffer: ``slots`` records of ``n`` layers, their steps, and the counters the step reads."""
        kw = dict(
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
        )
        with strategy.scope():
            self.counts = tf.Variable(tf.zeros([slots, n, record.NUM_COUNTS], tf.int32), name="gh_counts", **kw)
            self.values = tf.Variable(
                tf.zeros([slots, n, record.NUM_VALUES + record.HIST_BINS], tf.float32), name="gh_values", **kw
            )
            self.stamps = tf.Variable(tf.zeros([slots], tf.int64), name="gh_stamps", **kw)
            self.count = tf.Variable(tf.constant(0, tf.int64), name="gh_count", **kw)
            self.remaining = tf.Variable(tf.constant(0, tf.int32), name="gh_remaining", **kw)
            #: After the step: 1 while the host wants the step's gradients returned (set around a logged call).
            self.wanted = tf.Variable(tf.constant(0, tf.int32), name="gh_wanted", **kw)

    # --- optimizer wrappers (run at trace time, inside the train step) ----------------------------------------

    def install(self) -> None:
        """Wrap the optimizer's update and all-reduce methods (instance attributes; :meth:`uninstall` undoes)."""
        opt = self.optimizer
        stale = opt.__dict__.get(_OWNER)
        if stale is not None:  # a previous fit ended by an exception: drop its hooks first
            stale.uninstall()
        try:
            original_update, original_reduce = compat.optimizer_methods(opt)
        except compat.CompatError as e:
            raise CaptureError(f"{e}. {CUSTOM_LOOP_ADVICE}") from e

        def update_step(grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
            return self._update_step(original_update, grads, trainable_variables, learning_rate)

        def all_reduce(grads_and_vars: Any) -> Any:
            reduced = original_reduce(grads_and_vars)
            self._local.reduced = list(reduced)
            return reduced

        compat.set_optimizer_methods(opt, update_step, all_reduce if original_reduce is not None else None)
        opt.__dict__[_OWNER] = self
        if self.after_step:
            stepoutputs.add(self.model, GRADIENTS_KEY, self._step_output)

    def uninstall(self) -> None:
        stepoutputs.remove(self.model, GRADIENTS_KEY)
        opt = self.optimizer
        if opt.__dict__.get(_OWNER) is not self:
            return
        compat.restore_optimizer_methods(opt)
        opt.__dict__.pop(_OWNER, None)

    def record_in_step(self) -> None:
        """Leave the statistics after the step for those in it (the step applied its gradients where they cannot
        be returned): the caller then traces the two variants of the train function."""
        self.after_step = False
        stepoutputs.remove(self.model, GRADIENTS_KEY)

    def _step(self) -> tf.Tensor:
        """The logged step's number: the optimizer's count after its update (in the step, the update is still
        to come)."""
        return tf.cast(tf.convert_to_tensor(self.steps), tf.int64) + (0 if self.after_step else 1)

    def _should_capture(self) -> tf.Tensor:
        step = self._step()
        armed = self.remaining > 0
        if self.period <= 0:
            return armed
        return tf.logical_or(tf.equal(step % self.period, 0), armed)

    def _update_step(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        self.traced = True
        if self.after_step:
            return self._update_and_keep(original, grads, trainable_variables, learning_rate)
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
        if logged is None:  # every step is logged: no conditional around the statistics
            self._store(self._compute(rows, applied, before))
        else:
            self._store_if_logged(logged, rows, applied, before)
        return result

    def _update_and_keep(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        """The update, and the applied gradients kept for :meth:`_step_output` (after the step)."""
        rows = [self._row_of(v) for v in trainable_variables]
        self._local.reduced = None
        result = original(grads, trainable_variables, learning_rate)
        reduced, self._local.reduced = self._local.reduced, None
        self._local.applied = (rows, [g for g, _ in reduced] if reduced is not None else list(grads))
        return result

    def _step_output(self, data: Any) -> tuple[Any, ...] | None:
        """The applied gradients as a few outputs of the train step (:mod:`tb_gradhealth._tf.gradpack`: the
        largest as they are, the others packed), on the calls the host asked for (:attr:`wanted`; empty tensors on
        other calls, so that the gradients live no longer than in the plain step); ``None`` when the update ran
        where its tensors cannot leave (inside a conditional or a loop of the step) or did not run."""
        kept = getattr(self._local, "applied", None)
        self._local.applied = None
        if kept is None:
            return None
        rows, applied = kept
        if any(g is None for g in applied):
            return None
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        if graph is not None and any(g.graph is not graph for g in applied):
            return None
        try:
            where = gradpack.layout(applied)
        except (TypeError, ValueError):  # a shape known only when the step runs
            return None
        self.step_rows, self.step_layout = rows, where
        if graph is None:  # run_eagerly: the host's flag is the call's
            return tuple(gradpack.pack(applied, where) if self._wanted_now else gradpack.empty(where))
        return tuple(tf.cond(self.wanted > 0, lambda: gradpack.pack(applied, where), lambda: gradpack.empty(where)))

    def want(self, on: bool) -> None:
        """Ask the next calls to return their gradients (``on``) or not; a device write only when it changes."""
        if int(on) != self._wanted_now:
            self._wanted_now = int(on)
            self.wanted.assign(self._wanted_now)

    def weights_now(self) -> list[tf.Tensor] | None:
        """Before a logged call (after the step): a read of every trainable variable, flattened, which the update
        leaves as it is (it writes a new buffer while a read is alive); ``None`` without ``record_updates``."""
        return self._read_weights() if self.record_updates else None

    def record_after(self, parts: Any, before: list[tf.Tensor] | None) -> None:
        """After a call the host asked to log, eagerly: the record of the gradients it returned, stored as the
        step's hook would if its step is a logged one (by the device's count: a call the host predicted to log may
        not, after a step the host did not hear of)."""
        if not bool(self._should_capture()):
            return
        rows = self.step_rows
        after = self._read_weights()
        if self.compiled:  # one XLA program for the whole model, compiled at the first logged step
            before_rows = [before[r] for r in rows] if before is not None else None
            self._store(self._compute(rows, gradpack.unpack(parts, self.step_layout, flat=True), before_rows,
                                      after))
            return
        self.statistics_built += 1
        at = {row: k for k, row in enumerate(rows)}
        before_of = {r: before[r] for r in rows} if before is not None else None

        def inputs_of(layers: list[int]) -> tuple[list[Any], list[Any], list[Any]]:
            mine = [r for r in layers if r in at]
            cut = gradpack.unpack(parts, self.step_layout, [at[r] for r in mine], flat=True)
            return self._layer_inputs(layers, dict(zip(mine, cut, strict=True)), before_of, after)

        rec = blockstats.compute(self.sizes, inputs_of, hist_sample=self.hist_sample or 0, seed=self.seed)
        self._guard(rec, before_of)
        self._store(rec)

    def _layer_inputs(self, layers: list[int], grads: dict[int, Any], before: dict[int, Any] | None,
                      now: Sequence[Any] | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        """The gradients, weights and updates of the rows ``layers``, from the applied gradients and the weights
        before the update by row: a row the optimizer did not update has no gradient, its weight now, and no
        update; an updated row its weight before and ``before - after`` (a :class:`record.Delta`, subtracted
        inside the statistics' loop over the update, never written out). ``now``: every variable already read
        (by row), else each is read here."""
        after = [tf.convert_to_tensor(self.variables[r]) if now is None else now[r] for r in layers]
        if before is None:
            return [grads.get(r) for r in layers], after, [None] * len(layers)
        weights = [before.get(r, w) for r, w in zip(layers, after, strict=True)]
        updates = [Delta(before[r], w) if r in before else None for r, w in zip(layers, after, strict=True)]
        return [grads.get(r) for r in layers], weights, updates

    def _guard(self, rec: DeviceRecord, before: dict[int, Any] | None) -> None:
        """The NaN-origin search's guard on a record whose weights from before the update were kept."""
        if self.guard is not None and before is not None:
            self.guard(rec, [self.variables[r] for r in before], list(before.values()))

    def _store_if_logged(self, logged: tf.Tensor, rows: list[int], applied: list[Any], before: Any) -> None:
        """Statistics, and their store, on logged steps only (a call of several steps may hold unlogged ones)."""
        tf.cond(logged, lambda: self._store(self._compute(rows, applied, before)), lambda: tf.constant(False))

    def _row_of(self, variable: Any) -> int:
        row = self._rows.get(id(variable))
        if row is None:
            raise CaptureError(
                f"the optimizer updates variable {getattr(variable, 'path', variable)!r}, which is not among the "
                "model's trainable_variables when training began. " + CUSTOM_LOOP_ADVICE
            )
        return row

    def _compute(self, rows: list[int], applied: list[Any], before: list[Any] | None,
                 now: Sequence[Any] | None = None) -> DeviceRecord:
        """The record of every layer, in one function: ``applied`` and ``before`` are by position in ``rows``,
        ``now`` (the variables already read, else read here) by row."""
        self.statistics_built += 1
        before_of = dict(zip(rows, before, strict=True)) if before is not None else None
        grads, weights, updates = self._layer_inputs(list(range(len(self.variables))),
                                                     dict(zip(rows, applied, strict=True)), before_of, now)
        rec = records.compute(grads, weights, updates, hist_sample=self.hist_sample or 0, seed=self.seed,
                              jit=True if self.compiled else "graph")
        self._guard(rec, before_of)
        return rec

    def _store(self, rec: DeviceRecord) -> tf.Tensor:
        step = self._step()
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
