"""Row names of gradient-health records: one rule for every writer, so a layer keeps its name whatever logs it.

A row is named by its variable's Keras 3 ``path`` (``dense/kernel``), else its TF ``name`` without the ``:0``
output suffix, else the key of a ``{name: grad}`` dict, else ``layer_<i>``; repeats get ``#1``, ``#2``, ...
Pure Python: no TensorFlow import, so the names can be checked anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["normalize", "variable_names", "layer_names"]


def is_variable(obj: Any) -> bool:
    """A TF or Keras variable (it can be assigned and has a path or a name)."""
    return obj is not None and hasattr(obj, "assign") and (hasattr(obj, "path") or hasattr(obj, "name"))


def _var_name(var: Any) -> str | None:
    """Keras 3 ``variable.path`` (e.g. ``dense/kernel``), else the TF name without the ``:0`` output suffix."""
    path = getattr(var, "path", None)
    if isinstance(path, str) and path:
        return path
    name = getattr(var, "name", None)
    if isinstance(name, str) and name:
        head, sep, tail = name.rpartition(":")
        return head if sep and tail.isdigit() else name
    return None


def _unique(names: list[str]) -> list[str]:
    """Repeats get ``#1``, ``#2``, ...: the first suffix that no other row has, given or made (variables named
    ``a``, ``a#1``, ``a`` become ``a``, ``a#1``, ``a#2``: every gradient keeps its own row)."""
    given = set(names)
    used: set[str] = set()
    last: dict[str, int] = {}
    out = []
    for n in names:
        name, k = n, last.get(n, 0)
        while name in used or (name != n and name in given):
            k += 1
            name = f"{n}#{k}"
        last[n] = k
        used.add(name)
        out.append(name)
    return out


def _is_parallel_lists(items: list[Any]) -> bool:
    """``[grads, vars]``: two lists of one length, the second holding variables (and not a list of two pairs)."""
    return (
        len(items) == 2
        and isinstance(items[0], list | tuple)
        and isinstance(items[1], list | tuple)
        and len(items[0]) == len(items[1])
        and not (len(items[0]) == 2 and is_variable(items[0][1]))
        and any(is_variable(v) for v in items[1])
    )


def _split(grads: Any) -> tuple[list[str | None], list[Any], list[Any]]:
    """``(names or None each, gradients, variables or None each)`` of any accepted form of ``grads``."""
    if isinstance(grads, Mapping):
        bad = [k for k in grads if not isinstance(k, str) or not k]
        if bad:
            raise TypeError(f"gradient names (dict keys) must be non-empty strings, got {bad[0]!r}")
        glist = list(grads.values())
        return list(grads), glist, [None] * len(glist)
    items = list(grads)
    if _is_parallel_lists(items):
        items = list(zip(items[0], items[1], strict=True))
    elif (len(items) == 2 and all(isinstance(x, list | tuple) for x in items) and len(items[0]) != len(items[1])
          and any(is_variable(v) for v in items[1]) and not any(is_variable(v) for v in items[0])):
        raise ValueError(f"(gradients, variables) lists of different lengths: {len(items[0])} gradients but "
                         f"{len(items[1])} variables")
    if items and all(isinstance(it, tuple) and len(it) == 2 and is_variable(it[1]) for it in items):
        return [None] * len(items), [g for g, _ in items], [v for _, v in items]
    for i, g in enumerate(items):
        if is_variable(g):
            raise TypeError(f"gradient {i} is a variable ({_var_name(g)!r}), not its gradient: pass (grad, var) "
                            f"pairs, a (grads, vars) pair of lists, or a {{name: grad}} dict")
        if isinstance(g, list | tuple):
            raise TypeError(f"gradient {i} is a {type(g).__name__}, not a tensor: pass (grad, var) pairs, a (grads, "
                            f"vars) pair of equal-length lists, a {{name: grad}} dict or a list of tensors")
    return [None] * len(items), items, [None] * len(items)


def normalize(grads: Any, weights: Any = None) -> tuple[list[str], list[Any], list[Any], list[Any]]:
    """``(names, grads, weight_values, variables)`` from ``(grad, var)`` pairs, ``{name: grad}``, or lists.

    Accepted: an iterable of ``(grad, var)`` pairs; a dict ``{name: grad}``; a pair of parallel lists
    ``(grads, vars)``; or a plain list of gradients with ``weights`` a parallel list of variables/tensors (or a dict
    keyed like ``grads``). ``weights=True`` records the pairs' variables; ``None``/``False`` records no weights.
    """
    names, glist, variables = _split(grads)
    if isinstance(weights, Mapping):
        wlist = [weights.get(n) for n in names]
    elif isinstance(weights, bool) or weights is None:
        wlist = list(variables) if weights else [None] * len(glist)
    else:
        wlist = list(weights)
        if len(wlist) != len(glist):
            raise ValueError(f"{len(glist)} gradients but {len(wlist)} weights")
        variables = [v if v is not None else w for v, w in zip(variables, wlist, strict=True)]
    return _resolve_names(names, variables), glist, wlist, variables


def _resolve_names(names: Sequence[str | None], variables: Sequence[Any]) -> list[str]:
    resolved = []
    for i, (n, v) in enumerate(zip(names, variables, strict=True)):
        resolved.append(n if n is not None else (_var_name(v) if v is not None else None) or f"layer_{i}")
    return _unique(resolved)


def variable_names(variables: Sequence[Any]) -> list[str]:
    """Row names of ``variables``, exactly as ``summary.compute`` names ``(grad, var)`` pairs of them."""
    return _resolve_names([None] * len(variables), list(variables))


def layer_names(grads: Any, weights: Any = None) -> list[str]:
    """The row names ``summary.compute`` gives the same arguments: variable paths (Keras 3) or names, or dict keys."""
    return normalize(grads, weights)[0]
