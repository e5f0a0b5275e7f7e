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


@pytest.mark.parametrize("wanted", [True, False])
def test_pack_then_unpack_gives_the_gradients_back_exactly(wanted):
    grads = _grads(np.random.default_rng(0))
    where = gradpack.layout(grads)
    assert where.sparse == (False, True, False, False) and len(where.dtypes) == 3  # float32, int64, float16

    @tf.function
    def step(flag):
        return tf.cond(flag, lambda: gradpack.pack(grads, where), lambda: gradpack.empty(where))

    packed = step(tf.constant(wanted))
    assert len(packed) == len(where.dtypes) + 1  # a handful of outputs, whatever the number of gradients
    if not wanted:
        assert all(int(tf.size(t)) == 0 for t in packed)
        return
    unpack = tf.function(lambda p: gradpack.unpack(p, where))
    # traced on buffers of unknown length, the gradients still have their static shapes (the statistics' sparse
    # kernel needs a static number of slices)
    traced = unpack.get_concrete_function([tf.TensorSpec([None], t.dtype) for t in packed])
    assert [t.shape.as_list() for t in tf.nest.flatten(traced.structured_outputs, expand_composites=True)] == \
        [[3, 5], [6, 4], [6], [2], [2, 2, 2], [4]]
    back = unpack(packed)
    for g, b in zip(grads, back, strict=True):
        if isinstance(g, tf.IndexedSlices):
            assert isinstance(b, tf.IndexedSlices)
            np.testing.assert_array_equal(b.values.numpy(), g.values.numpy())
            np.testing.assert_array_equal(b.indices.numpy(), g.indices.numpy())
            np.testing.assert_array_equal(b.dense_shape.numpy(), g.dense_shape.numpy())
        else:
            assert b.dtype == g.dtype and b.shape == g.shape
            np.testing.assert_array_equal(b.numpy(), g.numpy())
