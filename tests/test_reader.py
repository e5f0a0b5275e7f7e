"""The reader: event files and TensorBoard's data provider → RunSeries, and everything that can go wrong in a logdir.

Event files are written with TensorBoard's protos and TFRecord framing (tests/testing.py), no TensorFlow.
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import metadata, reader, record
from tb_gradhealth import testing as gl


def _rows(n_layers: int, scale: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([record.compute(rng.normal(0, scale, 64), hist_sample=None) for _ in range(n_layers)])


def _roundtrip(rows: np.ndarray) -> np.ndarray:
    """What a reader must return for rows written to disk (float32 values)."""
    return record.from_disk(record.to_disk(rows))


def _only(data: reader.LogdirData, run: str) -> reader.RunSeries:
    (series,) = [s for s in data.runs if s.run == run]
    return series


@pytest.mark.unit
def test_demo_logdir_reads_every_run_in_network_order(tmp_path):
    facts = gl.make_demo_logdir(str(tmp_path))
    data = reader.read_logdir(str(tmp_path))
    assert data.problems == []
    assert [s.run for s in data.runs] == sorted(facts)
    for s in data.runs:
        f = facts[s.run]
        assert list(s.layers) == f.layers
        assert s.steps.dtype == np.int64 and s.steps.tolist() == f.steps
        assert s.records.shape == (len(f.steps), len(f.layers), record.NUM_FIELDS)
        assert s.records.dtype == np.float64
        assert s.present().all() and s.problems == ()
        assert s.sample_limit is None and not s.maybe_downsampled
    assert _only(data, "xss").layers[0] == gl.XSS_LAYER


@pytest.mark.unit
def test_values_survive_the_disk_form_exactly(tmp_path):
    layers = ["a", "b", "c"]
    recs = np.stack([_rows(3, 10.0 ** -k, seed=k) for k in range(4)])
    recs[2, 1, record.INDEX["nan"]] = 7  # counts are exact (int32 bits on disk); 7 NaN more than the 64 finite
    recs[2, 1, record.INDEX["size"]] += 7
    gl.write_records(str(tmp_path / "r"), layers, [0, 5, 6, 9], recs)
    s = _only(reader.read_logdir(str(tmp_path)), "r")
    np.testing.assert_array_equal(s.records, np.stack([_roundtrip(r) for r in recs]))
    assert s.records[2, 1, record.INDEX["nan"]] == 7


@pytest.mark.unit
def test_tags_with_different_layer_sets_merge_by_name_with_absent_rows_nan(tmp_path):
    run = tmp_path / "multi"
    big, small = ["embed", "dense/kernel", "dense/bias", "out"], ["dense/kernel", "extra", "out"]
    rec_big = np.stack([_rows(4, 1e-3, seed=s) for s in range(5)])
    rec_small = np.stack([_rows(3, 1e-1, seed=10 + s) for s in range(5)])
    gl.write_records(str(run), big, [0, 1, 2, 3, 4], rec_big, name="gradients")
    gl.write_records(str(run), small, [3, 4, 5, 6, 7], rec_small, wall_time0=gl.WALL_TIME0 + 100)
    s = _only(reader.read_logdir(str(tmp_path)), "multi")
    assert len(s.tags) == 2 and s.problems == ()
    # Each tag's order is kept; the new layer goes right after its predecessor in its own tag.
    assert list(s.layers) == ["embed", "dense/kernel", "extra", "dense/bias", "out"]
    assert s.steps.tolist() == list(range(8))
    present = s.present()
    col = {n: i for i, n in enumerate(s.layers)}
    assert present[:, col["embed"]].tolist() == [True] * 5 + [False] * 3
    assert present[:, col["extra"]].tolist() == [False] * 3 + [True] * 5
    assert present[:, col["dense/kernel"]].all()
    assert np.isnan(s.records[6, col["embed"]]).all()  # absent rows are all-NaN
    # Steps 3 and 4 hold dense/kernel in both tags: the one written last (later wall time, the small tag) wins.
    np.testing.assert_array_equal(s.records[3:5, col["dense/kernel"]], _roundtrip(rec_small[:2, 0]))
    np.testing.assert_array_equal(s.records[3:5, col["out"]], _roundtrip(rec_small[:2, 2]))
    np.testing.assert_array_equal(s.records[:3, col["out"]], _roundtrip(rec_big[:3, 3]))


@pytest.mark.unit
def test_streams_of_one_run_are_separate_series(tmp_path):
    """Keras' probe gradients (name="probe_gradients") are another measurement of the same layers: not merged."""
    run = tmp_path / "keras"
    layers = ["dense/kernel", "dense/bias"]
    train = np.stack([_rows(2, 1e-3, seed=s) for s in range(4)])
    probe = np.stack([_rows(2, 1e+1, seed=20 + s) for s in range(2)])
    gl.write_records(str(run), layers, [0, 1, 2, 3], train)
    gl.write_records(str(run), layers, [1, 3], probe, name="probe_gradients")
    gl.write_records(str(tmp_path / "solo"), layers, [0, 1], train[:2], name="custom")
    data = reader.read_logdir(str(tmp_path))
    assert [s.run for s in data.runs] == ["keras", "keras [probe_gradients]", "solo"]
    main, side = data.runs[0], data.runs[1]
    assert main.steps.tolist() == [0, 1, 2, 3] and side.steps.tolist() == [1, 3]
    np.testing.assert_array_equal(main.records, np.stack([_roundtrip(r) for r in train]))
    np.testing.assert_array_equal(side.records, np.stack([_roundtrip(r) for r in probe]))
    assert [s.run for s in reader.read_logdir(str(tmp_path), runs=["keras [probe_gradients]"]).runs] == [
        "keras [probe_gradients]"]
    assert reader.stream_of("gradhealth/probe_gradients/0a1b2c3d") == "probe_gradients"
    assert reader.stream_of("gradhealth/a/b/0a1b2c3d") == "a/b"


