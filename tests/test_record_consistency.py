"""Every TensorFlow path's record is a consistent record for every input, and agrees with the float64 reference.

Hypothesis draws gradients around the sizes where the statistics change strategy (the histogram's sample size,
the packed / in-place boundary, and far above it in the slow tier), with sparsity from none to all-but-one
nonzero value, NaN/±Inf patterns, subnormals and values near float32's and float16's limits, in float16, bfloat16,
float32 and float64, plus empty and scalar tensors. Each path (per-layer plain TF ops eagerly, per-layer under
XLA, the packed whole-model function eagerly, called from a ``tf.function`` (its whole binning then compiles on
first need) and inlined into a user's ``jit_compile`` step) is compared
field by field with :func:`tb_gradhealth.record.compute` and must pass the checks every writer and reader apply
(:func:`tb_gradhealth.record.check_disk`): above all, the histogram sums to the exact finite nonzero count, which
the merge rules rely on. A tensor's values are built by numpy from a few drawn parameters (hypothesis draws the
parameters, not millions of elements), and a handful of sizes keeps XLA compilations cached across examples.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tb_gradhealth import record

pytestmark = pytest.mark.tf
#: Bound by tests/conftest.py when a test here runs, never at collection: ``tf`` and these names.
TF_IMPORTS = {"summary": "tb_gradhealth.summary"}
tf: Any = None
summary: Any = None

HIST_SAMPLE = record.DEFAULT_HIST_SAMPLE
#: Sizes at the edges of the strategies: tiny, the histogram's sample size and just above it, the packed buffer's
#: largest tensor and the smallest in-place one (with a ragged tail of 1,000 values).
FAST_SIZES = (0, 1, 7, HIST_SAMPLE, HIST_SAMPLE + 1, 5_000, (1 << 18), (1 << 18) + 1_000)
#: Far above: a (3, 3, 512, 512) convolution kernel, and a tensor of ~4M values.
SLOW_SIZES = (3 * 3 * 512 * 512, (1 << 22) + 17)
DTYPES = ("float32", "float16", "bfloat16", "float64")
#: Magnitudes at every edge the record cares about, per dtype (float16 and bfloat16 take those they can hold).
EDGES = {
    "float32": (1e-45, 1e-39, 1.17e-38, 1.18e-38, 1e-37, 1e-20, 1.0, 1e19, 1e20, 1e37, 3.4e38, 3.4028235e38),
    "float64": (1e-300, 1e-39, 1.18e-38, 1e-37, 1.0, 1e38, 3.4028235e38, 3.5e38, 1e300),
    "float16": (6e-8, 6.1e-5, 1e-3, 1.0, 1e3, 6.5e4, 65504.0),
    "bfloat16": (1e-39, 1.2e-38, 1e-30, 1.0, 1e30, 3.3e38),
}
SETTINGS = dict(derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def gradients(draw: st.DrawFn, sizes: tuple[int, ...]) -> tuple[str, np.ndarray]:
    """``(dtype name, float32 values as that dtype holds them)``: a tensor of one of ``sizes`` with a drawn number
    of nonzero values (none, one, a few, a fraction, all but one, all), magnitudes from the dtype's edges or a
    normal spread over decades, and a few NaN/±Inf values."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.sampled_from(sizes))
    nonzero = draw(st.sampled_from(("none", "one", "few", "fraction", "all_but_one", "all")))
    k = {"none": 0, "one": min(n, 1), "few": min(n, draw(st.integers(2, 100))),
         "fraction": int(n * draw(st.floats(0.0005, 0.9))), "all_but_one": max(n - 1, 0), "all": n}[nonzero]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    wide = np.float64 if dtype == "float64" else np.float32
    values = np.zeros(n, wide)
    at = rng.choice(n, size=k, replace=False) if k < n else np.arange(n)
    if draw(st.booleans()):  # magnitudes from the dtype's edges
        mags = rng.choice(np.array(EDGES[dtype], np.float64), size=k)
    else:  # a normal spread over a drawn number of decades around a drawn scale
        wide_range = dtype in ("float32", "float64", "bfloat16")
        scale = 10.0 ** draw(st.integers(-30, 30) if wide_range else st.integers(-6, 4))
        mags = scale * 10.0 ** rng.uniform(-draw(st.integers(0, 6)), 0, size=k)
    with np.errstate(over="ignore"):
        values[at] = (mags * rng.choice([-1.0, 1.0], size=k)).astype(wide)
    bad = draw(st.lists(st.sampled_from((np.nan, np.inf, -np.inf)), max_size=3)) if n else []
    if bad:
        values[rng.choice(n, size=len(bad), replace=len(bad) > n)] = bad
    return dtype, values


def _as_tf(dtype: str, values: np.ndarray):
    """The tensor in ``dtype``, and the values as that dtype holds them (the reference's input)."""
    t = tf.cast(tf.constant(values), getattr(tf, dtype))
    held = t.numpy() if dtype != "bfloat16" else tf.cast(t, tf.float32).numpy()
    return t, held


@functools.cache
def _paths() -> dict:
    """The TF paths, each ``g -> memory-form row`` (made once, so their traces are reused across examples)."""
    def row(rec):
        return record.from_device(np.asarray(rec.counts), np.asarray(rec.values))[0]

    per_layer_xla = tf.function(lambda g: summary.compute([g], jit=False, hist_sample=HIST_SAMPLE), jit_compile=True)
    packed_inlined = tf.function(lambda g: summary.compute([g], jit=True, hist_sample=HIST_SAMPLE), jit_compile=True)
    packed_in_graph = tf.function(lambda g: summary.compute([g], jit=True, hist_sample=HIST_SAMPLE))
    return {
        "eager": lambda g: row(summary.compute([g], jit=False, hist_sample=HIST_SAMPLE)),
        "xla_per_layer": lambda g: row(per_layer_xla(g)),
        "packed": lambda g: row(summary.compute([g], jit=True, hist_sample=HIST_SAMPLE)),
        "packed_in_user_jit": lambda g: row(packed_inlined(g)),
        "packed_in_tf_function": lambda g: row(packed_in_graph(g)),
    }


