"""Gradient accumulation over micro-batches (TF2), with the record of the applied gradient and the gradient noise.

Accumulating ``k`` micro-batch gradients before one optimizer step simulates a ``k`` times larger batch on one
device. The accumulator keeps, per variable, the running *mean* of the micro-batch gradients (one
buffer of the variable's size, as the seed's ``assign_add(g / k)`` does) and, per layer, one extra scalar: the sum
of squared deviations of the micro-batch gradients from their mean, which gives the **gradient noise** for free:

    noise_ssq_rel = sum_i ||g_i - mean||^2 / (k - 1) / max|mean|^2          (record.noise_fields, float64 reference)
    noise         = sqrt(noise_ssq_rel / ssq_rel)  = std_i(g_i) / ||mean||    (record.derived)

``noise`` is the sample standard deviation of the micro-batch gradients (as vectors) over the norm of their mean:
the inverse of a gradient signal-to-noise ratio. Near 0 the micro-batches agree (a larger batch buys little);
above 1 one micro-batch's gradient is mostly noise; above ``sqrt(k)`` even their mean is.

Why Welford and not ``sum ||g_i||^2 - k ||mean||^2``: for a low-noise layer the two terms agree to many digits
and float32 cancellation leaves garbage (even negative values); the relative error of that difference is about
``eps * (||g|| / ||g - mean||)^2``. Welford's update ``M2 += (g - mean_old) . (g - mean_new)`` never subtracts
large sums, so its relative error is about ``eps * ||g|| / ||g - mean||`` (see tests/test_accumulate.py, which
measures both against numpy float64). ``M2`` is kept relative to a running scale (the largest deviation seen),
as ``record.py`` keeps sums of squares relative to ``max|g|``, so it neither overflows nor underflows float32.

Example::

    acc = GradientAccumulator(model.trainable_variables, micro_batches=4)

    @tf.function
    def micro_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        acc.add(tape.gradient(loss, model.trainable_variables))
        return loss

    @tf.function
    def apply_step():
        return acc.apply(optimizer)        # DeviceRecord of the applied (mean) gradient, noise filled

    writer = tf.summary.create_file_writer(log_dir)
    for step, batches in enumerate(groups_of_4_micro_batches):
        for x, y in batches:
            micro_step(x, y)
        rec = apply_step()
        with writer.as_default():
            tb_gradhealth.summary.write(rec, acc.layers, step=step)

The accumulators are plain (non-mirrored) variables: use it on one device. Under ``tf.distribute`` record the
per-replica or the applied gradients with :mod:`tb_gradhealth.tpu` instead (Keras 3 optimizers also accumulate
by themselves with ``gradient_accumulation_steps=k``, without the noise figure).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tb_gradhealth import record, summary

__all__ = ["GradientAccumulator", "set_noise_fields"]

_MICRO = record.INDEX["micro_batches"] - record.NUM_COUNTS
_NOISE = record.INDEX["noise_ssq_rel"] - record.NUM_COUNTS


def _accumulator_dtype(dtype: tf.DType) -> tf.DType:
    """Accumulate half-precision gradients in float32 (mixed precision), float64 in float64."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def _finite_max_abs(x: tf.Tensor) -> tf.Tensor:
    """max|x| over finite elements (0 when none), in float32 for the per-layer scalars."""
    a = tf.abs(x)
    return tf.cast(tf.reduce_max(tf.where(tf.math.is_finite(a), a, tf.zeros_like(a))), tf.float32)


def set_noise_fields(device_record: Any, micro_batches: tf.Tensor, noise_ssq_rel: tf.Tensor) -> Any:
    """A copy of ``device_record`` (counts [L,5], values [L,89]) with ``micro_batches`` / ``noise_ssq_rel`` set.

    Built from column slices rather than a scatter so that it stays XLA-friendly.
    """
    counts, values = device_record
    n_layers = tf.shape(values)[0]
    micro = tf.broadcast_to(tf.reshape(tf.cast(micro_batches, tf.float32), [-1, 1]), [n_layers, 1])
    noise = tf.reshape(tf.cast(noise_ssq_rel, tf.float32), [-1, 1])
    new_values = tf.concat(
        [values[:, :_MICRO], micro, values[:, _MICRO + 1 : _NOISE], noise, values[:, _NOISE + 1 :]], axis=1
    )
    return summary.DeviceRecord(counts, new_values)


