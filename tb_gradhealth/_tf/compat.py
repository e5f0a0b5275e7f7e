"""Every private TensorFlow / Keras access of this package, in one place.

The TF writers need a few things that TensorFlow and Keras do not expose publicly: an XLA variadic reduce (one
loop computing several reductions), whether the current graph is being compiled by XLA, a switch that silences a
by-design retracing warning, and three optimizer methods plus the train-function slot that the Keras callback
wraps to see the gradient ``fit`` applies. Each accessor below names the versions it was verified on
(:data:`VERIFIED`) and either raises :class:`CompatError` with what to do instead, or falls back as documented.

Supported range (``setup.py``): TensorFlow 2.16 to 2.21 with Keras 3.0 to 3.15 (TensorFlow's ``tf.keras`` is
Keras 3 from 2.16 on). CI runs the TensorFlow tests against the oldest and the newest of this range.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

#: The range the tests pass on: (oldest, newest) of TensorFlow and of Keras.
VERIFIED = {"tensorflow": ("2.16.2", "2.21.0"), "keras": ("3.0.5", "3.15.1")}

#: Optimizer methods the Keras callback wraps on the optimizer *instance* (Keras 3.0 to 3.15, TF backend):
#: ``_backend_update_step(grads, variables, learning_rate)`` runs after unscaling, clipping and accumulation,
#: where the variables change; ``_all_reduce_sum_gradients(grads_and_vars)`` returns the cross-replica sum.
OPTIMIZER_UPDATE_STEP = "_backend_update_step"
OPTIMIZER_ALL_REDUCE = "_all_reduce_sum_gradients"


class CompatError(RuntimeError):
    """This TensorFlow / Keras lacks an internal that the package relies on (the message says what to use)."""


def _versions() -> str:
    import tensorflow as tf

    try:
        import keras

        kv = keras.__version__
    except ImportError:  # pragma: no cover - TF >= 2.16 always brings Keras 3
        kv = "none"
    lo, hi = VERIFIED["tensorflow"]
    klo, khi = VERIFIED["keras"]
    return f"TensorFlow {tf.__version__}, Keras {kv} (verified: TensorFlow {lo}..{hi}, Keras {klo}..{khi})"


# --- TensorFlow -------------------------------------------------------------------------------------------------


def in_xla_context() -> bool:
    """Whether the op being built is compiled by XLA (inside ``tf.function(jit_compile=True)``).

    ``control_flow_util.GraphOrParentsInXlaContext`` (TF 2.16..2.21). Fallback when missing: ``False``, so the
    statistics take the plain-TF path (correct, slower under XLA) and ``summary.write`` does not refuse early.
    """
    try:
        from tensorflow.python.framework import ops
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - present in every verified version
        return False
    check = getattr(control_flow_util, "GraphOrParentsInXlaContext", None)
    return bool(check(ops.get_default_graph())) if check is not None else False


def has_variadic_reduce() -> bool:
    """Whether :func:`variadic_reduce` is available (``tf2xla.python.xla.variadic_reduce``, TF 2.16..2.21)."""
    try:
        from tensorflow.compiler.tf2xla.python import xla
    except ImportError:  # pragma: no cover
        return False
    return hasattr(xla, "variadic_reduce")


def variadic_reduce(operands: Sequence[Any], init: Sequence[Any], axis: int, reducer: Any) -> list[Any]:
    """One XLA reduce of several same-shape tensors along ``axis`` (``reducer``: a concrete function of 2n scalars).

    ``tf2xla.python.xla.variadic_reduce`` plus ``ConcreteFunction.add_to_graph`` (TF 2.16..2.21). Without it the
    callers reduce each operand on its own (:func:`has_variadic_reduce`); this raises :class:`CompatError`.
    """
    try:
        from tensorflow.compiler.tf2xla.python import xla
        from tensorflow.python.framework import ops
    except ImportError as e:  # pragma: no cover
        raise CompatError(f"no tf2xla variadic_reduce in {_versions()}") from e
    reducer.add_to_graph(ops.get_default_graph())
    return list(xla.variadic_reduce(list(operands), list(init), dimensions_to_reduce=[axis], reducer=reducer))


def quiet_retracing(fn: Any) -> Any:
    """Silence TF's "frequent retracing" warning on a ``tf.function`` that retraces per signature by design.

    Sets ``Function._omit_frequent_tracing_warning`` (TF 2.16..2.21). Fallback: nothing (the warning may show).
    """
    try:
        fn._omit_frequent_tracing_warning = True
    except AttributeError:  # pragma: no cover - a Function without the attribute slot
        pass
    return fn


# --- Keras ------------------------------------------------------------------------------------------------------


def optimizer_methods(optimizer: Any) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
    """``(update_step, all_reduce or None)``: the optimizer's bound methods that the callback wraps.

    Raises :class:`CompatError` when ``_backend_update_step`` is missing (a Keras outside the verified range or a
    non-Keras optimizer); ``_all_reduce_sum_gradients`` may be missing (then the gradients are taken as given).
    """
    update = getattr(optimizer, OPTIMIZER_UPDATE_STEP, None)
    if update is None:
        raise CompatError(
            f"{type(optimizer).__name__} has no {OPTIMIZER_UPDATE_STEP} ({_versions()}): this optimizer is not "
            "supported by GradientHealthCallback"
        )
    return update, getattr(optimizer, OPTIMIZER_ALL_REDUCE, None)


def set_optimizer_methods(
    optimizer: Any, update_step: Callable[..., Any], all_reduce: Callable[..., Any] | None
) -> None:
    """Shadow the optimizer's methods with instance attributes (undone by :func:`restore_optimizer_methods`)."""
    setattr(optimizer, OPTIMIZER_UPDATE_STEP, update_step)
    if all_reduce is not None:
        setattr(optimizer, OPTIMIZER_ALL_REDUCE, all_reduce)