@pytest.mark.unit
@pytest.mark.parametrize(("name", "run", "stream"), [
    ("keras", "keras", None),
    ("keras [probe_gradients]", "keras", "probe_gradients"),
    ("exp [v2] [probe_gradients]", "exp [v2]", "probe_gradients"),  # a directory named with brackets keeps them
    ("a/b [x/y]", "a/b", "x/y"),
    ("half [open", "half [open", None),
])
def test_series_names_parse_back_to_their_run_and_stream(name, run, stream):
    assert reader.parse_series(name) == (run, stream) and reader.run_of(name) == run
    assert reader.series_name(run, stream) == name


@pytest.mark.unit
def test_split_streams_names_each_stream_as_the_parser_reads_it():
    tags = [metadata.tag_for(["a"], "gradients"), metadata.tag_for(["a"], "probe"), metadata.tag_for(["b"], "x/y")]
    names = reader.split_streams("runs/exp", tags)
    assert sorted(names) == ["runs/exp", "runs/exp [probe]", "runs/exp [x/y]"]
    assert {reader.parse_series(n) for n in names} == {("runs/exp", None), ("runs/exp", "probe"),
                                                        ("runs/exp", "x/y")}


@pytest.mark.unit
def test_sampling_knows_the_loaders_by_their_types_not_their_names():
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer

    provider = data_provider.MultiplexerDataProvider(plugin_event_multiplexer.EventMultiplexer(), "")
    assert reader.sampling(provider, None) == (reader.SAMPLE_ALL, reader.PYTHON_LOADER_DEFAULT)
    impostor = type("MultiplexerDataProvider", (), {})()  # the class name alone says nothing
    assert reader.sampling(impostor, None) == (reader.SAMPLE_ALL, None)


