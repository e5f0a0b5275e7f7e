"""Layers point one way: which modules may import TensorFlow, PyTorch or JAX, read from the source itself.

Every module's imports (at any depth of its code, since a lazy import is still a dependency when it runs) are
parsed; an intra-package import follows that module's own. The diagnosis, the readers, the plugin, the CLI and
the TF-free writer must reach none of the frameworks, however indirectly; each framework is imported only by the
modules that exist for it. Nothing here is a hand-kept list of modules: a new module is classified by what it
imports, and the test says which rule it breaks.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
PACKAGE = Path(__file__).resolve().parent.parent / "tb_gradhealth"
FRAMEWORKS = {"tensorflow": "tensorflow", "keras": "keras", "torch": "torch", "jax": "jax", "optax": "jax",
              "flax": "jax", "lightning": "torch", "pytorch_lightning": "torch", "transformers": "torch"}
#: The side that must run without any framework: the plugin and CLI, their readers and the diagnosis, the record
#: and the TF-free writer.
FRAMEWORK_FREE = ("plugin", "cli", "_payloads", "reader", "health", "record", "metadata", "writer", "_eventfile",
                  "_storage", "testing", "_failsafe", "_filereader", "_tiers", "numbers", "live")

#: The writers' shared core and the statistics written once for PyTorch and JAX: numpy only.
FRAMEWORK_FREE += ("_core", "_devicestats")


def _modules() -> dict[str, Path]:
    """``{dotted name below the package: file}`` of every module of the package."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[0] != "static":
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """``(package modules, external top-level packages)`` that a module imports anywhere in its code."""
    package_mods, external = set(), set()
    is_package = path.name == "__init__.py"
    base = name.split(".") if is_package else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                mod = ".".join([*anchor, node.module] if node.module else anchor)
                targets = ["tb_gradhealth." + ".".join(p for p in (mod, a.name) if p) for a in node.names]
                targets.append("tb_gradhealth." + mod if mod else "tb_gradhealth")
            else:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("tb_gradhealth"):
                inner = target[len("tb_gradhealth."):] if target != "tb_gradhealth" else ""
                while inner and inner not in modules:
                    inner = inner.rpartition(".")[0]
                if inner:
                    package_mods.add(inner)
            else:
                external.add(target.split(".")[0])
    package_mods.discard(name)
    return package_mods, external


def _reach() -> dict[str, tuple[set[str], dict[str, list[str]]]]:
    """For every module: the package modules it reaches, and for each framework it reaches, one import chain."""
    modules = _modules()
    direct = {name: _imports(name, path, modules) for name, path in modules.items()}
    out = {}
    for name in modules:
        seen, chains, stack = {name}, {}, [(name, [name])]
        while stack:
            mod, chain = stack.pop()
            package_mods, external = direct[mod]
            for ext in external:
                if ext in FRAMEWORKS:
                    chains.setdefault(FRAMEWORKS[ext], chain + [ext])
            for nxt in package_mods - seen:
                seen.add(nxt)
                stack.append((nxt, chain + [nxt]))
        out[name] = (seen, chains)
    return out


def test_the_framework_free_side_reaches_no_framework():
    reach = _reach()
    broken = {name: chains for name, (_, chains) in reach.items()
              if name.split(".")[0] in FRAMEWORK_FREE and chains}
    assert not broken, "\n".join(f"{n}: " + "; ".join(" -> ".join(c) for c in ch.values()) for n, ch in broken.items())


def test_each_framework_is_imported_only_for_its_own_writers():
    """torch and jax never meet TensorFlow in one module's reach (in one process the newest torch crashes after
    TensorFlow): the torch and JAX writers reach neither TensorFlow nor each other (Keras 3 alone, which runs on
    JAX too, is allowed beside JAX)."""
    reach = _reach()
    for name, (_, chains) in reach.items():
        frameworks = set(chains) - {"keras"}
        assert len(frameworks) <= 1, f"{name} reaches {sorted(chains)}: " + "; ".join(map(" -> ".join,
                                                                                            chains.values()))


def test_the_classification_is_not_empty():
    """The parse finds what is known to be there (so the two tests above cannot pass on an empty reading)."""
    reach = _reach()
    assert "tensorflow" in reach["summary"][1] and "tensorflow" in reach["keras"][1]
    assert "torch" in reach["torch"][1] and "jax" in reach["jax"][1]
    assert {"record", "health"} <= reach["_payloads"][0]


def test_import_tb_gradhealth_exposes_every_module():
    """Every public module is an attribute of the package (loaded on first use); this test loads those that need no
    framework, so it imports none."""
    import tb_gradhealth

    reach = _reach()
    for name, (_, chains) in reach.items():
        top = name.split(".")[0]
        if top and not top.startswith("_") and not chains:
            assert getattr(tb_gradhealth, top).__name__ == f"tb_gradhealth.{top}"
    assert set(tb_gradhealth.__all__) >= {"summary", "keras", "torch", "jax", "writer", "health", "reader",
                                          "testing", "plugin", "record", "metadata", "progress", "layerinfo"}
    missing = [m for m in tb_gradhealth.__all__ if m not in reach and m not in ("Writer", "Thresholds", "__version__")]
    assert not missing, f"__all__ names modules that do not exist: {missing}"
    with pytest.raises(AttributeError):
        importlib.import_module("tb_gradhealth").no_such_module  # noqa: B018


