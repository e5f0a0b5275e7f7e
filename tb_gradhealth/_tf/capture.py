"""The device side of ``GradientHealthCallback``: optimizer hooks, the statistics of a logged step, a ring buffer.

The hooks wrap two methods of the model's optimizer *instance* (through :mod:`tb_gradhealth._tf.compat`) before
``fit`` traces its train function:

* ``_all_reduce_sum_gradients`` (TF backend): the gradients after the cross-replica all-reduce, i.e. the gradient
  every replica applies (identity without a ``tf.distribute`` strategy);
* ``_backend_update_step(grads, variables, lr)``: runs after the optimizer has unscaled the gradients
  (``loss_scale_factor``, ``LossScaleOptimizer``: its inner optimizer is the one wrapped), clipped them and
  averaged accumulated ones; it is where the variables change.

The record (:class:`Statistics`: :func:`tb_gradhealth._tf.records.compute` of the applied gradient, the weights from
before the update and the update ``w_before - w_after``, a :class:`tb_gradhealth.record.Delta`) is stored with its
step into a :class:`Ring` of non-trainable variables that the host reads (:meth:`Ring.read_new`). Both are made once
per ``fit`` (a :class:`CaptureKit`); how the record is taken is one of two *capture paths*, each a :class:`Capture`
with the same few methods for the callback (install, take_over, call, close), chosen once by the callback:

* :class:`AfterStep` (one step a call, one replica, no XLA step): the train step returns the
  applied gradients beside its logs on the calls the host asked for (:attr:`AfterStep.wanted`; empty tensors on
  other calls; :mod:`tb_gradhealth._tf.stepoutputs`, :mod:`tb_gradhealth._tf.gradpack`: the largest as they are,
  the others packed into one buffer per dtype), the host reads the weights before a logged call (the
  update then writes new buffers, as it does for any read that stays alive) and computes the record after it. The
  train step is traced once, with nothing added but those outputs. The statistics run eagerly, a block of layers
  at a time (:mod:`tb_gradhealth._tf.blockstats`): nothing of them is traced, so nothing stays in memory after
  them, and they hold one block's temporaries at a time; or, asked to be compiled (frequent logging), as one XLA
  program.
* :class:`InStep`: a second variant of the train function computes and stores the record in the update hook, on
  logged steps only (several steps a call, a distribution strategy, an XLA step, whose compiled program the
  statistics join, or an update applied inside a conditional such as ``LossScaleOptimizer``'s, where nothing made
  can leave the step but through variables).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import tensorflow as tf

from tb_gradhealth import record
from tb_gradhealth._tf import blockstats, compat, gradpack, records, stepoutputs
from tb_gradhealth._tf import forward as forward_hooks
from tb_gradhealth._tf.kernels import DeviceRecord
from tb_gradhealth._tf.naming import variable_names
from tb_gradhealth.record import Delta

#: Marks the optimizer instance that carries this module's hooks.
_OWNER = "_tb_gradhealth_capture"
#: The key under which the train step returns the applied gradients (taken out before ``fit`` sees the logs).
GRADIENTS_KEY = "_tb_gradhealth_gradients"
#: The key under which it returns its layers' forward records (:mod:`tb_gradhealth._tf.forward`), likewise.
FORWARD_KEY = "_tb_gradhealth_forward"

CUSTOM_LOOP_ADVICE = (
    "In a custom train_step or training loop, record the gradients yourself with "
    "tb_gradhealth.summary.gradients(zip(grads, model.trainable_variables)) inside a tf.summary writer's "
    "as_default() (or tb_gradhealth.Writer.add_gradients for non-TensorFlow code)."
)


class CaptureError(RuntimeError):
    """The callback cannot see the gradients that training applies (see the message for what to do instead)."""


def _replica_local(strategy: Any, value: Any, name: str) -> tf.Variable:
    """A non-trainable variable that each replica writes locally (no cross-replica traffic in the step) and whose
    first replica's copy the host reads, right because every replica applies the same all-reduced gradient."""
    with strategy.scope():
        return tf.Variable(value, name=name, trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)


