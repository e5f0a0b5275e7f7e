"""The README's first command, for real: ``python demo/demo.py --logdir DIR`` trains every demo network through the
project's writers, the diagnosis tells the sick runs from the healthy ones, ``tb-gradhealth report`` (the installed
console script) gates on them, and ``--serve`` ends with TensorBoard serving the Gradient Health tab.

The demo runs once per module (about 40 s of CPU on two cores); every test reads its output.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tb_gradhealth import reader, record
from tests.test_health_answer import check_answer

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo" / "demo.py"
HAS_TORCH = importlib.util.find_spec("torch") is not None
RUNS = ("healthy/train", "vanishing/train", "exploding", "accumulation", "tpu_host_call", "numpy_writer") + (
    ("pytorch",) if HAS_TORCH else ())
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def _console_script(name: str) -> list[str]:
    """An installed console script of this interpreter's environment (what ``pip install`` put there)."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return [str(here)]
    found = shutil.which(name)
    if not found:
        pytest.fail(f"console script {name!r} is not installed: run `pip install -e .` first")
    return [found]


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    logdir = tmp_path_factory.mktemp("demo_logdir")
    proc = subprocess.run(
        [sys.executable, str(DEMO), "--logdir", str(logdir)],
        capture_output=True, text=True, timeout=900, env=ENV, cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return logdir, proc.stdout


def _report(logdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*_console_script("tb-gradhealth"), "report", str(logdir), *args],
        capture_output=True, text=True, timeout=300, env=ENV,
    )


@pytest.fixture(scope="module")
def health(demo) -> dict[str, dict]:
    logdir, _ = demo
    proc = _report(logdir, "--json", "--fail-on", "none")
    assert proc.returncode == 0, proc.stderr
    return {run["run"]: run for run in json.loads(proc.stdout)["runs"]}


