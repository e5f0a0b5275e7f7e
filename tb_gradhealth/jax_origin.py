"""Where the first NaN/Inf was made, in a JAX training loop: the primitive, its named scope, forward or backward,
the line of user code.

A JAX step is a pure function, so the weights of a step are simply the ``params`` it was given: pass those (not the
updated ones) with the step's record and batch to :meth:`OriginFinder.check`::

    finder = OriginFinder(loss_fn, "logs/run1")   # loss_fn(params, *batch) -> scalar loss
    for i, (x, y) in enumerate(batches, 1):
        new_params, stacked = step(params, x, y)    # stacked: tb_gradhealth.jax.compute(grads, ...)
        rows = tb_gradhealth.jax.to_memory(stacked)
        if finder.check(i, rows, params, x, y) is not None:
            break                                  # finder.origin.message()
        params = new_params

At the first record that counts a NaN/Inf, the loss is traced to a jaxpr (calls to ``jit`` functions inlined) and
evaluated primitive by primitive, outside ``jit``, like ``jax_debug_nans`` but for Inf as well and in both
directions: forward, the first primitive whose output is not finite while its inputs are; backward (when the loss
is finite), the cotangent of every intermediate value from one backward pass, then from the loss down the first
primitive whose cotangent is finite but whose own vector-Jacobian product is not. The "layer" is the
``jax.named_scope`` (or Flax module) path the primitive ran in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tb_gradhealth import origin
from tb_gradhealth.origin import NanOrigin, nonfinite_samples

__all__ = ["OriginFinder", "replay", "NanOrigin"]

_log = logging.getLogger("tb_gradhealth")
#: Primitives whose body is a jaxpr to inline (``jit`` calls, custom derivatives keep their primal body).
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
          "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
          "remat": "jaxpr", "checkpoint": "jaxpr"}


@dataclass
class _Eqn:
    index: int
    prim: Any
    params: dict
    invals: list[Any]
    outvals: list[Any]
    scope: str
    frame: Any


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _nonfinite(x: Any) -> bool:
    return _is_float(x) and not bool(np.all(np.isfinite(np.asarray(x))))


def _user_frame(eqn: Any) -> tuple[str, int, str]:
    try:
        from jax._src import source_info_util

        f = source_info_util.user_frame(eqn.source_info.traceback)
    except Exception:  # noqa: BLE001 - a private helper: without it no line is named
        return "", 0, ""
    return (f.file_name, f.start_line, f.function_name) if f is not None else ("", 0, "")


def _scope(eqn: Any, outer: str) -> str:
    inner = str(getattr(eqn.source_info, "name_stack", "") or "")
    return "/".join(s for s in (outer, inner) if s)


def _literal_class() -> type:
    """The class of a jaxpr's constant operands (``jax.extend.core`` since JAX 0.4.36, ``jax.core`` before)."""
    try:
        from jax.extend.core import Literal  # noqa: PLC0415
    except ImportError:
        from jax.core import Literal  # noqa: PLC0415
    return Literal


_LITERAL = _literal_class()


def _run(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], out: list[_Eqn] | None, scope: str = "",
         eps: Sequence[Any] | None = None) -> list[Any]:
    """Evaluate ``jaxpr`` primitive by primitive, inlining calls; record each primitive in ``out`` (when given) and
    add ``eps[k]`` to the k-th primitive's float outputs (when given, for cotangents of intermediates)."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, _LITERAL) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        key = _CALLS.get(eqn.primitive.name)
        if key is not None and key in eqn.params:
            sub = eqn.params[key]
            inner, sub_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
            outvals = _run(inner, sub_consts, invals, out, _scope(eqn, scope), eps)
        else:
            result = eqn.primitive.bind(*invals, **eqn.params)
            outvals = list(result) if eqn.primitive.multiple_results else [result]
            k = len(out) if out is not None else None
            if eps is not None:
                k = eps.next()
                outvals = [o + eps.values[k] if eps.values[k] is not None else o for o in outvals]
            if out is not None:
                out.append(_Eqn(k, eqn.primitive, dict(eqn.params), invals, outvals, _scope(eqn, scope),
                                _user_frame(eqn)))
        for v, val in zip(eqn.outvars, outvals, strict=True):
            env[v] = val
    return [read(v) for v in jaxpr.outvars]


class _Eps:
    """Zero offsets added to each primitive's output, in evaluation order: their gradient is its cotangent."""

    def __init__(self, values: Sequence[Any]) -> None:
        self.values, self.k = list(values), -1

    def next(self) -> int:
        self.k += 1
        return self.k


def _result(step: int, e: _Eqn, direction: str, **kw: Any) -> NanOrigin:
    file, line, function = e.frame
    code = ""
    if file:
        import linecache

        code = linecache.getline(file, line).strip()
    return NanOrigin(step=step, found=True, framework="jax", op=e.prim.name, layer=e.scope or None,
                     direction=direction, input_shapes=tuple(tuple(getattr(x, "shape", ())) for x in e.invals),
                     output_shapes=tuple(tuple(getattr(x, "shape", ())) for x in e.outvals), file=file, line=line,
                     function=function, code=code, **kw)


