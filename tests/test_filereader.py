"""The plugin's own event-file reader against the CLI's (:func:`reader.read_logdir`): the same series whatever the
chunk size, and only what was appended is read again."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tb_gradhealth import _filereader, _payloads, _storage, health, metadata, reader, record
from tb_gradhealth import testing as gl

pytestmark = [pytest.mark.unit]

LAYERS = ["dense/kernel", "dense/bias", "out/kernel"]


def _rows(n_layers: int, scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([record.compute(rng.normal(0, scale, 64), hist_sample=None) for _ in range(n_layers)])


def _records(steps: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    return np.stack([_rows(len(LAYERS), scale, seed + s) for s in range(steps)])


def _cli(logdir: str) -> dict[str, reader.RunSeries]:
    return {s.run: s for s in reader.read_logdir(logdir).runs}


def _served(fr: _filereader.FileReader) -> dict[str, reader.RunSeries]:
    return {s["run"]: fr.run(None, "", s["run"]) for s in fr.summaries()}


def _assert_same(a: reader.RunSeries, b: reader.RunSeries) -> None:
    assert (a.run, a.layers, a.tags, a.notes) == (b.run, b.layers, b.tags, b.notes)
    np.testing.assert_array_equal(a.steps, b.steps)
    np.testing.assert_array_equal(a.records, b.records)  # NaN where absent, in both
    # A file still being written is not a problem for the plugin (its next read resumes there).
    assert a.problems == tuple(p for p in b.problems if "partial record" not in p)


@pytest.fixture(scope="module")
def varied(tmp_path_factory) -> str:
    """Runs of every kind the readers handle: the demo's, step-block tags, several layer lists, several streams,
    a rewritten step, an undecodable event, a truncated file."""
    root = tmp_path_factory.mktemp("varied")
    gl.make_demo_logdir(str(root))
    gl.make_scale_logdir(str(root), 2, 1200, run="long")
    gl.write_records(str(root / "multi"), LAYERS, range(5), _records(5), name="gradients")
    gl.write_records(str(root / "multi"), ["dense/kernel", "extra"], range(3, 8),
                     np.stack([_rows(2, 1e-1, 40 + s) for s in range(5)]), wall_time0=gl.WALL_TIME0 + 100)
    gl.write_records(str(root / "streams"), LAYERS, range(4), _records(4))
    gl.write_records(str(root / "streams"), LAYERS, [1, 3], _records(2, 9, 1e1), name="probe_gradients")
    tag = metadata.tag_for(LAYERS)
    rows = _records(3, 20)
    gl.write_events(gl.event_file_path(str(root / "rewritten")), [
        gl.record_event(0, tag, rows[0], layers=LAYERS, wall_time=100.0),
        gl.record_event(1, tag, rows[1], wall_time=101.0),
        gl.record_event(1, tag, rows[2], wall_time=105.0),
    ])
    path = gl.event_file_path(str(root / "undecodable"))
    gl.write_events(path, [gl.record_event(0, tag, rows[0], layers=LAYERS)])
    with open(path, "ab") as f:
        f.write(gl.frame(b"\xff\xff\xff\xff not a protobuf"))
    gl.write_events(path, [gl.record_event(1, tag, rows[1])], with_version=False)
    cut = gl.write_records(str(root / "truncated"), LAYERS, range(6), _records(6, 30))
    with open(cut, "r+b") as f:
        f.truncate(_storage.size(cut) - 30)
    return str(root)


@pytest.mark.parametrize("chunk", [64, 4096, 1 << 20])
def test_every_kind_of_run_is_read_as_the_cli_reads_it(varied, chunk):
    cli = _cli(varied)
    served = _served(_filereader.FileReader(varied, chunk_bytes=chunk))
    assert set(served) == set(cli)
    for name, series in served.items():
        _assert_same(series, cli[name])


def test_the_diagnosis_is_the_clis(varied):
    cli, served = _cli(varied), _served(_filereader.FileReader(varied, chunk_bytes=4096))
    for name in ("exploding", "vanishing", "long", "multi"):
        t = health.Thresholds()
        assert json.dumps(_payloads.health_payload(served[name], t, None)) == json.dumps(
            _payloads.health_payload(cli[name], t, None))


def _append(path: str, steps: range, rows: np.ndarray, first: bool = False) -> None:
    tag = metadata.tag_for(LAYERS)
    with open(path, "ab") as f:
        for i, s in enumerate(steps):
            f.write(gl.frame(gl.record_event(s, tag, rows[i], layers=LAYERS if first and i == 0 else None,
                                             wall_time=gl.WALL_TIME0 + s)))


def test_only_appended_bytes_are_read_and_earlier_series_stay_valid(tmp_path, monkeypatch):
    path = gl.write_events(gl.event_file_path(str(tmp_path / "live")), [])
    rows = _records(30)
    _append(path, range(10), rows[:10], first=True)
    read: list[tuple[int, int]] = []
    real = _storage.read_range
    monkeypatch.setattr(_storage, "read_range", lambda p, start, n, opts=None: read.append((start, n)) or real(
        p, start, n, opts))
    fr = _filereader.FileReader(str(tmp_path), listing_ttl=0.0, chunk_bytes=1 << 20)
    before = fr.run(None, "", "live")
    kept = before.records.copy()
    assert before.steps.tolist() == list(range(10)) and [s for s, _ in read] == [0]
    size = _storage.size(path)
    _append(path, range(10, 30), rows[10:])
    after = fr.run(None, "", "live")
    assert [s for s, _ in read] == [0, size]  # the second read starts where the first stopped
    _assert_same(after, _cli(str(tmp_path))["live"])
    assert after.generation != before.generation
    np.testing.assert_array_equal(before.records, kept)  # what was handed out earlier did not change
    assert fr.run(None, "", "live") is after  # nothing new: the same series


def test_a_restart_appended_later_is_read_whole_like_the_cli(tmp_path):
    path = gl.write_events(gl.event_file_path(str(tmp_path / "job")), [])
    _append(path, range(20), _records(20), first=True)
    fr = _filereader.FileReader(str(tmp_path), listing_ttl=0.0, chunk_bytes=256)
    assert fr.run(None, "", "job").num_steps == 20
    _append(path, range(15, 25), _records(10, 100, 1e1))  # the job restarted from a checkpoint at step 15
    got = fr.run(None, "", "job")
    _assert_same(got, _cli(str(tmp_path))["job"])
    assert got.steps.tolist() == list(range(25)) and got.notes


def test_a_half_written_record_waits_for_the_next_read(tmp_path):
    path = gl.write_events(gl.event_file_path(str(tmp_path / "live")), [])
    _append(path, range(3), _records(3), first=True)
    tag = metadata.tag_for(LAYERS)
    framed = gl.frame(gl.record_event(3, tag, _records(1, 50)[0], wall_time=gl.WALL_TIME0 + 3))
    with open(path, "ab") as f:
        f.write(framed[:25])
    fr = _filereader.FileReader(str(tmp_path), listing_ttl=0.0)
    s = fr.run(None, "", "live")
    assert s.steps.tolist() == [0, 1, 2] and s.problems == ()
    with open(path, "ab") as f:
        f.write(framed[25:])
    assert fr.run(None, "", "live").steps.tolist() == [0, 1, 2, 3]


def test_unknown_run_and_eviction(tmp_path):
    for i in range(3):
        gl.write_records(str(tmp_path / f"r{i}"), LAYERS, range(4), _records(4, i))
    fr = _filereader.FileReader(str(tmp_path), cache_bytes=1)
    assert fr.run(None, "", "nope") is None
    first = fr.run(None, "", "r0").generation
    assert [s["run"] for s in fr.summaries()] == ["r0", "r1", "r2"]
    assert len(fr._runs) == 1  # only the last run read stays decoded
    again = fr.run(None, "", "r0")
    _assert_same(again, _cli(str(tmp_path))["r0"])
    assert again.generation == first  # read again from the same bytes: the plugin's cached diagnoses still apply
