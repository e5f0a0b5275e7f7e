"""Which leaves an optax-style transformation never updates, read from its structure: the jaxpr of its ``update``,
where such a leaf's update is zero by construction.

optax freezes a subtree by giving it a zero update: ``set_to_zero()`` (alone, under ``masked``, or as a partition of
``multi_transform`` / ``partition``, as flax's recipe for frozen layers does) and ``transforms.freeze``. In the
jaxpr that is a zero constant which only shape changes, products, quotients with it on top and sums of zeros carry
to the output, whatever scaling transformations follow. No value is read, so a gradient that happens to be zero
is not frozen, and a leaf that any input (gradient, state, weights) can move is not either. Imports jax only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

#: Zero when any operand is zero (a product).
_ANY = frozenset({"mul", "dot_general"})
#: Zero when every operand is zero (a sum, a choice between them, a join).
_ALL = frozenset({"add", "add_any", "sub", "max", "min", "concatenate", "pad"})
#: Zero when the first operand is: shape and type changes, a sign, a quotient's numerator, a sum over axes.
_FIRST = frozenset({
    "broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
    "neg", "div", "reduce_sum", "slice", "dynamic_slice", "rev", "reduce_precision", "sharding_constraint",
})


def _is_zero(value: Any) -> bool:
    """Whether a constant is all zeros (a number array; anything else is not)."""
    try:
        a = np.asarray(value)
    except Exception:  # noqa: BLE001 - a constant numpy cannot read is not a known zero
        return False
    return a.dtype.kind in "biufc" and not np.any(a)


def _called(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """``(jaxpr, consts)`` of a call-like equation (``jit``, ``closed_call``, ``remat``, custom derivatives): a
    sub-jaxpr in its parameters taking its operands and giving its outputs."""
    for value in eqn.params.values():
        jaxpr, consts = (value.jaxpr, value.consts) if isinstance(value, jcore.ClosedJaxpr) else (value, ())
        if (isinstance(jaxpr, jcore.Jaxpr) and len(jaxpr.invars) == len(eqn.invars)
                and len(jaxpr.outvars) == len(eqn.outvars) and len(jaxpr.constvars) == len(consts)):
            return jaxpr, consts
    return None


def _eqn_zero(eqn: Any, zero_in: list[bool]) -> list[bool]:
    n = len(eqn.outvars)
    name = eqn.primitive.name
    if name == "cond":  # zero where every branch gives zero
        outs = [zero_outputs(b.jaxpr, b.consts, zero_in[1:]) for b in eqn.params["branches"]]
        return [all(o[k] for o in outs) for k in range(n)]
    called = _called(eqn)
    if called is not None:
        return zero_outputs(called[0], called[1], zero_in)
    if name == "select_n":
        return [all(zero_in[1:])] * n
    if name in _ANY:
        return [any(zero_in)] * n
    if name in _ALL:
        return [all(zero_in)] * n
    if name in _FIRST:
        return [bool(zero_in) and zero_in[0]] * n
    return [False] * n


def zero_outputs(jaxpr: Any, consts: Sequence[Any], zero_in: Sequence[bool]) -> list[bool]:
    """Whether each output of ``jaxpr`` is zero by construction, given which inputs are."""
    zero: dict[Any, bool] = {v: _is_zero(c) for v, c in zip(jaxpr.constvars, consts, strict=True)}
    zero.update(zip(jaxpr.invars, zero_in, strict=True))

    def known(a: Any) -> bool:
        return _is_zero(a.val) if isinstance(a, jcore.Literal) else zero.get(a, False)

    for eqn in jaxpr.eqns:
        zero.update(zip(eqn.outvars, _eqn_zero(eqn, [known(a) for a in eqn.invars]), strict=True))
    return [known(a) for a in jaxpr.outvars]


def never_updated(update: Callable[..., Any], grads: Any, state: Any, params: Any, extra: dict[str, Any]) -> Any:
    """A pytree of bools shaped like ``update``'s updates: True where the update is zero by construction. ``None``
    when ``update`` cannot be traced on its own with these arguments (nothing is known then)."""
    try:
        closed, shapes = jax.make_jaxpr(lambda g, s, p, e: update(g, s, p, **e)[0], return_shape=True)(
            grads, state, params, extra)
    except Exception:  # noqa: BLE001 - a transformation we cannot trace alone freezes nothing
        return None
    flags = zero_outputs(closed.jaxpr, closed.consts, [False] * len(closed.jaxpr.invars))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), flags)
