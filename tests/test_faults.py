"""Fault injection: a logdir of damaged runs beside good ones, read by the CLI and served by the plugin over
TensorBoard's own data server (and its Python loader for the restart rule).

Every damaged run is either served with what can be read and a problem line naming the damage, or listed as
unreadable with its reason; good runs are served completely; no request gets a 5xx and no output holds a traceback.
What TensorBoard itself cannot see (its data server skips data checksums and stops reading a file at a record that
neither parses nor passes its checksum) is stated per case (``tab_steps``), so a change in TensorBoard shows here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from tensorboard import context as tb_context
from tensorboard.backend import application
from tensorboard.backend.event_processing import data_provider as tb_data_provider
from tensorboard.backend.event_processing import plugin_event_multiplexer
from tensorboard.compat.proto import event_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from werkzeug.test import Client

from tb_gradhealth import Writer, cli, health, metadata, plugin, reader, record
from tb_gradhealth import testing as gl

LAYERS = ["l0/kernel", "l0/bias", "l1/kernel"]
TAG = metadata.tag_for(LAYERS)
REPO = Path(__file__).resolve().parent.parent


@dataclass
class Case:
    """One run of the fault logdir and what each reader must make of it.

    ``cli_steps``: the steps the CLI serves ([] = listed as unreadable); ``tab_steps``: the steps the tab serves
    (None: the run is not listed by TensorBoard at all); ``reason`` / ``tab_reason``: text that must appear in the
    run's problems (CLI / tab; None: no problem line expected); ``damaged``: records made unreadable on purpose
    (the CLI must serve every other record: nothing lost silently)."""

    cli_steps: list[int]
    tab_steps: list[int] | None
    reason: str | None
    tab_reason: str | None
    damaged: int = 0
    written: int = 0
    notes: list[str] = field(default_factory=list)


def _rows(rng: np.random.Generator, scale: float = 1e-3, nan: bool = False) -> np.ndarray:
    out = []
    for _ in LAYERS:
        g = rng.normal(0.0, scale, 32)
        if nan:
            g[:3] = np.nan
        out.append(record.compute(g, hist_sample=None))
    return np.stack(out)


def _events(steps, rng, *, first_md: bool = True, tensor=None, content=None, wall0: float = gl.WALL_TIME0,
            nan_from: int | None = None) -> list[bytes]:
    out = []
    for i, s in enumerate(steps):
        md = LAYERS if (first_md and i == 0) else None
        rows = _rows(rng, nan=nan_from is not None and s >= nan_from)
        t = tensor(s, rows) if tensor is not None else None
        proto = t if isinstance(t, tensor_pb2.TensorProto) else None
        ev = gl.record_event(s, TAG, rows, layers=md, tensor=None if proto is not None else t,
                             plugin_content=content if i == 0 else None, wall_time=wall0 + s)
        if proto is not None:
            e = event_pb2.Event.FromString(ev)
            e.summary.value[0].tensor.CopyFrom(proto)
            ev = e.SerializeToString()
        out.append(ev)
    return out


def _write(run_dir: Path, frames: list[bytes], name_time: float = gl.WALL_TIME0) -> Path:
    path = Path(gl.event_file_path(str(run_dir), name_time))
    path.write_bytes(gl.frame(gl.version_event()) + b"".join(frames))
    return path


def _offsets(path: Path) -> list[int]:
    """Byte offset of every record of an event file (the version event first)."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        out.append(pos)
        pos += 12 + int(np.frombuffer(data[pos : pos + 8], "<u8")[0]) + 4
    return out


def _mixed_shape_tensor(_step: int, rows: np.ndarray) -> tensor_pb2.TensorProto:
    """A tensor proto whose shape says one size and whose bytes another."""
    disk = record.to_disk(rows)
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n)
                                                   for n in (disk.shape[0], disk.shape[1] + 5)])
    return tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=shape, tensor_content=disk.tobytes())


