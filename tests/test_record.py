"""The record's numpy reference against float64 computed independently here, at every scale float32 can hold."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tb_gradhealth import record

TINY = float(np.finfo(np.float32).tiny)
SCALES = [1e-37, 1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30, 1e37]


def reference(g: np.ndarray) -> dict[str, float]:
    """Plain float64 statistics of a float32 tensor, flushing |g| < TINY to zero, over finite values."""
    x = np.asarray(g, dtype=np.float32).astype(np.float64).ravel()
    x = np.where(np.abs(x) < TINY, 0.0, x)
    fin = x[np.isfinite(x)]
    out = {
        "size": x.size,
        "nan": int(np.isnan(x).sum()),
        "posinf": int((x == np.inf).sum()),
        "neginf": int((x == -np.inf).sum()),
        "zero": int((fin == 0).sum()),
        "norm": math.sqrt(float(np.sum(fin * fin))),  # no overflow in float64 for float32 inputs
        "finite": fin.size,
    }
    if fin.size:
        out.update(min=fin.min(), max=fin.max(), mean=fin.mean(), max_abs=np.abs(fin).max())
        out["rms"] = out["norm"] / math.sqrt(fin.size)
    return out


def decade_bins(abs_values: np.ndarray) -> np.ndarray:
    """Independent bin index: number of float32 decade edges 1e-37..1e38 at or below each magnitude."""
    edges = np.array([np.float32(f"1e{e}") for e in range(-37, 39)], dtype=np.float32)
    a = np.asarray(abs_values, dtype=np.float32)
    return (a[:, None] >= edges[None, :]).sum(axis=1)


@pytest.mark.unit
@pytest.mark.parametrize("scale", SCALES)
def test_exact_fields_at_extreme_scales(scale):
    rng = np.random.default_rng(int(-math.log10(scale) + 100))
    g = (rng.standard_normal(5000) * scale).astype(np.float32)
    g[::97] = 0.0
    rec = record.compute(g, hist_sample=None)
    d = record.derived(rec)
    ref = reference(g)
    for f in ("size", "nan", "zero"):
        assert d[f] == ref[f], f
    assert d["inf"] == 0
    assert rec[record.INDEX["min"]] == ref["min"] and rec[record.INDEX["max"]] == ref["max"]
    assert d["max_abs"] == ref["max_abs"]
    np.testing.assert_allclose(d["norm"], ref["norm"], rtol=1e-5)
    np.testing.assert_allclose(d["rms"], ref["rms"], rtol=1e-5)
    np.testing.assert_allclose(d["mean"], ref["mean"], rtol=1e-5, atol=1e-12 * ref["max_abs"])
    # histogram: exact, of the finite nonzero magnitudes
    nz = np.abs(g[(g != 0) & (np.abs(g) >= TINY)])
    expect = np.bincount(decade_bins(nz), minlength=record.HIST_BINS)
    np.testing.assert_array_equal(rec[record.HIST_START:], expect)
    assert rec[record.INDEX["hist_sample"]] == nz.size and d["hist_exact"]


@pytest.mark.unit
def test_largest_and_smallest_normal_float32():
    big = np.finfo(np.float32).max
    g = np.array([big, -big, big / 2, TINY, -TINY * 3], np.float32)
    d = record.derived(record.compute(g))
    ref = reference(g)
    np.testing.assert_allclose(d["norm"], ref["norm"], rtol=1e-6)
    assert math.isfinite(d["norm"]) and d["norm"] > big
    d = record.derived(record.compute(np.full(1000, 2 * TINY, np.float32)))
    np.testing.assert_allclose(d["norm"], math.sqrt(1000) * 2 * TINY, rtol=1e-6)


@pytest.mark.unit
def test_subnormals_flush_to_zero():
    g = np.array([1e-39, -1e-40, 1.0, 0.0], np.float32)  # the first two are float32 subnormals
    rec = record.compute(g)
    assert rec[record.INDEX["zero"]] == 3
    assert rec[record.INDEX["min"]] == 0.0 and rec[record.INDEX["max"]] == 1.0
    assert rec[record.HIST_START:].sum() == 1


@pytest.mark.unit
def test_nan_inf_are_counted_and_do_not_poison_finite_stats():
    rng = np.random.default_rng(1)
    clean = rng.standard_normal(300).astype(np.float32) * 1e-25
    dirty = np.concatenate([clean, np.array([np.nan] * 3 + [np.inf] * 2 + [-np.inf], np.float32)])
    rng.shuffle(dirty)
    a, b = record.compute(dirty), record.compute(clean)
    assert (a[record.INDEX["nan"]], a[record.INDEX["posinf"]], a[record.INDEX["neginf"]]) == (3, 2, 1)
    assert a[record.INDEX["size"]] == 306
    for f in ("min", "max", "mean", "ssq_rel", "zero", "hist_sample"):
        np.testing.assert_allclose(a[record.INDEX[f]], b[record.INDEX[f]], rtol=1e-12, err_msg=f)
    np.testing.assert_array_equal(a[record.HIST_START:], b[record.HIST_START:])
    d = record.derived(a)
    assert d["inf"] == 3 and d["finite"] == 300
    np.testing.assert_allclose(d["norm"], reference(clean)["norm"], rtol=1e-6)


@pytest.mark.unit
def test_all_nonfinite_and_empty():
    d = record.derived(record.compute(np.array([np.nan, np.inf], np.float32)))
    # Statistics of no finite value are unknown (NaN, JSON null), never 0.
    assert d["finite"] == 0 and math.isnan(d["norm"]) and math.isnan(d["rms"]) and math.isnan(d["max_abs"])
    rec = record.compute(np.zeros((0, 4), np.float32))
    np.testing.assert_array_equal(rec, record.empty())
    d = record.derived(rec)
    assert d["size"] == 0 and math.isnan(d["zero_fraction"]) and math.isnan(d["rms"]) and d["norm"] == 0


@pytest.mark.unit
def test_missing_and_optional_fields():
    w = np.array([3.0, -4.0, np.nan], np.float32)
    rec = record.compute(None, w)
    assert rec[record.INDEX["missing"]] == 1 and rec[record.INDEX["size"]] == 3
    d = record.derived(rec)
    np.testing.assert_allclose(d["weight_norm"], 5.0, rtol=1e-12)  # over finite weights
    g = np.array([0.3, 0.4], np.float32)
    d = record.derived(record.compute(g, np.array([3.0, 4.0], np.float32), np.array([0.0, 1e-3], np.float32)))
    np.testing.assert_allclose(d["grad_to_weight"], 0.5 / 5.0, rtol=1e-6)
    np.testing.assert_allclose(d["update_to_weight"], 1e-3 / 5.0, rtol=1e-6)
    assert math.isnan(record.derived(record.compute(g))["grad_to_weight"])  # not recorded -> unknown


def split_merge(g: np.ndarray, cut: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    whole = record.compute(g, **kw)
    merged = record.merge(record.compute(g[:cut], **kw), record.compute(g[cut:], **kw))
    return whole, merged


@pytest.mark.unit
@pytest.mark.parametrize("scale", [1e-36, 1.0, 1e36])
def test_merge_of_two_halves_equals_whole(scale):
    rng = np.random.default_rng(2)
    g = (rng.standard_normal(2000) * scale).astype(np.float32)
    g[5] = np.nan
    g[1500] = -np.inf
    g[::50] = 0
    g[1200:1300] *= np.float32(min(1e3, 1e37 / scale))  # the halves have different max|g|
    w = rng.standard_normal(2000).astype(np.float32)
    whole = record.compute(g, w, hist_sample=None)
    merged = record.merge(record.compute(g[:700], w[:700], hist_sample=None),
                          record.compute(g[700:], w[700:], hist_sample=None))
    exact = list(record.COUNT_FIELDS) + ["min", "max", "missing", "hist_sample", "weight_max_abs"]
    for f in exact:
        assert merged[record.INDEX[f]] == whole[record.INDEX[f]], f
    np.testing.assert_array_equal(merged[record.HIST_START:], whole[record.HIST_START:])
    for f in ("mean", "ssq_rel", "weight_ssq_rel"):
        np.testing.assert_allclose(merged[record.INDEX[f]], whole[record.INDEX[f]], rtol=1e-10, err_msg=f)
    dm, dw = record.derived(merged), record.derived(whole)
    np.testing.assert_allclose(dm["norm"], reference(g)["norm"], rtol=1e-6)
    np.testing.assert_allclose(dm["rms"], dw["rms"], rtol=1e-10)


@pytest.mark.unit
def test_merge_identity_all_and_unknown_optionals():
    g = np.arange(-5, 20, dtype=np.float32)
    r = record.compute(g, g)
    np.testing.assert_array_equal(record.merge(record.empty(), r), r)  # empty() is the identity
    np.testing.assert_array_equal(record.merge(r, record.empty()), r)
    parts = np.stack([record.compute(p) for p in np.array_split(g, 4)])
    whole = record.compute(g)
    merged = record.merge_all(parts)
    np.testing.assert_allclose(merged, whole, rtol=1e-12)
    # an optional field one part lacks yields to the other; it stays unknown only when no part has it
    assert record.merge(r, record.compute(g))[record.INDEX["weight_max_abs"]] == 19
    assert math.isnan(record.merge(whole, whole)[record.INDEX["weight_ssq_rel"]])
    # merging a present gradient with a missing part: not missing
    assert record.merge(record.missing(), whole)[record.INDEX["missing"]] == 0


def _mixed_records(rng: np.random.Generator, k: int) -> np.ndarray:
    """Records of every kind a merge meets: plain, with NaN/Inf, all zero, without the optional weight/update
    fields, with noise fields, a missing gradient and the empty record, at scales from 1e-30 to 1e30."""
    rows = []
    for _ in range(k):
        kind = rng.integers(0, 6)
        if kind == 4:
            rows.append(record.missing())
            continue
        if kind == 5:
            rows.append(record.empty())
            continue
        g = rng.normal(0.0, 10.0 ** rng.uniform(-30, 30), int(rng.integers(1, 60)))
        if kind == 1:
            g[rng.random(g.size) < 0.3] = rng.choice([np.nan, np.inf, -np.inf])
        if kind == 2:
            g[:] = 0.0
        w = rng.normal(0.0, 10.0 ** rng.uniform(-3, 3), g.size) if kind != 3 else None
        rec = record.compute(g, weight=w, update=None if w is None else w * 1e-3, hist_sample=None)
        if rng.random() < 0.3:
            rec[record.INDEX["micro_batches"]] = float(rng.integers(1, 5))
            rec[record.INDEX["noise_ssq_rel"]] = float(rng.uniform(0, 3))
        rows.append(rec)
    return np.stack(rows)


@pytest.mark.unit
@pytest.mark.parametrize("seed", range(12))
def test_merge_all_is_the_fold_of_pairwise_merges(seed):
    """``merge_all`` reduces each field in one pass; the rules are :func:`record.merge`'s, folded pair by pair."""
    import functools

    rng = np.random.default_rng(seed)
    rows = _mixed_records(rng, int(rng.integers(1, 40)))
    folded = functools.reduce(record.merge, rows, record.empty())
    merged = record.merge_all(rows)
    counts = [record.INDEX[n] for n in record.COUNT_FIELDS + ("hist_sample",)] + list(
        range(record.HIST_START, record.NUM_FIELDS))
    np.testing.assert_array_equal(merged[counts], folded[counts])
    np.testing.assert_allclose(merged, folded, rtol=1e-12, atol=0, equal_nan=True)
    # along another axis, and cut inside the histogram as the plugin's windows are
    stacked = np.stack([rows, rows[::-1]], axis=1)
    np.testing.assert_allclose(record.merge_all(stacked, axis=0)[1], record.merge_all(rows[::-1]), rtol=1e-12,
                               equal_nan=True)
    cut = record.HIST_START + 40
    np.testing.assert_allclose(record.merge_all(rows[:, :cut]), merged[:cut], rtol=1e-12, equal_nan=True)