def _status(run: dict) -> dict[str, str]:
    return {layer["layer"]: layer["status"] for layer in run["layers"]}


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_progress_line_per_run(demo):
    _, out = demo
    for name in ("healthy", "vanishing", "exploding", "accumulation", "tpu_host_call", "numpy_writer") + (
            ("pytorch",) if HAS_TORCH else ()):
        assert re.search(rf"^\[demo\] {name}: \d+ steps in [\d.]+ s", out, re.M), out


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_every_run_is_written(health):
    assert set(health) == set(RUNS), sorted(health)


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_healthy_runs_have_no_flag(health):
    healthy = ("healthy/train", "accumulation", "tpu_host_call", "numpy_writer") + (("pytorch",) if HAS_TORCH else ())
    for name in healthy:
        statuses = _status(health[name])
        assert set(statuses.values()) == {"healthy"}, (name, statuses)


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_vanishing_run_flags_the_layers_that_do_not_learn(demo, health):
    """Ground truth from what each layer does: how far its parameters moved over the run (the sum of the recorded
    update RMS over the logged steps), next to the logits layer's. The diagnosis only sees each step's records."""
    logdir, _ = demo
    series = next(s for s in reader.read_logdir(str(logdir)).runs if s.run == "vanishing/train")
    d = record.derived(series.records)
    moved = np.nansum(d["update_norm"] / np.sqrt(d["size"]), axis=0)
    decades = np.log10(moved) - np.log10(np.median(moved[-2:]))  # the logits kernel and bias
    statuses = _status(health["vanishing/train"])
    assert list(statuses) == series.layers or set(statuses) == set(series.layers)
    sick = [n for n, dec in zip(series.layers, decades, strict=True) if dec < -3.3]  # >2,000x slower
    fine = [n for n, dec in zip(series.layers, decades, strict=True) if dec > -2.5]
    assert "vanishing/sigmoid_00/kernel" in sick and len(sick) >= 8 and "vanishing/logits/kernel" in fine
    assert all(statuses[n] == "vanishing" for n in sick), {n: statuses[n] for n in sick}
    assert all(statuses[n] == "healthy" for n in fine), {n: statuses[n] for n in fine}
    assert set(statuses.values()) == {"vanishing", "healthy"}
    run = health["vanishing/train"]
    assert run["layers"][0]["layer"] in sick and run["summary"]["first_bad"]["layer"] == run["layers"][0]["layer"]
    assert run["summary"]["onset"]["step"] == int(series.steps[0])
    # The answer is the layer whose gradient is lowest at the last step (from the records), by its kernel, everywhere.
    rms = record.derived(series.records[-1])["rms"]
    lowest = series.layers[int(np.nanargmin(rms))].rsplit("/", 1)[0] + "/kernel"
    sm = run["summary"]
    assert sm["answer"]["layer"] == lowest == sm["timeline"][0]["layer"] == run["layers"][0]["layer"]
    assert sm["answer"]["headline"] == f"{lowest}: vanishing since step {int(series.steps[0])}"


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_every_run_tells_one_answer(health):
    for run in health.values():
        check_answer(run)


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_exploding_run_ends_nonfinite_and_was_exploding_before(demo, health):
    logdir, _ = demo
    series = next(s for s in reader.read_logdir(str(logdir)).runs if s.run == "exploding")
    d = record.derived(series.records)
    nan_step = int(series.steps[np.argmax((d["nan"] + d["inf"]).sum(axis=1) > 0)])  # from the counts alone
    run = health["exploding"]
    top = run["layers"][0]
    assert top["status"] == "nonfinite" and top["status_since"] == nan_step
    # Since when: the chain of episodes starts with the growth, well before the NaN, and the timeline tells it.
    assert run["summary"]["first_bad"] == {"layer": top["layer"], "status": "nonfinite", "step": top["first_step"]}
    assert top["first_step"] < nan_step - 5 and top["episodes"][0]["status"] == "exploding"
    timeline = run["summary"]["timeline"]
    assert timeline[0]["status"] == "exploding" and timeline[0]["step"] < nan_step - 5
    assert timeline[-1]["status"] == "nonfinite" and timeline[-1]["step"] == nan_step
    # The run's onset is its first flagged step: the chain's start, or an earlier episode that lasted into it and
    # is told beside the timeline ("earlier, lasted past step N"), never a step the answer does not show.
    shown = [timeline[0]["step"]] + [e["step"] for e in run["summary"]["earlier"]
                                     if e["label"] == f"earlier, lasted past step {timeline[0]['step']}"]
    assert run["summary"]["onset"]["step"] == min(shown) and min(shown) < nan_step - 5
    origin = run["nan_origin"]  # where the NaN/Inf was made, replayed by the demo's loop
    assert origin is not None and origin["found"] and origin["step"] == nan_step and origin["op"] and origin["line"]
    # Before the first NaN, the growth was already flagged as exploding (the point of the trend rule).
    proc = _report(logdir, "--json", "--fail-on", "none", "--run", "exploding", "--step", str(nan_step - 1))
    before = json.loads(proc.stdout)["runs"][0]
    assert before["summary"]["counts"]["nonfinite"] == 0
    assert before["summary"]["counts"]["exploding"] > 0
    assert before["summary"]["first_bad"]["step"] < nan_step - 5, before["summary"]


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_report_gates_on_nonfinite(demo):
    logdir, _ = demo
    proc = _report(logdir)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "exploding" in proc.stdout and "nonfinite" in proc.stdout
    ok = _report(logdir, "--run", "healthy/train")
    assert ok.returncode == 0, ok.stdout + ok.stderr


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_accumulation_records_noise_and_tpu_merges_shards(demo):
    logdir, _ = demo
    runs = {r.run: r for r in reader.read_logdir(str(logdir), ["accumulation", "tpu_host_call"]).runs}
    acc = runs["accumulation"].records
    assert np.all(acc[..., record.INDEX["micro_batches"]] == 4)
    noise = record.derived(acc)["noise"]
    assert np.all(np.isfinite(noise)) and np.all(noise > 0), noise
    tpu = runs["tpu_host_call"]
    kernel = tpu.layers.index("tpu_host_call/hidden_0/kernel")
    # The host merged the 4 shards: the record covers every shard's values (4 x the variable's 32 x 64).
    assert np.all(tpu.records[:, kernel, record.INDEX["size"]] == 4 * 32 * 64)