def restore_optimizer_methods(optimizer: Any) -> None:
    """Drop the instance attributes set by :func:`set_optimizer_methods`: the class methods show again."""
    for attr in (OPTIMIZER_UPDATE_STEP, OPTIMIZER_ALL_REDUCE):
        optimizer.__dict__.pop(attr, None)


def optimizer_step_counter(optimizer: Any) -> Any:
    """The optimizer's raw step variable: ``_iterations`` (Keras 3.0..3.15: one per batch, even with
    ``gradient_accumulation_steps``). Fallback: the public ``iterations`` (steps that applied an update)."""
    raw = getattr(optimizer, "_iterations", None)
    return raw if raw is not None else optimizer.iterations


def compute_loss_for_inference(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any) -> Any:
    """``model.compute_loss`` of an inference-mode forward pass: with ``training=False`` where the Keras version
    takes that argument (it selects the losses added during training); older versions (3.0) take no ``training``."""
    try:
        takes_training = "training" in inspect.signature(model.compute_loss).parameters
    except (TypeError, ValueError):  # pragma: no cover - a compute_loss without a signature
        takes_training = True
    extra = {"training": False} if takes_training else {}
    return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **extra)


def train_functions(model: Any, modes: Sequence[str]) -> dict[str, Any]:
    """One freshly traced-on-first-call train function per mode (``make_train_function(force=True)``).

    The caller sets whatever its hooks read at trace time before a function's first call.
    """
    out = {}
    for mode in modes:
        model.make_train_function(force=True)
        out[mode] = model.train_function
    return out


def set_train_function(model: Any, fn: Callable[..., Any] | None) -> None:
    """Make ``fit`` call ``fn`` for each step (``Trainer.train_function``, Keras 3.0..3.15); ``None`` rebuilds
    the ordinary one, so later ``fit`` calls pay nothing for hooks that were installed."""
    if fn is None:
        model.make_train_function(force=True)
    else:
        model.train_function = fn


#: The attribute the forward hooks shadow on a layer *instance* (Keras 3.0..3.15: ``Layer.__call__`` reads
#: ``self.call`` when it runs the layer, eagerly and when a step traces).
LAYER_CALL = "call"


def leaf_layers(model: Any) -> list[Any]:
    """Every layer of ``model`` that holds no layer of its own, outer layers first (``_flatten_layers``, Keras
    3.0..3.15; fallback: the public ``layers`` walked recursively)."""
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        layers = list(flatten(include_self=False, recursive=True))
    else:  # pragma: no cover - present in every verified version
        layers, stack = [], list(getattr(model, "layers", []))
        while stack:
            layer = stack.pop(0)
            layers.append(layer)
            stack[:0] = list(getattr(layer, "layers", []))
    return [layer for layer in layers if not getattr(layer, "layers", None) and type(layer).__name__ != "InputLayer"]


def layer_path(layer: Any) -> str:
    """A layer's name in the records: its ``path`` (``sequential/dense``, the prefix of its variables' paths), or its
    ``name`` where it has no path (a layer without weights)."""
    return str(getattr(layer, "path", None) or layer.name)


def wrap_layer_call(layer: Any, call: Callable[..., Any]) -> None:
    """Shadow a layer's ``call`` with ``call`` (an instance attribute, read when the step traces)."""
    layer.__dict__[LAYER_CALL] = call


def unwrap_layer_call(layer: Any) -> None:
    """Drop what :func:`wrap_layer_call` set: the class's ``call`` shows again."""
    layer.__dict__.pop(LAYER_CALL, None)


# --- NaN origin replay (tb_gradhealth._tf.replay) ---------------------------------------------------------------


def add_op_callback(callback: Callable[..., Any]) -> None:
    """Call ``callback(op_type, inputs, attrs, outputs, op_name, graph)`` for every op this thread runs or builds.

    ``tensorflow.python.framework.op_callbacks`` (TF 2.16..2.21; what ``tf.debugging.enable_check_numerics``
    uses). Raises :class:`CompatError` when missing: the NaN origin is then reported as not replayed.
    """
    try:
        from tensorflow.python.framework import op_callbacks
    except ImportError as e:  # pragma: no cover - present in every verified version
        raise CompatError(f"no op callbacks in this TensorFlow ({_versions()}): cannot replay op by op") from e
    op_callbacks.add_op_callback(callback)


def remove_op_callback(callback: Callable[..., Any]) -> None:
    from tensorflow.python.framework import op_callbacks

    op_callbacks.remove_op_callback(callback)
