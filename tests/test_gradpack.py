"""Gradients packed into a few buffers inside a traced step and cut back out come back bit for bit: dense tensors
of several dtypes and ``IndexedSlices`` with repeated indices, through the conditional the Keras callback uses."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tb_gradhealth._tf import gradpack  # noqa: E402

pytestmark = pytest.mark.tf


def _grads(rng: np.random.Generator) -> list:
    return [
        tf.constant(rng.standard_normal((3, 5)).astype(np.float32)),
        tf.IndexedSlices(tf.constant(rng.standard_normal((6, 4)).astype(np.float32)),
                         tf.constant([7, 1, 7, 0, 1, 7], tf.int64), tf.constant([9, 4], tf.int64)),
        tf.constant(rng.standard_normal((2, 2, 2)).astype(np.float16)),
        tf.constant(rng.standard_normal((4,)).astype(np.float32)),
    ]


def _assert_same(grads: list, back: list) -> None:
    for g, b in zip(grads, back, strict=True):
        if isinstance(g, tf.IndexedSlices):
            assert isinstance(b, tf.IndexedSlices)
            np.testing.assert_array_equal(b.values.numpy(), g.values.numpy())
            np.testing.assert_array_equal(b.indices.numpy(), g.indices.numpy())
            np.testing.assert_array_equal(b.dense_shape.numpy(), g.dense_shape.numpy())
        else:
            assert b.dtype == g.dtype and b.shape == g.shape
            np.testing.assert_array_equal(b.numpy(), g.numpy())


@pytest.mark.parametrize("wanted", [True, False])
@pytest.mark.parametrize("alone_min", [None, 10])
def test_pack_then_unpack_gives_the_gradients_back_exactly(wanted, alone_min, monkeypatch):
    """Packed all (real models' small gradients), or with the [3, 5] one leaving the step as it is."""
    if alone_min is not None:
        monkeypatch.setattr(gradpack, "ALONE_MIN", alone_min)
    grads = _grads(np.random.default_rng(0))
    where = gradpack.layout(grads)
    assert where.sparse == (False, True, False, False)
    assert where.alone == ((-1,) * 5 if alone_min is None else (0, -1, -1, -1, -1))
    assert len(where.dtypes) == 3  # float32 (the [4] one, and the [3, 5] one unless alone), int64, float16

    @tf.function
    def step(flag):
        return tf.cond(flag, lambda: gradpack.pack(grads, where), lambda: gradpack.empty(where))

    out = step(tf.constant(wanted))
    n_alone = 0 if alone_min is None else 1
    assert len(out) == n_alone + len(where.dtypes) + 1  # a handful of outputs, whatever the number of gradients
    if not wanted:
        assert all(int(tf.size(t)) == 0 for t in out)
        return
    if n_alone:  # as it is, flattened
        np.testing.assert_array_equal(out[0].numpy(), grads[0].numpy().ravel())
    unpack = tf.function(lambda p: gradpack.unpack(p, where))
    # traced on buffers of unknown length, the gradients still have their static shapes (the statistics' sparse
    # kernel needs a static number of slices)
    traced = unpack.get_concrete_function([tf.TensorSpec([None] * len(t.shape), t.dtype) for t in out])
    assert [t.shape.as_list() for t in tf.nest.flatten(traced.structured_outputs, expand_composites=True)] == \
        [[3, 5], [6, 4], [6], [2], [2, 2, 2], [4]]
    _assert_same(grads, unpack(out))


def test_only_the_largest_dense_gradients_leave_as_they_are(monkeypatch):
    monkeypatch.setattr(gradpack, "ALONE_MIN", 4)
    monkeypatch.setattr(gradpack, "ALONE_MAX", 2)
    grads = _grads(np.random.default_rng(2))  # dense sizes 15, 8, 4; a sparse one of 24 values stays packed
    where = gradpack.layout(grads)
    assert where.alone == (0, -1, -1, 1, -1)  # the [3, 5] and [2, 2, 2] ones, in order; the [4] one packed
    _assert_same(grads, gradpack.unpack(gradpack.pack(grads, where), where))


def test_unpack_a_few_gives_those_gradients_alone():
    grads = _grads(np.random.default_rng(1)) + [
        tf.IndexedSlices(tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)), tf.constant([4, 0], tf.int64),
                         tf.constant([5, 3], tf.int64))]  # a second sparse gradient, of another dense shape
    where = gradpack.layout(grads)
    packed = gradpack.pack(grads, where)
    for which in ([3, 1], [2], [4, 1, 0, 3, 2], [4], []):
        _assert_same([grads[i] for i in which], gradpack.unpack(packed, where, which))


@pytest.mark.parametrize("alone_min", [None, 10])
def test_unpack_flat_leaves_dense_gradients_flattened_and_sparse_ones_shaped(alone_min, monkeypatch):
    if alone_min is not None:
        monkeypatch.setattr(gradpack, "ALONE_MIN", alone_min)
    grads = _grads(np.random.default_rng(3))
    where = gradpack.layout(grads)
    back = gradpack.unpack(gradpack.pack(grads, where), where, flat=True)
    flat = [g if isinstance(g, tf.IndexedSlices) else tf.reshape(g, [-1]) for g in grads]
    _assert_same(flat, back)
    assert back[1].values.shape == (6, 4)