def build_fault_logdir(root: Path) -> dict[str, Case]:  # noqa: PLR0915 - one block per case, read top to bottom
    """Write every case under ``root``; returns ``{run: Case}``."""
    rng = np.random.default_rng(0)
    cases: dict[str, Case] = {}
    six = list(range(6))

    _write(root / "good", [gl.frame(e) for e in _events(six, rng)])
    cases["good"] = Case(six, six, None, None, written=6)

    # float64 beyond float32's range: a good run whose l2 is Inf on a float32 device (nonfinite), never a crash.
    with Writer(str(root / "huge"), seed=0) as w:
        for s in six:
            w.add_gradients(s, {"l1": rng.normal(size=100), "l2": rng.normal(size=1000) * 1e300})
    cases["huge"] = Case(six, six, None, None, written=6)

    # One row of one event with another histogram window start than its siblings: that row only is lost.
    def shifted(step, rows):
        t = record.to_disk(rows)
        if step == 2:
            t[1, record.DISK_HIST_LO] += 1
        return t

    _write(root / "mixed_window", [gl.frame(e) for e in _events(six, rng, tensor=shifted)])
    cases["mixed_window"] = Case(six, six, "damaged record row", "damaged record row", damaged=0, written=6)

    def nan_window(_step, rows):
        t = record.to_disk(rows)
        t[:, record.DISK_HIST_LO] = np.nan
        return t

    _write(root / "nan_window", [gl.frame(e) for e in _events(six, rng, tensor=nan_window)])
    cases["nan_window"] = Case([], [], "histogram window", "histogram window", damaged=6, written=6)

    future = zlib.compress(json.dumps({"v": 99, "layers": LAYERS}).encode())
    _write(root / "future", [gl.frame(e) for e in _events(six, rng, content=future)])
    cases["future"] = Case([], [], "upgrade", "upgrade", damaged=6, written=6)

    _write(root / "bad_metadata", [gl.frame(e) for e in _events(six, rng, content=b"\x00garbage")])
    cases["bad_metadata"] = Case([], [], "unreadable gradhealth metadata", "unreadable gradhealth metadata",
                                 damaged=6, written=6)

    def four_rows(_step, rows):
        return record.to_disk(np.concatenate([rows, rows[:1]]))

    _write(root / "wrong_rows", [gl.frame(e) for e in _events(six, rng, tensor=four_rows)])
    cases["wrong_rows"] = Case([], [], "4 rows for 3 layers", "4 rows for 3 layers", damaged=6, written=6)

    _write(root / "one_d", [gl.frame(e) for e in _events(six, rng, tensor=lambda s, r: record.to_disk(r)[0])])
    cases["one_d"] = Case([], [], "not a gradhealth record tensor", "not a gradhealth record tensor", damaged=6,
                          written=6)

    _write(root / "strings", [gl.frame(e) for e in _events(six, rng, tensor=lambda s, r: np.array([b"x", b"y"]))])
    cases["strings"] = Case([], [], "dtype", "dtype", damaged=6, written=6)

    # Mixed shapes within one tensor proto at step 3: that step is unreadable, the others are read.
    def mixed(step, rows):
        return _mixed_shape_tensor(step, rows) if step == 3 else record.to_disk(rows)

    _write(root / "mixed_shapes", [gl.frame(e) for e in _events(six, rng, tensor=mixed)])
    # TensorBoard's data provider decodes a whole answer at once and fails on the malformed tensor: the tab loses
    # that tag (and says so), the CLI only that step.
    cases["mixed_shapes"] = Case([0, 1, 2, 4, 5], [], "undecodable tensor", "cannot decode one of its tensors",
                                 damaged=1, written=6)

    # A restart from a checkpoint: writer A logs 0..99 (NaN from 80), writer B restarts at 50 and logs to 70.
    run = root / "restart"
    _write(run, [gl.frame(e) for e in _events(range(100), rng, nan_from=80)], gl.WALL_TIME0)
    _write(run, [gl.frame(e) for e in _events(range(50, 71), rng, wall0=gl.WALL_TIME0 + 1000)],
           gl.WALL_TIME0 + 1000)
    cases["restart"] = Case(list(range(71)), list(range(71)), None, None, written=71)
    cases["restart"].notes = ["steps went back"]

    # Truncated in the middle of the file (a copy cut short): the records before the cut are read.
    path = _write(root / "truncated", [gl.frame(e) for e in _events(range(10), rng)])
    cut = _offsets(path)[6] + 30  # inside the record of step 5
    path.write_bytes(path.read_bytes()[:cut])
    cases["truncated"] = Case(list(range(5)), list(range(5)), "partial record", None, damaged=5, written=10)

    path = _write(root / "garbage_tail", [gl.frame(e) for e in _events(six, rng)])
    with open(path, "ab") as f:
        f.write(np.random.default_rng(1).bytes(100))
    cases["garbage_tail"] = Case(six, six, "corrupt record header", None, written=6)

    run = root / "extra_files"
    _write(run, [gl.frame(e) for e in _events(six, rng)])
    (run / "events.out.tfevents.1700000001.empty").write_bytes(b"")
    (run / "events.out.tfevents.1700000002.random").write_bytes(np.random.default_rng(2).bytes(4000))
    cases["extra_files"] = Case(six, six, "corrupt record header", None, written=6)

    # Data-checksum damage that still parses: step 3's size count made negative (the row checks see it too), and
    # one bit of step 6's mean (only the checksum sees it; TensorBoard does not check it).
    path = _write(root / "crc_flip", [gl.frame(e) for e in _events(range(10), rng)])
    _flip(path, 4, 3, 0x80)  # byte 3 of row 0's size (int32 little-endian): the sign bit
    _flip(path, 7, 4 * record.NUM_COUNTS, 0x01)  # lowest mantissa bit of row 0's min
    cases["crc_flip"] = Case([0, 1, 2, 4, 5, 7, 8, 9], list(range(10)), "fails its data checksum",
                             "damaged record row", damaged=2, written=10)

    # The first event of the tag (the only one with its metadata) does not parse and fails its checksum.
    evs = _events(six, rng)
    frames = [gl.frame(b"\xff\xff\xff" + evs[0][3:], crc=12345)] + [gl.frame(e) for e in evs[1:]]
    _write(root / "first_event", frames)
    cases["first_event"] = Case([], None, "without the tag's metadata", None, damaged=6, written=6)
    return cases


