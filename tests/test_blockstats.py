"""A model's record computed eagerly a block of layers at a time is the whole model's record, bit for bit: every
layer kind (packed, in place, sampled, sparse, missing, non-finite), with weights and updates, whatever the blocks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tb_gradhealth import record, summary  # noqa: E402
from tb_gradhealth._tf import blockstats, packed  # noqa: E402
from tests.test_packed import _model_like  # noqa: E402

pytestmark = pytest.mark.tf


def test_blocks_take_every_layer_once_in_order_within_the_limit():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sizes = rng.integers(0, 50, size=rng.integers(0, 30)).tolist()
        limit = int(rng.integers(1, 120))
        got = blockstats.blocks(sizes, limit)
        assert [i for b in got for i in b] == list(range(len(sizes)))
        for b in got:
            assert len(b) == 1 or sum(sizes[i] for i in b) <= limit
        for b, nxt in itertools.pairwise(got):  # a block ends only where the next layer would not fit
            assert sum(sizes[i] for i in b) + sizes[nxt[0]] > limit
    assert blockstats.blocks([5, 5, 20, 3, 3], 10) == [[0, 1], [2], [3, 4]]


#: Layers of ``_layers`` whose float32 pass is redone exactly: a tiny, a huge and a non-finite gradient; tiny
#: weights and updates; a non-finite weight.
_SICK_GRADIENTS = ("tiny/bias", "huge/bias", "big_nan/kernel")
_SICK_NORMS = ("dead/kernel", "conv/kernel")


def _layers(rng: np.random.Generator) -> tuple[list, list, list, list[int], list[str]]:
    """Gradients of every kind, their weights and applied updates, each layer's size and name."""
    named = _model_like(rng)
    names, grads = list(named), list(named.values())
    weights = [rng.standard_normal(np.shape(g)).astype(np.float32) for g in grads]
    weights[names.index("dead/kernel")] *= np.float32(1e-12)  # weights and update below float32's safe squares
    weights[names.index("conv/kernel")][0, 0, 0, 0] = np.nan
    rows = 3 * packed.IN_PLACE_MIN // 8  # a sparse table large enough for the one-layer kernel
    big_table = tf.IndexedSlices(tf.constant(rng.standard_normal((40, 8)).astype(np.float32)),
                                 tf.constant(rng.integers(0, rows, 40)), tf.constant([rows, 8], tf.int64))
    small_table = tf.IndexedSlices(tf.constant(rng.standard_normal((3, 8)).astype(np.float32)),
                                   tf.constant([4, 4, 9]), tf.constant([50, 8], tf.int64))
    tg = [tf.constant(g) for g in grads] + [big_table, small_table, None]
    weights += [rng.standard_normal((rows, 8)).astype(np.float32), rng.standard_normal((50, 8)).astype(np.float32),
                np.ones(7, np.float32)]
    tw = [tf.constant(w) for w in weights]
    step = [np.float32(1e-13 if n == "dead/kernel" else 0.5 ** 10) for n in names] + [np.float32(0.5 ** 10)] * 3
    tu = [summary.Delta(w, tf.constant(w.numpy() - d)) if g is not None else None
          for g, w, d in zip(tg, tw, step, strict=True)]
    sizes = [int(np.prod(w.shape)) for w in weights]
    return tg, tw, tu, sizes, names + ["big_table", "small_table", "no_gradient"]


@pytest.mark.parametrize("seed", [None, 7])
def test_blocks_give_the_whole_models_record_bit_for_bit(seed):
    tg, tw, tu, sizes, _ = _layers(np.random.default_rng(5))
    whole = summary.compute(tg, tw, tu, seed=seed, jit="graph")
    traced = tf.function(lambda: summary.compute(tg, tw, tu, seed=seed, jit="graph"))()
    np.testing.assert_array_equal(whole.values.numpy(), traced.values.numpy())  # the same ops, traced or not
    counts = whole.counts.numpy()
    assert record.COUNT_FIELDS[0] == "size"
    finite_nonzero = counts[:, 0] - counts[:, 1:].sum(1)  # size minus NaN, +Inf, -Inf and zeros
    assert (whole.values.numpy()[:, record.INDEX["hist_sample"]] < finite_nonzero).sum() >= 3  # sampled layers
    asked = []

    def inputs_of(layers):
        asked.append(layers)
        return [tg[i] for i in layers], [tw[i] for i in layers], [tu[i] for i in layers]

    for limit in (1, 1000, 70_000, blockstats.BLOCK):
        asked.clear()
        rec = blockstats.compute(sizes, inputs_of, hist_sample=record.DEFAULT_HIST_SAMPLE, seed=seed, limit=limit)
        assert asked == blockstats.blocks(sizes, limit)
        np.testing.assert_array_equal(rec.counts.numpy(), whole.counts.numpy(), err_msg=f"limit {limit}")
        np.testing.assert_array_equal(rec.values.numpy(), whole.values.numpy(), err_msg=f"limit {limit}")


def test_eagerly_only_the_flagged_layers_are_redone(monkeypatch):
    """The exact float64 pass of an eager record packs the layers the fast pass flagged, not their whole block."""
    tg, tw, tu, sizes, names = _layers(np.random.default_rng(5))
    redone: dict[str, list[set[str]]] = {"gradient": [], "norm": []}
    reduce_layers = packed._reduce_layers

    def spy(flat, lay, n, rows_of, kinds, buf=None):
        kind = {packed._exact_gradient_rows: "gradient", packed._exact_norm_rows: "norm"}.get(rows_of)
        if kind is not None:
            redone[kind].append({names[i] for i in np.unique(lay.row_layer)})
        return reduce_layers(flat, lay, n, rows_of, kinds, buf)

    monkeypatch.setattr(packed, "_reduce_layers", spy)
    summary.compute(tg, tw, tu, jit="graph")
    assert redone["gradient"] == [set(_SICK_GRADIENTS)]
    assert redone["norm"] == [set(_SICK_NORMS)] * 2  # the weights, then the updates (NaN - NaN is NaN)
