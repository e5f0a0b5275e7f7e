"""Logdirs on object storage, end to end against real servers started here: moto's S3 server (``moto_server``) and
a GCS emulator (``gcp-storage-emulator``).

For each: the numpy ``Writer`` writes to the bucket, ``tb-gradhealth report`` (a subprocess configured by
environment variables only, as a CI job is) reads it back with the documented exit codes; records become visible
within the writer's flush interval without an explicit flush; a writer killed with SIGKILL loses nothing it had
flushed; and a real ``tensorboard`` serves the tab over the bucket where TensorBoard itself can reach the server
(its Python loader through its own file-system layer when TensorFlow is not importable: boto3 with
``S3_ENDPOINT`` for ``s3://``, fsspec for ``gs://``).

Skipped, with the reason, when a server program or fsspec backend is not installed (``pip install -e '.[test]'``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tensorboard_process import TensorBoardProcess, _installed_entry_point  # noqa: E402

from tb_gradhealth import Writer, _storage, cli, reader, testing  # noqa: E402
from tb_gradhealth.problems import Kind  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVER_START_S = 60.0
LAYERS = ["conv/kernel", "conv/bias", "dense/kernel"]


def _program(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)



def _wait_for_port(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    pytest.fail(f"server did not listen on port {port} in {SERVER_START_S:.0f} s")


class Server:
    """A storage server process, the bucket URL to write under, and how to reach it: ``env`` for subprocesses
    (what a user's job would set) and ``options`` for in-process fsspec calls."""

    def __init__(self, scheme: str, cmd: list[str], port: int, log: Path, env: dict[str, str],
                 options: dict[str, str], bucket: str):
        self.scheme, self.env, self.options, self.bucket = scheme, env, options, bucket
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for_port(self.proc, port, log)

    def url(self, *parts: str) -> str:
        return "/".join([f"{self.scheme}://{self.bucket}", *parts])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        self._log.close()


def _s3(tmp: Path) -> Server:
    program = _program("moto_server")
    if program is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    pytest.importorskip("s3fs", reason="s3fs not installed (pip install 'tb-gradhealth[s3]')")
    port = testing.free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT": endpoint}
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    server = Server("s3", [program, "-H", "127.0.0.1", "-p", str(port)], port, tmp / "moto.log", env, options,
                    "gradhealth-test")
    fs, _ = _storage.filesystem(server.url(), options)
    fs.mkdir(server.bucket)
    return server


def _gcs(tmp: Path) -> Server:
    program = _program("gcp-storage-emulator")
    if program is None:
        pytest.skip("gcp-storage-emulator not installed (pip install gcp-storage-emulator)")
    # gcsfs probes new buckets' type over gRPC (hierarchical namespace), which an emulator does not answer;
    # read when gcsfs is imported, so set before the first gs:// URL is used.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("gcsfs", reason="gcsfs not installed (pip install 'tb-gradhealth[gcs]')")
    port = testing.free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": endpoint, "FSSPEC_GCS_TOKEN": "anon", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    options = {"token": "anon", "endpoint_url": endpoint}
    # the emulator with its multipart uploads read byte for byte (tests/gcs_emulator.py says why)
    cmd = [sys.executable, str(ROOT / "tests" / "gcs_emulator.py"), "start", "--host", "127.0.0.1", "--port",
           str(port), "--in-memory", "--default-bucket", "gradhealth-test"]
    return Server("gs", cmd, port, tmp / "gcs.log", env, options, "gradhealth-test")


@pytest.fixture(scope="module", params=["s3", "gs"])
def server(request, tmp_path_factory):
    srv = (_s3 if request.param == "s3" else _gcs)(tmp_path_factory.mktemp(f"{request.param}_server"))
    try:
        yield srv
    finally:
        srv.stop()


def _grads(rng: np.random.Generator, step: int, nan_at: int | None) -> dict[str, np.ndarray]:
    out = {name: rng.normal(0.0, 1e-3, size=64) for name in LAYERS}
    if nan_at is not None and step >= nan_at:
        out[LAYERS[-1]][0] = np.nan
    return out


def _write(url: str, options: dict, steps: int, nan_at: int | None = None, **kw) -> Writer:
    rng = np.random.default_rng(0)
    w = Writer(url, storage_options=options, **kw)
    for s in range(steps):
        w.add_gradients(s, _grads(rng, s, nan_at))
    return w


def _report(server: Server, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **server.env)
    return subprocess.run([sys.executable, "-m", "tb_gradhealth.cli", "report", *args], capture_output=True,
                          text=True, env=env, timeout=180)


def _fresh(server: Server, name: str) -> str:
    return server.url(f"{name}-{uuid.uuid4().hex[:8]}")


@pytest.mark.e2e
def test_objects_round_trip_byte_for_byte(server):
    """Every byte written comes back, whatever the object ends in (an event-file object ends in its last record's
    checksum, any byte at all); the emulator's multipart parse dropped a last ``\\r`` before the launcher's fix."""
    base = _fresh(server, "bytes")
    endings = [b"\r", b"\n", b"\r\n", b"\n\r", b"--", b"\x00", bytes(range(256))]
    for k, end in enumerate(endings):
        data = b"record bytes\r\n" + end
        _storage.write_object(f"{base}/{k}", data, server.options)
        assert _storage.read_bytes(f"{base}/{k}", server.options) == data, end


@pytest.mark.e2e
def test_writer_to_bucket_then_report_exit_codes(server):
    logdir = _fresh(server, "report")
    _write(f"{logdir}/healthy", server.options, 20).close()
    _write(f"{logdir}/sick", server.options, 20, nan_at=13).close()

    both = _report(server, logdir, "--json")
    assert both.returncode == cli.EXIT_FAIL, both.stderr
    runs = {r["run"]: r for r in json.loads(both.stdout)["runs"]}
    assert runs["sick"]["summary"]["first_bad"] == {"layer": "dense/kernel", "status": "nonfinite", "step": 13}
    assert runs["healthy"]["summary"]["first_bad"] is None
    healthy = _report(server, logdir, "--run", "healthy")
    assert healthy.returncode == cli.EXIT_OK, healthy.stderr
    assert "20 logged" in healthy.stdout, healthy.stdout
    assert _report(server, logdir, "--fail-on", "none").returncode == cli.EXIT_OK
    missing = _report(server, server.url("no-such-logdir"))
    assert missing.returncode == cli.EXIT_USAGE and "does not exist" in missing.stderr, missing.stderr


@pytest.mark.e2e
def test_records_become_visible_within_the_flush_interval(server):
    logdir = _fresh(server, "live")
    w = _write(f"{logdir}/run", server.options, 5, flush_secs=0.5, max_queue=1000)
    try:
        # No flush() call: the writer's own flush interval makes them visible; the deadline is generous.
        deadline = time.monotonic() + 30
        steps = 0
        while time.monotonic() < deadline and steps < 5:
            runs = reader.read_logdir(logdir, storage_options=server.options).runs
            steps = runs[0].num_steps if runs else 0
            time.sleep(0.2)
        assert steps == 5
    finally:
        w.close()
    assert len(w._writer.objects) >= 2  # the file-version record, then at least one flush of records


_KILLED_WRITER = """
import sys, time, numpy as np
from tb_gradhealth import Writer
w = Writer(sys.argv[1], flush_secs=3600, max_queue=10**6)
for s in range(15):
    w.add_gradients(s, {"a": np.full(8, 1e-3 * (s + 1)), "b": np.ones(4)})
    if s == 9:
        assert w.flush(), "the flush failed"
print("flushed", flush=True)
time.sleep(600)
"""


@pytest.mark.e2e
def test_a_killed_writer_loses_nothing_it_flushed(server):
    logdir = _fresh(server, "killed")
    env = dict(os.environ, PYTHONPATH=str(ROOT), **server.env)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, f"{logdir}/run"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "flushed", proc.stderr.read() if proc.poll() is not None else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    # The emulator (not GCS, whose objects appear whole) may still be storing an object the killed client sent,
    # which then reads as "still being written": read again, a few times, while that is the only problem.
    for _ in range(10):
        data = reader.read_logdir(logdir, storage_options=server.options)
        (run,) = data.runs
        if data.problems or not run.problems or any(getattr(p, "kind", None) is not Kind.PARTIAL
                                                    for p in run.problems):
            break
        time.sleep(0.5)
    assert run.steps.tolist() == list(range(10)) and not run.problems and not data.problems
    assert run.records[-1, 0, 0] == 8  # the size of layer a: whole records


@pytest.mark.e2e
@pytest.mark.slow
def test_tensorboard_serves_the_tab_over_the_bucket(server, tmp_path):
    """TensorBoard's own loaders: the Rust data server reads only real GCS (its endpoint is fixed), and TensorFlow's
    file systems have no emulator endpoint and no s3:// (since TF 2.6); without TensorFlow, TensorBoard's Python
    loader reads s3:// through boto3 (``S3_ENDPOINT``) and other URLs through fsspec. That is what runs here:
    TensorFlow hidden from the ``tensorboard`` process, ``--load_fast=false``."""
    logdir = _fresh(server, "tensorboard")
    _write(f"{logdir}/sick", server.options, 30, nan_at=21).close()
    hide_tf = tmp_path / "no_tensorflow"
    (hide_tf / "tensorflow").mkdir(parents=True)
    (hide_tf / "tensorflow" / "__init__.py").write_text("raise ImportError('TensorFlow hidden from this process')\n")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    _installed_entry_point(cwd)
    pythonpath = os.pathsep.join([str(hide_tf), str(ROOT)])
    tb = TensorBoardProcess(logdir, tmp_path / "tb.log", cwd, flags=("--load_fast=false",),
                            env={**server.env, "PYTHONPATH": pythonpath})
    try:
        def loaded():
            runs = tb.get_json("/data/plugin/gradhealth/runs")["runs"]
            return runs if runs and runs[0]["last_step"] == 29 else None

        (run,) = tb.wait_until("the bucket's run to be loaded", loaded)
        assert run["run"] == "sick" and run["num_steps"] == 30 and run["layers"] == LAYERS
        health = tb.get_json("/data/plugin/gradhealth/health?run=sick")
        assert health["summary"]["first_bad"] == {"layer": LAYERS[-1], "status": "nonfinite", "step": 21}
    finally:
        tb.stop()


# --- URLs that cannot be used: clear errors, never a local directory named like a scheme ------------------------


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["s3:bucket/run", "gs:/bucket/run"])
def test_a_malformed_url_is_an_error_not_a_local_directory(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_storage.StorageError, match="neither a local path nor a URL"):
        Writer(bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.unit
@pytest.mark.parametrize("url, extra", [("s3://bucket/run", "s3"), ("gs://bucket/run", "gcs")])
def test_without_fsspec_a_url_is_a_clear_error(url, extra, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if not installed
    with pytest.raises(_storage.StorageError, match=rf"pip install 'tb-gradhealth\[{extra}\]'"):
        Writer(url)
    assert list(tmp_path.iterdir()) == []
    assert cli.main(["report", url]) == cli.EXIT_USAGE
    assert f"tb-gradhealth[{extra}]" in capsys.readouterr().err


@pytest.mark.unit
def test_file_urls_and_paths_are_local(tmp_path):
    w = Writer(f"file://{tmp_path}/run")
    w.add_gradients(0, {"a": np.ones(3)})
    w.close()
    (run,) = reader.read_logdir(f"file://{tmp_path}").runs
    assert run.run == "run" and run.num_steps == 1
    assert _storage.scheme("gs://b/x") == "gs" and _storage.scheme("C:\\logs") is None