def _tensor_content_at(data: bytes, start: int) -> int:
    """Offset in ``data`` of the record tensor's bytes of the event framed at ``start``."""
    (length,) = np.frombuffer(data[start : start + 8], "<u8")
    event = event_pb2.Event.FromString(data[start + 12 : start + 12 + int(length)])
    return data.index(event.summary.value[0].tensor.tensor_content, start + 12)


def _flip(path: Path, record_index: int, byte: int, mask: int) -> None:
    """XOR ``mask`` into byte ``byte`` of the record tensor of record ``record_index``; the record keeps its old
    data checksum."""
    data = bytearray(path.read_bytes())
    pos = _tensor_content_at(bytes(data), _offsets(path)[record_index]) + byte
    data[pos] ^= mask
    path.write_bytes(bytes(data))


# --- the logdir, read by the CLI and served by the tab ------------------------------------------------------------


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    return root, build_fault_logdir(root)


@pytest.fixture(scope="module")
def tab(faults):
    """TensorBoard's WSGI app with the plugin, over TensorBoard's default data server reading the fault logdir."""
    root, cases = faults
    last = {run: c.tab_steps[-1] for run, c in cases.items() if c.tab_steps}
    ingester = gl.data_server(str(root), {"gradhealth": 0}, last_steps=last)
    flags = argparse.Namespace(logdir=str(root), samples_per_plugin={"gradhealth": 0}, window_title="",
                               path_prefix="", generic_data="true")
    app = application.TensorBoardWSGIApp(flags, [plugin.GradHealthLoader], data_provider=ingester.data_provider)
    return Client(app)


PREFIX = "/data/plugin/gradhealth"


def _get(client: Client, url: str) -> tuple[int, dict]:
    r = client.get(PREFIX + url)
    text = r.get_data(as_text=True)
    assert r.status_code < 500, (url, r.status_code, text[:300])
    assert "Traceback" not in text, url
    assert r.headers["Content-Type"].startswith("application/json"), url
    return r.status_code, json.loads(text)


@pytest.mark.unit
def test_cli_reads_every_record_it_can_and_names_every_damage(faults, capsys):
    root, cases = faults
    data = reader.read_logdir(str(root))
    served = {s.run: s for s in data.runs}
    assert served.keys() == cases.keys() and data.problems == []
    for run, c in cases.items():
        s = served[run]
        assert s.steps.tolist() == c.cli_steps, run
        text = "\n".join(s.problems)
        assert (c.reason in text) if c.reason else s.problems == (), (run, s.problems)
        for note in c.notes:
            assert any(note in n for n in s.notes), (run, s.notes)
        # Nothing lost silently: every record not damaged on purpose is served, whole.
        if run != "restart":
            assert int(s.present().all(axis=1).sum()) == c.written - c.damaged - (run == "mixed_window"), run
    rc = cli.main(["report", str(root), "--json", "--fail-on", "none"])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_UNREADABLE and "Traceback" not in out + err
    body = json.loads(out)
    unreadable = [run for run, c in cases.items() if not c.cli_steps]
    assert sorted(b["run"] for b in body["runs"]) == sorted(set(cases) - set(unreadable))
    for run in unreadable:
        lines = [p for p in body["problems"] if p.startswith(f"run {run!r}")]
        assert lines and any(cases[run].reason in p for p in lines), (run, body["problems"])
        assert any(run in line and cases[run].reason in line for line in err.splitlines()), run
    for b in body["runs"]:
        c = cases[b["run"]]
        assert (not c.reason) or any(c.reason in p for p in b["problems"]), b["run"]
        assert b["step"] == c.cli_steps[-1]
    # The restart: the CLI diagnoses step 70 as TensorBoard shows it (the NaN steps 80..99 were superseded).
    restart = next(b for b in body["runs"] if b["run"] == "restart")
    assert restart["summary"]["counts"]["nonfinite"] == 0 and restart["notes"]


