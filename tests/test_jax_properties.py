"""Property tests of tb_gradhealth.jax under ``jax.jit``: for generated gradients of every dtype, shape and
sparsity, each record equals the float64 reference field by field, its histogram is exact whenever the rule says
so (a ``lax.cond`` picks it), its bins always add up to the finite nonzero count, and it passes ``check_disk``.

``pytest --hypothesis-show-statistics`` prints how many cases ran."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.device_cases import SETTINGS, SLOW_SIZES, build, check_recipe, check_record, gradients, sizes_near

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jgh = pytest.importorskip("tb_gradhealth.jax")

pytestmark = pytest.mark.jax

HS = 256
FAST_SIZES = st.one_of(sizes_near(1, 64, HS, 4 * HS, 64 * HS), st.integers(0, 20 * HS), st.integers(HS, 64 * HS))


def _array(recipe: dict) -> tuple[jax.Array, np.ndarray]:
    """The gradient as a JAX array of the recipe's dtype (float64 stays float64 on the host: JAX's default
    config has no float64 arrays), and its values as the path reads them."""
    values = build(recipe)
    if recipe["dtype"] == "float64":
        return values, values
    x = jnp.asarray(values, getattr(jnp, recipe["dtype"]))
    return x, np.asarray(x.astype(jnp.float32))


_COMPUTE = jax.jit(lambda g, hs, s: jgh.compute({"g": g}, hist_sample=hs, seed=s), static_argnums=1)


def _jitted(x, hs: int, seed: int) -> np.ndarray:
    return jgh.to_memory(_COMPUTE(x, hs, seed))[0]


@settings(SETTINGS, max_examples=40)
@given(gradients(FAST_SIZES), st.sampled_from([HS, 0, 4096]), st.integers(0, 1000))
def test_jitted_records_match_reference(recipe, hs, seed):
    check_recipe(recipe, _array, lambda x: _jitted(x, hs, seed), hs)


@pytest.mark.slow
@settings(SETTINGS, max_examples=25)
@given(gradients(SLOW_SIZES, dtypes=("float32", "bfloat16")), st.integers(0, 1000))
def test_jitted_records_match_reference_at_large_sizes(recipe, seed):
    check_recipe(recipe, _array, lambda x: _jitted(x, 4096, seed), 4096)


def test_sparse_tensor_whose_sample_misses_its_nonzeros_has_the_exact_histogram():
    """A (3, 3, 512, 512) gradient with 3 nonzero values: the sample almost surely misses them all."""
    g = np.zeros((3, 3, 512, 512), np.float32)
    g.reshape(-1)[[5, 99_999, 1_234_567]] = [1.0, -2e-5, 3e3]
    for seed in range(3):
        assert check_record(g, _jitted(g, 4096, seed), 4096) == "exact"
    dense = np.random.default_rng(0).normal(size=g.shape).astype(np.float32)
    assert check_record(dense, _jitted(dense, 4096, 0), 4096) == "sampled"
