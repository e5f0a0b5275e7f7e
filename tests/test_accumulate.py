"""Gradient accumulation: the applied gradient is the micro-batch mean, and the noise matches the float64 reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tb_gradhealth import record

pytestmark = pytest.mark.tf

#: Bound by tests/conftest.py when a test here runs, never at collection: ``tf`` and these names.
TF_IMPORTS = {"GradientAccumulator": "tb_gradhealth.accumulate:GradientAccumulator"}
tf: Any = None
GradientAccumulator: Any = None

SHAPES = [(8, 4), (4,), (4, 2)]


def micro_grads(k: int, seed: int, scales=(1.0, 1e-3, 30.0), noise=(0.5, 0.5, 0.5)) -> list[list[np.ndarray]]:
    """k micro-batches of gradients: a common signal per layer plus per-micro-batch noise of relative size noise."""
    rng = np.random.default_rng(seed)
    base = [rng.normal(size=s) * sc for s, sc in zip(SHAPES, scales, strict=True)]
    parts = list(zip(base, scales, noise, strict=True))
    return [[(b + nz * sc * rng.normal(size=b.shape)).astype(np.float32) for b, sc, nz in parts] for _ in range(k)]


def variables() -> list[tf.Variable]:
    rng = np.random.default_rng(99)
    return [tf.Variable(rng.normal(size=s).astype(np.float32), name=f"v{i}") for i, s in enumerate(SHAPES)]


def rec_rows(device_record) -> np.ndarray:
    return record.from_device(device_record.counts.numpy(), device_record.values.numpy())


def reference_noise(micro: list[list[np.ndarray]]) -> np.ndarray:
    return np.array([record.noise_fields([m[i] for m in micro]) for i in range(len(SHAPES))])


@pytest.mark.parametrize("use_function", [False, True])
def test_applied_gradient_is_the_mean_and_noise_matches_reference(use_function):
    k = 4
    micro = micro_grads(k, seed=1)
    vs = variables()
    before = [v.numpy().copy() for v in vs]
    acc = GradientAccumulator(vs, micro_batches=k, hist_sample=None)
    opt = tf.keras.optimizers.SGD(learning_rate=0.1)
    add = tf.function(acc.add) if use_function else acc.add
    apply = tf.function(acc.apply) if use_function else acc.apply
    for i, m in enumerate(micro):
        assert not bool(acc.ready)
        assert int(add([tf.constant(g) for g in m])) == i + 1
    assert bool(acc.ready)
    mean = [np.mean([m[i].astype(np.float64) for m in micro], axis=0) for i in range(len(SHAPES))]
    for got, want in zip(acc.gradients(), mean, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    rows = rec_rows(apply(opt))
    for v, b, want in zip(vs, before, mean, strict=True):  # SGD: w -= lr * mean gradient
        np.testing.assert_allclose(v.numpy(), b - 0.1 * want, rtol=1e-5, atol=1e-6)
    ref = reference_noise(micro)
    np.testing.assert_array_equal(rows[:, record.INDEX["micro_batches"]], ref[:, 0])
    np.testing.assert_allclose(rows[:, record.INDEX["noise_ssq_rel"]], ref[:, 1], rtol=1e-4)
    # The rest of the record is the record of the mean gradient (with the weights it was taken at).
    want_rows = np.stack([record.compute(m, b, hist_sample=None) for m, b in zip(mean, before, strict=True)])
    for f in ("size", "nan", "zero", "hist_sample"):
        np.testing.assert_array_equal(rows[:, record.INDEX[f]], want_rows[:, record.INDEX[f]], err_msg=f)
    d, dw = record.derived(rows), record.derived(want_rows)
    for f in ("norm", "max_abs", "weight_norm"):
        np.testing.assert_allclose(d[f], dw[f], rtol=1e-5, err_msg=f)
    # noise = std of micro-batch gradients / norm of their mean (record.derived), the same as numpy's
    stack = [np.stack([m[i].astype(np.float64).ravel() for m in micro]) for i in range(len(SHAPES))]
    want_noise = [np.sqrt(np.sum((s - s.mean(0)) ** 2) / (k - 1)) / np.linalg.norm(s.mean(0)) for s in stack]
    np.testing.assert_allclose(d["noise"], want_noise, rtol=1e-4)
    assert int(acc.count) == 0 and np.all([not g.numpy().any() for g in acc.gradients()])  # reset


def test_identical_micro_batches_have_zero_noise():
    micro = micro_grads(1, seed=2) * 5
    acc = GradientAccumulator(variables(), micro_batches=5)
    for m in micro:
        acc.add(m)
    rows = rec_rows(acc.record())
    assert np.all(rows[:, record.INDEX["noise_ssq_rel"]] == 0.0)
    assert np.all(rows[:, record.INDEX["micro_batches"]] == 5)


def test_second_round_is_independent_of_the_first():
    vs = variables()
    acc = GradientAccumulator(vs, micro_batches=2)
    opt = tf.keras.optimizers.SGD(learning_rate=0.0)
    for m in micro_grads(2, seed=3, scales=(1e6, 1e6, 1e6)):
        acc.add(m)
    acc.apply(opt)
    second = micro_grads(3, seed=4)
    for m in second:
        acc.add(m)
    rows = rec_rows(acc.record())
    ref = reference_noise(second)
    np.testing.assert_array_equal(rows[:, record.INDEX["micro_batches"]], 3)
    np.testing.assert_allclose(rows[:, record.INDEX["noise_ssq_rel"]], ref[:, 1], rtol=1e-4)


def test_low_noise_layer_welford_vs_naive_float32():
    """sum||g_i||^2 - k||mean||^2 in float32 cancels for a low-noise layer; the accumulator's Welford sum does not."""
    k = 8
    micro = micro_grads(k, seed=5, scales=(1.0, 1.0, 1.0), noise=(1e-3, 1e-2, 1e-1))
    acc = GradientAccumulator(variables(), micro_batches=k)
    for m in micro:
        acc.add(m)
    ours = rec_rows(acc.record())[:, record.INDEX["noise_ssq_rel"]]
    ref = reference_noise(micro)[:, 1]
    err_ours = np.abs(ours / ref - 1)
    naive = []
    for i in range(len(SHAPES)):
        g = np.stack([m[i].ravel() for m in micro]).astype(np.float32)
        mean = g.mean(0, dtype=np.float32)
        ssq = np.sum(g * g, dtype=np.float32) - np.float32(k) * np.sum(mean * mean, dtype=np.float32)
        naive.append(ssq / (k - 1) / np.abs(mean).max() ** 2)
    err_naive = np.abs(np.array(naive) / ref - 1)
    assert np.all(err_ours < 1e-3), err_ours
    assert err_naive[0] > 10 * err_ours[0], (err_naive, err_ours)  # the 1e-3 noise layer: naive is far off


