"""Each layer's output of a PyTorch model at logged steps: forward hooks, registered only while a logged step's
forward runs, that reduce every output on its device (:func:`tb_gradhealth._forwardstats.output_stats`) and keep a
few numbers and one bit a unit until the step is written.

Which modules: every leaf module that owns parameters (``Linear``, convolutions, normalisations, embeddings) and
every activation module (:data:`tb_gradhealth.torch_kinds.ACTIVATIONS`), named as ``named_modules()`` names them;
a module called again within one forward (one ``nn.ReLU`` used after several layers) gets a row per call,
``name``, ``name#1``, ... A functional activation (``F.relu`` in ``forward``) is no module: the output of the
layer before it is recorded, before the activation. The unit axis is 1 for convolutions and the normalisations
of images (``NCHW``), the last axis for ``Linear`` and the rest; an activation module takes the unit axis of the
layer recorded just before it in the same forward. Micro-batches (several forwards before one optimizer step)
are parts of one batch: their records merge with the units' alive bits ORed (:func:`record.act_merge_batches`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tb_gradhealth import _forwardstats, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth.torch_kinds import ACTIVATIONS, KINDS

#: Classes whose outputs have their units (channels) at axis 1.
CHANNELS_FIRST = frozenset({
    "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d", "LazyConv1d",
    "LazyConv2d", "LazyConv3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "InstanceNorm1d",
    "InstanceNorm2d", "InstanceNorm3d", "GroupNorm",
})


def _bounds(module: torch.nn.Module, activation: str) -> tuple[float, float] | None:
    """A bounded activation's range: ``Hardtanh``'s own ``min_val``/``max_val``, else :data:`record.BOUNDS`."""
    if activation == "hard_tanh":
        return float(getattr(module, "min_val", -1.0)), float(getattr(module, "max_val", 1.0))
    return record.activation_bounds(activation)


class _Target:
    """A module whose output is recorded: its row name, kind, activation, bounds and unit axis (None: the axis of
    the layer recorded before it in the forward)."""

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        cls = type(module).__name__
        self.name = name
        self.activation = ACTIVATIONS.get(cls, "")
        self.kind = cls if self.activation else KINDS.get(cls, cls)
        self.bounds = _bounds(module, self.activation) if self.activation else None
        if self.activation == "softmax":
            dim = getattr(module, "dim", None)
            self.axis: int | None = -1 if dim is None else int(dim)
        elif self.activation:
            self.axis = None
        else:
            self.axis = 1 if cls in CHANNELS_FIRST else -1


def targets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, _Target]]:
    """The modules of ``model`` whose outputs are recorded (leaf modules with parameters, activation modules)."""
    out = []
    for name, module in model.named_modules():
        if next(module.children(), None) is not None:
            continue
        owns = next(module.parameters(recurse=False), None) is not None
        if owns or type(module).__name__ in ACTIVATIONS:
            out.append((module, _Target(name or type(module).__name__, module)))
    return out


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The output tensor of a module (the first element of a tuple, as ``LSTM`` and ``MultiheadAttention`` return)."""
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if isinstance(output, torch.Tensor) and output.is_floating_point() and not output.is_sparse:
        return output
    return None


_unit_extremes = _forwardstats.per_unit_extremes(torch.amin, torch.amax)


def output_stats(t: torch.Tensor, axis: int, bounds: tuple[float, float] | None) -> _forwardstats.OutputStats:
    """The statistics of one output. On the host, a healthy output takes the few plain passes of
    :func:`_forwardstats.one_pass_output_stats` (a Python branch on its per-unit extremes chooses). On an
    accelerator, where reading that choice would stall the stream at every layer, and while ``torch.compile``
    traces: the masked passes, with no branch."""
    host = t.device.type == "cpu" and not torch.compiler.is_compiling()
    return _forwardstats.output_stats(ts.BE, t, unit_axis=axis, bounds=bounds,
                                      unit_extremes=_unit_extremes if host else None)