@pytest.mark.e2e
def test_tab_serves_good_runs_and_lists_each_damaged_one(faults, tab):
    _, cases = faults
    _, body = _get(tab, "/runs")
    runs = {r["run"]: r for r in body["runs"]}
    assert runs.keys() == {run for run, c in cases.items() if c.tab_steps is not None}
    for run, c in cases.items():
        if c.tab_steps is None:
            continue
        r = runs[run]
        assert r["num_steps"] == len(c.tab_steps), (run, r)
        text = "\n".join(r["problems"])
        assert (c.tab_reason in text) if c.tab_reason else r["problems"] == [], (run, r["problems"])
        layer = (r["layers"] or LAYERS)[0]
        status, h = _get(tab, f"/health?run={run}")
        status_s, _ = _get(tab, f"/series?run={run}&layer={layer}")
        status_h, _ = _get(tab, f"/histograms?run={run}&layer={layer}")
        status_p, _ = _get(tab, f"/profile?run={run}")
        if c.tab_steps:
            assert status == 200 and h["step"] == c.tab_steps[-1], (run, h)
            assert (status_p, status_h, status_s) == (200, 200, 200)
        else:  # a run with no readable record: every route answers the same 404 naming the run
            assert status == status_s == status_h == status_p == 404, run
            assert h["parameter"] == "run" and c.tab_reason in h["error"], h
    _, restart = _get(tab, "/health?run=restart")
    assert restart["summary"]["counts"]["nonfinite"] == 0


@pytest.mark.e2e
def test_tab_and_cli_agree_on_every_readable_run(faults, tab, capsys):
    root, cases = faults
    rc = cli.main(["report", str(root), "--json", "--fail-on", "none"])
    body = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_UNREADABLE
    for b in body["runs"]:
        c = cases[b["run"]]
        if c.tab_steps != c.cli_steps:
            continue  # damage TensorBoard does not see (data checksums) or stops at
        _, served = _get(tab, f"/health?run={b['run']}")
        for key in ("step", "summary"):
            assert served[key] == b[key], (b["run"], key)
        assert [x["layer"] for x in served["layers"]] == [x["layer"] for x in b["layers"]]


FUZZ_VALUES = ["0", "3", "70", "99999999999999999999", "-1", "5\n", "５", "1_000", " 5 ", "1e3", "nan", "", "%00",
               "0x10", "+4", "..", "<script>"]


@pytest.mark.e2e
def test_fuzzed_requests_never_get_a_5xx(faults, tab):
    """Every route x run (readable, damaged, unknown) x odd values of every parameter, and other methods."""
    _, cases = faults
    runs = list(cases) + ["nope", "", "../good", "good\n"]
    urls = ["/runs", "/runs?x=1"]
    for run in runs:
        for v in FUZZ_VALUES:
            urls += [f"/health?run={run}&step={v}", f"/profile?run={run}&step={v}",
                     f"/health?run={run}&vanish_decades={v}", f"/series?run={run}&layer={v}",
                     f"/histograms?run={run}&layer={LAYERS[1]}&explode_decades={v}"]
        urls += [f"/series?run={run}&layer={layer}&sustain_steps=2" for layer in LAYERS + ["l1", "l2"]]
    statuses: dict[int, int] = {}
    for url in urls:
        status, body = _get(tab, url)
        statuses[status] = statuses.get(status, 0) + 1
        if status >= 400:
            assert body["error"], url
    for method in ("post", "put", "delete", "patch"):
        for route in ("/runs", "/health?run=good", "/index.js"):
            r = getattr(tab, method)(PREFIX + route)
            assert r.status_code == 405 and json.loads(r.get_data(as_text=True))["error"], (method, route)
            statuses[405] = statuses.get(405, 0) + 1
    assert set(statuses) <= {200, 400, 404, 405} and statuses[200] > 0 and statuses[400] > 0
    print(f"fuzzed {sum(statuses.values())} requests: {statuses}")


@pytest.mark.unit
def test_strict_numbers_are_400():
    """What does not look like a plain ASCII number is refused, in steps and in thresholds alike."""
    from tb_gradhealth import _payloads

    for raw in ("5\n", "５", "1_000", " 5 ", "+5", "5.0", "1e3", "٣"):
        with pytest.raises(_payloads.RequestError) as e:
            _payloads.parse_step(raw)
        assert e.value.status == 400 and e.value.parameter == "step"
    for raw in ("5\n", "５", "1_000", " 5 ", "inf", "nan", "0x10", "1e", "--1"):
        with pytest.raises(_payloads.RequestError) as e:
            _payloads.parse_thresholds({"vanish_decades": raw})
        assert e.value.status == 400 and e.value.parameter == "vanish_decades", raw
    assert _payloads.parse_step("0012") == 12
    assert _payloads.parse_thresholds({"vanish_decades": "2.5e0"}).vanish_decades == 2.5


# --- the restart rule: TensorBoard's, whichever loader ---------------------------------------------------------