class Ring:
    """The records on the device: ``slots`` records of ``n`` layers with their steps, the count stored so far, the
    steps still to record whatever the period (``remaining``), and the optimizer's step counter."""

    def __init__(self, strategy: Any, steps: Any, *, period: int, slots: int, n: int, forward_rows: int = 0) -> None:
        #: The optimizer's step counter: its raw ``_iterations`` (batches, which ``iterations`` divides by
        #: ``gradient_accumulation_steps``), so steps line up with keras.callbacks.TensorBoard's batch steps.
        self.steps = steps
        #: Every ``period``-th step is logged (0: only those ``remaining`` asks for: epoch mode).
        self.period = period
        self.slots = slots
        self.counts = _replica_local(strategy, tf.zeros([slots, n, record.NUM_COUNTS], tf.int32), "gh_counts")
        self.values = _replica_local(strategy, tf.zeros([slots, n, record.NUM_VALUES + record.HIST_BINS], tf.float32),
                                     "gh_values")
        #: Each slot's forward records (disk form, :mod:`tb_gradhealth._tf.forward`), when layers' outputs are
        #: recorded: ``forward_rows`` rows a step.
        self.forward = _replica_local(strategy, tf.zeros([slots, forward_rows, record.ACT_NUM_FIELDS], tf.float32),
                                      "gh_forward") if forward_rows else None
        self.stamps = _replica_local(strategy, tf.zeros([slots], tf.int64), "gh_stamps")
        self.count = _replica_local(strategy, tf.constant(0, tf.int64), "gh_count")
        self.remaining = _replica_local(strategy, tf.constant(0, tf.int32), "gh_remaining")

    def device_step(self) -> int:
        """The optimizer's step count, read from the device (one read)."""
        return int(self.steps.numpy())

    def arm(self, steps: int) -> None:
        """Record the next ``steps`` steps whatever the period (epoch mode)."""
        self.remaining.assign(steps)

    def logged(self, step: tf.Tensor) -> tf.Tensor:
        """Whether ``step`` is a logged one: a multiple of the period, or asked for by :meth:`arm`."""
        armed = self.remaining > 0
        if self.period <= 0:
            return armed
        return tf.logical_or(tf.equal(step % self.period, 0), armed)

    def store(self, rec: DeviceRecord, step: tf.Tensor, forward: Any = None) -> tf.Tensor:
        """``rec`` (and the step's ``forward`` records) written at ``step`` into the next slot (the oldest one once
        the ring is full)."""
        count = self.count.read_value()
        slot = tf.reshape(tf.cast(count % self.slots, tf.int32), [1, 1])
        self.counts.assign(tf.tensor_scatter_nd_update(self.counts.read_value(), slot, rec.counts[None]))
        self.values.assign(tf.tensor_scatter_nd_update(self.values.read_value(), slot, rec.values[None]))
        if self.forward is not None and forward is not None:
            self.forward.assign(tf.tensor_scatter_nd_update(self.forward.read_value(), slot, forward[None]))
        self.stamps.assign(tf.tensor_scatter_nd_update(self.stamps.read_value(), slot, step[None]))
        self.count.assign(count + 1)
        self.remaining.assign(tf.maximum(self.remaining.read_value() - 1, 0))
        return tf.constant(True)

    def read_new(self, already: int) -> tuple[int, list[tuple[int, np.ndarray, np.ndarray | None]], int]:
        """Records captured since the first ``already``: ``(count, [(step, rows [L, F], forward rows or None)] by
        step, lost)``; the forward rows in their disk form ``[forward_rows, ACT_NUM_FIELDS]``."""
        count = int(self.count.numpy())
        if count <= already:
            return count, [], 0
        lost = max(0, count - already - self.slots)
        counts, values, stamps = self.counts.numpy(), self.values.numpy(), self.stamps.numpy()
        forward = self.forward.numpy() if self.forward is not None else None
        out = []
        for i in range(max(already, count - self.slots), count):
            slot = i % self.slots
            out.append((int(stamps[slot]), record.from_device(counts[slot], values[slot]),
                        None if forward is None else forward[slot]))
        out.sort(key=lambda item: item[0])
        return count, out, lost


