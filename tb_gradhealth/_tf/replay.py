"""Replay one TensorFlow training step eagerly, op by op, and name the first op that made a NaN/Inf.

The step's loss is recomputed eagerly (``tf.config.run_functions_eagerly``; same weights, same batch) under an op
callback that keeps every op's type, inputs, outputs, Keras layer and user frame. The forward pass is searched
first (when the loss itself is not finite): the first op whose output is not finite while its inputs are. When the
loss is finite but gradients are not, the backward pass is searched from the loss down: the first op whose output
gradients are finite but whose own gradient (its vector-Jacobian product, computed for that op alone) is not.
Only called after a NaN/Inf was seen, so it costs nothing before; see docs/NAN_ORIGIN.md for what it cannot do.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tb_gradhealth import _frames
from tb_gradhealth._tf import compat
from tb_gradhealth.origin import NanOrigin, nonfinite_samples


@dataclass
class _Op:
    index: int
    op_type: str
    inputs: tuple[Any, ...]
    attrs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    layer: str | None
    frame: _frames.Frame | None


def _is_float(t: Any) -> bool:
    dtype = getattr(t, "dtype", None)
    return dtype is not None and getattr(dtype, "is_floating", False)


def _nonfinite(t: Any) -> bool:
    return _is_float(t) and not bool(np.all(np.isfinite(np.asarray(t))))


def _shape(t: Any) -> tuple[int, ...] | None:
    shape = getattr(t, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        return None


def _layer_path(frame: Any, root: Any) -> str | None:
    """The Keras layers whose ``call`` is on the stack, outermost first (the replayed model itself left out)."""
    layer_cls = _keras_layer_class()
    if layer_cls is None:
        return None
    names: list[str] = []
    skip = (root, getattr(root, "_functional", None))  # a Sequential runs an inner Functional model of its own
    while frame is not None:
        if frame.f_code.co_name == "call":
            owner = frame.f_locals.get("self")
            if isinstance(owner, layer_cls) and all(owner is not s for s in skip) and \
                    (not names or names[-1] != owner.name):
                names.append(owner.name)
        frame = frame.f_back
    return "/".join(reversed(names)) or None


def _keras_layer_class() -> Any:
    keras = sys.modules.get("keras")
    return getattr(getattr(keras, "layers", None), "Layer", None)


class _Recorder:
    """The op callback: every eager op of the forward pass, in execution order."""

    def __init__(self, root: Any) -> None:
        self.ops: list[_Op] = []
        self.root = root
        self.active = True

    def __call__(self, op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None,
                 graph: Any = None) -> None:
        if graph is not None or not self.active:  # ops being traced into a graph: not executed here
            return None
        caller = sys._getframe(1)
        op_type = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
        self.ops.append(_Op(len(self.ops), op_type, tuple(inputs), tuple(attrs or ()), tuple(outputs),
                            _layer_path(caller, self.root), _frames.user_frame(caller)))
        return None


def _named_inputs(batch: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for name, value in batch.items():
        flat = tf.nest.flatten(value)
        for i, t in enumerate(flat):
            if t is not None and tf.is_tensor(t) or isinstance(t, np.ndarray):
                out.append((name if len(flat) == 1 else f"{name}[{i}]", tf.convert_to_tensor(t)))
    return out


def _vjp(op: _Op, out_grads: Sequence[Any]) -> tuple[list[Any], str]:
    """The gradient of one op alone w.r.t. its float inputs, given its output gradients; and the first backward
    op type whose output was not finite (``""`` if none)."""
    from tensorflow.python.eager import context, execute

    float_inputs = [t for t in op.inputs if _is_float(t)]
    seen: list[str] = []

    def watch(op_type: str, inputs: Any, attrs: Any, outputs: Any, op_name: Any = None, graph: Any = None) -> None:
        if graph is None and not seen and any(_nonfinite(t) for t in outputs):
            seen.append(op_type)
        return None

    with tf.GradientTape() as tape:
        for t in float_inputs:
            tape.watch(t)
        outs = execute.execute(op.op_type, len(op.outputs), list(op.inputs), op.attrs, context.context())
        execute.record_gradient(op.op_type, list(op.inputs), op.attrs, outs)
    floats = [(o, g) for o, g in zip(outs, out_grads, strict=True) if _is_float(o)]
    compat.add_op_callback(watch)
    try:
        grads = tape.gradient([o for o, _ in floats], float_inputs, output_gradients=[g for _, g in floats],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
    finally:
        compat.remove_op_callback(watch)
    return list(grads), (seen[0] if seen else "")


def _result(step: int, op: _Op, direction: str, **kw: Any) -> NanOrigin:
    frame = op.frame
    return NanOrigin(
        step=step, found=True, framework="tensorflow", op=op.op_type, layer=op.layer, direction=direction,
        input_shapes=tuple(_shape(t) for t in op.inputs), output_shapes=tuple(_shape(t) for t in op.outputs),
        file=frame.file if frame else "", line=frame.line if frame else 0, function=frame.function if frame else "",
        code=frame.code if frame else "", **kw,
    )


def _forward(step: int, ops: Sequence[_Op], bad_inputs: Sequence[str]) -> NanOrigin | None:
    for op in ops:
        outs = [t for t in op.outputs if _nonfinite(t)]
        if not outs:
            continue
        kind = "NaN" if any(np.isnan(np.asarray(t)).any() for t in outs) else "Inf"
        if not any(_nonfinite(t) for t in op.inputs):
            return _result(step, op, "forward", nonfinite=f"{kind} in its output")
        if bad_inputs:
            return _result(step, op, "forward", input_nonfinite=tuple(bad_inputs),
                           nonfinite=f"{kind} in its output, from a non-finite input")
    return None


def _backward(step: int, ops: Sequence[_Op], grads: Mapping[int, Any]) -> NanOrigin | None:
    """``grads``: ``id(tensor) -> d loss / d tensor`` for the ops' float outputs (the total over its consumers)."""
    for op in reversed(ops):
        floats_in = [t for t in op.inputs if _is_float(t)]
        if not floats_in or not any(_is_float(t) for t in op.outputs):
            continue
        out_grads = [grads.get(id(t)) if _is_float(t) else None for t in op.outputs]
        if any(g is not None and _nonfinite(g) for g in out_grads):
            continue  # the NaN/Inf reached this op from further down the backward pass
        tracked = [grads.get(id(t)) for t in floats_in]
        if all(g is not None and not _nonfinite(g) for g in tracked):
            continue  # every contribution to a finite total is finite
        out_grads = [tf.zeros_like(t) if g is None else g for t, g in zip(op.outputs, out_grads, strict=True)]
        try:
            in_grads, grad_op = _vjp(op, out_grads)
        except Exception:  # noqa: BLE001 - an op that cannot be re-executed alone (stateful, no gradient)
            continue
        if any(g is not None and _nonfinite(g) for g in in_grads):
            return _result(step, op, "backward", nonfinite="NaN/Inf in its gradient",
                           extra={"gradient_op": grad_op} if grad_op else {})
    return None


