"""Property tests of tb_gradhealth.torch (eager and traced by torch.compile): for generated gradients of every
dtype, shape and sparsity, each record equals the float64 reference field by field, its histogram is exact
whenever the rule says so, its bins always add up to the finite nonzero count, and it passes ``check_disk``.

``pytest --hypothesis-show-statistics`` prints how many cases each path ran."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tb_gradhealth import _cpustats
from tests.device_cases import SETTINGS, SLOW_SIZES, build, check_recipe, check_record, gradients, sizes_near

torch = pytest.importorskip("torch")
tgh = pytest.importorskip("tb_gradhealth.torch")

pytestmark = pytest.mark.torch

HS = 256  # a small sample keeps the boundaries cheap; the slow tier uses the default 4096
FAST_SIZES = st.one_of(sizes_near(1, 64, HS, 4 * HS, 64 * HS), st.integers(0, 20 * HS), st.integers(HS, 200 * HS))


def _tensor(recipe: dict) -> tuple[torch.Tensor, np.ndarray]:
    """The gradient as a torch tensor of the recipe's dtype, and its values as the framework holds them."""
    values = build(recipe)
    t = torch.from_numpy(np.ascontiguousarray(values)).to(getattr(torch, recipe["dtype"]))
    return t, (t.numpy() if recipe["dtype"] == "float64" else t.float().numpy())


def _eager(t: torch.Tensor, hs: int, seed: int) -> np.ndarray:
    return tgh.to_memory(tgh.compute({"g": t}, hist_sample=hs, seed=seed))[0]


@settings(SETTINGS, max_examples=400)
@given(gradients(FAST_SIZES), st.sampled_from([HS, 0, 4096]), st.integers(0, 1000))
def test_eager_records_match_reference(recipe, hs, seed):
    check_recipe(recipe, _tensor, lambda t: _eager(t, hs, seed), hs)


@settings(SETTINGS, max_examples=200)
@given(gradients(FAST_SIZES), st.sampled_from([HS, 0, 4096]), st.integers(0, 1000))
def test_eager_records_through_torch_ops_match_reference(recipe, hs, seed):
    """The same through torch ops alone: an accelerator's path, and a CPU's where the compiled loop is not built."""
    with mock.patch.dict(os.environ, {_cpustats.ENV: "0"}):
        check_recipe(recipe, _tensor, lambda t: _eager(t, hs, seed), hs)


@settings(SETTINGS, max_examples=24)
@given(gradients(FAST_SIZES, dtypes=("float32", "bfloat16")), st.integers(0, 1000))
def test_traced_records_match_reference(recipe, seed):
    """Traced whole (``fullgraph=True``): the histogram's choice is a ``torch.cond``, not a graph break."""
    torch._dynamo.reset()  # a new shape per case: past the recompile limit dynamo would fall back to eager
    traced = torch.compile(lambda g, s: tgh.compute({"g": g}, hist_sample=HS, seed=s), backend="aot_eager",
                           fullgraph=True)
    check_recipe(recipe, _tensor, lambda t: tgh.to_memory(traced(t, seed))[0], HS)


@pytest.mark.slow
@settings(SETTINGS, max_examples=30)
@given(gradients(SLOW_SIZES, dtypes=("float32", "float16")), st.integers(0, 1000))
def test_eager_records_match_reference_at_large_sizes(recipe, seed):
    check_recipe(recipe, _tensor, lambda t: _eager(t, 4096, seed), 4096)


@pytest.mark.slow
def test_compile_true_records_match_reference():
    """``compile=True`` (inductor), one shape so one compilation: dense (sampled), sparse beyond the sample (exact),
    NaN/Inf with huge and tiny values (the scaled passes)."""
    rng = np.random.default_rng(9)
    n = 64 * HS
    dense = rng.normal(size=n).astype(np.float32)
    sparse = np.where(rng.random(n) < 0.05, dense, 0.0).astype(np.float32)
    wild = (dense * 1e35).astype(np.float32)
    wild[::97] = np.nan
    wild[5], wild[7], wild[11] = np.inf, -np.inf, 1e-40
    kinds = []
    for values in (dense, sparse, wild):
        got = tgh.to_memory(tgh.compute({"g": torch.from_numpy(values)}, hist_sample=HS, seed=3, compile=True))[0]
        kinds.append(check_record(values, got, HS))
    assert kinds == ["sampled", "exact, sparse", "sampled"]


def test_sparse_tensor_whose_sample_misses_its_nonzeros_has_the_exact_histogram():
    """A (3, 3, 512, 512) gradient with 3 nonzero values: the sample almost surely misses them all."""
    g = torch.zeros(3, 3, 512, 512)
    g.view(-1)[[5, 99_999, 1_234_567]] = torch.tensor([1.0, -2e-5, 3e3])
    traced = torch.compile(lambda g, s: tgh.compute({"g": g}, seed=s), backend="aot_eager", fullgraph=True)
    for seed in range(3):
        assert check_record(g.numpy(), _eager(g, 4096, seed), 4096) == "exact"
        assert check_record(g.numpy(), tgh.to_memory(traced(g, seed))[0], 4096) == "exact"
    dense = torch.randn(3, 3, 512, 512)
    assert check_record(dense.numpy(), _eager(dense, 4096, 0), 4096) == "sampled"
