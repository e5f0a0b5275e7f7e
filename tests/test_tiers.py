"""Long runs in bounded memory: a window's row against the record of all its steps' values together (float64,
:func:`record.compute` of the concatenation), the plan's grouping, and the plugin's reader on runs past its budget
against the CLI's every-step reading of the same files."""

from __future__ import annotations

import numpy as np
import pytest

from tb_gradhealth import _filereader as filereader
from tb_gradhealth import _payloads as payloads
from tb_gradhealth import _tiers as tiers
from tb_gradhealth import health, metadata, reader, record
from tb_gradhealth import testing as gl

pytestmark = [pytest.mark.unit]


def _values(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    g = rng.normal(0.0, scale, n)
    g[rng.random(n) < 0.1] = 0.0
    return g


def _step_rows(values: list[np.ndarray], weights: list[np.ndarray]) -> np.ndarray:
    return np.stack([record.compute(v, weight=w, update=w * 1e-3, hist_sample=None)
                     for v, w in zip(values, weights, strict=True)])


def test_a_window_is_the_mean_step_of_all_its_values():
    rng = np.random.default_rng(0)
    values = [_values(rng, 500, 10.0 ** rng.uniform(-6, 2)) for _ in range(5)]
    weights = [rng.normal(0, 1, 500) for _ in range(5)]
    rows = _step_rows(values, weights)[:, None, :]  # [k=5, L=1, F]
    mean, steps = tiers.mean_step(rows, np.ones((5, 1), np.int64))
    whole = record.compute(np.concatenate(values), weight=np.concatenate(weights),
                           update=np.concatenate(weights) * 1e-3, hist_sample=None)
    assert steps.tolist() == [5]
    back = tiers.window_sums(mean[0], 5)
    for name in record.COUNT_FIELDS + ("hist_sample",):
        assert back[record.INDEX[name]] == whole[record.INDEX[name]], name
    np.testing.assert_allclose(back[record.HIST_START:], whole[record.HIST_START:], rtol=1e-12)  # estimates
    for name in ("min", "max", "weight_max_abs", "update_max_abs"):
        assert back[record.INDEX[name]] == whole[record.INDEX[name]], name
    for name in ("mean", "ssq_rel", "weight_ssq_rel", "update_ssq_rel"):
        np.testing.assert_allclose(back[record.INDEX[name]], whole[record.INDEX[name]], rtol=1e-12, err_msg=name)
    # The mean step: per-step counts and norms (the RMS of the steps' norms), the window's extremes.
    d, per_step = record.derived(mean[0]), [record.derived(r) for r in rows[:, 0]]
    np.testing.assert_allclose(d["norm"], np.sqrt(np.mean([p["norm"] ** 2 for p in per_step])), rtol=1e-12)
    assert mean[0, record.INDEX["size"]] == 500


def test_a_window_leaves_out_the_steps_where_a_layer_has_no_record():
    rng = np.random.default_rng(1)
    values = [_values(rng, 64, 1.0) for _ in range(4)]
    rows = np.stack([np.stack([record.compute(v, hist_sample=None), record.empty() * np.nan]) for v in values])
    rows[2, 1] = record.compute(values[2] * 7, hist_sample=None)  # the second layer has one record, at step 2
    mean, steps = tiers.mean_step(rows, np.array([[1, 0], [1, 0], [1, 1], [1, 0]]))
    assert steps.tolist() == [4, 1]
    np.testing.assert_allclose(mean[1], rows[2, 1], rtol=1e-15)
    whole = record.compute(np.concatenate(values), hist_sample=None)
    np.testing.assert_allclose(tiers.window_sums(mean[0], 4), whole, rtol=1e-12)
    empty, none = tiers.mean_step(rows[:2, 1:], np.zeros((2, 1), np.int64))
    assert none.tolist() == [0] and np.isnan(empty).all()


@pytest.mark.parametrize("n_rows,n_old,width,pinned", [(40, 0, 1, None), (40, 8, 4, None), (41, 10, 8, 12),
                                                       (100, 0, 1, 0), (33, 6, 2, 32)])
def test_the_plan_covers_every_row_once_and_keeps_the_recent_ones_and_the_pinned_one_alone(n_rows, n_old, width,
                                                                                         pinned):
    budget = 32
    groups, old, new_width = tiers.plan(n_rows, n_old, width, budget, pinned)
    assert groups[0][0] == 0 and groups[-1][1] == n_rows
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(groups, groups[1:], strict=False))
    assert old <= budget // 4 + (pinned is not None) * 2 and len(groups) <= budget // 2 + 2
    assert all(e - s == 1 for s, e in groups[old:])  # the recent rows stay single steps
    assert len(groups) - old >= min(budget // 4, n_rows - n_old)
    if pinned is not None:
        assert (pinned, pinned + 1) in groups
    assert new_width >= width and new_width & (new_width - 1) == 0


def _long_run(logdir: str, steps: int, layers: int, nan_from: int | None = None, jump_at: int | None = None
              ) -> tuple[list[str], np.ndarray]:
    """Records of a run whose gradients wander around 1e-3 (x1e4 on every layer from ``jump_at``, NaN in the last
    layer from ``nan_from``)."""
    rng = np.random.default_rng(7)
    names = [f"dense_{i}/kernel" for i in range(layers)]
    rows = np.empty((steps, layers, record.NUM_FIELDS))
    for s in range(steps):
        scale = 1e-3 * (1e4 if jump_at is not None and s >= jump_at else 1.0)
        for j in range(layers):
            g = rng.normal(0, scale * (1 + j), 32)
            if nan_from is not None and s >= nan_from and j == layers - 1:
                g[:3] = np.nan
            rows[s, j] = record.compute(g, weight=rng.normal(0, 1, 32), hist_sample=None)
    gl.write_records(f"{logdir}/long", names, list(range(0, 10 * steps, 10)), rows)
    return names, rows


def test_a_run_past_the_budget_keeps_its_recent_steps_exactly_and_its_older_ones_as_windows(tmp_path):
    names, rows = _long_run(str(tmp_path), 700, 2, nan_from=230)
    full = reader.read_logdir(str(tmp_path)).runs[0]
    assert _tiered(str(tmp_path), 1024).window_steps is None  # 700 steps fit in 1,024 rows
    tiered = _tiered(str(tmp_path), 256)
    assert tiered.window_steps is not None and tiered.num_steps <= 256
    # Every step is accounted for once, and the recent quarter of the budget is the full reading's.
    steps_per_layer = tiered.window_steps.sum(axis=0)
    assert steps_per_layer.tolist() == [700, 700]
    recent = tiered.num_steps - int(np.flatnonzero(tiered.window_steps[:, 0] > 1).max()) - 1
    assert recent >= 256 // 4
    np.testing.assert_array_equal(tiered.records[-recent:], full.records[-recent:])
    np.testing.assert_array_equal(tiered.steps[-recent:], full.steps[-recent:])
    # The first NaN step is a row of its own; each window is the merge of the full reading's rows it spans.
    k = int(np.searchsorted(tiered.steps, 2300))
    assert tiered.steps[k] == 2300 and tiered.window_steps[k].tolist() == [1, 1]
    for i in range(tiered.num_steps):
        a, b = np.searchsorted(full.steps, [tiered.steps[i], tiered.window_last[i] + 1])
        want = record.merge_all(full.records[a:b], axis=0)
        got = tiers.window_sums(tiered.records[i], tiered.window_steps[i])
        np.testing.assert_allclose(got, want, rtol=1e-9, equal_nan=True)


def _tiered(logdir: str, rows: int) -> reader.RunSeries:
    return filereader.FileReader(logdir, chunk_bytes=8192, layer_steps=0, min_rows=rows).run(None, "", "long")


def test_steps_appended_after_a_merge_are_read_alone_and_join_the_run(tmp_path):
    names, rows = _long_run(str(tmp_path), 400, 2)
    fr = filereader.FileReader(str(tmp_path), chunk_bytes=8192, listing_ttl=0.0, layer_steps=0, min_rows=128)
    first = fr.run(None, "", "long")
    kept = first.records.copy()
    assert first.window_steps.sum(axis=0).tolist() == [400, 400]
    (path,) = fr.listing()["long"]
    tag = metadata.tag_for(names)
    with open(path, "ab") as f:
        for i in range(100):
            f.write(gl.frame(gl.record_event(4000 + 10 * i, tag, rows[i], wall_time=gl.WALL_TIME0 + 4000 + i)))
    after = fr.run(None, "", "long")
    assert after.window_steps.sum(axis=0).tolist() == [500, 500]
    assert after.steps[-1] == 4990 and after.generation != first.generation
    on_disk = np.stack([record.from_disk(record.to_disk(r)) for r in rows[:100]])  # float32 values
    np.testing.assert_array_equal(after.records[-100:], on_disk)
    np.testing.assert_array_equal(first.records, kept)  # a merge writes a new buffer: earlier series stay valid


def test_the_diagnosis_of_a_merged_run_keeps_the_exact_nan_onset_and_the_verdicts(tmp_path):
    _long_run(str(tmp_path), 700, 2, nan_from=230)
    full = reader.read_logdir(str(tmp_path)).runs[0]
    tiered = _tiered(str(tmp_path), 256)
    t = health.Thresholds()
    a, b = payloads.diagnose(full, t, None), payloads.diagnose(tiered, t, None)
    assert b.statuses() == a.statuses()
    nan_layer = b.by_layer()["dense_1/kernel"]
    assert nan_layer.status == "nonfinite" and nan_layer.first_step == 2300  # the injected fault's step
    assert any("merged windows" in n for n in tiered.notes)
    s = payloads.series_payload(tiered, "dense_0/kernel", t)
    assert s["total_steps"] == 700 and s["merged"]
    whole = payloads.series_payload(full, "dense_0/kernel", t)
    assert max(s["fields"]["max_abs"]) == max(whole["fields"]["max_abs"])
