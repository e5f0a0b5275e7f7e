"""Shared test set-up: quiet TensorFlow logs and keep TF on the CPU; every test must carry a tier marker
(pytest.ini). With ``-m``, a test module none of whose tests the expression selects is not even imported (its
markers are read from its source), so ``pytest -m unit`` never imports TensorFlow, PyTorch or JAX."""

import ast
import importlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

#: A test belongs to at least one of these tiers (``slow`` only adds to one of them).
TIERS = ("unit", "tf", "e2e", "browser", "torch", "jax")


@pytest.fixture(scope="session")
def tensorflow():
    """The ``tensorflow`` module; the test is skipped where TensorFlow is not installed."""
    return pytest.importorskip("tensorflow")


@pytest.fixture(autouse=True, scope="module")
def _tensorflow_imports(request: pytest.FixtureRequest) -> None:
    """A test module that declares ``TF_IMPORTS = {name: "module[:attribute]"}`` gets ``tf`` and those names bound
    in its globals when its first test runs (so collecting it imports no TensorFlow; without TensorFlow it skips)."""
    imports = getattr(request.module, "TF_IMPORTS", None)
    if imports is None:
        return
    names = vars(request.module)
    names["tf"] = request.getfixturevalue("tensorflow")
    for name, target in imports.items():
        module, _, attribute = target.partition(":")
        loaded = importlib.import_module(module)
        names[name] = getattr(loaded, attribute) if attribute else loaded


@pytest.fixture
def tmpfs(tmp_path: Path):
    """A 1 MiB tmpfs mounted for the test (root only; skipped with the reason otherwise): a disk that can be
    filled, freed and remounted read-only (:class:`tests.write_faults.Tmpfs`)."""
    from tests.write_faults import Tmpfs

    fs = Tmpfs(tmp_path, 1 << 20)
    try:
        yield fs
    finally:
        fs.unmount()


def pytest_configure(config: pytest.Config) -> None:
    """Where torch tests may run beside TensorFlow ones, torch's compiler stack is imported first: the newest torch
    crashes when ``torch._dynamo`` is imported after TensorFlow, not before (a PyTorch user's process has no
    TensorFlow; this keeps the suite's mixed process alive). Not for ``-m unit`` and the like, which import
    neither."""
    expr = config.option.markexpr or ""
    if _unit_only(expr):  # -m unit: TensorBoard's readers use their TensorFlow-free stub
        _tensorboard_without_tensorflow()
    if expr and "torch" not in expr:
        return
    try:
        importlib.import_module("torch._dynamo")
    except ImportError:
        pass


def _unit_only(expr: str) -> bool:
    """Whether the ``-m`` expression selects unit tests only (``unit``, ``unit and not slow``, ...)."""
    words = set(re.findall(r"\w+", expr))
    return "unit" in words and words <= {"unit", "slow", "and", "or", "not"} and not re.search(r"not\s+unit", expr)


def _tensorboard_without_tensorflow() -> None:
    """Make TensorBoard's lazy ``tf`` its own TensorFlow-free stub in this process (what it uses where TensorFlow
    is not installed): its event-file loaders and data provider would otherwise import TensorFlow whenever it is
    installed, 10-40 s of a ``-m unit`` run, for tests that are about our files, not TensorFlow's reader."""
    import sys
    import types

    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))


def pytest_collection_modifyitems(config, items):
    untiered = [item.nodeid for item in items if not any(item.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"{len(untiered)} test(s) without a tier marker ({', '.join(TIERS)}; see pytest.ini), e.g. "
            + ", ".join(untiered[:5])
        )


def _mark_names(node: ast.AST) -> set[str]:
    """Names ``X`` of every ``pytest.mark.X`` inside an expression (a decorator, a ``pytestmark`` value)."""
    return {
        n.attr for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
        and isinstance(n.value.value, ast.Name) and n.value.value.id == "pytest"
    }


def _marker_sets(tree: ast.Module) -> list[set[str]]:
    """The marker names of each test function of a module: its decorators, its classes' and the module's marks."""
    module: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module |= _mark_names(node.value)
    sets = []

    def visit(body: list[ast.stmt], inherited: set[str]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, inherited | set().union(*map(_mark_names, node.decorator_list)))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                sets.append(inherited | set().union(*map(_mark_names, node.decorator_list)))

    visit(tree.body, module)
    return sets


class _Present(Mapping):
    """Marker names as booleans for ``eval`` of a ``-m`` expression: present or not."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def __getitem__(self, key: str) -> bool:
        return key in self.names

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    expr = config.getoption("markexpr")
    if not expr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        sets = _marker_sets(ast.parse(collection_path.read_text(encoding="utf-8")))
        selected = [eval(expr, {"__builtins__": {}}, _Present(s)) for s in sets]  # noqa: S307 - marker names only
    except Exception:  # an expression this reading does not understand: collect as usual
        return None
    return True if sets and not any(selected) else None