def assert_consistent_with_reference(mem: np.ndarray, held: np.ndarray, hist_sample: int) -> None:
    """One device row against the float64 reference of the same values.

    Counts and extremes exactly; the mean, the norm and every relative sum to float32's precision; the histogram
    sums to the exact finite nonzero count; it equals the exact one where the device kept it exact, and was sampled
    only where the sample was enough; every row passes the readers' and the writer's checks.
    """
    ref = record.compute(held, hist_sample=None)
    np.testing.assert_array_equal(mem[: record.NUM_COUNTS], ref[: record.NUM_COUNTS], err_msg="counts")
    for f in ("min", "max"):
        np.testing.assert_array_equal(np.float32(mem[record.INDEX[f]]), np.float32(ref[record.INDEX[f]]), err_msg=f)
    dm, dr = record.derived(mem), record.derived(ref)
    np.testing.assert_allclose(dm["norm"], dr["norm"], rtol=2e-5, err_msg="norm")
    for s in record.GRAD_SUMS:  # every relative sum (the norm's ssq_rel, and any field added to the table)
        if not s.mean:
            at = record.INDEX[s.name]
            np.testing.assert_allclose(mem[at], ref[at], rtol=5e-5, atol=1e-30, err_msg=s.name)
    tiny = float(np.finfo(np.float32).tiny)
    atol = 2e-6 * float(np.nan_to_num(dr["max_abs"])) + tiny
    np.testing.assert_allclose(dm["mean"], dr["mean"], rtol=1e-5, atol=atol, err_msg="mean")
    n_nonzero = ref[record.INDEX["hist_sample"]]  # the exact reference keeps every finite nonzero value
    hist = mem[record.HIST_START:]
    kept = mem[record.INDEX["hist_sample"]]
    np.testing.assert_allclose(hist.sum(), n_nonzero, rtol=1e-5, atol=1e-3, err_msg="histogram total")
    if kept == n_nonzero:  # exact: the same bins as the reference
        np.testing.assert_array_equal(hist, ref[record.HIST_START:], err_msg="exact histogram")
    else:
        assert record.sample_is_enough(int(n_nonzero), int(kept), hist_sample), (n_nonzero, kept)
        assert np.all(ref[record.HIST_START:][hist > 0] > 0), "a sampled bin the exact histogram does not have"
    if held.size <= hist_sample or n_nonzero <= hist_sample:
        assert kept == n_nonzero, "at most hist_sample finite nonzero values: the histogram must be exact"
    _, reasons = record.check_disk(record.to_disk(mem[None, :]))
    assert reasons == {}, reasons


def _check_all_paths(case: tuple[str, np.ndarray]) -> None:
    dtype, values = case
    g, held = _as_tf(dtype, values)
    for path, compute in _paths().items():
        try:
            assert_consistent_with_reference(compute(g), held, HIST_SAMPLE)
        except AssertionError as e:
            raise AssertionError(f"path {path}, dtype {dtype}, size {values.size}: {e}") from e


@settings(max_examples=16, **SETTINGS)
@given(gradients(FAST_SIZES))
def test_every_tf_path_is_consistent_and_matches_the_reference(case):
    _check_all_paths(case)


@pytest.mark.slow
@settings(max_examples=6, **SETTINGS)
@given(gradients(SLOW_SIZES))
def test_every_tf_path_is_consistent_far_above_the_in_place_size(case):
    _check_all_paths(case)


def test_a_sparse_convolution_gradient_gets_its_exact_histogram():
    """The reported case: a (3, 3, 512, 512) gradient of which ~0.001% of the values are nonzero (a ReLU network
    at a 2x2 feature map); every path bins its 23 nonzero values exactly."""
    rng = np.random.default_rng(7)
    g = np.zeros((3, 3, 512, 512), np.float32)
    g.reshape(-1)[rng.choice(g.size, 23, replace=False)] = rng.standard_normal(23).astype(np.float32)
    for path, compute in _paths().items():
        mem = compute(tf.constant(g.reshape(-1)))
        assert mem[record.INDEX["hist_sample"]] == 23, path
        assert_consistent_with_reference(mem, g.reshape(-1), HIST_SAMPLE)


def test_the_exact_branch_runs_only_where_the_sample_is_not_enough():
    """Dense layers keep their sampled histogram beside a sparse one in the same packed call: each layer follows
    the rule on its own (the sparse one exact, the dense ones sampled from ``hist_sample`` positions)."""
    rng = np.random.default_rng(11)
    dense_packed = rng.standard_normal(50_000).astype(np.float32)
    dense_in_place = rng.standard_normal(300_000).astype(np.float32)
    sparse = np.zeros(300_000, np.float32)
    sparse[[3, 77_777, 299_999]] = [1e-3, -2.0, 5e5]
    rec = summary.compute([tf.constant(x) for x in (dense_packed, sparse, dense_in_place)], hist_sample=HIST_SAMPLE)
    mem = record.from_device(rec.counts.numpy(), rec.values.numpy())
    kept = mem[:, record.INDEX["hist_sample"]]
    assert kept[1] == 3 and 0 < kept[0] <= HIST_SAMPLE and 0 < kept[2] <= HIST_SAMPLE
    for row, held in zip(mem, (dense_packed, sparse, dense_in_place), strict=True):
        assert_consistent_with_reference(row, held, HIST_SAMPLE)
