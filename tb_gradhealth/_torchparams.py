"""Which of a model's parameters a PyTorch record reads, and whether each one's ``.grad`` is this step's gradient.

* **Frozen**: ``requires_grad=False``, or, given the optimizer, in none of its ``param_groups`` (unless the
  optimizer holds none of the recorded parameters at all: a wrapper that keeps flattened copies, as DeepSpeed's
  ZeRO does). Its row is :func:`record.frozen` of its size, built on the host; its ``.grad``, which an earlier loop
  may have left behind, is never read.
* **Stale**: a parameter that requires a gradient but whose ``.grad`` was not produced since the last optimizer
  step (a branch not taken after ``zero_grad(set_to_none=False)``, an expert that got no token): its row is
  missing, not the old values or zeros. :class:`GradWatch` tells, armed after the optimizer step before a logged
  step: a ``.grad`` is this step's when its ``register_post_accumulate_grad_hook`` ran since (backward reached
  the parameter) or when it is another tensor than the one held then (a gradient assigned, ``p.grad = g``). All
  of it is host bookkeeping (no device work, no host sync); unarmed, every ``.grad`` counts as this step's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

#: ``(name, parameter)`` pairs, in row order.
Params = Sequence[tuple[str, torch.Tensor]]


class Selection(NamedTuple):
    """One logged step's rows: which are frozen and which read as missing, with every row's element count."""

    frozen: tuple[bool, ...]
    #: Rows that require a gradient whose ``.grad`` is not this step's (never a frozen row).
    stale: tuple[bool, ...]
    #: Each parameter's element count (its local shard's: a shard merge adds them up).
    sizes: tuple[int, ...]

    @property
    def live(self) -> list[int]:
        """The rows whose gradient is read (everything but the frozen rows), in order."""
        return [i for i, f in enumerate(self.frozen) if not f]


def local(t: Any) -> Any:
    """A DTensor's local shard (what this rank holds); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def optimized(params: Params, optimizer: Any) -> list[bool] | None:
    """Whether each parameter is in one of ``optimizer``'s ``param_groups``; ``None`` (nothing known) without an
    optimizer, or when it holds none of these parameters (it steps copies of them)."""
    groups = getattr(optimizer, "param_groups", None)
    if groups is None:
        return None
    held = {id(p) for group in groups for p in group["params"]}
    inside = [id(p) in held for _, p in params]
    return inside if any(inside) else None


def select(params: Params, optimizer: Any = None, watch: GradWatch | None = None) -> Selection:
    """The rows of ``params`` at this logged step: frozen (``requires_grad=False``, or outside ``optimizer``) and
    stale (``watch``'s verdict on the others)."""
    inside = optimized(params, optimizer)
    frozen = tuple(not p.requires_grad or (inside is not None and not inside[i]) for i, (_, p) in enumerate(params))
    stale = watch.stale(params, frozen) if watch is not None else None
    return Selection(frozen=frozen, stale=tuple(stale) if stale is not None else (False,) * len(frozen),
                     sizes=tuple(local(p).numel() for _, p in params))


def _held(grad: torch.Tensor | None) -> Any:
    return None if grad is None else weakref.ref(grad)


class GradWatch:
    """Tells which parameters' ``.grad`` was not produced since the optimizer step it was last armed at.

    :meth:`stepped` after each optimizer step (with whether the next step is logged) arms it, or takes its hooks
    away: they run only during the backward passes of logged steps. Armed when made (the first step is logged).
    """

    def __init__(self, params: Params) -> None:
        self._params = [p for _, p in params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._fired: set[int] = set()
        self._handles: dict[int, Any] = {}
        #: each ``.grad`` when armed (a weak reference, or None); ``None``: not armed
        self._held: list[Any] | None = None
        self.arm()

    @property
    def armed(self) -> bool:
        return self._held is not None

    def _hook(self, i: int) -> Any:
        fired = self._fired

        def produced(_: torch.Tensor) -> None:
            fired.add(i)

        return produced

    def arm(self) -> None:
        """Now is an optimizer step: the ``.grad`` each parameter holds is from before it."""
        self._fired.clear()
        self._held = [_held(p.grad) for p in self._params]
        for i, p in enumerate(self._params):
            if i not in self._handles and p.requires_grad and p.is_leaf:
                self._handles[i] = p.register_post_accumulate_grad_hook(self._hook(i))

    def disarm(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._fired.clear()
        self._held = None

    def stepped(self, next_logged: bool) -> None:
        """After an optimizer step: arm for the next step when it is logged, else disarm."""
        if next_logged:
            self.arm()
        elif self.armed:
            self.disarm()

    def stale(self, params: Params, skip: Sequence[bool]) -> list[bool] | None:
        """Whether each of ``params`` holds a ``.grad`` that is not this step's: the tensor it held when armed, and
        backward did not reach it since (False for the ``skip`` rows, whose ``.grad`` is not looked at, and for a
        parameter not watched). ``None`` when not armed (nothing known)."""
        if self._held is None:
            return None
        out = []
        for (_, p), skipped in zip(params, skip, strict=True):
            i = self._index.get(id(p))
            if skipped or i is None:
                out.append(False)
                continue
            grad, held = p.grad, self._held[i]
            out.append(grad is not None and i not in self._fired and held is not None and held() is grad)
        return out
