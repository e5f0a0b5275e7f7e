"""The statistics' XLA program compiled ahead on a background thread is the one a graph's call runs, and gives the
record of the same call compiled where it runs (and of the float64 reference)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tb_gradhealth import record, summary  # noqa: E402
from tb_gradhealth._tf import precompile  # noqa: E402

pytestmark = pytest.mark.tf


def _tensors(seed: int, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [(rng.standard_normal(s) * 10.0 ** rng.uniform(-8, 2, size=s)).astype(np.float32) for s in shapes]
    out[0].flat[::7] = 0.0  # exact zeros, counted
    return out


def test_graph_call_runs_the_program_compiled_ahead_and_its_record_is_the_same(monkeypatch):
    # sizes no other test uses: a signature of its own, so that this graph's call starts the compile
    shapes = [(3, 5, 7), (311,), ((1 << 18) + 123,), (19,)]
    grads, before, after = (_tensors(s, shapes) for s in (1, 2, 3))
    started = []
    compile_ahead = precompile.compile_ahead

    def spy(*args, **kwargs):
        started.append(compile_ahead(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(precompile, "compile_ahead", spy)

    @tf.function
    def in_graph(g, b, a):
        return summary.compute(list(g), list(b), [summary.Delta(x, y) for x, y in zip(b, a, strict=True)], jit=True)

    args = tuple(tuple(tf.constant(t) for t in ts) for ts in (grads, before, after))
    concrete = in_graph.get_concrete_function(*args)
    precompile.wait()
    assert started == [True]
    ahead = concrete(*args)
    # the same statistics called eagerly: compiled there, apart from the graph's program
    eager = summary.compute(grads, before, [summary.Delta(tf.constant(b), tf.constant(a))
                                            for b, a in zip(before, after, strict=True)], jit=True)
    np.testing.assert_array_equal(ahead.counts.numpy(), eager.counts.numpy())
    np.testing.assert_array_equal(ahead.values.numpy(), eager.values.numpy())
    rows = record.from_device(ahead.counts.numpy(), ahead.values.numpy())
    exact = list(record.COUNT_FIELDS) + ["min", "max"]
    close = ["mean", "ssq_rel", "weight_max_abs", "weight_ssq_rel", "update_max_abs", "update_ssq_rel"]
    for i, (g, b, a) in enumerate(zip(grads, before, after, strict=True)):
        ref = record.compute(g, weight=b, update=b.astype(np.float64) - a.astype(np.float64))
        for f in exact:
            assert rows[i, record.INDEX[f]] == ref[record.INDEX[f]], f
        for f in close:
            np.testing.assert_allclose(rows[i, record.INDEX[f]], ref[record.INDEX[f]], rtol=1e-5, err_msg=f)


def test_nothing_is_compiled_ahead_eagerly_or_for_an_unknown_shape():
    fn = tf.function(lambda x: tf.reduce_sum(x), jit_compile=True)
    assert not precompile.compile_ahead(fn, (tf.ones([3]),), {})  # eager: the call compiles at once
    seen = []

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def unknown(x):
        seen.append(precompile.compile_ahead(fn, (x,), {}))
        return fn(x)

    unknown(tf.ones([4]))
    assert seen == [False]
