"""Where the first NaN/Inf was made, in a custom TensorFlow training loop (eager, ``tf.function`` or XLA).

The step returns its device record (:func:`tb_gradhealth.summary.compute`), which counts NaN/Inf exactly;
:func:`apply_if_finite` applies the update only when the record is finite (as dynamic loss scaling skips a step),
so the weights stay those the step started from; :meth:`OriginFinder.check` reads the record's counts on the host
and, the first time they are not zero, replays the loss of that step eagerly, op by op, on the same batch, and
stores the answer next to the records. Nothing runs before the first NaN/Inf but the read of the counts::

    finder = OriginFinder(lambda x, y: loss_fn(y, model(x, training=True)), model.trainable_variables, log_dir)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        rec = summary.compute(list(zip(grads, model.trainable_variables)))
        apply_if_finite(optimizer, zip(grads, model.trainable_variables), rec)
        return rec

    for i, (x, y) in enumerate(dataset, 1):
        rec = step(x, y)
        summary.write(rec, names, i)
        if finder.check(i, rec, x, y) is not None:
            break  # finder.origin.message(): the op, its layer, forward or backward, the line
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tb_gradhealth import origin
from tb_gradhealth._core import NONFINITE_COLUMNS
from tb_gradhealth._tf import replay
from tb_gradhealth.origin import NanOrigin

__all__ = ["OriginFinder", "apply_if_finite", "NanOrigin"]

_log = logging.getLogger("tb_gradhealth")


def _nonfinite_total(device_record: Any) -> tf.Tensor:
    counts = device_record[0]
    return tf.reduce_sum(tf.gather(counts, NONFINITE_COLUMNS, axis=1))


def apply_if_finite(optimizer: Any, grads_and_vars: Any, device_record: Any) -> tf.Tensor:
    """``optimizer.apply_gradients(grads_and_vars)`` only when ``device_record`` (of those gradients) counts no
    NaN/Inf; returns whether it applied. Build the optimizer (``optimizer.build(variables)``) before tracing."""
    pairs = list(grads_and_vars)

    def apply() -> tf.Tensor:
        optimizer.apply_gradients(pairs)
        return tf.constant(True)

    return tf.cond(_nonfinite_total(device_record) > 0, lambda: tf.constant(False), apply)


class OriginFinder(origin.OriginSearch):
    """Replays the first step whose record holds a NaN/Inf and keeps the answer in :attr:`origin`.

    ``loss_fn(*batch)`` computes the step's loss (the forward pass in training mode) with the current weights;
    ``variables`` are the trained variables (checked to be finite before the replay); ``log_dir`` (optional) is the
    run directory where the answer is stored for TensorBoard and ``tb-gradhealth report``; ``root`` the model whose
    own name is left out of layer paths.
    """

    def __init__(self, loss_fn: Callable[..., Any], variables: Sequence[Any], log_dir: str | None = None, *,
                 name: str = "gradients", root: Any = None) -> None:
        super().__init__(log_dir, name)
        self.loss_fn = loss_fn
        self.variables = list(variables)
        self.root = root

    def check(self, step: int, device_record: Any, *batch: Any) -> NanOrigin | None:
        """After step ``step`` (its record and batch): the origin, the first time the record shows a NaN/Inf."""
        return self.find(step, device_record[0], batch=batch)

    def replay(self, step: int, *, batch: Sequence[Any]) -> NanOrigin:
        """The step replayed op by op on ``batch`` (:func:`tb_gradhealth._tf.replay.replay`)."""
        names = {f"batch[{i}]" if len(batch) > 1 else "batch": b for i, b in enumerate(batch)}
        return replay.replay(lambda: self.loss_fn(*batch), self.variables, step=step, batch=names, root=self.root)