def _run_recorded(loss_fn: Callable[[], Any], inputs: Sequence[tuple[str, Any]], root: Any
                  ) -> tuple[Any, _Recorder, tf.GradientTape]:
    """``(loss, recorder, tape)``: ``loss_fn()`` run under a tape that watches the batch's float inputs, every eager
    op it ran recorded in order."""
    rec = _Recorder(root)
    with tf.GradientTape() as tape:
        for _, t in inputs:
            if _is_float(t):
                tape.watch(t)
        compat.add_op_callback(rec)
        try:
            loss = loss_fn()
        finally:
            rec.active = False
            compat.remove_op_callback(rec)
    return loss, rec, tape


def _first_nonfinite(step: int, loss_fn: Callable[[], Any], inputs: Sequence[tuple[str, Any]],
                     bad_inputs: Sequence[str], root: Any) -> NanOrigin | None:
    """The op that made the first NaN/Inf of a replay: forward when the loss (or an input) is not finite, else
    backward, from the loss's gradient w.r.t. every op's float outputs; None when the replay made none."""
    loss, rec, tape = _run_recorded(loss_fn, inputs, root)
    if _nonfinite(loss) or bad_inputs:
        return _forward(step, rec.ops, bad_inputs)
    sources = [t for op in rec.ops for t in op.outputs if _is_float(t)]
    total = tape.gradient(loss, sources, unconnected_gradients=tf.UnconnectedGradients.NONE)
    return _backward(step, rec.ops, {id(t): g for t, g in zip(sources, total, strict=True)})


def replay(
    loss_fn: Callable[[], Any],
    variables: Sequence[Any],
    *,
    step: int,
    batch: Mapping[str, Any] | None = None,
    root: Any = None,
) -> NanOrigin:
    """Run ``loss_fn()`` (the step's loss on its batch, at its weights) eagerly, op by op; the first op that made a
    NaN/Inf, forward or backward. ``batch`` names the step's inputs (checked and watched); ``root`` is the model
    whose own name is left out of layer paths. Never raises: a failed replay is a :class:`NanOrigin` with ``found``
    False and the reason."""
    start = time.perf_counter()

    def not_found(reason: str) -> NanOrigin:
        return NanOrigin(step=step, found=False, framework="tensorflow", reason=reason,
                         seconds=time.perf_counter() - start)

    bad_weights = [getattr(v, "path", getattr(v, "name", "?")) for v in variables
                   if _nonfinite(tf.convert_to_tensor(v))]
    if bad_weights:
        return not_found(f"the weights already hold NaN/Inf ({', '.join(map(str, bad_weights[:3]))}): they were made "
                         "at an earlier step, whose update was applied before it was recorded")
    inputs = _named_inputs(batch or {})
    bad_inputs = [nonfinite_samples(n, t) for n, t in inputs if _nonfinite(t)]
    eager_before = tf.config.functions_run_eagerly()
    tf.config.run_functions_eagerly(True)
    try:
        found = _first_nonfinite(step, loss_fn, inputs, bad_inputs, root)
    except Exception as e:  # noqa: BLE001 - the answer says why the replay failed; training goes on
        return not_found(f"the replay failed: {type(e).__name__}: {e}")
    finally:
        tf.config.run_functions_eagerly(eager_before)
    if found is None:
        return not_found("the replay of the step produced no NaN/Inf (a random op such as dropout drew other "
                         "values, or a non-deterministic kernel): not reproduced")
    return NanOrigin(**{**found.__dict__, "seconds": time.perf_counter() - start})
