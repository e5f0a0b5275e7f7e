"""Generated gradients for the device paths' property tests, and the check every record of them must pass.

:func:`gradients` draws a gradient's recipe (dtype, shape, size, sparsity from none to all-but-one, NaN/Inf,
subnormals and values near float32/float16 limits, magnitudes over float32's range) and :func:`build` makes it
with numpy; each path casts it with its own framework. :func:`check_record` compares the path's record with the
float64 reference :func:`record.compute` field by field, under the histogram rule every path follows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

from tb_gradhealth import record
from tests.record_close import assert_records_close


def min_kept(hist_sample: int) -> int:
    """The sample that keeps fewer finite nonzero draws than this gives way to the exact histogram (the documented
    rule: 64, or half the draws of a smaller sample; written here, not imported, so that a changed rule fails)."""
    return min(64, max(1, hist_sample // 2))
DTYPES = ("float32", "float16", "bfloat16", "float64")
SPECIALS = {
    "nan": np.nan, "inf": np.inf, "-inf": -np.inf, "f32max": 3.4028235e38, "-f32max": -3.4028235e38,
    "f32tiny": 1.1754944e-38, "subnormal": 1e-40, "-subnormal": -3e-45, "f16max": 65504.0, "f16sub": 6e-8,
    "beyond_f32": 1e39, "below_f32": 1e-39, "f64tiny": 1e-300,
}


def sizes_near(*points: int) -> st.SearchStrategy[int]:
    """Sizes at and one either side of each point (the boundaries where the histogram's rule changes)."""
    return st.sampled_from(sorted({max(0, p + d) for p in points for d in (-1, 0, 1)}))


#: The device paths' hypothesis settings: the same examples every run, no deadline (compiling takes long).
SETTINGS = settings(derandomize=True, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
#: The slow tier's sizes: around a sample of 4096, the in-place threshold (2^18), and up to 16 M values.
SLOW_SIZES = sizes_near(4096, 1 << 18, 9 * (1 << 18), (1 << 24) // 4 * 4 + 8)


@st.composite
def gradients(draw, sizes: st.SearchStrategy[int], dtypes=DTYPES) -> dict:
    """A gradient's recipe: ``dtype``, ``shape``, and what :func:`build` needs to make its values."""
    dtype = draw(st.sampled_from(dtypes))
    kind = draw(st.sampled_from(["flat", "flat", "flat", "4d", "scalar", "empty"]))
    if kind == "scalar":
        shape: tuple[int, ...] = ()
    elif kind == "empty":
        shape = draw(st.sampled_from([(0,), (0, 3), (4, 0, 2)]))
    else:
        n = draw(sizes)
        shape = (n,) if kind == "flat" or n % 9 else (3, 3, n // 9)
    lo = -8 if dtype == "float16" else -45
    hi = 5 if dtype == "float16" else 39
    return {
        "dtype": dtype,
        "shape": shape,
        "seed": draw(st.integers(0, 2**32 - 1)),
        "decade": draw(st.integers(lo, hi)),
        "spread": draw(st.sampled_from([0.0, 0.5, 3.0, 20.0])),
        "nonzero": draw(st.sampled_from(["all", "all", "fraction", "sparse", "sparse", "few", "one", "none"])),
        "sparse": draw(st.sampled_from([0.001, 0.01, 0.05, 0.2])),
        "fraction": draw(st.floats(0.0, 1.0)),
        "specials": draw(st.lists(st.sampled_from(sorted(SPECIALS)), max_size=6)),
    }


def build(recipe: dict) -> np.ndarray:
    """The gradient's values as float64 (float32 for every dtype but float64): cast them with the framework."""
    shape = recipe["shape"]
    n = int(np.prod(shape, dtype=np.int64))
    rng = np.random.default_rng(recipe["seed"])
    exps = recipe["decade"] + recipe["spread"] * rng.uniform(-1.0, 1.0, n)
    x = rng.choice([-1.0, 1.0], n) * 10.0 ** exps
    mode = recipe["nonzero"]
    if n and mode != "all":
        keep = {"fraction": int(recipe["fraction"] * n), "sparse": int(np.ceil(recipe["sparse"] * n)),
                "few": min(n, int(rng.integers(1, 40))), "one": 1, "none": 0}[mode]
        mask = np.zeros(n, bool)
        mask[rng.choice(n, keep, replace=False)] = True
        x[~mask] = 0.0
    if n:
        for name in recipe["specials"]:
            x[rng.integers(n)] = SPECIALS[name]
    with np.errstate(over="ignore"):
        return (x if recipe["dtype"] == "float64" else x.astype(np.float32)).reshape(shape)


def check_record(values: np.ndarray, got: np.ndarray, hist_sample: int) -> str:
    """Assert ``got`` (one memory-form row) is the record of ``values`` (as the framework holds them, float32 or
    float64) under the histogram rule; returns which histogram it has: ``"exact"``, ``"exact, sparse"`` (more
    finite nonzero values than the sample, too few of them in it) or ``"sampled"``."""
    ref = record.compute(values, hist_sample=None)
    nonzero = ref[record.HIST_START:].sum()  # exact reference: every finite nonzero value binned
    hs = got[record.INDEX["hist_sample"]]
    bad, reasons = record.check_disk(record.to_disk(got[None]))
    assert not bad.any(), reasons
    np.testing.assert_allclose(got[record.HIST_START:].sum(), nonzero, rtol=1e-5, atol=0.5)
    if hs == nonzero:
        assert_records_close(ref, got)
        return "exact, sparse" if hist_sample and nonzero > hist_sample else "exact"
    assert hist_sample and nonzero > hist_sample, (hs, nonzero, hist_sample)  # exact whenever it fits the sample
    assert min_kept(hist_sample) <= hs <= hist_sample, (hs, hist_sample)  # a sample that kept too few is exact instead
    mixed = np.array(ref)
    mixed[record.INDEX["hist_sample"]:] = got[record.INDEX["hist_sample"]:]
    assert_records_close(mixed, got)  # every other field exact
    assert set(np.flatnonzero(got[record.HIST_START:])) <= set(np.flatnonzero(ref[record.HIST_START:]))
    return "sampled"


def check_recipe(recipe: dict, convert: Callable[[dict], tuple[Any, np.ndarray]],
                 record_of: Callable[[Any], np.ndarray], hist_sample: int) -> str:
    """:func:`check_record` of one drawn gradient: ``convert`` makes it in the framework (the framework's array, and
    its values as the path reads them), ``record_of`` records it (one memory-form row). Which histogram it has is
    counted as a hypothesis event (``pytest --hypothesis-show-statistics``) and returned."""
    x, values = convert(recipe)
    kind = check_record(values, record_of(x), hist_sample)
    event(kind)
    return kind
