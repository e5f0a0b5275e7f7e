"""End to end through what a user gets: the installed ``tensorboard`` command, in its own process, finds the
``gradhealth`` plugin through the package's ``tensorboard_plugins`` entry point, lists it as an ES-module tab, and
serves the module and the data routes over a demo-like logdir (read through TensorBoard's default data loader).

Nothing is installed here: the test needs ``pip install -e .`` (or ``pip install .``) to have been run, as the
README's test command does, and fails with that advice otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tb_gradhealth import testing

STARTUP_TIMEOUT_S = 90.0  # TensorBoard imports TF when present and starts its data server: slow on 2 busy cores


_PROBE = """
import json
from importlib import metadata
from tensorboard.plugins import base_plugin
eps = [e for e in metadata.entry_points().select(group="tensorboard_plugins") if e.name == "gradhealth"]
out = {"value": eps[0].value if eps else None}
if eps:
    obj = eps[0].load()
    out["plugin"] = isinstance(obj, type) and issubclass(obj, (base_plugin.TBPlugin, base_plugin.TBLoader))
    out["module_file"] = __import__(obj.__module__, fromlist=["_"]).__file__
print(json.dumps(out))
"""


def _installed_entry_point(cwd: Path) -> dict:
    """What a fresh interpreter of this environment, started outside the checkout (so that the checkout's own
    directory is not on ``sys.path``), finds in the ``tensorboard_plugins`` group."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    if found["value"] is None:
        pytest.fail("the gradhealth tensorboard_plugins entry point is not installed: run `pip install -e .` first")
    return found


def _tensorboard_command() -> list[str]:
    """The ``tensorboard`` script of this interpreter's environment (a venv's own), else ``python -m``."""
    here = Path(sys.executable).parent / "tensorboard"
    if here.exists():
        return [str(here)]
    found = shutil.which("tensorboard")
    if found and Path(found).resolve().parent == Path(sys.executable).resolve().parent:
        return [found]
    return [sys.executable, "-m", "tensorboard.main"]



def _get(url: str, timeout: float = 10.0) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read()


