"""The forward record's float64 reference, computed here independently of :mod:`tb_gradhealth.record` (plain numpy,
a loop over units), and the comparison every writer path's forward records pass: counts equal, extremes equal to
float32's rounding, RMS and mean to ``rtol`` (float32 accumulation on a device)."""

from __future__ import annotations

import math

import numpy as np

from tb_gradhealth import record

TINY = float(np.finfo(np.float32).tiny)


def reference(a: np.ndarray, unit_axis: int = -1, bounds: tuple[float, float] | None = None) -> dict[str, float]:
    """Plain float64 statistics of a float32 output, |a| < TINY flushed to zero; units and dead units by a loop;
    saturated: within 1% of the range from a bound."""
    x = np.asarray(a, dtype=np.float32).astype(np.float64)
    x = np.where(np.abs(x) < TINY, 0.0, x)
    flat = x.ravel()
    fin = flat[np.isfinite(flat)]
    units = x.shape[unit_axis] if x.ndim >= 2 else 1
    dead = 0
    for u in range(units):
        unit = np.take(x, u, axis=unit_axis) if x.ndim >= 2 else x
        dead += all(v == 0 for v in unit.ravel())  # NaN != 0: a NaN unit is not dead
    out = {"size": flat.size, "nonfinite": int((~np.isfinite(flat)).sum()), "zero": int((fin == 0).sum()),
           "units": units if flat.size else 0, "dead": dead if flat.size else 0}
    if fin.size:
        out.update(mean=float(fin.mean()), max_abs=float(np.abs(fin).max()),
                   rms=math.sqrt(float(np.mean(fin * fin))), min=float(fin.min()), max=float(fin.max()))
    if bounds is not None:
        lo, hi = bounds
        margin = 0.01 * (hi - lo)
        lo_e, hi_e = float(np.float32(lo + margin)), float(np.float32(hi - margin))  # compared in float32
        out["saturated"] = int(sum(1 for v in fin if v <= lo_e or v >= hi_e))
    return out


def check_against(rec: np.ndarray, ref: dict[str, float], rtol: float = 1e-6) -> None:
    """``rec`` (memory form) is the record :func:`reference` describes."""
    d = record.act_derived(rec)
    for name in ("size", "nonfinite", "units", "dead"):
        assert d[name] == ref[name], (name, d[name], ref[name])
    assert rec[record.ACT_INDEX["zero"]] == ref["zero"]
    if "mean" in ref:
        f32 = [float(np.float32(ref[k])) for k in ("min", "max", "max_abs")]
        assert [float(d["min"]), float(d["max"]), float(d["max_abs"])] == f32
        np.testing.assert_allclose(d["rms"], ref["rms"], rtol=rtol)
        np.testing.assert_allclose(d["mean"], ref["mean"], rtol=rtol, atol=rtol * ref["max_abs"])
    if "saturated" in ref:
        assert rec[record.ACT_INDEX["saturated"]] == ref["saturated"]
    else:
        assert rec[record.ACT_INDEX["saturated"]] == 0 and np.isnan(rec[record.ACT_INDEX["bound_lo"]])


def edge_outputs() -> dict[str, tuple[np.ndarray, int, tuple[float, float] | None]]:
    """``name -> (output, unit axis, bounds)``: outputs that take each path of the writers' statistics, healthy ones
    (per-unit extremes and plain sums) and every kind the masked passes are for (NaN, Inf, huge, tiny, subnormal
    values), with dead units among them."""
    rng = np.random.default_rng(5)
    relu = np.maximum(rng.normal(size=(6, 8, 5, 5)), 0).astype(np.float32)
    relu[:, [1, 6]] = 0.0  # two dead channels
    sub = relu.copy()
    sub[0, 2, 0, 0] = 1e-41  # a subnormal inside: counted as zero
    tiny_unit = relu.copy()
    tiny_unit[:, 3] = 1e-41  # a unit of subnormals only: dead
    nan = relu.copy()
    nan[2, 4, 1, 1] = np.nan
    inf = relu.copy()
    inf[1, 0, 0, 0], inf[3, 5, 2, 2] = np.inf, -np.inf
    sig = (1 / (1 + np.exp(-4 * rng.normal(size=(16, 12))))).astype(np.float32)
    return {
        "relu": (relu, 1, None), "subnormal_inside": (sub, 1, None), "subnormal_unit": (tiny_unit, 1, None),
        "nan": (nan, 1, None), "inf": (inf, 1, None), "huge": (relu * np.float32(1e35), 1, None),
        "tiny": (relu * np.float32(1e-33), 1, None), "negative_last_axis": (-relu.reshape(6, -1), -1, None),
        "sigmoid_saturated": (sig, -1, (0.0, 1.0)), "one_axis": (rng.normal(size=40).astype(np.float32), -1, None),
        "all_zero": (np.zeros((4, 3), np.float32), -1, None),
    }

