"""Extra outputs of ``model.train_step``, under private keys of its logs, for the Keras callback's parts.

The callback's parts each need something that only exists inside the traced train step: the NaN-origin search
its batch, the capture the gradients the optimizer applied. Returning them beside the logs needs no second trace
of the step (the batch is a reference to a tensor the step has anyway); the callback takes them out again before
``fit`` sees the logs. One wrapper (an instance attribute, read when ``fit``'s train function traces) holds every
part's output, so the parts can be added and removed in any order, and a wrapper left by a ``fit`` that ended by an
exception is reused instead of wrapped again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The wrapper's table of ``{key: (output(data), begin() or None)}``.
_TABLE = "_tb_gradhealth_outputs"


def add(model: Any, key: str, output: Callable[[Any], Any], begin: Callable[[], None] | None = None) -> None:
    """Make ``model.train_step(data)`` also return ``output(data)`` (called after the step; ``None``: nothing)
    under ``key`` of its logs (when they are a dict); ``begin()`` is called before the step (a part that follows
    what the step computes, such as the layers' outputs)."""
    step = model.__dict__.get("train_step")
    table = getattr(step, _TABLE, None)
    if table is None:
        original = model.train_step
        table = {}

        def train_step(data: Any) -> Any:
            for _, starts in table.values():
                if starts is not None:
                    starts()
            logs = original(data)
            outputs = {k: out(data) for k, (out, _) in table.items()}
            if not isinstance(logs, dict):
                return logs
            return {**logs, **{k: v for k, v in outputs.items() if v is not None}}

        setattr(train_step, _TABLE, table)
        train_step.__wrapped__ = original
        model.train_step = train_step
    table[key] = (output, begin)


def remove(model: Any, key: str) -> None:
    """Undo :func:`add` for ``key``; the model's own ``train_step`` shows again once no key is left."""
    step = model.__dict__.get("train_step")
    table = getattr(step, _TABLE, None)
    if table is None:
        return
    table.pop(key, None)
    if not table:
        del model.train_step


def take(logs: Any, key: str) -> tuple[Any, Any]:
    """``(logs without key, its value or None)``: what ``fit`` may see, and the part's output."""
    if not isinstance(logs, dict) or key not in logs:
        return logs, None
    logs = dict(logs)
    return logs, logs.pop(key)
