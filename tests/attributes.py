"""Which attributes a class's instances get, read from the source: those its ``__init__`` sets (with its bases'
in the same files, and a dataclass's fields) and those any other method sets.

Why: an attribute first set by a later method (a ``fit`` hook, a trace) exists only on some paths; a reader of
``__init__`` cannot see all of an object's state, and a path that skips the method finds it missing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "tb_gradhealth"


@dataclass(frozen=True)
class ClassAttributes:
    """One class's attribute names as its source sets them (``self.<name> = ...`` anywhere in a method)."""

    name: str
    bases: tuple[str, ...]
    #: Set in ``__init__`` / ``__post_init__``, or a class-level annotated field (a dataclass's).
    own_init: frozenset[str]
    #: ``{name: method}`` for every name set in another method (nested functions count as their method).
    elsewhere: dict[str, str]


def _self_targets(node: ast.AST) -> Iterable[str]:
    """The ``self.<name>`` targets assigned anywhere under ``node`` (tuple targets unpacked)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assign):
            targets = list(sub.targets)
        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
            targets = [sub.target]
        else:
            continue
        while targets:
            t = targets.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                targets.extend(t.elts)
            elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                yield t.attr


def _fields(cls: ast.ClassDef) -> set[str]:
    """Class-level annotated names that are instance fields (not ``ClassVar``)."""
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            and "ClassVar" not in ast.unparse(n.annotation)}


def classes_of(path: Path) -> dict[str, ClassAttributes]:
    """Every class defined at the top level of ``path``, by name."""
    out = {}
    for cls in ast.parse(path.read_text()).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        init, elsewhere = _fields(cls), {}
        for fn in cls.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for name in _self_targets(fn):
                    if fn.name in ("__init__", "__post_init__"):
                        init.add(name)
                    else:
                        elsewhere.setdefault(name, fn.name)
        bases = tuple(ast.unparse(b).rsplit(".", 1)[-1] for b in cls.bases)
        out[cls.name] = ClassAttributes(cls.name, bases, frozenset(init), elsewhere)
    return out


def init_names(classes: dict[str, ClassAttributes], name: str) -> frozenset[str]:
    """The names ``__init__`` gives an instance of class ``name``: its own and its bases' (those in ``classes``)."""
    cls = classes[name]
    names = set(cls.own_init)
    for base in cls.bases:
        if base in classes:
            names |= init_names(classes, base)
    return frozenset(names)


def born_outside_init(classes: dict[str, ClassAttributes]) -> dict[str, dict[str, str]]:
    """``{class: {attribute: method}}`` for each attribute first set outside ``__init__`` (none: ``{}``)."""
    out = {}
    for name, cls in classes.items():
        names = init_names(classes, name)
        born = {attr: method for attr, method in cls.elsewhere.items() if attr not in names}
        if born:
            out[name] = born
    return out
