"""The NaN-origin search of ``GradientHealthCallback``: keep the batch, keep the weights, replay the step.

* Batch: the model's train step returns its batch beside the logs (a reference to a tensor that
  already exists, so no copy and no extra device work outside XLA); the callback's dispatcher takes it back out
  before ``fit`` sees the logs and keeps those of the calls not yet read (at most the calls of one ring-buffer read).
  Only with ``steps_per_execution == 1``, no distribution strategy and not ``run_eagerly``: one step, one batch.
* Weights: on a captured step whose record shows a NaN/Inf gradient, the capture (in the step, or right after
  it) puts back the weights it already read for the update statistics (``record_updates``) and freezes them until
  the host has replayed that step, as dynamic loss scaling skips a non-finite step. The optimizer's own state
  (moments) is not put back.
* Replay: :func:`tb_gradhealth._tf.replay.replay` of ``model(x, training=True)`` and ``model.compute_loss`` on the
  kept batch, with the model's non-trainable state (batch-norm statistics) restored after it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import origin
from tb_gradhealth._core import NONFINITE_COLUMNS
from tb_gradhealth._tf import compat, replay, stepoutputs
from tb_gradhealth.origin import NanOrigin

_log = logging.getLogger("tb_gradhealth")

#: The key under which the train functions return their batch (taken out again before ``fit`` sees the logs).
BATCH_KEY = "_tb_gradhealth_batch"


def _unpack(data: Any) -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` of a batch, as ``train_step`` unpacks it (a tuple of 1 to 3, else ``x`` alone)."""
    if isinstance(data, list):
        data = tuple(data)
    if isinstance(data, tuple) and 1 <= len(data) <= 3:
        return (*data, *([None] * (3 - len(data))))
    return data, None, None


class FitOrigin(origin.OriginSearch):
    """The NaN-origin state of one ``fit``: kept batches by step, the freeze flag, and the answer once found."""

    def __init__(self, model: Any, log_dir: str, name: str, *, stop_after: bool, restores: bool) -> None:
        super().__init__(log_dir, name)
        self.model = model
        self.restores = restores
        self.stop_after = stop_after
        strategy = model.distribute_strategy
        self.keeps_batches = int(getattr(model, "steps_per_execution", 1) or 1) == 1 and \
            strategy.num_replicas_in_sync == 1 and not getattr(model, "run_eagerly", False)
        self.batches: dict[int, Any] = {}
        with strategy.scope():
            #: 1 from a step with a NaN/Inf gradient until the host has replayed it: captured updates are undone.
            self.frozen = tf.Variable(tf.constant(0, tf.int32), trainable=False, name="gh_frozen")

    def install(self) -> None:
        """Make ``model.train_step`` also return its batch (:mod:`tb_gradhealth._tf.stepoutputs`; read when
        ``fit``'s train functions trace; :meth:`uninstall` removes it)."""
        if self.keeps_batches:
            stepoutputs.add(self.model, BATCH_KEY, lambda data: data)

    def uninstall(self) -> None:
        stepoutputs.remove(self.model, BATCH_KEY)

    def take_batch(self, logs: Any, step: int, keep: bool) -> Any:
        """``logs`` without the batch; the batch of ``step`` kept when ``keep`` (a captured call)."""
        logs, batch = stepoutputs.take(logs, BATCH_KEY)
        if batch is not None and keep and self.origin is None:
            self.batches[step] = batch
        return logs

    def guard(self, rec: Any, variables: list[Any], before: list[Any]) -> None:
        """In the captured step: put the weights back when the gradient is not finite, or while frozen."""
        bad = tf.reduce_sum(tf.gather(rec.counts, NONFINITE_COLUMNS, axis=1)) > 0

        def restore() -> tf.Tensor:
            for v, w in zip(variables, before, strict=True):
                v.assign(tf.reshape(w, tf.shape(v)))  # those read before a step come flattened
            self.frozen.assign(1)
            return tf.constant(True)

        tf.cond(bad | (self.frozen > 0), restore, lambda: tf.constant(False))

    def check(self, step: int, rows: np.ndarray) -> NanOrigin | None:
        """After a record was read: the first non-finite one is replayed, stored and returned (else None)."""
        return self.find(step, rows)

    def finite(self, step: int) -> None:
        """A finite record of ``step``: the batches of it and of earlier steps are no longer needed."""
        self.batches = {s: b for s, b in self.batches.items() if s > step}

    def release(self) -> None:
        """Training goes on after a replay that expected it to stop (``stop_after``: ``stop_on`` did not stop at
        that step): the updates apply again."""
        self.frozen.assign(0)

    def replay(self, step: int) -> NanOrigin:
        """The kept batch of ``step`` replayed from the weights put back (or why it cannot be); the weights are
        unfrozen after it unless training stops."""
        batch = self.batches.pop(step, None)
        self.batches.clear()
        if batch is None:
            why = ("steps_per_execution > 1, a distribution strategy or run_eagerly" if not self.keeps_batches
                   else "the step's call was not a captured one")
            found = NanOrigin(step=step, found=False, framework="tensorflow",
                              reason=f"the batch of step {step} was not kept ({why})")
        elif not self.restores:
            found = NanOrigin(step=step, found=False, framework="tensorflow",
                              reason="the step's update was applied (record_updates=False keeps no copy of the "
                              "weights to put back)")
        else:
            try:
                found = self._replay(step, batch)
            except Exception as e:  # noqa: BLE001 - never raise from inside fit because of the data
                found = NanOrigin(step=step, found=False, framework="tensorflow",
                                  reason=f"the replay failed: {type(e).__name__}: {e}")
        if not self.stop_after:
            self.frozen.assign(0)
        return found

    def _replay(self, step: int, batch: Any) -> NanOrigin:
        model = self.model
        x, y, sample_weight = _unpack(batch)
        state = [(v, tf.identity(v)) for v in model.non_trainable_variables]

        def loss() -> Any:
            y_pred = model(x, training=True)
            return compat.compute_loss_for_inference(model, x, y, y_pred, sample_weight)

        try:
            return replay.replay(loss, model.trainable_variables, step=step, root=model,
                                     batch={"x": x, "y": y, "sample_weight": sample_weight})
        finally:
            for v, value in state:
                v.assign(value)
