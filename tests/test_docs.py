"""Numbers the docs state that can drift from the code: defaults and the supported TensorFlow/Keras range.

Read from the sources as text (``ast``), so this runs without TensorFlow.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tb_gradhealth import record
from tb_gradhealth._tf import compat

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent


def _defaults(path: Path, cls: str, method: str = "__init__") -> dict[str, object]:
    """Literal default values of ``cls.method``'s parameters in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method)
    args = fn.args.args[len(fn.args.args) - len(fn.args.defaults):] + fn.args.kwonlyargs
    defaults = list(fn.args.defaults) + list(fn.args.kw_defaults)
    return {a.arg: ast.literal_eval(d) for a, d in zip(args, defaults, strict=True)
            if d is not None and isinstance(d, ast.Constant)}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("."))


def test_keras_update_freq_default_is_the_one_documented():
    default = _defaults(REPO / "tb_gradhealth" / "keras.py", "GradientHealthCallback")["update_freq"]
    table = (REPO / "docs" / "KERAS.md").read_text(encoding="utf-8")
    assert re.search(rf"\| `update_freq` \| `{default}` \|", table), f"docs/KERAS.md does not give default {default}"
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    stated = re.findall(r"`update_freq`[^.]*?\(default (\d+)\)", readme)
    assert stated, "README does not state the update_freq default"
    for value in stated:
        assert int(value) == default, f"README says update_freq defaults to {value}, the code to {default}"


def test_supported_tensorflow_and_keras_range_agrees_everywhere():
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    for package in ("tensorflow", "keras"):
        oldest, newest = compat.VERIFIED[package]
        low, high = re.search(rf'"{package}>=([\d.]+),<([\d.]+)"', setup).groups()
        assert _version(oldest)[:2] == _version(low)[:2], (package, oldest, low)
        assert _version(newest) < _version(high), (package, newest, high)
        pinned = re.search(rf"^OLDEST_{'TF' if package == 'tensorflow' else 'KERAS'}=([\d.]+)$", ci, re.M).group(1)
        assert pinned == oldest, f".ci/run tests {package} {pinned}, compat.VERIFIED says {oldest}"
    assert '-e ".[test,tf-cpu]"' in ci, ".ci/run does not install the tf-cpu extra"


def _setup_list(setup: str, name: str) -> list[str]:
    """The literal list ``name = [...]`` of setup.py."""
    tree = ast.parse(setup)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(node.value)


def test_the_cpu_extra_is_the_supported_range_of_the_cpu_build():
    """``tf-cpu`` (the README's first command, CI) pins what ``tf`` pins, with TensorFlow's CPU-only build."""
    setup = (REPO / "setup.py").read_text(encoding="utf-8")
    tf, cpu = _setup_list(setup, "TF_REQUIREMENTS"), _setup_list(setup, "TF_CPU_REQUIREMENTS")
    assert tf[0].startswith("tensorflow>=") and cpu[0] == "tensorflow-cpu" + tf[0][len("tensorflow"):], (tf, cpu)
    assert cpu[1:] == tf[1:]
    assert re.search(r'"tf": TF_REQUIREMENTS,\s*"tf-cpu": TF_CPU_REQUIREMENTS,', setup)
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    setup_block = readme.split("## Set-up: two commands", 1)[1].split("```", 2)[1]
    first = next(ln for ln in setup_block.splitlines() if ln.startswith("python3 -m venv"))
    installs = re.search(r"pip install ([^&]+)&&", first).group(1).split()
    assert installs == ['".[tf-cpu]"'], f"README command 1 installs {installs}, not the supported range's extra"


def test_device_record_size_stated_in_the_docs_is_the_layout():
    from tb_gradhealth import record

    size = (record.NUM_COUNTS + record.NUM_VALUES + record.HIST_BINS) * 4  # int32 counts, float32 values and bins
    texts = {p: p.read_text(encoding="utf-8") for p in (REPO / "README.md", REPO / "docs" / "DISTRIBUTED.md")}
    stated = {p.name: re.findall(r"(\d+) (?:bytes a layer|B per layer)", t) for p, t in texts.items()}
    assert any(stated.values()), "no device-record size stated"
    for name, values in stated.items():
        assert all(int(v) == size for v in values), (name, values, size)


@pytest.mark.unit
def test_the_bytes_a_layer_of_a_device_record_match_the_layout():
    """The device record's size per layer, where the README and docs state it (what crosses to the host, what a
    shard computes), is the record's: NUM_FIELDS float32 values. Sizes on disk and in memory are other figures."""
    texts = [(REPO / "README.md").read_text(encoding="utf-8")]
    texts += [p.read_text(encoding="utf-8") for p in sorted((REPO / "docs").glob("*.md"))]
    claims = [line for t in texts for line in t.splitlines()
              if re.search(r"\d+ bytes", line) and re.search(r"host|copies only|copy only|shard computes", line)
              and "on disk" not in line.split("bytes")[0][-40:]]
    stated = {int(n) for line in claims for n in re.findall(r"\b(\d+) bytes\b(?! (?:per layer-step|on disk))", line)}
    assert claims and stated == {record.NUM_FIELDS * 4}, (stated, claims)


def test_the_switch_of_the_compiled_cpu_statistics_is_the_one_documented():
    from tb_gradhealth import _cpustats

    for doc in ("README.md", "docs/TORCH_JAX.md"):
        named = set(re.findall(r"`(TB_GRADHEALTH_\w+)=0`", (REPO / doc).read_text(encoding="utf-8")))
        assert named == {_cpustats.ENV}, f"{doc} names {named}, the code reads {_cpustats.ENV}"