def _backward(step: int, closed: Any, flat: list[Any], eqns: list[_Eqn]) -> NanOrigin | None:
    shapes = [e.outvals[0] if e.outvals and _is_float(e.outvals[0]) and not e.prim.multiple_results else None
              for e in eqns]
    zeros = [None if s is None else jnp.zeros_like(s) for s in shapes]

    def with_offsets(offsets: list[Any]) -> Any:
        eps = _Eps(offsets)
        return _run(closed.jaxpr, closed.consts, flat, None, eps=eps)[0]

    cotangents = jax.grad(with_offsets)(zeros)
    for e, ct in zip(reversed(eqns), reversed(cotangents), strict=True):
        if ct is None or _nonfinite(ct):
            continue
        floats = [i for i, x in enumerate(e.invals) if _is_float(x)]
        if not floats:
            continue

        def alone(*xs: Any, e: _Eqn = e, floats: list[int] = floats) -> Any:
            args = list(e.invals)
            for i, x in zip(floats, xs, strict=True):
                args[i] = x
            return e.prim.bind(*args, **e.params)

        try:
            _, vjp = jax.vjp(alone, *[e.invals[i] for i in floats])
            grads = vjp(ct)
        except Exception:  # noqa: BLE001 - a primitive without a derivative here (integer ops, effects)
            continue
        if any(_nonfinite(g) for g in grads):
            return _result(step, e, "backward", nonfinite="NaN/Inf in its gradient")
    return None


def replay(loss_fn: Callable[..., Any], params: Any, *batch: Any, step: int) -> NanOrigin:
    """Evaluate ``loss_fn(params, *batch)`` primitive by primitive and name the first that made a NaN/Inf. Never
    raises: a replay that fails or meets no NaN/Inf is a :class:`NanOrigin` with ``found`` False."""
    start = time.perf_counter()

    def not_found(reason: str) -> NanOrigin:
        return NanOrigin(step=step, found=False, framework="jax", reason=reason, seconds=time.perf_counter() - start)

    leaves = jax.tree_util.tree_leaves(params)
    if any(_nonfinite(p) for p in leaves):
        return not_found("the weights already hold NaN/Inf: they were made at an earlier step, whose update was "
                         "applied before it was recorded")
    named = [(f"batch[{i}]" + (f"[{j}]" if len(leaves_i) > 1 else ""), x)
             for i, leaves_i in enumerate(jax.tree_util.tree_leaves(b) for b in batch) for j, x in enumerate(leaves_i)]
    bad_inputs = [nonfinite_samples(n, x) for n, x in named if _nonfinite(x)]
    try:
        closed = jax.make_jaxpr(loss_fn)(params, *batch)
        flat = jax.tree_util.tree_leaves((params, *batch))
        eqns: list[_Eqn] = []
        loss = _run(closed.jaxpr, closed.consts, flat, eqns)[0]
        found = None
        if _nonfinite(loss) or bad_inputs:
            for e in eqns:
                if not any(_nonfinite(o) for o in e.outvals):
                    continue
                if not any(_nonfinite(i) for i in e.invals):
                    found = _result(step, e, "forward", nonfinite="NaN/Inf in its output")
                    break
                if bad_inputs:
                    found = _result(step, e, "forward", input_nonfinite=tuple(bad_inputs),
                                    nonfinite="NaN/Inf in its output, from a non-finite input")
                    break
        else:
            found = _backward(step, closed, flat, eqns)
    except Exception as e:  # noqa: BLE001 - the answer says why; training goes on
        return not_found(f"the replay failed: {type(e).__name__}: {e}")
    if found is None:
        return not_found("the replay of the step produced no NaN/Inf (a random draw differed, or a "
                         "non-deterministic kernel): not reproduced")
    return NanOrigin(**{**found.__dict__, "seconds": time.perf_counter() - start})


class OriginFinder(origin.OriginSearch):
    """Replays the first step whose record holds a NaN/Inf; the answer in :attr:`origin` (and in ``log_dir``)."""

    def __init__(self, loss_fn: Callable[..., Any], log_dir: str | None = None, *, name: str = "gradients") -> None:
        super().__init__(log_dir, name)
        self.loss_fn = loss_fn

    def check(self, step: int, rows: np.ndarray, params: Any, *batch: Any) -> NanOrigin | None:
        """After step ``step``: ``rows`` its memory-form record (``tb_gradhealth.jax.to_memory``), ``params`` the
        weights the step started from; the origin, the first time the record shows a NaN/Inf."""
        return self.find(step, rows, params=params, batch=batch)

    def replay(self, step: int, *, params: Any, batch: Sequence[Any]) -> NanOrigin:
        """The step's jaxpr evaluated equation by equation from ``params`` on ``batch`` (:func:`replay`)."""
        return replay(self.loss_fn, params, *batch, step=step)
