"""Records of whole models from a fixed number of XLA loops: every layer kind against the float64 reference, and
a compiled program whose size does not grow with the number of layers."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from tb_gradhealth import record, summary  # noqa: E402
from tb_gradhealth._tf import packed  # noqa: E402
from tests.test_summary import assert_matches_reference, to_mem  # noqa: E402

pytestmark = pytest.mark.tf
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_like(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Layers as a real network has them: many tiny ones, a few large ones (ragged tails), and the sick kinds."""
    g = {f"bn{i}/gamma": (rng.standard_normal(64) * 10.0 ** rng.integers(-8, 2)).astype(np.float32) for i in range(40)}
    g["conv/kernel"] = rng.standard_normal((3, 3, 64, 64)).astype(np.float32) * 1e-3  # 36,864: packed, sampled
    g["big/kernel"] = rng.standard_normal(300_007).astype(np.float32)  # in place, ragged tail
    g["big/kernel"][-3:] = [-9.0, 0.0, 1e-40]  # extremes and a flushed value in the tail
    g["big_nan/kernel"] = rng.standard_normal(2 * packed.IN_PLACE_MIN).astype(np.float32)
    g["big_nan/kernel"][[5, 77, 1000]] = [np.nan, np.inf, -np.inf]
    g["tiny/bias"] = np.array([3e-39, -2e-38, 5e-37, 0.0], np.float32)  # below and near float32's smallest normal
    g["huge/bias"] = np.array([3e38, -2e38, 1e38], np.float32)  # squares overflow float32, sum overflows too
    g["dead/kernel"] = np.zeros((16, 16), np.float32)
    g["half/kernel"] = (rng.standard_normal(300) * 50).astype(np.float16)
    g["empty/bias"] = np.zeros(0, np.float32)
    return g


def test_every_layer_kind_matches_the_reference_with_weights_and_updates():
    rng = np.random.default_rng(3)
    grads = _model_like(rng)
    weights = {n: rng.standard_normal(np.shape(g)).astype(np.float32) for n, g in grads.items()}
    after = {n: (w - 0.01 * np.nan_to_num(grads[n].astype(np.float32), posinf=1, neginf=-1)).astype(np.float32)
             for n, w in weights.items()}
    weights["big_nan/kernel"][9] = np.inf  # a non-finite weight: the norm covers the finite values
    names = list(grads)
    tg = [tf.constant(grads[n]) for n in names]
    tw = [tf.constant(weights[n]) for n in names]
    tu = [summary.Delta(tf.constant(weights[n]), tf.constant(after[n])) for n in names]
    for path, rec in {
        "function": summary.compute(tg, tw, tu),
        "jit_compile": tf.function(lambda: summary.compute(tg, tw, tu), jit_compile=True)(),
        "graph": tf.function(lambda: summary.compute(tg, tw, tu, jit="graph"))(),
        "graph, eager": summary.compute(tg, tw, tu, jit="graph"),
    }.items():
        mem = to_mem(rec)
        for i, n in enumerate(names):
            try:
                assert_matches_reference(mem[i], grads[n], record.DEFAULT_HIST_SAMPLE, w=weights[n])
                ref = record.compute(grads[n], weights[n], weights[n] - after[n], hist_sample=None)
                for f in ("weight_max_abs", "weight_ssq_rel", "update_max_abs", "update_ssq_rel"):
                    np.testing.assert_allclose(mem[i, record.INDEX[f]], ref[record.INDEX[f]], rtol=1e-5, err_msg=f)
            except AssertionError as e:
                raise AssertionError(f"{path} / {n}: {e}") from e


@pytest.mark.parametrize("jit", [True, "graph"])
def test_missing_and_sparse_gradients_beside_packed_ones(jit):
    rng = np.random.default_rng(4)
    table = tf.Variable(rng.standard_normal((50, 8)).astype(np.float32))
    dense = rng.standard_normal(100).astype(np.float32)
    slices = tf.IndexedSlices(tf.constant(rng.standard_normal((3, 8)).astype(np.float32)), tf.constant([4, 4, 9]),
                              tf.constant([50, 8]))
    unused = tf.Variable(np.ones(7, np.float32))
    rec = to_mem(summary.compute([(tf.constant(dense), tf.Variable(dense)), (slices, table), (None, unused)],
                                 weights=True, jit=jit))
    assert_matches_reference(rec[0], dense, record.DEFAULT_HIST_SAMPLE, w=dense)
    want = np.zeros((50, 8), np.float32)
    np.add.at(want, slices.indices.numpy(), slices.values.numpy())
    assert_matches_reference(rec[1], want, record.DEFAULT_HIST_SAMPLE, w=table.numpy())
    assert rec[2, record.INDEX["missing"]] == 1 and rec[2, record.INDEX["size"]] == 7
    np.testing.assert_allclose(record.derived(rec[2:3])["weight_norm"], [np.sqrt(7)], rtol=1e-6)


