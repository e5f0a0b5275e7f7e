"""The README's first command, for real: ``python demo/demo.py --logdir DIR`` trains every demo network through the
project's writers, the diagnosis tells the sick runs from the healthy ones, ``tb-gradhealth report`` (the installed
console script) gates on them, and ``--serve`` ends with TensorBoard serving the Gradient Health tab.

The demo runs once per module (about 40 s of CPU on two cores); every test reads its output.
"""

from __future__ import annotations

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

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo" / "demo.py"
RUNS = ("healthy/train", "vanishing/train", "exploding", "accumulation", "tpu_host_call", "numpy_writer")
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


def test_progress_line_per_run(demo):
    _, out = demo
    for name in ("healthy", "vanishing", "exploding", "accumulation", "tpu_host_call", "numpy_writer"):
        assert re.search(rf"^\[demo\] {name}: \d+ steps in [\d.]+ s", out, re.M), out


def test_every_run_is_written(health):
    assert set(health) == set(RUNS), sorted(health)


def test_healthy_runs_have_no_flag(health):
    for name in ("healthy/train", "accumulation", "tpu_host_call", "numpy_writer"):
        statuses = _status(health[name])
        assert set(statuses.values()) == {"healthy"}, (name, statuses)


def test_vanishing_run_flags_the_first_layers_only(health):
    statuses = _status(health["vanishing/train"])
    layers = list(statuses)
    assert all(name.startswith("vanishing/") for name in layers)
    assert statuses["vanishing/sigmoid_00/kernel"] == "vanishing"
    assert statuses["vanishing/logits/kernel"] == "healthy"
    flagged = [name for name, s in statuses.items() if s != "healthy"]
    assert flagged and set(s for s in statuses.values()) == {"vanishing", "healthy"}
    # Only the shallow end vanishes: every flagged layer comes before the deepest sigmoid layers.
    assert all(int(re.search(r"sigmoid_(\d+)", name).group(1)) < 6 for name in flagged), flagged


def test_exploding_run_ends_nonfinite_and_was_exploding_before(demo, health):
    run = health["exploding"]
    assert run["layers"][0]["status"] == "nonfinite"
    first_bad = run["summary"]["first_bad"]
    assert first_bad["status"] == "nonfinite"
    nan_step = first_bad["step"]
    # Before the first NaN, the growth was already flagged as exploding (the point of the trend rule).
    logdir, _ = demo
    proc = _report(logdir, "--json", "--fail-on", "none", "--run", "exploding", "--step", str(nan_step - 1))
    before = json.loads(proc.stdout)["runs"][0]
    assert before["summary"]["counts"]["nonfinite"] == 0
    assert before["summary"]["counts"]["exploding"] > 0
    assert before["summary"]["first_bad"]["step"] < nan_step - 5, before["summary"]


def test_report_gates_on_nonfinite(demo):
    logdir, _ = demo
    proc = _report(logdir)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "exploding" in proc.stdout and "nonfinite" in proc.stdout
    ok = _report(logdir, "--run", "healthy/train")
    assert ok.returncode == 0, ok.stdout + ok.stderr


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
