"""The forward record (a layer's output at a logged step) against float64 computed independently here: its fields,
merge rules, disk form, the numpy writer and the readers that return it beside the gradient records."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tb_gradhealth import metadata, reader, record, testing
from tb_gradhealth._streams import split_streams, stream_of
from tb_gradhealth.writer import Writer
from tests.forward_reference import check_against, reference

SCALES = [1e-36, 1e-20, 1e-6, 1.0, 1e6, 1e20, 1e36]


@pytest.mark.unit
@pytest.mark.parametrize("scale", SCALES)
def test_fields_at_every_scale(scale):
    rng = np.random.default_rng(int(-math.log10(scale) + 50))
    a = (np.maximum(rng.standard_normal((16, 6, 6, 24)), 0) * scale).astype(np.float32)
    a[..., :5] = 0.0  # five dead channels
    a[3, 2, 1, 7] = 0.0
    rec = record.compute_activations(a)
    check_against(rec, reference(a))
    assert rec[record.ACT_INDEX["dead"]] == 5


@pytest.mark.unit
def test_unit_axis_channels_first_and_one_dimensional_outputs():
    rng = np.random.default_rng(1)
    a = np.maximum(rng.standard_normal((8, 12, 5, 5)), 0).astype(np.float32)
    a[:, [2, 9]] = 0.0  # channels 2 and 9 dead in NCHW
    a[:, :, 0, 0] = 0.0  # a position dead in every channel is no dead unit
    for axis in (1, -3):
        rec = record.compute_activations(a, unit_axis=axis)
        check_against(rec, reference(a, unit_axis=1))
        assert rec[record.ACT_INDEX["units"]] == 12 and rec[record.ACT_INDEX["dead"]] == 2
    assert record.compute_activations(a)[record.ACT_INDEX["units"]] == 5  # last axis: a different question
    one = np.zeros(7, np.float32)
    assert record.compute_activations(one)[record.ACT_INDEX["units"]] == 1
    assert record.compute_activations(one)[record.ACT_INDEX["dead"]] == 1


@pytest.mark.unit
def test_nonfinite_counted_apart_and_a_nan_unit_is_not_dead():
    a = np.zeros((4, 6), np.float32)
    a[:, 0] = 1.0
    a[1, 2] = np.nan
    a[2, 3] = np.inf
    a[3, 4] = -np.inf
    a[0, 5] = 1e-40  # subnormal: zero
    rec = record.compute_activations(a)
    check_against(rec, reference(a))
    assert rec[record.ACT_INDEX["dead"]] == 2  # units 1 and 5
    assert (rec[record.ACT_INDEX["nan"]], rec[record.ACT_INDEX["posinf"]], rec[record.ACT_INDEX["neginf"]]) == (1, 1, 1)


@pytest.mark.unit
@pytest.mark.parametrize("activation", ["tanh", "sigmoid", "softsign", "hard_sigmoid"])
def test_saturated_count_at_the_stated_margin(activation):
    bounds = record.activation_bounds(activation)
    lo, hi = bounds
    rng = np.random.default_rng(2)
    pre = rng.standard_normal((64, 32)) * 4
    a = (np.tanh(pre) if lo < 0 else 1 / (1 + np.exp(-pre))).astype(np.float32)
    rec = record.compute_activations(a, bounds=bounds)
    ref = reference(a, bounds=bounds)
    check_against(rec, ref)
    assert 0 < ref["saturated"] < a.size
    assert (rec[record.ACT_INDEX["bound_lo"]], rec[record.ACT_INDEX["bound_hi"]]) == bounds
    d = record.act_derived(rec)
    assert d["saturated_fraction"] == ref["saturated"] / a.size
    # the stated distance: tanh at |a| = 0.98 is saturated, at 0.97 not; sigmoid at 0.99 / 0.01
    lo_e, hi_e = record.saturation_edges(bounds)
    np.testing.assert_allclose([lo_e, hi_e], [lo + 0.01 * (hi - lo), hi - 0.01 * (hi - lo)], rtol=1e-6)


@pytest.mark.unit
def test_unbounded_activation_has_no_saturation():
    rec = record.compute_activations(np.ones((3, 4), np.float32))
    assert rec[record.ACT_INDEX["saturated"]] == 0 and np.isnan(rec[record.ACT_INDEX["bound_lo"]])
    assert np.isnan(record.act_derived(rec)["saturated_fraction"])
    assert record.activation_bounds("relu") is None and record.activation_bounds("Tanh") == (-1.0, 1.0)


@pytest.mark.unit
def test_empty_and_all_nonfinite():
    rec = record.compute_activations(np.zeros((0, 5), np.float32))
    assert rec[record.ACT_INDEX["size"]] == 0 and rec[record.ACT_INDEX["units"]] == 0
    assert np.isnan(record.act_derived(rec)["rms"])
    nan = record.compute_activations(np.full((2, 3), np.nan, np.float32))
    d = record.act_derived(nan)
    assert d["nonfinite"] == 6 and d["dead"] == 0 and np.isnan(d["rms"]) and np.isnan(d["mean"])
    assert not record.act_check_disk(record.act_to_disk(np.stack([rec, nan])))[0].any()


@pytest.mark.unit
@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
def test_merge_of_unit_halves_and_of_batch_halves_equals_whole(scale):
    rng = np.random.default_rng(3)
    a = (np.maximum(rng.standard_normal((10, 16)), 0) * scale).astype(np.float32)
    a[:, [1, 12]] = 0.0
    a[:5, 4] = 0.0  # dead in the first half of the batch only: alive over the whole batch
    a[5:, 9] = 0.0
    a[2, 3] = np.nan
    bounds = (0.0, 1.0)
    whole = record.compute_activations(a, bounds=bounds)
    units = record.act_merge_all(np.stack([record.compute_activations(a[:, :7], bounds=bounds),
                                           record.compute_activations(a[:, 7:], bounds=bounds)]))
    parts = [a[:5], a[5:]]
    batch = record.act_merge_batches(np.stack([record.compute_activations(p, bounds=bounds) for p in parts]),
                                     np.stack([record.unit_alive(p) for p in parts]))
    for merged in (units, batch):
        exact = [record.ACT_INDEX[n] for n in (*record.ACT_COUNT_FIELDS, "min", "max", "bound_lo", "bound_hi")]
        np.testing.assert_array_equal(merged[exact], whole[exact])
        np.testing.assert_allclose(merged[[record.ACT_INDEX["mean"], record.ACT_INDEX["ssq_rel"]]],
                                   whole[[record.ACT_INDEX["mean"], record.ACT_INDEX["ssq_rel"]]], rtol=1e-12)
    assert whole[record.ACT_INDEX["dead"]] == 2
    # counts of the parts added say more units are dead: only the alive masks give the batch's answer
    per_part = sum(reference(p)["dead"] for p in parts)
    assert per_part >= 6 and record.act_merge_all(np.stack([record.compute_activations(p) for p in parts]))[
        record.ACT_INDEX["dead"]] == per_part


@pytest.mark.unit
def test_merge_identity_and_window_mean():
    rng = np.random.default_rng(4)
    recs = np.stack([record.compute_activations(np.maximum(rng.standard_normal((8, 4)), 0).astype(np.float32))
                     for _ in range(3)])
    np.testing.assert_array_equal(record.act_merge_all(np.stack([recs[0], record.act_empty()])), recs[0])
    mean = record.act_scale(record.act_merge_all(recs), 1 / 3)
    d = record.act_derived(mean)
    np.testing.assert_allclose(d["dead_fraction"], record.act_derived(recs)["dead_fraction"].mean())
    np.testing.assert_allclose(d["zero_fraction"], record.act_derived(recs)["zero_fraction"].mean())


@pytest.mark.unit
def test_disk_round_trip_and_damage():
    rng = np.random.default_rng(5)
    rows = np.stack([record.compute_activations(np.tanh(rng.standard_normal((6, 9)) * 3).astype(np.float32),
                                                bounds=(-1.0, 1.0)),
                     record.compute_activations(np.maximum(rng.standard_normal((6, 3, 3, 5)), 0).astype(np.float32)),
                     record.act_empty()])
    disk = record.act_to_disk(rows)
    assert disk.dtype == np.float32 and disk.shape == (3, record.ACT_NUM_FIELDS)
    back = record.act_from_disk(disk)
    counts = slice(0, record.ACT_NUM_COUNTS)
    np.testing.assert_array_equal(back[:, counts], rows[:, counts])
    np.testing.assert_allclose(back, rows.astype(np.float32).astype(np.float64), equal_nan=True)
    assert not record.act_check_disk(disk)[0].any()
    for field, value, why in (("dead", 99, "dead units"), ("saturated", 3, "saturated count without bounds"),
                              ("nan", -1, "negative count")):
        bad = disk.copy()
        bad[1:2].view(np.int32)[0, record.ACT_INDEX[field]] = value
        flags, reasons = record.act_check_disk(bad)
        assert flags.tolist() == [False, True, False] and why in reasons[1]
    bad = disk.copy()
    bad[0, record.ACT_INDEX["mean"]] = 5.0
    assert "mean outside" in record.act_check_disk(bad)[1][0]
    with pytest.raises(ValueError):
        record.act_from_disk(np.zeros((2, 5), np.float32))


@pytest.mark.unit
def test_writer_and_readers_return_forward_records_beside_the_gradients(tmp_path):
    rng = np.random.default_rng(6)
    outs = [{"dense": np.maximum(rng.standard_normal((32, 20)), 0).astype(np.float32),
             "conv": np.tanh(rng.standard_normal((32, 7, 4, 4)) * 3).astype(np.float32)} for _ in range(3)]
    with Writer(str(tmp_path / "run")) as w:
        for step, out in enumerate(outs):
            w.add_gradients(step * 10, {"dense/kernel": rng.standard_normal((5, 20)), "conv/kernel": None})
            w.add_activations(step * 10, out, unit_axis={"conv": 1}, activations={"dense": "relu", "conv": "tanh"})
    (series,) = reader.read_logdir(str(tmp_path)).runs
    assert series.layers == ("dense/kernel", "conv/kernel") and series.num_steps == 3
    act = series.activations
    assert act.layers == ("dense", "conv") and act.steps.tolist() == [0, 10, 20]
    assert act.layer_info == {"dense": ("", "relu"), "conv": ("", "tanh")}
    assert series.layer_info == {}
    for s, out in enumerate(outs):
        check_against(act.records[s, 0], reference(out["dense"]))
        check_against(act.records[s, 1], reference(out["conv"], unit_axis=1, bounds=(-1.0, 1.0)))
    assert series.summary()["activation_layers"] == ["dense", "conv"]


@pytest.mark.unit
def test_forward_tags_are_v3_in_the_gradient_stream_and_old_runs_read_without_them(tmp_path):
    with Writer(str(tmp_path / "run")) as w:
        grad_tag = w.add_gradients(1, {"a/kernel": np.ones(3)})
        act_tag = w.add_activations(1, {"a": np.ones((2, 3))})
    assert act_tag.startswith("gradhealth/gradients/activations/") and stream_of(act_tag) == "gradients"
    assert split_streams("run", [grad_tag, act_tag]) == {"run": sorted([grad_tag, act_tag])}
    back = testing.read_back(str(tmp_path / "run"))
    assert metadata.decode_content(back[grad_tag][0]).version == 2
    forward = metadata.decode_content(back[act_tag][0])
    assert (forward.version, forward.kind) == (3, record.ACTIVATIONS) == (record.FORMAT_VERSION, "activations")
    # a logdir of gradients only (every log written before v3) reads with no forward records
    with Writer(str(tmp_path / "old")) as w:
        w.add_gradients(1, {"a/kernel": np.ones(3)})
    old = [s for s in reader.read_logdir(str(tmp_path)).runs if s.run == "old"][0]
    assert old.activations is None and old.summary()["activation_layers"] == []


@pytest.mark.unit
def test_damaged_forward_rows_and_a_future_version_are_problems_not_errors(tmp_path):
    rows = np.stack([record.compute_activations(np.ones((2, 3), np.float32)),
                     record.compute_activations(np.zeros((2, 3), np.float32))])
    disk = record.act_to_disk(rows)
    disk[1:2].view(np.int32)[0, record.ACT_INDEX["dead"]] = 7
    tag = metadata.tag_for(["a", "b"], "gradients", 0, kind=record.ACTIVATIONS)
    td = reader.TagData(tag, metadata.create_summary_metadata(["a", "b"], kind=record.ACTIVATIONS).plugin_data.content,
                        [reader.TagPoint(0, 1.0, disk)])
    series = reader.assemble("r", [td])
    assert "damaged row" in " ".join(series.problems)
    assert series.activations.records[0, 0, record.ACT_INDEX["units"]] == 3
    assert np.isnan(series.activations.records[0, 1]).all()
    future = metadata.encode_content(metadata.Content(record.FORMAT_VERSION + 1, ("a",), kind=record.ACTIVATIONS))
    series = reader.assemble("r", [reader.TagData(tag, future, [reader.TagPoint(0, 1.0, disk[:1])])])
    assert series.activations is None and "newer" in " ".join(series.problems)


@pytest.mark.unit
def test_writer_refuses_bad_forward_input(tmp_path):
    with Writer(str(tmp_path)) as w:
        with pytest.raises(ValueError, match="activations: no output"):
            w.add_activations(0, {"a": np.ones((2, 2))}, activations={"b": "relu"})
        with pytest.raises(ValueError, match="unit_axis 3"):
            w.add_activations(0, {"a": np.ones((2, 2))}, unit_axis=3)
        with pytest.raises(TypeError):
            w.add_activations(0, {"a": np.array(["x"])})
        with pytest.raises(ValueError, match="shape"):
            w.add_records(0, ["a"], record.empty((1,)), kind=record.ACTIVATIONS)


def _write_steps(w: Writer, rng: np.random.Generator, steps: range) -> None:
    for s in steps:
        w.add_gradients(s, {"d/kernel": rng.standard_normal((4, 6)), "e/kernel": rng.standard_normal((6, 2))})
        w.add_activations(s, {"d": np.maximum(rng.standard_normal((8, 6)), 0), "e": rng.standard_normal((8, 2))},
                          activations={"d": "relu"})


@pytest.mark.unit
def test_the_plugins_incremental_reading_and_a_live_run_give_the_clis_forward_records(tmp_path):
    from tb_gradhealth import _filereader, live

    rng = np.random.default_rng(7)
    fr = _filereader.FileReader(str(tmp_path), listing_ttl=0.0, chunk_bytes=1 << 12)
    run = live.LiveRun()
    w = Writer(str(tmp_path / "r"), flush_secs=1e9)
    run.watch(w)
    _write_steps(w, rng, range(5))
    w.flush()
    first = fr.run(None, "", "r")
    assert first.activations.steps.tolist() == list(range(5))
    _write_steps(w, rng, range(5, 12))
    w.close()
    served = fr.run(None, "", "r")
    (cli,) = reader.read_logdir(str(tmp_path)).runs
    for got in (served, run.series()):
        assert got.layers == cli.layers and got.activations.layers == cli.activations.layers == ("d", "e")
        np.testing.assert_array_equal(got.steps, cli.steps)
        np.testing.assert_array_equal(got.activations.steps, cli.activations.steps)
        np.testing.assert_array_equal(got.activations.records, cli.activations.records)
        np.testing.assert_array_equal(got.records, cli.records)
        assert got.activations.layer_info == {"d": ("", "relu"), "e": ("", "")}
    assert first.activations.steps.tolist() == list(range(5))  # what was handed out earlier did not change
    assert not fr._runs["r"].whole  # read as appends, not whole again
