"""The decade histogram of a gradient on the device: exact for small tensors, else from a uniform sample.

Above ``hist_sample`` elements the histogram is built from ``hist_sample`` gathered positions (a golden-ratio
sequence from one stateless random offset: each position uniform over the tensor; O(sample), no shuffle). The
finite nonzero draws are binned and scaled by ``finite_nonzero / draws_kept``, and ``hist_sample`` records
``draws_kept``: the rule of :func:`tb_gradhealth.record.compute` (estimated count = count x finite_nonzero /
hist_sample). A sparse tensor whose sample is not enough (:func:`tb_gradhealth.record.sample_is_enough`) is binned
whole instead, in a branch that only such steps run, so the histogram always sums to the finite nonzero count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import _core, record

__all__ = ["histogram", "bin_index"]

#: Lower / upper float32 edge of each histogram bin (bin b holds lo[b] <= |g| < hi[b]).
_BIN_LO = np.concatenate([[0.0], record.HIST_EDGES]).astype(np.float32)
_BIN_HI = np.concatenate([record.HIST_EDGES, [np.inf]]).astype(np.float32)


def _seed_for(x: tf.Tensor, layer: Any, seed: Any) -> tf.Tensor:
    """A stateless-RNG seed that differs by layer and by step: from ``seed`` if given, else from the data."""
    salt = tf.cast(record.sample_salt(layer), tf.int32)
    if seed is not None:
        return tf.stack([tf.cast(seed, tf.int32), salt])
    probes = tf.cast(tf.gather(x, _core.probe_indices(x.shape.num_elements())), tf.float32)
    mix = _core.probe_hash(tf.unstack(tf.bitcast(probes, tf.int32)), tf.bitwise.bitwise_xor)
    return tf.stack([salt, mix])


def _sample_positions(x: tf.Tensor, n: int, k: int, layer: Any, seed: Any, valid_len: tf.Tensor | None) -> tf.Tensor:
    """``k`` positions in ``[0, valid_len or n)``: a golden-ratio (Weyl) sequence from one random offset.

    Each position is uniform over the tensor (so the scaled histogram is an unbiased estimate) and the positions
    are spread evenly (lower variance than independent draws). One random number per tensor instead of ``k``
    independent draws, which cost a noticeable part of the record under XLA (docs/DEVELOPMENT.md, design notes).
    """
    length = None if valid_len is None else tf.cast(tf.maximum(valid_len, 1), tf.int64)
    offset = tf.random.stateless_uniform([], seed=_seed_for(x, layer, seed), minval=0, maxval=2**62, dtype=tf.int64)
    return tf.cast(_core.sample_positions(offset, n, k, const=tf.constant, length=length), tf.int32)


def bin_index(a: tf.Tensor) -> tf.Tensor:
    """The decade bin (int32) of each float32 magnitude ``a > 0`` (``+Inf``: the top bin), as
    :func:`tb_gradhealth.record.hist_bin`: a log10 estimate corrected at the decade edges."""
    e = tf.clip_by_value(tf.floor(tf.math.log(a) * np.float32(1 / np.log(10))), -38.0, 38.0)
    b = tf.cast(e, tf.int32) + 38
    b = tf.where(a < tf.gather(_BIN_LO, b), b - 1, b)  # correct log10 rounding at decade edges
    return tf.where(a >= tf.gather(_BIN_HI, b), b + 1, b)


def _binned(v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """``(hist float32 [77], count)`` of the finite nonzero values of ``v`` (zeros, padding, NaN/Inf left out)."""
    av = tf.abs(v)
    ok = (av >= tf.constant(record.FLUSH_BELOW, v.dtype)) & (av <= v.dtype.max)
    b = bin_index(tf.where(ok, tf.cast(av, tf.float32), tf.ones_like(av, tf.float32)))  # float64 beyond float32: inf
    w = tf.cast(ok, tf.float32)
    return tf.math.unsorted_segment_sum(w, b, record.HIST_BINS), tf.reduce_sum(w)


def histogram(
    x: tf.Tensor, n_nonzero: tf.Tensor, hist_sample: int, layer: int, seed: Any, valid_len: tf.Tensor | None
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(hist float32 [77], hist_sample float32)``: exact if the tensor is small or the sample is not enough
    (:func:`tb_gradhealth.record.sample_is_enough`), else a uniform sample scaled to ``n_nonzero``."""
    n = x.shape.num_elements()
    if n is None:
        raise ValueError("gradients need a static shape for the histogram (XLA-safe sampling)")
    if not hist_sample or n <= hist_sample:
        return _binned(x)
    hist, kept = _binned(tf.gather(x, _sample_positions(x, n, hist_sample, layer, seed, valid_len)))
    nz = tf.cast(n_nonzero, tf.float32)
    enough = (nz > hist_sample) & (kept >= record.sample_min_kept(hist_sample))
    return tf.cond(enough, lambda: (hist * (nz / tf.maximum(kept, 1.0)), kept), lambda: _binned(x))
