"""Field-by-field comparison of a device path's record with the float64 reference (:func:`record.compute`).

The documented tolerance of the torch and JAX paths: the counts, ``missing``, ``hist_sample``, the histogram and
the optional ``max|.|`` fields are equal; ``min``/``max`` equal the reference rounded to float32 (the device form
is float32); the relative sums of squares agree to ``rtol`` (float32 accumulation) and ``mean`` to
``rtol * max|g|`` (it may cancel to near zero; a subnormal mean may be flushed to zero).
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth import record

#: The relative sums: every relative field of :data:`record.GRAD_SUMS`, and the optional ones.
RELATIVE = (*(s.name for s in record.GRAD_SUMS if not s.mean), "weight_ssq_rel", "update_ssq_rel", "noise_ssq_rel")


def _f32(x: float) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def mismatches(ref: np.ndarray, got: np.ndarray, rtol: float = 2e-6) -> list[tuple[str, float, float]]:
    """``(field, reference, got)`` of every field that differs beyond the documented tolerance."""
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    scale = float(record.max_abs(ref))
    bad = []
    for i, name in enumerate(record.FIELDS):
        r, g = float(ref[i]), float(got[i])
        if name in ("min", "max", "mean", "weight_max_abs", "update_max_abs"):
            r = _f32(r)
        if (np.isnan(r) and np.isnan(g)) or r == g:
            continue
        if name in RELATIVE and abs(r - g) <= rtol * abs(r):
            continue
        if name == "mean" and abs(r - g) <= max(rtol * _f32(scale), record.FLUSH_BELOW):  # may flush to zero
            continue
        bad.append((name, r, g))
    return bad


def assert_records_close(ref: np.ndarray, got: np.ndarray, names: list[str] | None = None, rtol: float = 2e-6):
    """Rows of ``ref`` and ``got`` (memory form ``[L, NUM_FIELDS]``) agree field by field."""
    ref, got = np.atleast_2d(ref), np.atleast_2d(got)
    assert ref.shape == got.shape, (ref.shape, got.shape)
    problems = {}
    for i in range(ref.shape[0]):
        bad = mismatches(ref[i], got[i], rtol)
        if bad:
            problems[names[i] if names else i] = bad
    assert not problems, problems


def extreme_cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Gradients that stress the record: magnitudes 1e-38..1e38, NaN/Inf, zeros, subnormals, edges of bins."""
    mags = 10.0 ** rng.uniform(-38, 38, size=2000)
    return {
        "normal": rng.normal(size=(64, 33)).astype(np.float32),
        "magnitudes_1e-38_1e38": (mags * rng.choice([-1.0, 1.0], size=mags.size)).astype(np.float32),
        "tiny": (rng.normal(size=3000) * 1e-36).astype(np.float32),
        "huge": (rng.normal(size=3000) * 1e37).astype(np.float32),
        "nonfinite": np.array([1.0, np.nan, np.inf, -np.inf, 0.0, 1e-40, -2.5, 3e38, np.nan], np.float32),
        "all_nonfinite": np.array([np.nan, np.inf, -np.inf], np.float32),
        "zeros": np.zeros((5, 4), np.float32),
        "subnormals_only": np.array([1e-39, -1e-40, 1e-45, 0.0], np.float32),
        "decade_edges": np.array([1e-37, 1e-10, 1.0, 10.0, 1e38, 9.99e-11, -1e-10], np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }
