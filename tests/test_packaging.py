"""What ``pip install .`` and a built wheel give a user: the package, the dashboard's static files inside it as
``tb_gradhealth/static/**`` (no node, no build step), the TensorBoard entry point, the console script, and
TensorFlow only as an extra.

CI installs the checkout in editable mode, where the plugin serves ``frontend/`` straight from the checkout; this
test covers the other path by building a real wheel from a copy of the checkout and importing the plugin from it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHIPPED = {".js", ".mjs", ".css", ".html", ".svg", ".png", ".json"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("tb_gradhealth", "frontend"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "static"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-q", "-w", str(out)],
        cwd=src, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    wheels = list(out.glob("tb_gradhealth-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.e2e
@pytest.mark.slow
def test_wheel_ships_every_frontend_file_as_package_data(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    frontend = [p for p in (REPO / "frontend").rglob("*") if p.is_file() and p.suffix in SHIPPED]
    assert any(p.name == "index.js" for p in frontend)
    expected = {"tb_gradhealth/static/" + p.relative_to(REPO / "frontend").as_posix() for p in frontend}
    assert expected <= names, sorted(expected - names)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "tb_gradhealth").rglob("*.py")}
    assert modules <= names, sorted(modules - names)  # subpackages (the diagnosis) included


@pytest.mark.e2e
@pytest.mark.slow
def test_wheel_metadata_entry_points_and_requirements(wheel):
    zf = zipfile.ZipFile(wheel)
    info = next(n.split("/")[0] for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert "[tensorboard_plugins]" in entry_points
    assert "gradhealth = tb_gradhealth.plugin:" in entry_points
    assert "tb-gradhealth = tb_gradhealth.cli:main" in entry_points
    meta = zf.read(f"{info}/METADATA").decode()
    requires = [ln.split(":", 1)[1].strip() for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    plain = [r for r in requires if "extra ==" not in r]
    assert {r.split(">")[0].split("=")[0].split("<")[0].strip().lower() for r in plain} == {
        "tensorboard", "numpy", "werkzeug", "google-crc32c"}
    assert "gradhealth = tb_gradhealth.plugin:GradHealthLoader" in entry_points  # only a loader gets fix_flags
    for extra, backend in (("gcs", "gcsfs"), ("s3", "s3fs"), ("torch", "torch"), ("jax", "jax")):  # optional backends
        assert any(r.startswith(backend) and f'extra == "{extra}"' in r for r in requires), requires
    assert any(r.startswith("tensorflow") and 'extra == "tf"' in r for r in requires), requires
    import tb_gradhealth

    assert f"Version: {tb_gradhealth.__version__}" in meta


@pytest.mark.e2e
@pytest.mark.slow
def test_installed_wheel_serves_static_files_from_the_package(wheel, tmp_path):
    target = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    code = "import tb_gradhealth.plugin as p; print(p.__file__); print(p._static_dir())"
    env = dict(os.environ, PYTHONPATH=str(target), TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    module_file, static = out.stdout.strip().splitlines()[-2:]
    assert Path(module_file).is_relative_to(target), module_file
    assert Path(static) == target / "tb_gradhealth" / "static"
    assert (Path(static) / "index.js").read_bytes() == (REPO / "frontend" / "index.js").read_bytes()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GRADHEALTH_WHEEL_CHECK") == "background",
                    reason=".ci/run runs .ci/wheel_check.py itself, in the background beside the tests")
def test_built_wheel_in_a_clean_venv_serves_the_tab():
    """.ci/wheel_check.py: ``python -m build`` makes the sdist and the wheel; the wheel, installed in a clean
    environment with only its own requirements (no TensorFlow), serves the tab's files and data routes from its
    TensorBoard, and its ``tb-gradhealth`` reads a run. The script is the check; this runs it where CI does not."""
    pytest.importorskip("build", reason="python -m build needs the build package (the test extra)")
    proc = subprocess.run([sys.executable, str(REPO / ".ci" / "wheel_check.py")], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[wheel-check] OK" in proc.stdout