@pytest.mark.unit
def test_points_read_from_event_files_are_named(tmp_path):
    run_dir = str(tmp_path / "r")
    tag = metadata.tag_for(["a"])
    gl.write_events(gl.event_file_path(run_dir), [gl.record_event(3, tag, _rows(1, 1e-3)[0][None], layers=["a"],
                                                                  wall_time=7.0)])
    (td,) = reader.read_run_dir(reader.find_runs(str(tmp_path))["r"], [])
    (p,) = td.points
    assert isinstance(p, reader.TagPoint) and (p.step, p.wall_time, p.tensor.shape) == (3, 7.0, (1, p.tensor.shape[1]))


@pytest.mark.unit
def test_rewritten_step_keeps_the_last_written_record(tmp_path):
    run_dir = str(tmp_path / "r")
    tag = metadata.tag_for(["a"])
    first, second = _rows(1, 1e-3, seed=1)[0], _rows(1, 1e+1, seed=2)[0]
    gl.write_events(gl.event_file_path(run_dir), [
        gl.record_event(0, tag, first[None], layers=["a"], wall_time=100.0),
        gl.record_event(1, tag, first[None], wall_time=101.0),
        gl.record_event(1, tag, second[None], wall_time=105.0),  # a restarted job rewrites step 1
    ])
    s = _only(reader.read_logdir(str(tmp_path)), "r")
    assert s.steps.tolist() == [0, 1]
    np.testing.assert_array_equal(s.records[1, 0], _roundtrip(second[None])[0])


@pytest.mark.unit
def test_bad_tensors_are_reported_and_the_rest_is_read(tmp_path):
    run_dir = str(tmp_path / "r")
    layers = ["a", "b"]
    tag = metadata.tag_for(layers)
    good = _rows(2, 1e-3)
    wrong_rows = record.to_disk(_rows(3, 1e-3))  # 3 rows for a 2-layer tag
    bad_window = record.to_disk(good)
    bad_window[:, record.DISK_HIST_LO] = 90  # histogram window beyond the 77 bins
    gl.write_events(gl.event_file_path(run_dir), [
        gl.record_event(0, tag, good, layers=layers),
        gl.record_event(1, tag, tensor=wrong_rows),
        gl.record_event(2, tag, tensor=np.array([b"not", b"numbers"])),
        gl.record_event(3, tag, tensor=bad_window),
        gl.record_event(4, tag, tensor=np.zeros((2, 3), np.float32)),  # too narrow for a record
        gl.record_event(5, tag, good),
    ])
    s = _only(reader.read_logdir(str(tmp_path)), "r")
    assert s.steps.tolist() == [0, 5]
    problem, rows_problem = s.problems
    assert tag in problem and "3 unreadable record tensor(s)" in problem and "step 1" in problem
    assert "3 rows for 2 layers" in problem
    # The window beyond the bins damages every row of step 3: reported per row, by step, row and reason.
    assert tag in rows_problem and "2 damaged record row(s)" in rows_problem and "step 3 row 0" in rows_problem
    assert "outside the 77 bins" in rows_problem


@pytest.mark.unit
def test_unreadable_and_future_metadata_skip_only_that_tag(tmp_path):
    run_dir = str(tmp_path / "r")
    ok_tag, bad_tag, future_tag = (metadata.tag_for(["a"]), metadata.tag_for(["b"]), metadata.tag_for(["c"]))
    future = zlib.compress(b'{"v": 99, "layers": ["c"]}')
    gl.write_events(gl.event_file_path(run_dir), [
        gl.record_event(0, ok_tag, _rows(1, 1e-3), layers=["a"]),
        gl.record_event(0, bad_tag, _rows(1, 1e-3), plugin_content=b"\x00garbage"),
        gl.record_event(0, future_tag, _rows(1, 1e-3), plugin_content=future),
        gl.record_event(1, ok_tag, _rows(1, 1e-3)),
    ])
    s = _only(reader.read_logdir(str(tmp_path)), "r")
    assert s.layers == ("a",) and s.steps.tolist() == [0, 1] and s.tags == (ok_tag,)
    text = "\n".join(s.problems)
    assert bad_tag in text and "unreadable gradhealth metadata" in text
    assert future_tag in text and "v99" in text and "upgrade" in text