@pytest.mark.e2e
@pytest.mark.tf
@pytest.mark.slow
def test_serve_ends_with_tensorboard_serving_the_tab(demo):
    logdir, _ = demo
    proc = subprocess.Popen(
        [sys.executable, str(DEMO), "--logdir", str(logdir), "--runs", "", "--serve", "--host", "127.0.0.1",
         "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=str(REPO),
        start_new_session=True,
    )
    lines = []
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"serving .* at (http://\S+?)/?#gradhealth", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        listing = None
        for _ in range(120):
            with urllib.request.urlopen(url + "/data/plugins_listing", timeout=10) as r:
                listing = json.loads(r.read())
            if listing.get("gradhealth", {}).get("enabled"):
                break
            time.sleep(0.5)
        assert listing["gradhealth"]["enabled"], listing.get("gradhealth")
        assert listing["gradhealth"]["tab_name"] == "Gradient Health"
        for _ in range(120):  # --samples_per_plugin=gradhealth=0: every logged step is kept
            with urllib.request.urlopen(url + "/data/plugin/gradhealth/runs", timeout=10) as r:
                runs = {x["run"]: x for x in json.loads(r.read())["runs"]}
            if set(runs) >= set(RUNS):
                break
            time.sleep(0.5)
        assert set(runs) >= set(RUNS), sorted(runs)
        assert runs["healthy/train"]["num_steps"] == 100 and not runs["healthy/train"]["maybe_downsampled"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.e2e
@pytest.mark.parametrize("args, message", [
    (["--steps", "-1"], "--steps must be a positive scale factor"),
    (["--steps", "0"], "--steps must be a positive scale factor"),
    (["--runs", ""], "--runs is empty"),
    (["--runs", "nope"], "unknown run(s) nope"),
])
def test_bad_arguments_are_refused_before_training(args, message, tmp_path):
    proc = subprocess.run([sys.executable, str(DEMO), "--logdir", str(tmp_path), *args], capture_output=True,
                          text=True, timeout=120, env=ENV, cwd=str(REPO))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "training" not in proc.stdout and not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_serve_on_a_busy_port_says_so_before_training(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, str(DEMO), "--logdir", str(tmp_path), "--serve", "--host",
                               "127.0.0.1", "--port", str(port)], capture_output=True, text=True, timeout=120,
                              env=ENV, cwd=str(REPO))
    assert proc.returncode == 2, proc.stderr
    assert f"--port {port}" in proc.stderr and "in use" in proc.stderr and "Traceback" not in proc.stderr
    assert "training" not in proc.stdout


@pytest.mark.unit
def test_a_run_whose_framework_is_missing_is_skipped_and_makes_no_folder(tmp_path, monkeypatch, capsys):
    """Without PyTorch the demo says the pytorch run is skipped, not "0 steps ... -> DIR/pytorch" for a folder it
    never makes."""
    spec = importlib.util.spec_from_file_location("demo_script", DEMO)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **kw: None if name.split(".")[0] == "torch" else real(name, *a, **kw))
    assert script.main(["--logdir", str(tmp_path), "--runs", "numpy_writer,pytorch", "--steps", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "[demo] pytorch: skipped (torch not installed)" in out
    assert not any(line.startswith(("[demo] pytorch: training", "[demo] pytorch: 0 steps")) for line in out), out
    assert any(re.match(r"\[demo\] numpy_writer: \d+ steps in", line) for line in out), out
    assert sorted(os.listdir(tmp_path)) == ["numpy_writer"]