def test_private_modules_are_imported_not_exposed():
    """A module named ``_x`` is the package's own: ``__all__`` does not name it and the lazy attribute does not load
    it; the modules that use it import it (``from tb_gradhealth import _storage``)."""
    import tb_gradhealth

    private = sorted({name.split(".")[0] for name in _reach() if name.startswith("_")})
    assert {"_eventfile", "_storage", "_payloads", "_filereader", "_failsafe", "_tiers", "_devicestats", "_tf"} \
        <= set(private)
    assert not [m for m in tb_gradhealth.__all__ if m.startswith("_") and m != "__version__"]
    for name in private:
        if name not in vars(tb_gradhealth):  # not imported yet in this process
            with pytest.raises(AttributeError):
                getattr(tb_gradhealth, name)
    assert importlib.import_module("tb_gradhealth._storage").__name__ == "tb_gradhealth._storage"


#: The modules users import to record or to read: the package's own modules build on the layers below them and
#: never import these (an import from one points back up, and drags in all that the entry point loads).
ENTRY_POINTS = ("summary", "keras", "torch", "jax", "tpu", "distribute", "accumulate", "lightning", "transformers",
                "plugin", "cli")


def test_private_modules_import_no_entry_point():
    """A private module (``_x.py``, ``_tf/...``) takes each name from the module that defines it, never through a
    public entry point that re-exports it."""
    modules = _modules()
    private = [name for name in modules if name.split(".")[0].startswith("_")]
    assert "_tf.capture" in private and "_devicestats" in private
    broken = {name: sorted(_imports(name, modules[name], modules)[0] & set(ENTRY_POINTS)) for name in private}
    broken = {name: mods for name, mods in broken.items() if mods}
    assert not broken, "\n".join(f"{n} imports {', '.join(m)}" for n, m in broken.items())


def test_the_entry_point_check_sees_an_import_up(tmp_path):
    """The check above reads a private module's ``from tb_gradhealth import summary`` (at any depth) as an import of
    the entry point, so that it cannot pass on a parse that misses them."""
    path = tmp_path / "_probe.py"
    path.write_text("def f():\n    from tb_gradhealth import summary, record\n    from . import keras\n")
    modules = {**_modules(), "_probe": path}
    assert {"summary", "keras", "record"} <= _imports("_probe", path, modules)[0]


HEALTH = "tb_gradhealth.health"


def _health_aliases(tree: ast.AST) -> set[str]:
    """The dotted names a file binds to the diagnosis package or one of its modules (``health``, ``rules``,
    ``lv`` for ``from tb_gradhealth.health import levels as lv``, ``tb_gradhealth.health.rules``)."""
    bound = {HEALTH}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == HEALTH or a.name.startswith(HEALTH + "."):
                    bound.add(a.asname or a.name)
        elif isinstance(node, ast.ImportFrom) and node.module in ("tb_gradhealth", HEALTH):
            for a in node.names:
                if node.module == HEALTH or a.name == "health":
                    bound.add(a.asname or a.name)
    return bound | {f"{b}.{m}" for b in set(bound) for m in _health_module_names()}


def _health_module_names() -> list[str]:
    return [p.stem for p in (PACKAGE / "health").glob("*.py") if p.stem != "__init__"]


def _private_health_uses(path: Path) -> list[str]:
    """Where a file takes an underscore name of a diagnosis module: ``from tb_gradhealth.health.x import _y`` or
    ``x._y`` on a name bound to the package or one of its modules (a module's own names are its own business)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound = _health_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(HEALTH):
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name.startswith("_")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and ast.unparse(node.value) in bound):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_takes_a_private_name_of_a_diagnosis_module():
    """The diagnosis modules share only public names: what one of them (or the plugin, a test, a benchmark) uses
    of another has no leading underscore, and the package exports no underscore name."""
    from tb_gradhealth import health

    root = PACKAGE.parent
    files = [p for d in ("tb_gradhealth", "tests", "benchmarks") for p in sorted((root / d).rglob("*.py"))]
    assert len(files) > 50
    found = [use for p in files for use in _private_health_uses(p)]
    assert not found, "\n".join(found)
    assert not [name for name in health.__all__ if name.startswith("_")]


def test_the_private_name_check_sees_imports_and_attributes(tmp_path):
    """The check above reads both forms (an import at any depth, an attribute on an alias) so it cannot pass on a
    parse that misses them."""
    path = tmp_path / "probe.py"
    path.write_text("from tb_gradhealth import health\nfrom tb_gradhealth.health import rules as r\n"
                    "def f():\n    from tb_gradhealth.health.levels import _log10, layer_groups\n"
                    "    return health._history, r._evaluate, health.levels._live, health.diagnose_run\n")
    uses = _private_health_uses(path)
    assert len(uses) == 4 and all(u.startswith("probe.py:") for u in uses), uses