@pytest.mark.unit
def test_truncated_file_reports_and_keeps_the_records_before(tmp_path):
    facts = gl.make_vanishing(str(tmp_path))
    (path,) = (tmp_path / "vanishing").iterdir()
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 30)  # cut into the last record
    s = _only(reader.read_logdir(str(tmp_path)), "vanishing")
    assert s.steps.tolist() == facts.steps[:-1]
    (problem,) = s.problems
    assert "partial record" in problem and path.name in problem


@pytest.mark.unit
def test_corrupt_record_header_stops_that_file_only(tmp_path):
    gl.make_vanishing(str(tmp_path))
    gl.make_xss(str(tmp_path))
    (path,) = (tmp_path / "vanishing").iterdir()
    data = bytearray(path.read_bytes())
    # Find the 6th record and break its length bytes (the length's own CRC catches it).
    pos = 0
    for _ in range(6):
        (length,) = np.frombuffer(bytes(data[pos : pos + 8]), dtype="<u8")
        pos += 12 + int(length) + 4
    data[pos + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    got = reader.read_logdir(str(tmp_path))
    s = _only(got, "vanishing")
    assert s.steps.tolist() == [0, 1, 2, 3, 4]  # records 1..5 after the version event
    assert any("corrupt record header" in p for p in s.problems)
    assert _only(got, "xss").problems == ()


@pytest.mark.unit
def test_undecodable_event_payload_is_skipped(tmp_path):
    run_dir = str(tmp_path / "r")
    tag = metadata.tag_for(["a"])
    path = gl.event_file_path(run_dir)
    gl.write_events(path, [gl.record_event(0, tag, _rows(1, 1e-3), layers=["a"])])
    with open(path, "ab") as f:
        f.write(gl.frame(b"\xff\xff\xff\xff not a protobuf"))
    gl.write_events(path, [gl.record_event(1, tag, _rows(1, 1e-3))], with_version=False)
    s = _only(reader.read_logdir(str(tmp_path)), "r")
    assert s.steps.tolist() == [0, 1]
    assert any("1 corrupt event(s)" in p for p in s.problems)


@pytest.mark.unit
def test_reading_while_a_writer_appends(tmp_path):
    """Each read sees a consistent prefix: a half-written record is left for the next read, not an error."""
    run_dir = str(tmp_path / "live")
    layers = ["a", "b"]
    tag = metadata.tag_for(layers)
    path = gl.event_file_path(run_dir)
    framed = [gl.frame(gl.record_event(s, tag, _rows(2, 1e-3, s), layers=layers if s == 0 else None))
              for s in range(6)]
    with open(path, "wb") as f:
        f.write(gl.frame(gl.version_event()))
        f.write(framed[0] + framed[1])
        f.flush()
        assert _only(reader.read_logdir(str(tmp_path)), "live").steps.tolist() == [0, 1]
        f.write(framed[2][:20])  # the writer is mid-record
        f.flush()
        s = _only(reader.read_logdir(str(tmp_path)), "live")
        assert s.steps.tolist() == [0, 1] and "still being written" in s.problems[0]
        f.write(framed[2][20:] + b"".join(framed[3:]))
        f.flush()
        s = _only(reader.read_logdir(str(tmp_path)), "live")
        assert s.steps.tolist() == list(range(6)) and s.problems == ()


@pytest.mark.unit
def test_runs_are_named_like_tensorboard_and_other_data_is_ignored(tmp_path):
    gl.make_xss(str(tmp_path), run=".")  # records in the logdir itself: run "."
    gl.make_xss(str(tmp_path), run="a/b")
    gl.write_events(gl.event_file_path(str(tmp_path / "scalars_only")), [gl.scalar_event(0, "loss", 1.0)])
    (tmp_path / "notes.txt").write_text("not an event file")
    data = reader.read_logdir(str(tmp_path))
    assert [s.run for s in data.runs] == [".", "a/b"]


@pytest.mark.unit
def test_read_logdir_selected_runs_and_missing_logdir(tmp_path):
    gl.make_demo_logdir(str(tmp_path))
    assert [s.run for s in reader.read_logdir(str(tmp_path), runs=["xss"]).runs] == ["xss"]
    with pytest.raises(FileNotFoundError):
        reader.read_logdir(str(tmp_path / "nope"))
    with pytest.raises(NotADirectoryError):
        reader.read_logdir(str(next((tmp_path / "xss").iterdir())))


@pytest.mark.unit
def test_merge_order_keeps_every_tags_order():
    assert reader._merge_order([["a", "b", "c"], ["x", "b", "y"], ["c", "z"]]) == ["a", "x", "b", "y", "c", "z"]
    assert reader._merge_order([]) == []


@pytest.mark.unit
def test_sampling_hint_becomes_a_positive_downsample():
    assert reader.sampling(object(), 0) == (reader.SAMPLE_ALL, None)
    assert reader.sampling(object(), 7) == (7, 7)
    assert reader.sampling(object(), None) == (reader.SAMPLE_ALL, None)


# --- through TensorBoard's data server (the default loader of `tensorboard`) -----------------------------------------


@pytest.mark.e2e
def test_provider_reader_matches_the_logdir_reader_and_caches(tmp_path):
    facts = gl.make_demo_logdir(str(tmp_path))
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps=gl.last_steps(facts))
    pr = reader.ProviderReader(ingester.data_provider, 0)
    assert (pr.downsample, pr.sample_limit) == (reader.SAMPLE_ALL, None)
    served = {s.run: s for s in pr.runs(None, "")}
    direct = {s.run: s for s in reader.read_logdir(str(tmp_path)).runs}
    assert served.keys() == direct.keys() == facts.keys()
    for run, s in served.items():
        assert s.layers == direct[run].layers
        np.testing.assert_array_equal(s.steps, direct[run].steps)
        np.testing.assert_array_equal(s.records, direct[run].records)
    again = pr.run(None, "", "vanishing")
    assert again is served["vanishing"]  # warm: no re-read, same decoded arrays
    assert pr.run(None, "", "no-such-run") is None
    assert pr.has_data(None, "")


