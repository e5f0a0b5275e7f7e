"""The per-tensor baselines the zoo prints beside the diagnosis, on records whose answer follows from how they are
built (a NaN gradient, an all-zero gradient, a gradient of RMS 1e-9, an ordinary one)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import deepdiagnosis_rules
from tb_gradhealth import record

pytestmark = pytest.mark.unit


def _run(grad: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng(0)
    # an ordinary gradient of a zero-initialised bias: healthy
    ok = record.compute(rng.standard_normal(64) * 1e-2, np.zeros(64), None, hist_sample=None)
    odd = record.compute(grad, rng.standard_normal(64), None, hist_sample=None)
    return np.stack([np.stack([ok, ok]), np.stack([ok, odd])])  # [2 steps, 2 layers]


@pytest.mark.parametrize(("grad", "expected"), [
    (np.r_[np.full(63, 1e-2), np.nan], "nonfinite"),
    (np.zeros(64), "dead"),
    (np.full(64, 1e-9), "vanishing"),
    (np.full(64, 1e-2), None),
])
def test_deepdiagnosis_checks(grad, expected):
    assert deepdiagnosis_rules.verdict(_run(grad)) == expected