@pytest.mark.unit
def test_merge_all_of_nothing_is_the_empty_record():
    np.testing.assert_array_equal(record.merge_all(np.zeros((0, 3, record.NUM_FIELDS))), record.empty((3,)))


@pytest.mark.unit
def test_sampled_histogram_scaling_rule_and_merge():
    rng = np.random.default_rng(3)
    g = (rng.standard_normal(50_000) * 10.0 ** rng.integers(-30, 30, 50_000)).astype(np.float32)
    g[:1000] = 0
    rec = record.compute(g, hist_sample=2048, rng=np.random.default_rng(4))
    n_nonzero = 49_000
    assert rec[record.INDEX["hist_sample"]] == 2048
    hist = rec[record.HIST_START:]
    np.testing.assert_allclose(hist.sum(), n_nonzero, rtol=1e-12)
    # counts are integers x (finite nonzero / hist_sample)
    np.testing.assert_allclose(hist / (n_nonzero / 2048), np.rint(hist / (n_nonzero / 2048)), atol=1e-9)
    assert not record.derived(rec)["hist_exact"]
    # the sampled estimate is close to the exact histogram (60 decades, uniform-ish)
    exact = record.compute(g, hist_sample=None)[record.HIST_START:]
    assert np.abs(hist - exact).sum() / n_nonzero < 0.25
    # exact fields stay exact when sampled
    full = record.compute(g, hist_sample=None)
    np.testing.assert_array_equal(rec[: record.INDEX["hist_sample"]], full[: record.INDEX["hist_sample"]])
    # sampled halves still add up to the whole's count
    whole, merged = split_merge(g, 20_000, hist_sample=1024)
    np.testing.assert_allclose(merged[record.HIST_START:].sum(), n_nonzero, rtol=1e-12)
    assert merged[record.INDEX["hist_sample"]] == 2048