@pytest.mark.e2e
def test_provider_reader_splits_streams_like_the_logdir_reader(tmp_path):
    layers = ["dense/kernel", "dense/bias"]
    gl.write_records(str(tmp_path / "keras"), layers, [0, 1, 2], np.stack([_rows(2, 1e-3, s) for s in range(3)]))
    gl.write_records(str(tmp_path / "keras"), layers, [2], _rows(2, 1e+1)[None], name="probe_gradients")
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, last_steps={"keras": 2})
    served = reader.ProviderReader(ingester.data_provider, 0).runs(None, "")
    direct = reader.read_logdir(str(tmp_path)).runs
    assert [s.run for s in served] == [s.run for s in direct] == ["keras", "keras [probe_gradients]"]
    for a, b in zip(served, direct, strict=True):
        np.testing.assert_array_equal(a.steps, b.steps)
        np.testing.assert_array_equal(a.records, b.records)


@pytest.mark.e2e
def test_provider_default_sample_limit_and_downsampling(tmp_path):
    gl.make_scale_logdir(str(tmp_path), 3, 150, run="long")
    ingester = gl.data_server(str(tmp_path), {}, last_steps={"long": 149})
    s = reader.ProviderReader(ingester.data_provider, None).run(None, "", "long")
    # The data server keeps RUST_LOADER_DEFAULT samples of a tensor series without --samples_per_plugin.
    assert s.sample_limit == reader.RUST_LOADER_DEFAULT and s.num_steps == reader.RUST_LOADER_DEFAULT
    assert s.maybe_downsampled and s.last_step == 149
    ingester5 = gl.data_server(str(tmp_path), {"gradhealth": 5}, last_steps={"long": 149})
    s5 = reader.ProviderReader(ingester5.data_provider, 5).run(None, "", "long")
    assert s5.num_steps == 5 and s5.sample_limit == 5 and s5.maybe_downsampled and s5.last_step == 149