class Statistics:
    """How a logged step's record is computed from the applied gradients and the weights before the update, the
    same for both capture paths: the whole model at once (traced in the step, or one XLA program after it), or
    eagerly a block of layers at a time (after the step)."""

    def __init__(self, variables: Sequence[Any], *, record_updates: bool, hist_sample: int | None,
                 seed: int | None, compiled: bool, guard: Any = None) -> None:
        self.variables = list(variables)
        self.layers = variable_names(self.variables)
        self.sizes = [int(np.prod(v.shape)) for v in self.variables]
        self.record_updates = record_updates
        self.hist_sample = hist_sample
        self.seed = seed
        #: One XLA program (True) or plain graph ops (``summary.compute(jit="graph")``, or eager blocks).
        self.compiled = compiled
        #: ``guard(record, variables, weights_before)``, called on records whose weights from before the update were
        #: kept: the NaN-origin search's (tb_gradhealth._tf.fit_origin), which puts them back after a NaN/Inf.
        self.guard = guard
        #: Times the statistics were built: traced into a capturing step, or run after one.
        self.built = 0
        self._rows = {id(v): i for i, v in enumerate(self.variables)}
        #: Every trainable variable read and flattened, in one call (eagerly, one op instead of two per variable).
        self.read_weights = tf.function(lambda: [tf.reshape(v, [-1]) for v in self.variables], autograph=False)

    def row_of(self, variable: Any) -> int:
        """The row of a variable the optimizer updates; one that was not trainable when training began raises."""
        row = self._rows.get(id(variable))
        if row is None:
            raise CaptureError(
                f"the optimizer updates variable {getattr(variable, 'path', variable)!r}, which is not among the "
                "model's trainable_variables when training began. " + CUSTOM_LOOP_ADVICE
            )
        return row

    def layer_inputs(self, layers: list[int], grads: dict[int, Any], before: dict[int, Any] | None,
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

    def whole(self, rows: list[int], applied: list[Any], before: list[Any] | None,
              now: Sequence[Any] | None = None) -> DeviceRecord:
        """The record of every layer, in one function: ``applied`` and ``before`` are by position in ``rows``,
        ``now`` (the variables already read, else read here) by row."""
        self.built += 1
        before_of = dict(zip(rows, before, strict=True)) if before is not None else None
        grads, weights, updates = self.layer_inputs(list(range(len(self.variables))),
                                                    dict(zip(rows, applied, strict=True)), before_of, now)
        rec = records.compute(grads, weights, updates, hist_sample=self.hist_sample or 0, seed=self.seed,
                              jit=True if self.compiled else "graph")
        self._guard(rec, before_of)
        return rec

    def blockwise(self, rows: list[int], cut: Callable[[list[int]], list[Any]], before: list[Any] | None,
                  now: Sequence[Any]) -> DeviceRecord:
        """The record computed eagerly a block of layers at a time (:mod:`tb_gradhealth._tf.blockstats`):
        ``cut(positions)`` gives the applied gradients at those positions of ``rows``; ``before`` and ``now``
        (every variable read before and after the update) are by row."""
        self.built += 1
        at = {row: k for k, row in enumerate(rows)}
        before_of = {r: before[r] for r in rows} if before is not None else None

        def inputs_of(layers: list[int]) -> tuple[list[Any], list[Any], list[Any]]:
            mine = [r for r in layers if r in at]
            grads = dict(zip(mine, cut([at[r] for r in mine]), strict=True))
            return self.layer_inputs(layers, grads, before_of, now)

        rec = blockstats.compute(self.sizes, inputs_of, hist_sample=self.hist_sample or 0, seed=self.seed)
        self._guard(rec, before_of)
        return rec

    def _guard(self, rec: DeviceRecord, before: dict[int, Any] | None) -> None:
        """The NaN-origin search's guard on a record whose weights from before the update were kept."""
        if self.guard is not None and before is not None:
            self.guard(rec, [self.variables[r] for r in before], list(before.values()))


@dataclass(frozen=True)
class CaptureKit:
    """What the capture paths of one ``fit`` share: the model, the optimizer that applies the updates, the ring
    buffer the host reads and how a record is computed (a path chosen again mid-fit keeps them)."""

    model: Any
    optimizer: Any
    ring: Ring
    statistics: Statistics
    #: The layers' outputs recorded in the step (:mod:`tb_gradhealth._tf.forward`), None when not asked for.
    forward: forward_hooks.LayerHooks | None = None


def make_kit(model: Any, optimizer: Any, *, period: int, slots: int, record_updates: bool,
             hist_sample: int | None, seed: int | None, compiled: bool, guard: Any = None,
             hooks: forward_hooks.LayerHooks | None = None) -> CaptureKit:
    """The ring buffer and statistics of one ``fit`` of ``model`` (``optimizer``: the one that applies the
    updates; ``hooks``: the layers' outputs too); the ring's variables are made under the model's distribution
    strategy."""
    stats = Statistics(model.trainable_variables, record_updates=record_updates, hist_sample=hist_sample,
                       seed=seed, compiled=compiled, guard=guard)
    ring = Ring(model.distribute_strategy, compat.optimizer_step_counter(optimizer), period=period, slots=slots,
                n=len(stats.variables), forward_rows=hooks.capacity if hooks is not None else 0)
    return CaptureKit(model, optimizer, ring, stats, hooks)


class CallResult(NamedTuple):
    """What one call of a capture path's train function gave: the logs for ``fit``, and what the callback acts on."""

    logs: Any
    #: ``(what, error)``: the statistics failed (the step ran, or ran again as the plain step); nothing more is
    #: recorded in this fit.
    failure: tuple[str, Exception] | None = None
    #: The step applied its update inside a conditional, where its gradients cannot leave it: this call's record
    #: is lost, and the path must be chosen again.
    conditional_update: bool = False


class _Trace(threading.local):
    """What one trace of the step hands from one optimizer hook to the next, per thread (replica functions may
    trace in parallel threads under ``MirroredStrategy``)."""

    def __init__(self) -> None:
        #: The all-reduced ``(gradient, variable)`` pairs of the update being traced.
        self.reduced: list[Any] | None = None
        #: After the step: ``(rows, applied gradients)`` of the update traced, for the step's outputs.
        self.applied: tuple[list[int], list[Any]] | None = None


class Capture:
    """A capture path: how one ``fit`` takes its records (:class:`AfterStep` or :class:`InStep`), over a
    :class:`CaptureKit`. The callback calls :meth:`install`, :meth:`take_over`, :meth:`call` and :meth:`close`
    the same way whichever path it chose."""

    #: The record is computed after the step from the gradients it returns (True) or in the step (False).
    after_step: ClassVar[bool]
    #: The train-function variants the path traces.
    variants: ClassVar[tuple[str, ...]]

    def __init__(self, kit: CaptureKit, *, traced: bool = False) -> None:
        self.kit = kit
        #: A trace of the step reached the optimizer's update (else the step applies no Keras optimizer).
        self.traced = traced
        #: The train function of each variant, fresh from :meth:`take_over`.
        self.functions: dict[str, Any] = {}
        self._trace = _Trace()

    @property
    def compiled(self) -> bool:
        """Whether the statistics are one XLA program."""
        return self.kit.statistics.compiled

    def install(self) -> None:
        """Wrap the optimizer's update and all-reduce methods (instance attributes; :meth:`uninstall` undoes)."""
        opt = self.kit.optimizer
        stale = opt.__dict__.get(_OWNER)
        if stale is not None:  # a previous fit ended by an exception (or another path): drop its hooks first
            stale.uninstall()
        try:
            original_update, original_reduce = compat.optimizer_methods(opt)
        except compat.CompatError as e:
            raise CaptureError(f"{e}. {CUSTOM_LOOP_ADVICE}") from e

        def update_step(grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
            self.traced = True
            return self._update_step(original_update, grads, trainable_variables, learning_rate)

        def all_reduce(grads_and_vars: Any) -> Any:
            reduced = original_reduce(grads_and_vars)
            self._trace.reduced = list(reduced)
            return reduced

        compat.set_optimizer_methods(opt, update_step, all_reduce if original_reduce is not None else None)
        opt.__dict__[_OWNER] = self
        if self.kit.forward is not None:  # the layers' outputs: hooks on their calls, opened and closed per trace
            self.kit.forward.install()
            stepoutputs.add(self.kit.model, FORWARD_KEY, self._forward_output, begin=self._forward_begin)

    def uninstall(self) -> None:
        """Put the optimizer's own methods back (if this path's hooks are still the ones installed)."""
        opt = self.kit.optimizer
        if opt.__dict__.get(_OWNER) is not self:
            return
        compat.restore_optimizer_methods(opt)
        opt.__dict__.pop(_OWNER, None)
        if self.kit.forward is not None:
            stepoutputs.remove(self.kit.model, FORWARD_KEY)
            self.kit.forward.uninstall()

    def _forward_begin(self) -> None:
        """A trace (or an eager run) of the train step begins: its layers' outputs are recorded under
        :meth:`_forward_logged`."""
        self.kit.forward.begin(self._forward_logged())

    def _forward_logged(self) -> Any:
        """Whether the step being traced records its layers' outputs: a boolean tensor, True (every step), or None
        (this trace records nothing)."""
        raise NotImplementedError

    def _forward_output(self, data: Any) -> Any:
        """After the step: the forward records it returns beside its logs (None: they were stored in the step)."""
        return self.kit.forward.end()

    def take_over(self, dispatch: Callable[[Any], Any]) -> None:
        """Fresh train functions, one per variant, traced at their first call with the hooks in place (``fit``
        made, and may have traced, its own before); ``fit`` then calls ``dispatch`` for each train call."""
        self.functions = compat.train_functions(self.kit.model, self.variants)
        compat.set_train_function(self.kit.model, dispatch)

    def close(self) -> None:
        """The hooks removed and the traced functions that hold them dropped: later ``fit`` calls without the
        callback pay nothing."""
        self.uninstall()
        self.functions = {}
        compat.set_train_function(self.kit.model, None)

    def call(self, mode: str, iterator: Any) -> CallResult:
        """One train call: ``mode`` ``"capture"`` for a call that may hold a logged step, else ``"plain"``."""
        raise NotImplementedError

    def _update_step(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        """The optimizer's update as traced into the step, with what the path adds to it."""
        raise NotImplementedError

    def _step(self) -> tf.Tensor:
        """The logged step's number: the optimizer's count after its update."""
        raise NotImplementedError

    def _apply(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> tuple[Any, list]:
        """``(result, applied gradients)`` of the optimizer's own update: the all-reduced gradients where the
        all-reduce hook saw them, else those given."""
        self._trace.reduced = None
        result = original(grads, trainable_variables, learning_rate)
        reduced, self._trace.reduced = self._trace.reduced, None
        return result, [g for g, _ in reduced] if reduced is not None else list(grads)

    def _store(self, rec: DeviceRecord, forward: Any = None) -> tf.Tensor:
        return self.kit.ring.store(rec, self._step(), forward)


class InStep(Capture):
    """The record computed and stored in the step: a *capture* variant of the train function for the calls that
    may hold a logged step (a ``tf.cond`` on the step's number, unless every step logs), the ordinary step for the
    others; a failure of the statistics turns to the ordinary step for the rest of the fit."""

    after_step = False
    variants = ("plain", "capture")

    def __init__(self, kit: CaptureKit, *, traced: bool = False) -> None:
        super().__init__(kit, traced=traced)
        #: The variant being traced and run (read when the update traces).
        self.mode = "plain"
        #: The capture variant has run once (so it was built: a later error of it is the model's).
        self.ran = False

    def call(self, mode: str, iterator: Any) -> CallResult:
        """One call of the ``mode`` variant; the plain one instead if the capturing one fails for the statistics'
        sake (then the caller records nothing more in this fit)."""
        self.mode = mode
        if mode == "plain":
            return CallResult(self.functions[mode](iterator))
        try:
            out = self.functions[mode](iterator)
        except Exception as e:  # noqa: BLE001 - sorted out by _is_ours
            if not self._is_ours(e):
                raise
            self.mode = "plain"
            return CallResult(self.functions["plain"](iterator), failure=("the step that records gradient health", e))
        self.ran = True
        return CallResult(out)

    def _is_ours(self, error: Exception) -> bool:
        """Whether an exception of the capturing step may come from the statistics (then ``fit`` goes on with the
        plain step): any error while it is built (traced, compiled: its first run), and later a Python error or
        running out of memory; never the end of the data (Keras ends the epoch on it) nor an op's error at run time
        (the user's model raises it in the plain step too)."""
        if isinstance(error, (StopIteration, tf.errors.OutOfRangeError)):
            return False
        if not self.ran:
            return True
        return not isinstance(error, tf.errors.OpError) or isinstance(error, tf.errors.ResourceExhaustedError)

    def _step(self) -> tf.Tensor:
        """In the step the update is still to come: its count plus one."""
        return tf.cast(tf.convert_to_tensor(self.kit.ring.steps), tf.int64) + 1

    def _forward_logged(self) -> Any:
        """The capture variant records the outputs of its logged steps (the plain one, nothing)."""
        if self.mode != "capture":
            return None
        return True if self.kit.ring.period == 1 else self.kit.ring.logged(self._step())

    def _forward_output(self, data: Any) -> Any:
        self.kit.forward.end()  # stored with the update's record; a step that ran no update has none
        return None

    def _update_step(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        if self.mode != "capture":
            return original(grads, trainable_variables, learning_rate)
        forward = self.kit.forward.end() if self.kit.forward is not None else None
        stats, ring = self.kit.statistics, self.kit.ring
        grads = list(grads)
        trainable_variables = list(trainable_variables)
        rows = [stats.row_of(v) for v in trainable_variables]
        logged = ring.logged(self._step()) if ring.period != 1 else None
        # The weights before the update. A read that stays alive across the update makes TensorFlow (and XLA) copy
        # the variable's buffer when the update writes it: the one copy this costs, only in the capture variant's
        # calls, and no lasting memory (the tensors die with the step).
        before = [tf.identity(tf.convert_to_tensor(v)) for v in trainable_variables] if stats.record_updates else None
        result, applied = self._apply(original, grads, trainable_variables, learning_rate)
        if logged is None:  # every step is logged: no conditional around the statistics
            self._store(stats.whole(rows, applied, before), forward)
        else:  # a call of several steps may hold unlogged ones
            tf.cond(logged, lambda: self._store(stats.whole(rows, applied, before), forward),
                    lambda: tf.constant(False))
        return result


class AfterStep(Capture):
    """The record computed after the step from the gradients it returns: one train function, traced once, which
    returns them on the calls the host asks for; the host reads the weights before such a call."""

    after_step = True
    variants = ("plain",)

    def __init__(self, kit: CaptureKit, *, traced: bool = False) -> None:
        super().__init__(kit, traced=traced)
        #: 1 while the host wants the step's gradients returned (set around a logged call).
        self.wanted = _replica_local(kit.model.distribute_strategy, tf.constant(0, tf.int32), "gh_wanted")
        self._wanted_now = 0
        #: The rows of the variables the optimizer updates, in its order, and where their gradients are in the
        #: buffers the step returns (:mod:`tb_gradhealth._tf.gradpack`); set when it traces.
        self.step_rows: list[int] | None = None
        self.step_layout: gradpack.Layout | None = None

    def install(self) -> None:
        """The optimizer hooks, and the applied gradients among the train step's outputs."""
        super().install()
        stepoutputs.add(self.kit.model, GRADIENTS_KEY, self._step_output)

    def uninstall(self) -> None:
        stepoutputs.remove(self.kit.model, GRADIENTS_KEY)
        super().uninstall()

    def call(self, mode: str, iterator: Any) -> CallResult:
        """One call of the train function; on a capturing call, the weights read before it and the record of
        the gradients it returned computed after it. A failure of the record is the statistics' alone (the step
        has run)."""
        capturing = mode == "capture"
        self.want(capturing)
        before = self.weights_now() if capturing else None
        logs, applied = stepoutputs.take(self.functions["plain"](iterator), GRADIENTS_KEY)
        logs, forward = stepoutputs.take(logs, FORWARD_KEY)
        if not capturing:
            return CallResult(logs)
        if applied is None:  # traced: the update ran where its gradients cannot leave the step
            return CallResult(logs, conditional_update=self.traced)
        try:
            self.record_after(applied, before, forward)
        except Exception as e:  # noqa: BLE001 - the step itself has run: only the record is lost
            return CallResult(logs, failure=("recording gradient health after the step", e))
        return CallResult(logs)

    def _step(self) -> tf.Tensor:
        return tf.cast(tf.convert_to_tensor(self.kit.ring.steps), tf.int64)

    def _forward_logged(self) -> Any:
        """The outputs of the calls the host asked for (:attr:`wanted`), returned beside the gradients."""
        if tf.executing_eagerly():  # run_eagerly: the host's flag is the call's
            return True if self._wanted_now else None
        return self.wanted > 0

    def _update_step(self, original: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
        """The update, and the applied gradients kept for :meth:`_step_output`."""
        rows = [self.kit.statistics.row_of(v) for v in trainable_variables]
        result, applied = self._apply(original, grads, trainable_variables, learning_rate)
        self._trace.applied = (rows, applied)
        return result

    def _step_output(self, data: Any) -> tuple[Any, ...] | None:
        """The applied gradients as a few outputs of the train step (:mod:`tb_gradhealth._tf.gradpack`: the
        largest as they are, the others packed), on the calls the host asked for (:attr:`wanted`; empty tensors on
        other calls, so that the gradients live no longer than in the plain step); ``None`` when the update ran
        where its tensors cannot leave (inside a conditional or a loop of the step) or did not run."""
        kept, self._trace.applied = self._trace.applied, None
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
        """Before a logged call: a read of every trainable variable, flattened, which the update leaves as it is
        (it writes a new buffer while a read is alive); ``None`` without ``record_updates``."""
        stats = self.kit.statistics
        return stats.read_weights() if stats.record_updates else None

    def record_after(self, parts: Any, before: list[tf.Tensor] | None, forward: Any = None) -> None:
        """After a call the host asked to log, eagerly: the record of the gradients it returned (and the forward
        records it returned beside them), stored as the step's hook would if its step is a logged one (by the
        device's count: a call the host predicted to log may not, after a step the host did not hear of)."""
        if not bool(self.kit.ring.logged(self._step())):
            return
        stats, rows, where = self.kit.statistics, self.step_rows, self.step_layout
        after = stats.read_weights()
        if stats.compiled:  # one XLA program for the whole model, compiled at the first logged step
            before_rows = [before[r] for r in rows] if before is not None else None
            self._store(stats.whole(rows, gradpack.unpack(parts, where, flat=True), before_rows, after), forward)
            return
        self._store(stats.blockwise(rows, lambda which: gradpack.unpack(parts, where, which, flat=True), before,
                                    after), forward)
