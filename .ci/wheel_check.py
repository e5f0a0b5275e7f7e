"""What a user's ``pip install tb-gradhealth`` gets, checked end to end: build the sdist and the wheel
(``python -m build``), install the wheel in a clean virtual environment with only its own requirements (tensorboard,
numpy, werkzeug, google-crc32c: no TensorFlow), write a run with the numpy ``Writer`` there, start that
environment's ``tensorboard`` and check that the Gradient Health tab is listed, that its static files are served
from the installed package (byte for byte the checkout's ``frontend/``) and that its data route lists the run; and
that the installed ``tb-gradhealth report`` reads the run.

    python .ci/wheel_check.py [--keep]   # exit 0 when every check passes; --keep leaves the temporary folder

``.ci/run`` runs it in the background beside the test suite (it costs about a minute, mostly pip); the e2e test
``tests/test_packaging.py::test_built_wheel_in_a_clean_venv_serves_the_tab`` runs it where ``.ci/run`` does not.
Needs ``build`` (the ``test`` extra) and the package index (pip installs the wheel's requirements).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: What the distribution is built from: the files setup.py reads (a copy, so the checkout gets no build output).
SOURCES = ("setup.py", "README.md", "tb_gradhealth", "frontend")
#: How long TensorBoard may take to answer after it started (it imports its plugins first).
SERVE_TIMEOUT_S = 120


def step(msg: str) -> None:
    print(f"[wheel-check] {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``cmd``; its output is shown and a non-zero exit ends the check."""
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise SystemExit(f"[wheel-check] FAILED: {' '.join(cmd)} exited with {proc.returncode}\n"
                         f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    return proc


def build(work: Path) -> tuple[Path, Path]:
    """``(wheel, sdist)`` built by ``python -m build`` from a copy of the checkout's sources (the wheel is built
    from the sdist, so a file missing from the sdist is missing from the wheel too)."""
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "static", "node_modules"))
        else:
            shutil.copy2(path, src / name)
    dist = work / "dist"
    step(f"python -m build {src} (sdist, then the wheel from it)")
    run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], timeout=900)
    wheels, sdists = list(dist.glob("tb_gradhealth-*.whl")), list(dist.glob("tb_gradhealth-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        raise SystemExit(f"[wheel-check] FAILED: expected one wheel and one sdist in {dist}, got "
                         f"{sorted(p.name for p in dist.iterdir())}")
    return wheels[0], sdists[0]


def clean_venv(work: Path, wheel: Path) -> Path:
    """A new virtual environment with the wheel and its requirements only; its ``bin`` folder."""
    env = work / "venv"
    step(f"clean virtual environment {env}: pip install {wheel.name}")
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    py = env / "bin" / "python"
    run([str(py), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check", str(wheel)],
        timeout=900)
    missing = run([str(py), "-c", "import importlib.util as u; print(u.find_spec('tensorflow') is None)"])
    if missing.stdout.strip() != "True":
        raise SystemExit("[wheel-check] FAILED: TensorFlow is installed in the clean environment: the wheel's "
                         "requirements pulled it in")
    # The C source of the CPU statistics ships in the wheel and builds from there (into a cache of this check's own).
    code = ("from tb_gradhealth import _cpustats as c\n"
            "print(c._SOURCE.exists() and (c._compiler() is None or c.library() is not None))")
    built = run([str(py), "-c", code], cwd=work, env={**os.environ, "XDG_CACHE_HOME": str(work / "cache")})
    if built.stdout.strip() != "True":
        raise SystemExit("[wheel-check] FAILED: the installed package could not build its CPU statistics "
                         f"(tb_gradhealth/_cpustats.c missing from the wheel?):\n{built.stdout}{built.stderr}")
    return env / "bin"


def write_run(bin_dir: Path, logdir: Path) -> None:
    """A short run written with the installed package's numpy ``Writer`` (no TensorFlow)."""
    code = ("import sys, numpy as np\nfrom tb_gradhealth import Writer\n"
            "rng = np.random.default_rng(0)\n"
            "with Writer(sys.argv[1]) as w:\n"
            "    for s in range(8):\n"
            "        w.add_gradients(s, {'dense/kernel': rng.normal(size=(8, 4)) * 1e-3})\n"
            "        w.add_loss(s, 1.0 / (s + 1))\n")
    run([str(bin_dir / "python"), "-c", code, str(logdir / "wheel_run")], cwd=logdir.parent)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_for(url: str, proc: subprocess.Popen, log: Path) -> bytes:
    """The body of ``url`` once it answers 200 (TensorBoard may take a while to start)."""
    deadline = time.monotonic() + SERVE_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"[wheel-check] FAILED: tensorboard exited with {proc.returncode}:\n"
                             f"{log.read_text()[-4000:]}")
        try:
            status, body = get(url)
            if status == 200:
                return body
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"[wheel-check] FAILED: {url} did not answer 200 within {SERVE_TIMEOUT_S} s:\n"
                     f"{log.read_text()[-4000:]}")