@pytest.mark.e2e
def test_provider_reader_sees_new_steps_while_training_writes(tmp_path):
    layers = ["a", "b"]
    tag = metadata.tag_for(layers)
    path = gl.event_file_path(str(tmp_path / "live"))
    gl.write_events(path, [gl.record_event(s, tag, _rows(2, 1e-3, s), layers=layers if s == 0 else None)
                           for s in range(3)])
    ingester = gl.data_server(str(tmp_path), {"gradhealth": 0}, reload_interval=1, last_steps={"live": 2})
    pr = reader.ProviderReader(ingester.data_provider, 0)
    first = pr.run(None, "", "live")
    assert first.steps.tolist() == [0, 1, 2]
    stale = reader.ProviderReader(ingester.data_provider, 0, listing_ttl=3600)  # reuses its first listing
    assert stale.run(None, "", "live").steps.tolist() == [0, 1, 2]
    with open(path, "ab") as f:  # the job logs more steps, the last one half-written for now
        f.write(b"".join(gl.frame(gl.record_event(s, tag, _rows(2, 1e-3, s))) for s in range(3, 6)))
        f.write(gl.frame(gl.record_event(6, tag, _rows(2, 1e-3, 6)))[:25])
    deadline = time.monotonic() + 20
    while pr.run(None, "", "live").last_step < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    second = pr.run(None, "", "live")
    assert second.steps.tolist() == list(range(6))
    assert stale.run(None, "", "live").steps.tolist() == [0, 1, 2]  # within its listing TTL: the cached series
    assert second.generation != first.generation and second.problems == ()


_PYTHON_LOADER = """
import json, sys, types
# TensorBoard's Python loader reaches tf.io.gfile through tensorboard.compat.tf, which imports TensorFlow when it is
# installed; its own no-TF switch (a tensorboard.compat.notf module) keeps this check free of TensorFlow.
sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
from tensorboard.backend.event_processing import data_provider, event_accumulator, plugin_event_multiplexer
from tensorboard.context import RequestContext
from tb_gradhealth import reader
logdir, hint = sys.argv[1], json.loads(sys.argv[2])
mux = plugin_event_multiplexer.EventMultiplexer(
    size_guidance=event_accumulator.DEFAULT_SIZE_GUIDANCE,
    tensor_size_guidance={} if hint is None else {"gradhealth": hint})
mux.AddRunsFromDirectory(logdir)
mux.Reload()
pr = reader.ProviderReader(data_provider.MultiplexerDataProvider(mux, logdir), hint)
runs = pr.runs(RequestContext(), "")
print(json.dumps({s.run: [s.num_steps, s.sample_limit, s.maybe_downsampled, s.last_step, list(s.layers)]
                  for s in runs}))
assert "tensorflow" not in sys.modules
"""


@pytest.mark.e2e
@pytest.mark.parametrize("hint", [None, 0])
def test_python_loader_provider(tmp_path, hint):
    """TensorBoard's other loader (`--load_fast=false`): the Python multiplexer keeps 10 samples per tensor tag by
    default, every sample with gradhealth=0."""
    import json
    import subprocess

    facts = gl.make_demo_logdir(str(tmp_path))
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _PYTHON_LOADER, str(tmp_path), json.dumps(hint)], cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got.keys() == facts.keys()
    for run, f in facts.items():
        n, limit, maybe, last, layers = got[run]
        assert layers == f.layers and last == f.steps[-1]
        if hint is None:
            assert (n, limit, maybe) == (reader.PYTHON_LOADER_DEFAULT, reader.PYTHON_LOADER_DEFAULT, True)
        else:
            assert (n, limit, maybe) == (len(f.steps), None, False)