class ForwardHooks:
    """The forward hooks of one model: :meth:`arm` registers them (before a logged step's forward) or removes them
    (unlogged steps run no hook at all); :meth:`take` hands the step's forward records to the host once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._targets = targets(model)
        self._handles: list[Any] = []
        #: each row's statistics, one entry per forward (micro-batch), in the order the rows were first seen
        self._parts: dict[str, list[_forwardstats.OutputStats]] = {}
        self._about: dict[str, _Target] = {}
        self._calls: dict[int, int] = {}
        self._last_axis = -1

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, on: bool) -> None:
        """Register the hooks (``on``) or remove them; idempotent."""
        if on == self.armed:
            return
        if not on:
            for h in self._handles:
                h.remove()
            self._handles = []
            return
        self._handles.append(self.model.register_forward_pre_hook(self._begin))
        for module, target in self._targets:
            self._handles.append(module.register_forward_hook(self._hook(target)))

    def _begin(self, module: Any, args: Any) -> None:
        self.begin()

    def begin(self) -> None:
        """A new forward of the model (its own forward runs this; a loop that calls its parts, as a Lightning
        ``training_step`` may, calls it at each batch): each module's calls count from 0 again."""
        self._calls.clear()
        self._last_axis = -1

    def _hook(self, target: _Target) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            t = _first_tensor(output)
            if t is None:
                return
            k = self._calls.get(id(module), 0)
            self._calls[id(module)] = k + 1
            key = target.name if k == 0 else f"{target.name}#{k}"
            axis = self._last_axis if target.axis is None else target.axis
            if not -t.dim() <= axis < t.dim():  # an activation after a layer of more axes (e.g. after a flatten)
                axis = -1
            self._last_axis = axis
            with torch.no_grad():
                stats = output_stats(t.detach(), axis, target.bounds)
            self._parts.setdefault(key, []).append(stats)
            self._about.setdefault(key, target)

        return hook

    def clear(self) -> None:
        """Forget what the hooks saw (a step that turned out not to be logged)."""
        self._parts.clear()

    def take(self) -> tuple[list[str], np.ndarray, list[tuple[str, str]]] | None:
        """``(row names, forward records [L, ACT_NUM_FIELDS], (kind, activation) per row)`` of what the hooks saw
        since the last call, in one host copy; None when they saw nothing."""
        parts, self._parts = self._parts, {}
        if not parts:
            return None
        flat = [s for stats in parts.values() for s in stats]
        host = torch.cat([torch.cat([s.counts.double(), s.values.double(), s.alive.double()]) for s in flat]).cpu()
        host = host.numpy()
        names, rows, info = [], [], []
        at = 0
        nc, nv = len(_forwardstats.COUNTS), len(_forwardstats.VALUES)
        for key, stats in parts.items():
            got = []
            for s in stats:
                u = int(s.alive.numel())
                got.append((host[at:at + nc], host[at + nc:at + nc + nv], host[at + nc + nv:at + nc + nv + u] > 0))
                at += nc + nv + u
            target = self._about[key]
            names.append(key)
            rows.append(_forwardstats.merged_row(got, target.bounds))
            info.append((target.kind, target.activation))
        return names, np.stack(rows), info

    def write(self, writer: Any, step: int, *, name: str, source: Any) -> None:
        """Write what the hooks saw since the last call at ``step`` of the stream ``name`` (with ``writer``, a
        :class:`tb_gradhealth.writer.Writer`), nothing when they saw nothing."""
        taken = self.take()
        if taken is not None:
            names, rows, info = taken
            writer.add_records(step, names, rows, name=name, kind=record.ACTIVATIONS, layer_info=info, source=source)


def release(hooks: ForwardHooks | None, writer: Any) -> tuple[None, None]:
    """The end of a framework callback's training: its forward hooks removed, its writer closed (either may be None
    already); ``(None, None)``, for the callback's two attributes, so that a second call does nothing."""
    if hooks is not None:
        hooks.arm(False)
    if writer is not None:
        writer.close()
    return None, None