@pytest.mark.e2e
def test_restart_rule_is_the_same_through_the_python_loader(faults):
    """TensorBoard's Python loader (``--load_fast=false``) keeps both histories of a restart; the reader applies the
    data server's rule to what it returns, so the tab shows what the CLI reports."""
    root, _ = faults
    mux = plugin_event_multiplexer.EventMultiplexer(tensor_size_guidance={"gradhealth": 0})
    mux.AddRunsFromDirectory(str(root / "restart"))
    mux.Reload()
    provider = tb_data_provider.MultiplexerDataProvider(mux, str(root / "restart"))
    raw = provider.read_tensors(tb_context.RequestContext(), experiment_id="", plugin_name="gradhealth",
                                downsample=10**6)
    assert [d.step for d in raw["."][TAG]][-21:] == list(range(50, 71))  # both histories, in read order
    s = reader.ProviderReader(provider, 0).run(tb_context.RequestContext(), "", ".")
    cli_series = reader.read_logdir(str(root / "restart")).runs[0]
    assert s.steps.tolist() == cli_series.steps.tolist() == list(range(71))
    np.testing.assert_array_equal(s.records, cli_series.records)


@pytest.mark.unit
def test_supersede_matches_the_data_server_rule():
    """Steps observed from TensorBoard's data server for these write orders (see the module docstring)."""
    def steps(order):
        return [p[0] for p in reader.supersede([(s, 0.0, None) for s in order])[0]]

    assert steps([0, 1, 2, 5, 3, 7, 8]) == [0, 1, 2, 3, 7, 8]
    assert steps(list(range(100)) + list(range(50, 71))) == list(range(71))
    assert steps([0, 1, 1, 2]) == [0, 1, 2]
    assert steps([4, 3, 2]) == [2]


# --- a file being written while it is read -------------------------------------------------------------------


@pytest.mark.unit
def test_reading_while_a_writer_appends_never_fails(tmp_path):
    stop = threading.Event()
    written = []

    def write():
        with Writer(str(tmp_path / "live"), max_queue=1, seed=0) as w:
            rng = np.random.default_rng(0)
            for s in range(200):
                w.add_gradients(s, {n: rng.normal(size=64) for n in LAYERS})
                written.append(s)
                if stop.is_set():
                    break

    t = threading.Thread(target=write)
    t.start()
    reads = 0
    while t.is_alive() or reads == 0:
        for s in reader.read_logdir(str(tmp_path)).runs:
            assert set(s.steps.tolist()) <= set(range(200))
            assert s.present().all()
            assert all("partial record" in p for p in s.problems), s.problems
        reads += 1
    stop.set()
    t.join()
    (s,) = reader.read_logdir(str(tmp_path)).runs
    assert s.steps.tolist() == written and s.problems == () and reads > 1