@pytest.mark.parametrize("jit", [True, "graph"])
def test_embedding_gradient_too_sparse_for_the_histogram_sample_is_binned_whole(jit):
    # A Keras embedding's gradient: a few dozen of 2,000 rows, repeated tokens (duplicate slices). The sample of
    # 64,000 mostly-zero values holds too few nonzero ones, so the histogram is binned whole, from the same dense
    # table the other fields were computed from.
    rng = np.random.default_rng(6)
    table = tf.Variable(rng.standard_normal((2000, 32)).astype(np.float32))
    tokens = np.minimum(rng.zipf(1.6, 512), 1999).astype(np.int32)
    slices = tf.IndexedSlices(tf.constant(rng.standard_normal((512, 32)).astype(np.float32)), tf.constant(tokens),
                              tf.constant([2000, 32]))
    rec = to_mem(summary.compute([(slices, table)], weights=True, jit=jit))
    want = np.zeros((2000, 32), np.float32)
    np.add.at(want, tokens, slices.values.numpy())
    assert_matches_reference(rec[0], want, want.size, w=table.numpy())  # binned whole: the exact histogram


def test_layout_rows_cover_each_piece_once():
    lay = packed.layout([10, None, 300, 2 * packed.IN_PLACE_MIN + 5, 0], [False, False, False, True, False],
                        first=[True, False, False, False, False])
    assert [p[0] for p in lay.pieces] == [0, 2, 3]  # absent and empty layers take no row; tails after the rest
    assert lay.pieces[-1] == (3, 2 * packed.IN_PLACE_MIN, 2 * packed.IN_PLACE_MIN + 5)
    assert lay.in_place == ((3, 2 * packed.IN_PLACE_MIN // packed.ROW),)
    per_layer = np.bincount(lay.row_layer[: lay.packed_rows], weights=lay.row_valid, minlength=5)
    np.testing.assert_array_equal(per_layer, [10, 0, 300, 5, 0])
    assert len(lay.row_layer) == lay.packed_rows + 2 * packed.IN_PLACE_MIN // packed.ROW


def _fusions(n_layers: int) -> int:
    """Loops in the optimised XLA program of ``n_layers`` distinct small layers' records with weights."""
    shapes = [(64 + i,) for i in range(n_layers)]
    args = ([tf.ones(s) for s in shapes], [tf.ones(s) for s in shapes])
    fn = tf.function(lambda g, w: summary.compute(g, w), jit_compile=True)
    hlo = fn.experimental_get_compiler_ir(*args)(stage="optimized_hlo")
    return len(re.findall(r"\bfusion\(", hlo))


def test_compiled_program_does_not_grow_with_the_number_of_layers():
    """One compiled loop per layer (the cost that made models of hundreds of variables compile for a minute) would
    make 200 layers' program ten times 20 layers'."""
    few, many = _fusions(20), _fusions(200)
    assert many <= few + 4, (few, many)


_LOWERING_PROBE = """
import sys
import tensorflow as tf
from tb_gradhealth import summary

def rss_mb():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) // 1024

gs = [tf.ones([1_000_000 + i]) for i in range(16)]
fn = tf.function(lambda g, w: summary.compute(g, w), jit_compile=True)
before = rss_mb()
fn.experimental_get_compiler_ir(gs, gs)(stage="hlo")
print(rss_mb() - before)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_lowering_to_xla_takes_memory_of_the_order_of_the_data():
    """Selects against a scalar zero, not ``zeros_like``: with the latter the XLA bridge folds data-sized constants
    while lowering (16 layers of 1M values, gradient and weight: 128 MB of data; measured +81 MB for 8 such layers,
    +210 MB with ``zeros_like``), memory a real model kept for the whole run (ResNet50: +1.2 GB instead of +0.56)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
           "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", _LOWERING_PROBE], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    grown = int(out.strip().splitlines()[-1])
    assert grown < 2 * 128, grown