class TensorBoardProcess:
    """A real ``tensorboard`` process on a loopback port; always stopped (with its data server) by :meth:`stop`."""

    def __init__(self, logdir: str, log_path: Path, cwd: Path,
                 flags: tuple[str, ...] = ("--samples_per_plugin", "gradhealth=0"),
                 env: dict[str, str] | None = None) -> None:
        self.port = testing.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **(env or {}))
        cmd = [
            *_tensorboard_command(),
            "--logdir",
            logdir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
            "--reload_interval",
            "1",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
        )

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_until(self, what: str, check, timeout: float = STARTUP_TIMEOUT_S):
        """Poll ``check()`` until it returns a truthy value; fail with TensorBoard's own output otherwise."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"tensorboard exited with {self.proc.returncode} before {what}:\n{self.log_tail()}")
            try:
                value = check()
                if value:
                    return value
            except (OSError, ValueError) as e:  # not listening yet / partial JSON while loading
                last_error = e
            time.sleep(0.5)
        tail = self.log_tail()
        pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error}):\n{tail}")

    def get_json(self, route: str):
        status, ctype, body = _get(self.base + route)
        assert status == 200, (route, status, body[:500])
        assert "json" in ctype, (route, ctype)
        return json.loads(body)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def demo_logdir(tmp_path_factory) -> tuple[str, dict]:
    logdir = tmp_path_factory.mktemp("tb_process_logdir")
    facts = testing.make_demo_logdir(str(logdir))
    return str(logdir), facts


@pytest.fixture(scope="module")
def neutral_cwd(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tb_process_cwd")


@pytest.fixture(scope="module")
def tensorboard(demo_logdir, neutral_cwd, tmp_path_factory):
    _installed_entry_point(neutral_cwd)
    logdir, _ = demo_logdir
    tb = TensorBoardProcess(logdir, tmp_path_factory.mktemp("tb_process_log") / "tensorboard.log", neutral_cwd)
    try:
        yield tb
    finally:
        tb.stop()
    assert tb.proc.poll() is not None, "tensorboard is still running"


@pytest.mark.e2e
def test_entry_point_is_the_loader_of_this_package(neutral_cwd):
    found = _installed_entry_point(neutral_cwd)
    # The loader, not the plugin class: only a TBLoader gets fix_flags (every step kept by default).
    assert found["value"] == "tb_gradhealth.plugin:GradHealthLoader", (
        f"{found}: reinstall the package (`pip install -e .`) to refresh its entry point")
    assert found["plugin"], f"{found['value']} is neither a TBPlugin nor a TBLoader subclass"


@pytest.mark.e2e
def test_plugins_listing_has_gradhealth_as_es_module(tensorboard):
    def listing():
        status, _, body = _get(tensorboard.base + "/data/plugins_listing")
        return json.loads(body) if status == 200 else None

    plugins = tensorboard.wait_until("/data/plugins_listing", listing)
    assert "gradhealth" in plugins, sorted(plugins)
    entry = plugins["gradhealth"]
    assert entry["tab_name"] == "Gradient Health"
    # An ES-module plugin (frontend_metadata(es_module_path="/index.js")) is listed by TensorBoard as an IFRAME
    # loader whose module_path is the plugin's route + the es_module_path.
    assert entry["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/gradhealth/index.js"}
    # ``enabled`` is is_active(): true because the logdir holds gradhealth data (once TensorBoard has loaded it).
    tensorboard.wait_until(
        "gradhealth to be enabled",
        lambda: json.loads(_get(tensorboard.base + "/data/plugins_listing")[2])["gradhealth"]["enabled"],
    )


@pytest.mark.e2e
def test_es_module_is_served_as_javascript(tensorboard):
    tensorboard.wait_until("the server", lambda: _get(tensorboard.base + "/data/plugins_listing")[0] == 200)
    status, ctype, body = _get(tensorboard.base + "/data/plugin/gradhealth/index.js")
    assert status == 200, body[:300]
    assert "javascript" in ctype, ctype
    text = body.decode("utf-8")
    assert "export" in text and "render" in text, text[:300]
    # The installed package serves this checkout's frontend (static files shipped by setup.py, or the checkout's
    # frontend/ for an editable install), not a stale or missing copy.
    assert body == (Path(__file__).resolve().parent.parent / "frontend" / "index.js").read_bytes()
    # Relative imports of the module resolve against the same route (the browser loads them from there).
    for spec in ("./model.js",):
        if spec in text:
            sub = _get(tensorboard.base + "/data/plugin/gradhealth/" + spec[2:])
            assert sub[0] == 200 and "javascript" in sub[1], (spec, sub[:2])


@pytest.mark.e2e
def test_data_routes_answer_json_for_every_run(tensorboard, demo_logdir):
    _, facts = demo_logdir

    def runs_loaded():
        data = tensorboard.get_json("/data/plugin/gradhealth/runs")
        names = {r["run"] for r in data["runs"]}
        return data if names >= set(facts) else None

    data = tensorboard.wait_until("every run to be loaded", runs_loaded)
    by_run = {r["run"]: r for r in data["runs"]}
    for name, fact in facts.items():
        run = by_run[name]
        assert run["layers"] == fact.layers, name
        # --samples_per_plugin=gradhealth=0 keeps every logged step through TensorBoard's own loader.
        assert run["num_steps"] == len(fact.steps), (name, run)
        assert run["last_step"] == fact.steps[-1]

    health = tensorboard.get_json("/data/plugin/gradhealth/health?run=exploding")
    assert health["run"] == "exploding"
    assert {layer["layer"] for layer in health["layers"]} == set(facts["exploding"].layers)
    assert health["layers"][0]["status"] == "nonfinite", health["layers"][0]

    vanishing = tensorboard.get_json("/data/plugin/gradhealth/health?run=vanishing")
    flagged = {layer["layer"] for layer in vanishing["layers"] if layer["status"] == "vanishing"}
    assert flagged == set(facts["vanishing"].vanishing), vanishing["summary"]

    status, ctype, body = _get(tensorboard.base + "/data/plugin/gradhealth/health?run=no-such-run")
    assert status == 404 and "json" in ctype and b"error" in body