def check_served(bin_dir: Path, logdir: Path, work: Path) -> None:
    """Start the clean environment's ``tensorboard`` and check the tab, its static files and a data route."""
    port = free_port()
    log = work / "tensorboard.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    step(f"tensorboard --logdir {logdir} --port {port}")
    with open(log, "w") as out:
        proc = subprocess.Popen([str(bin_dir / "tensorboard"), "--logdir", str(logdir), "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work)
    try:
        base = f"http://127.0.0.1:{port}"
        listing = json.loads(wait_for(f"{base}/data/plugins_listing", proc, log))
        if "gradhealth" not in listing:
            raise SystemExit(f"[wheel-check] FAILED: the gradhealth tab is not listed: {sorted(listing)}")
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while True:  # the first answers may come before TensorBoard read the logdir
            runs = json.loads(wait_for(f"{base}/data/plugin/gradhealth/runs", proc, log))
            if [r.get("run") for r in runs.get("runs", [])] == ["wheel_run"]:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"[wheel-check] FAILED: /data/plugin/gradhealth/runs does not list the run: {runs}")
            time.sleep(1)
        for name in ("index.js",):
            served = wait_for(f"{base}/data/plugin/gradhealth/{name}", proc, log)
            if served != (REPO / "frontend" / name).read_bytes():
                raise SystemExit(f"[wheel-check] FAILED: the served {name} is not the checkout's frontend/{name}")
        status, _ = get(f"{base}/data/plugin/gradhealth/setup.py")
        if status == 200:
            raise SystemExit("[wheel-check] FAILED: the static route serves a file that is not a frontend file")
        step("tensorboard serves the tab: listed in plugins_listing, the run in its runs route, index.js from the "
             "installed package")
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace_s: int = 30) -> None:
    """End ``proc``: SIGTERM, then SIGKILL if it is still running after ``grace_s`` seconds."""
    proc.terminate()
    for _ in range(grace_s):
        if proc.poll() is not None:
            return
        time.sleep(1)
    proc.kill()
    proc.wait()


def check_cli(bin_dir: Path, logdir: Path) -> None:
    out = run([str(bin_dir / "tb-gradhealth"), "report", str(logdir)]).stdout
    if "run wheel_run:" not in out:
        raise SystemExit(f"[wheel-check] FAILED: tb-gradhealth report does not show the run:\n{out}")
    step("tb-gradhealth report reads the run")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", action="store_true", help="keep the temporary folder (its path is printed)")
    args = p.parse_args(argv)
    # CI ends it with SIGTERM when the tests fail first: the `finally`s then stop TensorBoard and remove the folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="gradhealth-wheel-check-"))
    try:
        wheel, sdist = build(work)
        step(f"built {wheel.name} ({wheel.stat().st_size // 1024} KiB) and {sdist.name}")
        bin_dir = clean_venv(work, wheel)
        logdir = work / "logs"
        logdir.mkdir()
        write_run(bin_dir, logdir)
        check_served(bin_dir, logdir, work)
        check_cli(bin_dir, logdir)
    finally:
        if args.keep:
            step(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    step(f"OK in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