@pytest.mark.unit
def test_histogram_edges():
    vals = np.array([2e-38, 1e-37, 9.9e-37, 1.0, 9.99, 10.0, 1e38, 3e38], np.float32)
    got = record.hist_bin(vals)
    np.testing.assert_array_equal(got, decade_bins(vals))
    np.testing.assert_array_equal(got, [0, 1, 1, 38, 38, 39, 76, 76])
    assert record.HIST_BIN_LOG10_LO[38] == 0 and record.HIST_BINS == 77


@pytest.mark.unit
def test_noise_fields():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([3.0, 2.0, 1.0], np.float32)
    k, noise = record.noise_fields([a, b])
    mean = (a.astype(np.float64) + b) / 2
    expect = (np.sum((a - mean) ** 2) + np.sum((b - mean) ** 2)) / 1 / np.abs(mean).max() ** 2
    assert k == 2 and noise == pytest.approx(expect)
    assert record.noise_fields([a]) == (1.0, 0.0)


@pytest.mark.unit
def test_disk_round_trip():
    rng = np.random.default_rng(5)
    rows = np.stack([
        record.compute(rng.standard_normal(100).astype(np.float32) * 1e-20, np.ones(100, np.float32)),
        record.compute(None, np.ones(7, np.float32)),
        record.compute(np.array([np.nan, 1e30, -1e30, 0], np.float32)),
    ])
    rows[0, record.INDEX["size"]] = 2**31 - 1  # counts survive exactly (int32 bits, not float32 rounding)
    rows[0, record.INDEX["zero"]] = 2**24 + 1
    disk = record.to_disk(rows)
    used = np.flatnonzero(rows[:, record.HIST_START:].any(axis=0))
    assert disk.dtype == np.float32 and disk.shape[1] == record.DISK_HIST_START + used[-1] - used[0] + 1  # trimmed
    back = record.from_disk(disk)
    np.testing.assert_array_equal(back[:, : record.NUM_COUNTS], rows[:, : record.NUM_COUNTS])
    np.testing.assert_array_equal(back[:, record.NUM_COUNTS:], rows[:, record.NUM_COUNTS:].astype(np.float32))
    # no histogram at all: width 0
    empty = record.to_disk(np.stack([record.missing()]))
    assert empty.shape == (1, record.DISK_HIST_START)
    np.testing.assert_array_equal(record.from_disk(empty), np.stack([record.missing()]))
    # zero layers
    assert record.from_disk(record.to_disk(record.empty((0,)))).shape == (0, record.NUM_FIELDS)


@pytest.mark.unit
def test_disk_errors():
    rows = np.stack([record.compute(np.ones(3, np.float32))])
    rows[0, 0] = 2**31
    with pytest.raises(ValueError):
        record.to_disk(rows)
    with pytest.raises(ValueError):
        record.to_disk(np.zeros((2, 5)))
    disk = record.to_disk(np.stack([record.compute(np.ones(3, np.float32))] * 2))
    disk[1, record.DISK_HIST_LO] = 3  # rows disagree on the window
    with pytest.raises(ValueError):
        record.from_disk(disk)
    with pytest.raises(ValueError):
        record.from_disk(np.zeros((1, 4), np.float32))


@pytest.mark.unit
def test_device_form():
    rows = np.stack([record.compute(np.arange(5, dtype=np.float32)), record.missing()])
    counts = rows[:, : record.NUM_COUNTS].astype(np.int32)
    values = rows[:, record.NUM_COUNTS :].astype(np.float32)
    np.testing.assert_array_equal(record.from_device(counts, values), rows.astype(np.float32))
    with pytest.raises(ValueError):
        record.from_device(counts[:, :4], values)
