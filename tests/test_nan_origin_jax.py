"""Where the first NaN/Inf was made, in a jitted JAX step recorded with ``tb_gradhealth.jax`` (its own process).

The same five injected faults (tests/nan_cases_jax.py); a layer is a ``jax.named_scope``. The answer names the
primitive, the scope, the direction and the marked source line at the faulty step.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.jax]

jax = pytest.importorskip("jax")

import tb_gradhealth.jax as tbj  # noqa: E402
from tb_gradhealth.jax_origin import OriginFinder  # noqa: E402
from tests import nan_cases_jax as cases  # noqa: E402


def train(case, log_dir: str) -> OriginFinder:
    def loss_fn(params, x, y):
        return case.loss(y, case.model(params, x))

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        new = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
        return new, tbj.compute(grads, params)

    finder = OriginFinder(loss_fn, log_dir)
    params = case.params
    for i, (x, y) in enumerate(cases.batches(case), 1):
        new, packed = step(params, x, y)
        if finder.check(i, tbj.to_memory(packed), params, x, y) is not None:
            break
        params = new
    return finder


@pytest.mark.parametrize("name", list(cases.CASES))
def test_jitted_step_names_the_origin(name, tmp_path):
    cases.nan_faults.assert_case_found(cases, name, train, tmp_path)
