"""The README stays true: every ``python`` block runs as written (each in its own process, in an empty directory)
and leaves gradient-health records that the reader can read back; the set-up commands are the ones the repository
actually has; every linked file exists. A TensorFlow block runs in a child forked from an interpreter that has
imported TensorFlow and Keras and run nothing (tests/forked_blocks.py); a PyTorch or JAX block in a fresh one, as
PyTorch must not be imported after TensorFlow.

A block preceded by ``<!-- readme-test: skip (reason) -->`` is not run (the TPUEstimator fragment: that API is
gone from TensorFlow 2.21); ``<!-- readme-test: needs torch -->`` (or ``needs jax``) runs only where that framework
is installed. The examples the README leaves to docs/*.md run the same way there: in those files a block runs when
it is preceded by ``<!-- readme-test: runs -->`` or a ``needs`` marker (the other blocks there are fragments).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from tb_gradhealth import reader

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<marker>[^>]*?) -->\n)?```python\n(?P<code>.*?)```", re.S)


DOCS = {f"docs/{p.name}": p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md"))}


def _blocks_of(name: str, text: str, every_block: bool) -> list:
    """The python blocks of ``text`` to run (all of them, or only the marked ones), as test parameters."""
    params = []
    for i, m in enumerate(BLOCK.finditer(text)):
        code, marker = m.group("code"), (m.group("marker") or "")
        if not every_block and not (marker.startswith("runs") or marker.startswith("needs")):
            continue
        line = text[: m.start("code")].count("\n") + 1
        marks = []
        if marker.startswith("skip"):
            marks.append(pytest.mark.skip(reason=f"{name} marks it {marker!r}"))
        fresh = False
        for module in ("torch", "jax"):
            if f"needs {module}" in marker:
                fresh = True
                if importlib.util.find_spec(module) is None:
                    marks.append(pytest.mark.skip(reason=f"{module} is not installed (optional)"))
        prefix = "" if name == "README.md" else f"{Path(name).stem}-"
        params.append(pytest.param(code, fresh, id=f"{prefix}block{i}-line{line}", marks=marks))
    return params


def _blocks() -> list:
    """Every python block of the README, then the marked ones of docs/*.md."""
    params = _blocks_of("README.md", README, every_block=True)
    for name, text in DOCS.items():
        params += _blocks_of(name, text, every_block=False)
    return params


ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
BLOCK_TIMEOUT_S = 600


class ForkedBlocks:
    """tests/forked_blocks.py as a server: :meth:`run` runs one block in a child forked from it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "forked_blocks.py")], env=ENV,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert json.loads(self._answer()) == {"ready": True}

    def _answer(self) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], BLOCK_TIMEOUT_S)
        assert ready, f"no answer from the forked-block runner in {BLOCK_TIMEOUT_S} s"
        line = self.proc.stdout.readline()
        assert line, f"the forked-block runner ended with {self.proc.wait()}"
        return line

    def run(self, code: str, cwd: Path) -> tuple[int, str]:
        out, err = cwd.parent / f"{cwd.name}.stdout", cwd.parent / f"{cwd.name}.stderr"
        self.proc.stdin.write(json.dumps({"code": code, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)})
                              + "\n")
        self.proc.stdin.flush()
        return json.loads(self._answer())["rc"], err.read_text(errors="replace")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def forked_blocks():
    runner = ForkedBlocks()
    yield runner
    runner.close()


@pytest.mark.unit
def test_readme_has_examples():
    assert len(_blocks_of("README.md", README, every_block=True)) >= 5
    assert len(_blocks()) >= 12, "the examples moved from the README to docs/*.md are not marked to run"


@pytest.mark.e2e
@pytest.mark.parametrize(("code", "fresh"), _blocks())
def test_python_block_runs_and_writes_records(code, fresh, tmp_path, request):
    work = tmp_path / "block"
    work.mkdir()
    if fresh:
        proc = subprocess.run([sys.executable, "-c", code], cwd=work, env=ENV, capture_output=True, text=True,
                              timeout=BLOCK_TIMEOUT_S)
        rc, stderr = proc.returncode, proc.stderr
    else:
        rc, stderr = request.getfixturevalue("forked_blocks").run(code, work)
    assert rc == 0, f"README block failed:\n{code}\n--- stderr ---\n{stderr[-4000:]}"
    data = reader.read_logdir(str(work / "logs"))
    assert data.runs, f"the block wrote no gradient-health run under logs/: {data.problems}"
    for run in data.runs:
        assert run.num_steps > 0 and run.layers, run.summary()
        assert not run.problems, run.problems


@pytest.mark.e2e
def test_forked_blocks_fail_as_an_interpreter_would(forked_blocks, tmp_path):
    """The runner cannot pass a failing block: an exception is exit status 1 with its traceback, ``sys.exit(n)`` is
    ``n``, ``atexit`` handlers run (writers that flush at exit), and nothing a block sets reaches the next one."""
    cases = {
        "raises": ("import os\nos.environ['GH_LEAK'] = '1'\nraise ValueError('boom')", 1, "ValueError: boom"),
        "exits": ("import sys\nsys.exit(3)", 3, ""),
        "atexit": ("import atexit, pathlib\natexit.register(pathlib.Path('flushed').write_text, 'yes')", 0, ""),
        "fresh": ("import os\nassert 'GH_LEAK' not in os.environ and os.getcwd().endswith('fresh')", 0, ""),
    }
    for name, (code, status, message) in cases.items():
        work = tmp_path / name
        work.mkdir()
        rc, stderr = forked_blocks.run(code, work)
        assert rc == status and message in stderr, (name, rc, stderr)
    assert (tmp_path / "atexit" / "flushed").read_text() == "yes"


@pytest.mark.unit
def test_setup_is_two_commands_that_exist():
    setup = README.split("## Set-up: two commands", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", setup, re.S).group(1)
    commands = [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands == [
        'python3 -m venv .venv && . .venv/bin/activate && pip install ".[tf-cpu]" && '

        "python demo/demo.py --logdir /tmp/gradhealth-demo --serve",
        "bash .ci/run",
    ]
    assert (REPO / "demo" / "demo.py").is_file() and (REPO / ".ci" / "run").is_file()
    ci = (REPO / ".ci" / "run").read_text()
    # The README says what .ci/run does; keep the two in step.
    for step in ('pip install -q -e ".[test,tf-cpu]"', "ruff check .", "python -m pytest", "apt-get install",
                 'pytest -m "tf and not (e2e and slow)"'):
        assert step in ci, step
    assert "playwright install" not in re.sub(r"#.*", "", ci)


@pytest.mark.unit
def test_linked_files_exist():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert not missing, missing


@pytest.mark.unit
def test_threshold_defaults_quoted_in_readme_are_the_code_defaults():
    from tb_gradhealth import Thresholds

    section = README.split("## Thresholds", 1)[1].split("\n## ", 1)[0]
    quoted = dict(re.findall(r"`(\w+)` = ([0-9.e+-]+)", section))
    assert len(quoted) >= 6, quoted
    defaults = Thresholds().to_dict()
    for name, value in quoted.items():
        assert name in defaults, name
        assert float(value) == defaults[name], (name, value, defaults[name])


@pytest.mark.unit
def test_cli_flags_in_readme_exist(capsys):
    from tb_gradhealth import cli

    assert cli.main(["report", "--help"]) == 0
    help_text = capsys.readouterr().out
    flags = {f for line in re.findall(r"tb-gradhealth report [^`\n]*", README) for f in re.findall(r"--[a-z-]+", line)}
    flags |= set(re.findall(r"`(--(?:run|step|top|json|fail-on)\b)", README))
    assert {"--run", "--top", "--json", "--fail-on", "--step", "--vanish-decades"} <= flags, flags
    for flag in flags:
        assert flag in help_text, flag