def test_huge_and_tiny_gradients_do_not_overflow():
    """Squares of 1e25 overflow float32 and squares of 1e-25 underflow: M2 is kept relative to a running scale."""
    micro = micro_grads(3, seed=6, scales=(1e25, 1e-25, 1.0))
    acc = GradientAccumulator(variables(), micro_batches=3)
    for m in micro:
        acc.add(m)
    rows = rec_rows(acc.record())
    np.testing.assert_allclose(rows[:, record.INDEX["noise_ssq_rel"]], reference_noise(micro)[:, 1], rtol=1e-4)


def test_fewer_micro_batches_than_k_average_over_those_added():
    micro = micro_grads(2, seed=7)
    acc = GradientAccumulator(variables(), micro_batches=4)
    for m in micro:
        acc.add(m)
    assert not bool(acc.ready)
    np.testing.assert_allclose(acc.gradients()[1].numpy(), (micro[0][1] + micro[1][1]) / 2, rtol=1e-6)
    assert rec_rows(acc.record())[0, record.INDEX["micro_batches"]] == 2


def test_missing_gradient_is_recorded_and_not_applied():
    vs = variables()
    acc = GradientAccumulator(vs, micro_batches=2)
    before = vs[2].numpy().copy()
    for m in micro_grads(2, seed=8):
        acc.add([m[0], m[1], None])
    rows = rec_rows(acc.apply(tf.keras.optimizers.SGD(learning_rate=1.0)))
    assert rows[2, record.INDEX["missing"]] == 1 and rows[2, record.INDEX["size"]] == 8
    assert rows[0, record.INDEX["missing"]] == 0
    np.testing.assert_array_equal(vs[2].numpy(), before)
    assert acc.layers == ["v0", "v1", "v2"]


def test_bad_input():
    with pytest.raises(ValueError, match="micro_batches"):
        GradientAccumulator(variables(), micro_batches=0)
    with pytest.raises(ValueError, match="variable"):
        GradientAccumulator([], micro_batches=2)
    acc = GradientAccumulator(variables(), micro_batches=2)
    with pytest.raises(ValueError, match="3 variables"):
        acc.add([tf.zeros([8, 4])])
    with pytest.raises(ValueError, match="shape"):
        acc.add([tf.zeros([4, 8]), tf.zeros([4]), tf.zeros([4, 2])])
    with pytest.raises(tf.errors.InvalidArgumentError, match="before any add"):
        acc.apply(tf.keras.optimizers.SGD())