# --- the CLI as a process ---------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_cli_process_names_unreadable_runs_with_exit_3(faults):
    root, cases = faults
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "tb_gradhealth.cli", "report", str(root), "--fail-on", "none"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    for run, c in cases.items():
        if not c.cli_steps:
            assert f"run {run!r}: unreadable" in proc.stderr and c.reason in proc.stderr, run
    alone = subprocess.run([sys.executable, "-m", "tb_gradhealth.cli", "report", str(root), "--run", "future"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert alone.returncode == 3 and "upgrade" in alone.stderr, alone.stderr


# --- float64 beyond float32, and the diagnosis of a zero RMS --------------------------------------------------


@pytest.mark.unit
def test_float64_beyond_float32_is_inf_as_on_a_float32_device():
    """Against a float64 reference: magnitudes that round beyond float32's largest finite value count as +-Inf,
    the rest keep their exact statistics."""
    rng = np.random.default_rng(3)
    big = float(np.finfo(np.float32).max)
    g = np.concatenate([rng.normal(size=50) * 1e300, rng.normal(size=50), [big, -big, 3.5e38, -1e39, 1e-300]])
    rec = record.compute(g, hist_sample=None)
    # float64 reference: float32 rounds to Inf from its largest value plus half an ulp (2**104 there) on.
    limit = big + 2.0**103
    over = np.abs(g) >= limit
    fin = g[~over]
    fin = np.where(np.abs(fin) < np.finfo(np.float32).tiny, 0.0, fin.astype(np.float32).astype(np.float64))
    assert np.all(np.isfinite(fin)) and over.sum() > 50
    d = record.derived(rec)
    assert rec[record.INDEX["posinf"]] == int(np.sum(over & (g > 0)))
    assert rec[record.INDEX["neginf"]] == int(np.sum(over & (g < 0)))
    assert rec[record.INDEX["zero"]] == int(np.sum(fin == 0))
    assert d["max_abs"] == np.max(np.abs(fin)) and d["max_abs"] == big
    assert d["norm"] == pytest.approx(big * np.sqrt(np.sum((fin / big) ** 2)), rel=1e-12)
    assert np.sum(rec[record.HIST_START:]) == np.count_nonzero(fin)
    # The disk form holds it and the row checks accept it.
    assert record.check_disk(record.to_disk(rec[None]))[1] == {}


@pytest.mark.unit
def test_huge_float64_gradients_are_diagnosed_nonfinite_without_an_error(faults, capsys):
    root, _ = faults
    rc = cli.main(["report", str(root), "--run", "huge", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert rc == cli.EXIT_FAIL
    (run,) = body["runs"]
    by_layer = {x["layer"]: x for x in run["layers"]}
    assert by_layer["l2"]["status"] == "nonfinite" and by_layer["l1"]["status"] == "healthy"


@pytest.mark.unit
def test_a_zero_rms_below_the_floor_is_diagnosed_not_divided_by():
    """A record whose finite values have norm 0 but are not all zero (as an old writer could store): vanishing."""
    rec = record.compute(np.full(8, 1e-3))
    rec[record.INDEX["min"]] = rec[record.INDEX["max"]] = 0.0
    records = np.stack([np.stack([rec, record.compute(np.full(8, 1e-3))])] * 3)
    h = health.diagnose_run(("a", "b"), np.arange(3), records, health.Thresholds())
    assert h.to_json()["layers"]


# --- the numpy Writer refuses wrong input before writing anything ---------------------------------------------


WRITER_CASES = [
    # (call, exception, text the message must hold)
    (lambda w: w.add_gradients(0, {"a": np.ones(3) + 1j}), TypeError, "'a'"),
    (lambda w: w.add_gradients(0, {"a": np.array([1.0, None])}), TypeError, "'a'"),
    (lambda w: w.add_gradients(0, {"a": np.array(["1", "2"])}), TypeError, "'a'"),
    (lambda w: w.add_gradients(0, {"a": np.ones(3)}, weights={"a": np.ones(4)}), ValueError, "weight of layer 'a'"),
    (lambda w: w.add_gradients(0, {"a": np.ones(3)}, updates={"a": np.ones((3, 1))}), ValueError, "update of"),
    (lambda w: w.add_gradients(0, {"a": np.ones(3)}, weights={"b": np.ones(3)}), ValueError, "'b'"),
    (lambda w: w.add_gradients(0, {None: np.ones(3)}), TypeError, "None"),
    (lambda w: w.add_gradients(0, {3: np.ones(3)}), TypeError, "3"),
    (lambda w: w.add_gradients(-1, {"a": np.ones(3)}), ValueError, "step"),
    (lambda w: w.add_gradients(1.7, {"a": np.ones(3)}), TypeError, "step"),
    (lambda w: w.add_gradients(True, {"a": np.ones(3)}), TypeError, "step"),
    (lambda w: w.add_gradients(np.float64(2), {"a": np.ones(3)}), TypeError, "step"),
    (lambda w: w.add_records(0, ["a"], _nan_count_rows()), ValueError, "'a'"),
    (lambda w: w.add_records(0, ["a"], np.zeros((1, 3))), ValueError, "shape"),
    (lambda w: w.add_records(0, ["a", "a"], np.stack([record.compute(np.ones(2))] * 2)), ValueError, "unique"),
    (lambda w: w.add_scalars(0, {"loss": "low"}), ValueError, "low"),
    (lambda w: w.add_scalars(-2, {"loss": 1.0}), ValueError, "step"),
]


def _nan_count_rows() -> np.ndarray:
    rows = record.compute(np.ones(4))[None].copy()
    rows[0, record.INDEX["nan"]] = np.nan
    return rows


def _inconsistent_rows() -> np.ndarray:
    rows = record.compute(np.ones(4))[None].copy()
    rows[0, record.INDEX["zero"]] = 9  # more zeros than values
    return rows


@pytest.mark.unit
@pytest.mark.parametrize("k", range(len(WRITER_CASES)))
def test_writer_refuses_wrong_input_before_writing(tmp_path, k):
    call, error, text = WRITER_CASES[k]
    with Writer(str(tmp_path), seed=0) as w:
        size_before = os.path.getsize(w._writer.path)
        with pytest.raises(error) as e:
            call(w)
        assert text in str(e.value), str(e.value)
        w.flush()
        assert os.path.getsize(w._writer.path) == size_before
    assert reader.read_logdir(str(tmp_path)).runs == []


@pytest.mark.unit
def test_an_inconsistent_record_is_written_with_a_warning_and_read_as_damaged(tmp_path, caplog):
    """A record that fails the readers' checks does not raise (it would end the training that made it): it is
    written, one warning names its layer and step, and the reader reports that row while keeping the others."""
    good = record.compute(np.ones(4))
    with Writer(str(tmp_path), seed=0) as w, caplog.at_level("WARNING", logger="tb_gradhealth"):
        w.add_records(0, ["a", "b"], np.stack([good, good]))
        w.add_records(1, ["a", "b"], np.stack([_inconsistent_rows()[0], good]))
        w.add_records(2, ["a", "b"], np.stack([_inconsistent_rows()[0], good]))
    warnings = [r.getMessage() for r in caplog.records if "not consistent" in r.getMessage()]
    assert len(warnings) == 1 and "'a'" in warnings[0] and "step 1" in warnings[0], warnings
    (s,) = reader.read_logdir(str(tmp_path)).runs
    assert s.steps.tolist() == [0, 1, 2]
    assert any("a" in p and "zero" in p for p in s.problems), s.problems
    rms = record.derived(s.records)["rms"]
    assert np.isnan(rms[1:, 0]).all() and np.isfinite(rms[:, 1]).all() and np.isfinite(rms[0, 0])


@pytest.mark.unit
def test_writer_refuses_a_step_below_the_last_of_the_same_tag(tmp_path):
    with Writer(str(tmp_path), seed=0) as w:
        w.add_gradients(np.int64(5), {"a": np.ones(3)})
        w.add_gradients(5, {"a": np.ones(3)})  # the same step again: a rewrite, allowed
        w.add_gradients(2, {"b": np.ones(3)})  # another tag has its own steps
        with pytest.raises(ValueError, match="below the step 5"):
            w.add_gradients(4, {"a": np.ones(3)})
        w.add_gradients(6, {"a": np.ones(3, dtype=np.int32)})  # integers are fine
    (s,) = reader.read_logdir(str(tmp_path)).runs
    assert s.steps.tolist() == [2, 5, 6] and s.problems == ()


# --- single-flight: one computation per distinct request ------------------------------------------------------


@pytest.mark.e2e
def test_concurrent_identical_cold_requests_share_one_diagnosis(faults, monkeypatch):
    from tensorboard.plugins import base_plugin

    root, cases = faults
    ingester = gl.data_server(str(root / "good"), {"gradhealth": 0}, last_steps={".": cases["good"].tab_steps[-1]})
    p = plugin.GradHealthPlugin(base_plugin.TBContext(data_provider=ingester.data_provider,
                                                      sampling_hints={"gradhealth": 0}))
    apps = p.get_plugin_apps()
    lock, calls, active, most = threading.Lock(), [], [0], [0]
    real = plugin.diagnose
    release = threading.Event()

    def counting(series, t, step, *evidence):
        with lock:
            calls.append(t)
            active[0] += 1
            most[0] = max(most[0], active[0])
        release.wait(10)  # hold every computation until all requests are in
        try:
            return real(series, t, step, *evidence)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(plugin, "diagnose", counting)

    def burst(urls):
        out = [None] * len(urls)

        def one(i):
            c = Client(lambda environ, start: apps[environ["PATH_INFO"]](environ, start))
            r = c.get(urls[i])
            out[i] = (r.status_code, r.get_data(as_text=True))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(urls))]
        for t in threads:
            t.start()
        while True:  # the first computation started: hold it a moment so the others join it
            with lock:
                if calls:
                    break
        threading.Event().wait(0.3)  # not a timing assertion: a late request finds the cached answer instead
        release.set()
        for t in threads:
            t.join()
        release.clear()
        return out

    same = burst(["/health?run=."] * 24)
    assert len(calls) == 1 and {a for a in same} == {same[0]} and same[0][0] == 200
    varied = burst([f"/health?run=.&vanish_decades={3 + i % 4}" for i in range(24)])
    assert {s for s, _ in varied} == {200}
    assert sorted(t.vanish_decades for t in calls[1:]) == [4.0, 5.0, 6.0]  # 3 is the default, already cached
    assert most[0] <= plugin.DIAGNOSES_AT_ONCE


# --- a bug in one run's diagnosis hides nothing else --------------------------------------------------------


@pytest.mark.unit
def test_a_failing_diagnosis_is_one_runs_error_not_a_traceback(faults, capsys, monkeypatch):
    """Simulated bug: diagnosing one run raises. The CLI reports that run (exit 3) and all the others."""
    root, cases = faults
    from tb_gradhealth import _payloads

    real = _payloads.diagnose

    def broken(series, t, step, *evidence):
        if series.run == "good":
            raise ZeroDivisionError("float division by zero")
        return real(series, t, step, *evidence)

    monkeypatch.setattr(_payloads, "diagnose", broken)
    rc = cli.main(["report", str(root), "--json", "--fail-on", "none"])
    out, err = capsys.readouterr()
    body = json.loads(out)
    assert rc == cli.EXIT_UNREADABLE and "Traceback" not in out + err
    assert "good" not in {b["run"] for b in body["runs"]} and "huge" in {b["run"] for b in body["runs"]}
    assert any(p.startswith("run 'good': unreadable, internal error ZeroDivisionError") for p in body["problems"])


@pytest.mark.e2e
def test_a_failing_route_answers_json_and_other_runs_are_served(faults, tab, monkeypatch):
    real = plugin.diagnose

    def broken(series, t, step, *evidence):
        if series.run == "good" and t.vanish_decades == 7:
            raise ZeroDivisionError("float division by zero")
        return real(series, t, step, *evidence)

    monkeypatch.setattr(plugin, "diagnose", broken)
    r = tab.get(PREFIX + "/health?run=good&vanish_decades=7")
    assert r.status_code == 500 and "ZeroDivisionError" in json.loads(r.get_data(as_text=True))["error"]
    assert "Traceback" not in r.get_data(as_text=True)
    assert _get(tab, "/health?run=huge&vanish_decades=7")[0] == 200


# --- the TF summary op refuses ambiguous input ------------------------------------------------------------------


@pytest.mark.tf
def test_summary_gradients_refuses_mismatched_or_misplaced_input_and_keeps_every_layer(tmp_path):
    tf = pytest.importorskip("tensorflow")
    from tb_gradhealth import summary

    v1, v2 = tf.Variable(tf.ones(3), name="v1"), tf.Variable(tf.ones(2), name="v2")
    g = [tf.ones(3), tf.ones(2), tf.ones(4)]
    writer = tf.summary.create_file_writer(str(tmp_path / "refused"))
    with writer.as_default():
        for bad, error, text in [
            ((g, [v1, v2]), ValueError, "3 gradients but 2 variables"),
            ([v1, v2], TypeError, "variable"),  # the variables instead of their gradients
            ([g[0], [g[1], g[2]]], TypeError, "gradient 1"),  # a nested list is not a gradient
            ({None: g[0]}, TypeError, "None"),
        ]:
            with pytest.raises(error, match=text):
                summary.gradients(bad, step=0)
    writer.close()
    assert reader.read_logdir(str(tmp_path)).runs == []
    # Variables named a, a#1 and a: the repeat is suffixed past the name another variable already has, so every
    # gradient keeps its own row.
    va, vb, vc = (tf.Variable(tf.fill([4], float(k)), name=n) for k, n in ((1, "a"), (2, "a#1"), (3, "a")))
    pairs = [(tf.fill([4], 1.0), va), (tf.fill([4], 2.0), vb), (tf.fill([4], 3.0), vc)]
    names = summary.layer_names(pairs)
    assert names == ["a", "a#1", "a#2"]
    writer = tf.summary.create_file_writer(str(tmp_path / "kept"))
    with writer.as_default():
        summary.gradients(pairs, step=0, weights=False)
    writer.close()
    (s,) = reader.read_logdir(str(tmp_path)).runs
    assert list(s.layers) == names
    np.testing.assert_array_equal(record.derived(s.records[0])["max_abs"], [1.0, 2.0, 3.0])
    # float64 beyond float32's range: the TF path counts what the numpy reference counts (+-Inf), in every mode.
    g64 = np.concatenate([np.random.default_rng(5).normal(size=60) * 1e300, np.linspace(-2.0, 2.0, 40)])
    want = record.compute(g64, hist_sample=None)
    for jit in (True, False):
        got = record.from_device(*summary.compute({"l": tf.constant(g64)}, hist_sample=0, jit=jit))[0]
        for name in record.COUNT_FIELDS + ("min", "max"):
            assert got[record.INDEX[name]] == want[record.INDEX[name]], (jit, name)
        np.testing.assert_array_equal(got[record.HIST_START:], want[record.HIST_START:])


@pytest.mark.unit
def test_repeated_names_never_collide_with_given_ones():
    from tb_gradhealth._tf import naming

    class Var:  # a variable as the naming rule sees one: assignable, with a name
        def __init__(self, name):
            self.name = name

        def assign(self, value):
            pass

    for given in (["a", "a#1", "a"], ["a", "a", "a#1"], ["a", "a", "a"], ["a#1", "a", "a", "a#2", "a"]):
        names = naming.variable_names([Var(n) for n in given])
        assert len(set(names)) == len(names) and names[0] == given[0], (given, names)
        assert all(n == g or n.startswith(g + "#") for n, g in zip(names, given, strict=True))
    with pytest.raises(ValueError, match="3 gradients but 2 variables"):
        naming.layer_names(([1.0, 2.0, 3.0], [Var("a"), Var("b")]))
    with pytest.raises(TypeError, match="gradient 0 is a variable"):
        naming.layer_names([Var("a"), Var("b")])
    with pytest.raises(TypeError, match="non-empty strings"):
        naming.layer_names({None: 1.0})


@pytest.mark.e2e
def test_shared_answer_is_the_same_with_and_without_gzip(tab):
    import gzip

    plain = tab.get(PREFIX + "/health?run=restart")
    packed = tab.get(PREFIX + "/health?run=restart", headers={"Accept-Encoding": "gzip, deflate"})
    assert plain.status_code == packed.status_code == 200
    assert "Content-Encoding" not in plain.headers and packed.headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(packed.get_data())) == json.loads(plain.get_data(as_text=True))