class GradientAccumulator(tf.Module):
    """Averages micro-batch gradients for one optimizer step and measures their spread (the gradient noise).

    ``add(grads)`` folds one micro-batch's gradients in (any number of times, inside or outside ``tf.function``);
    ``apply(optimizer)`` applies the mean gradient, returns its record with ``micro_batches`` and
    ``noise_ssq_rel`` filled, and resets. ``micro_batches`` is the intended ``k``: :attr:`ready` says when that
    many were added; ``apply`` averages over the number actually added (the seed divides by ``k`` regardless,
    which silently shrinks the step when fewer arrive).

    Memory: one buffer per variable (the running mean, float32 for half-precision variables) plus three scalars
    per layer; no per-micro-batch copies.
    """

    def __init__(
        self,
        variables: Sequence[Any],
        micro_batches: int,
        *,
        record_weights: bool = True,
        hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
        seed: int | None = None,
        name: str = "gradient_accumulator",
    ) -> None:
        super().__init__(name=name)
        variables = list(variables)
        if not variables:
            raise ValueError("GradientAccumulator needs at least one variable")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.micro_batches = micro_batches
        self.record_weights = record_weights
        self.hist_sample = hist_sample
        self.seed = seed
        self._variables = variables
        self._layer_names = tuple(summary.layer_names([(None, v) for v in variables]))
        n = len(variables)
        with tf.init_scope():
            self._mean = [
                tf.Variable(
                    tf.zeros(v.shape, _accumulator_dtype(tf.as_dtype(v.dtype))),
                    trainable=False,
                    name=f"mean_{i}",
                )
                for i, v in enumerate(variables)
            ]
            # Per layer: M2 / scale^2 (Welford's sum of squared deviations, relative) and the scale.
            self._m2_rel = tf.Variable(tf.zeros([n], tf.float32), trainable=False, name="m2_rel")
            self._scale = tf.Variable(tf.zeros([n], tf.float32), trainable=False, name="scale")
            self._count = tf.Variable(0, dtype=tf.int64, trainable=False, name="count")
        # Trace-time (static) knowledge: which variables ever received a gradient (None = not on the loss path).
        self._has_grad = [False] * n

    @property
    def layers(self) -> list[str]:
        """Row names of the records (variable paths or names), in the variables' order."""
        return list(self._layer_names)

    @property
    def count(self) -> tf.Tensor:
        """Micro-batches added since the last apply/reset."""
        return self._count.read_value()

    @property
    def ready(self) -> tf.Tensor:
        """True once ``micro_batches`` micro-batches were added."""
        return self._count >= self.micro_batches

    def add(self, grads: Sequence[Any]) -> tf.Tensor:
        """Fold in one micro-batch's gradients (aligned with the variables; ``None`` = no gradient). Returns count."""
        grads = list(grads)
        if len(grads) != len(self._variables):
            raise ValueError(f"add() got {len(grads)} gradients for {len(self._variables)} variables")
        n = tf.cast(self._count + 1, tf.float32)
        m2_new, scale_new = [], []
        for i, (g, mean) in enumerate(zip(grads, self._mean, strict=True)):
            if g is None:
                m2_new.append(self._m2_rel[i])
                scale_new.append(self._scale[i])
                continue
            self._has_grad[i] = True
            g = tf.cast(tf.convert_to_tensor(g), mean.dtype)
            if g.shape.is_fully_defined() and mean.shape.is_fully_defined() and g.shape != mean.shape:
                raise ValueError(f"gradient {i} ({self.layers[i]}) has shape {g.shape}, variable {mean.shape}")
            mean_old = mean.read_value()
            d_old = g - mean_old
            mean_now = mean_old + d_old / tf.cast(n, mean.dtype)
            mean.assign(mean_now)
            d_new = g - mean_now
            s_old = self._scale[i]
            s = tf.maximum(s_old, _finite_max_abs(d_old))
            safe = tf.where(s > 0, s, tf.ones_like(s))
            ratio = tf.where(s > 0, s_old / safe, tf.zeros_like(s))
            inv = tf.cast(1.0 / safe, mean.dtype)
            term = tf.cast(tf.reduce_sum((d_old * inv) * (d_new * inv)), tf.float32)
            m2_new.append(self._m2_rel[i] * tf.square(ratio) + term)
            scale_new.append(s)
        self._m2_rel.assign(tf.stack(m2_new))
        self._scale.assign(tf.stack(scale_new))
        return self._count.assign_add(1)

    def gradients(self) -> list[tf.Tensor | None]:
        """The mean gradient per variable, in the variable's dtype (``None`` for variables that never got one)."""
        return [
            tf.cast(m.read_value(), tf.as_dtype(v.dtype)) if has else None
            for m, v, has in zip(self._mean, self._variables, self._has_grad, strict=True)
        ]

    def noise_ssq_rel(self) -> tf.Tensor:
        """Per layer ``sum_i ||g_i - mean||^2 / (k - 1) / max|mean|^2`` (0 for k < 2 or a zero mean), float32 [L]."""
        n = tf.cast(self._count, tf.float32)
        peaks = tf.stack([_finite_max_abs(m) for m in self._mean])
        safe = tf.where(peaks > 0, peaks, tf.ones_like(peaks))
        noise = self._m2_rel * tf.square(self._scale / safe) / tf.maximum(n - 1.0, 1.0)
        return tf.where((n >= 2.0) & (peaks > 0), noise, tf.zeros_like(noise))

    def record(self) -> Any:
        """The device record of the mean gradient, with ``micro_batches`` and ``noise_ssq_rel`` filled."""
        pairs = list(zip(self.gradients(), self._variables, strict=True))
        rec = summary.compute(
            pairs, True if self.record_weights else None, hist_sample=self.hist_sample or 0, seed=self.seed
        )
        return set_noise_fields(rec, self._count, self.noise_ssq_rel())

    def reset(self) -> None:
        """Forget everything added (the accumulators go back to zero)."""
        for m in self._mean:
            m.assign(tf.zeros_like(m))
        self._m2_rel.assign(tf.zeros_like(self._m2_rel))
        self._scale.assign(tf.zeros_like(self._scale))
        self._count.assign(0)

    def apply(self, optimizer: Any) -> Any:
        """Apply the mean gradient with ``optimizer.apply_gradients``, reset, and return the applied record.

        The record is computed before the update (weights are those the gradients were taken at). Raises (an
        op error inside ``tf.function``) when nothing was added.
        """
        tf.debugging.assert_positive(self._count, message="GradientAccumulator.apply() before any add()")
        rec = self.record()
        grads = self.gradients()
        pairs = [(g, v) for g, v in zip(grads, self._variables, strict=True) if g is not None]
        with tf.control_dependencies([rec.values, rec.counts]):
            optimizer.apply_gradients(pairs)
        self.reset()
        return rec
