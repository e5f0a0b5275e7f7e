"""PyTorch writer: gradient-health records computed on the gradients' device, merged across shards, written
without TensorFlow.

* :func:`compute` reduces every layer's gradient (and optionally its weight and applied update) with torch ops on
  the tensor's own device and stacks the records into one small float32 tensor ``[L, NUM_FIELDS]`` (the *stacked*
  record: the 5 counts as int32 bit patterns, then the value fields and the histogram bins, one float32 row a
  layer).
  No gradient is copied to the host; :func:`to_memory` copies only the stacked tensor.
* Eagerly (``tb_gradhealth._torcheager``) each tensor's statistics take a few cheap passes, a piece of the tensor
  at a time (on a CPU one read, by the compiled loop of ``tb_gradhealth._cpustats`` where it builds), and one host
  read of them all decides which tensors take the plain sums (all finite, max|g| in a safe range); the others are
  computed again tensor by tensor. ``compile=True`` (``tb_gradhealth._torchfused``) reads
  each tensor once: one compiled function whose reductions of a tensor inductor fuses into one loop, and no host
  read before the record is copied (with its flags: the layers whose plain sums do not hold, or whose histogram
  sample missed a sparse tensor's nonzeros, are computed again eagerly, on the steps that have one). Traced inside
  the caller's ``torch.compile`` it has no data-dependent Python control flow: float64 sums (right at any
  magnitude) and one ``torch.cond`` for those samples.
* :func:`merge` merges the records of gradient shards (FSDP, ZeRO, tensor parallel) with two collectives
  (``all_reduce`` MAX, then SUM), giving the record of the full gradient: counts and histograms add, min/max
  combine, relative sums of squares are rescaled to the global max|g| first.
* :func:`add_gradients` = compute (+ merge) + one host copy + :meth:`Writer.add_records`; under
  ``torch.distributed`` rank 0 writes. :class:`StepRecorder` wraps ``optimizer.step()`` (and ``GradScaler``):
  it records the gradient the optimizer applies, after AMP unscaling, the applied update, and skipped steps.
* A parameter frozen by the user (``requires_grad=False``, or outside the optimizer given) gets the frozen record,
  built on the host without reading its ``.grad``; under :class:`StepRecorder` a ``.grad`` that is not this
  step's (not produced since the last optimizer step) is recorded missing (:mod:`tb_gradhealth._torchparams`).

Numbers agree with :func:`tb_gradhealth.record.compute` (float64 reference): counts, min/max and the exact
histogram are equal; ``ssq_rel``/``mean`` (float32 accumulation) to about 1e-6 relative. Values are taken as float32
holds them (float64 beyond its range is +-Inf; below its smallest normal number, zero), as on every other path.
The histogram of a tensor larger than
``hist_sample`` is built from ``hist_sample`` positions ``(offset + i * stride) % n`` (the TF path's rule; the
offset comes from ``seed`` and the layer index, or from the data), scaled to the finite nonzero count, unless
the exact histogram is due (at most ``hist_sample`` finite nonzero values, or fewer than ``record.sample_min_kept``
of them in the sample).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from tb_gradhealth import _core, _devicestats, _torcheager, _torchfused, _torchparams, metadata, record
from tb_gradhealth import _torchstats as ts
from tb_gradhealth._core import LayerInputs
from tb_gradhealth._failsafe import Failsafe
from tb_gradhealth._torchforward import ForwardHooks
from tb_gradhealth._torchparams import Selection, local
from tb_gradhealth.live import StopCheck, StopEvent, Stoppable, StopTraining
from tb_gradhealth.record import Delta
from tb_gradhealth.torch_kinds import layer_info_for
from tb_gradhealth.writer import Writer

__all__ = [
    "Delta",
    "Pending",
    "StepRecorder",
    "StopEvent",
    "StopTraining",
    "add_gradients",
    "after_step",
    "before_step",
    "compute",
    "layer_names",
    "merge",
    "named_gradients",
    "to_memory",
]

_log = logging.getLogger("tb_gradhealth")

#: The stacked columns of the applied update's norms (:func:`after_step` fills them in).
_UPDATE_COLUMNS = [_core.stacked_column("update_max_abs"), _core.stacked_column("update_ssq_rel")]
#: The weights' (:func:`before_step` fills them in where it reads them as it copies them).
_WEIGHT_COLUMNS = [_core.stacked_column("weight_max_abs"), _core.stacked_column("weight_ssq_rel")]


# --- inputs -------------------------------------------------------------------------------------------------


def named_gradients(
    source: Any, weights: bool = True
) -> tuple[list[str], list[torch.Tensor | None], list[torch.Tensor | None]]:
    """``(names, grads, weights)`` from a module, ``named_parameters()`` pairs, or a ``{name: grad}`` dict.

    A module or ``(name, parameter)`` pairs give each parameter's ``.grad`` (``None`` when no gradient reached it)
    and, with ``weights=True``, the parameter itself; a dict maps names to gradient tensors (no weights).
    """
    if isinstance(source, torch.nn.Module):
        source = source.named_parameters()
    if isinstance(source, Mapping):
        names = [str(k) for k in source]
        return names, list(source.values()), [None] * len(names)
    pairs = list(source)
    names = [str(n) for n, _ in pairs]
    grads = [p.grad for _, p in pairs]
    return names, grads, [p.detach() if weights else None for _, p in pairs]


def layer_names(source: Any) -> list[str]:
    """The row names :func:`compute` gives ``source`` (parameter names or dict keys)."""
    return named_gradients(source, weights=False)[0]


def _stack(counts: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[L, 5]`` int counts and ``[L, 89]`` float32 values -> the stacked ``[L, 94]`` float32 tensor."""
    return _core.stack(counts.to(torch.int32).view(torch.float32), values.float(), lambda p: torch.cat(p, dim=1))


def _unstack(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked tensor -> its ``[L, 5]`` int64 counts and ``[L, 89]`` float32 values."""
    bits, values = _core.unstack(stacked)
    return bits.contiguous().view(torch.int32).long(), values


def _per_layer(inputs: LayerInputs) -> torch.Tensor:
    """Each layer on its own (tensors on several devices)."""
    offsets = inputs.offsets
    rows = [ts.layer_record(g, w, u, size, inputs.hist_sample, i, None if offsets is None else offsets[i])
            for i, (g, w, u, size) in enumerate(zip(inputs.grads, inputs.weights, inputs.updates, inputs.sizes,
                                                    strict=True))]
    return _stack(torch.stack([c for c, _ in rows]), torch.stack([v for _, v in rows]))


def _fused(inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stacked records, flags)`` of :func:`_torchfused.records`: what ``compile=True`` compiles."""
    counts, values, due = _torchfused.records(inputs, exact_in_graph=False)
    return _stack(counts, values), due


_compiled: Any = None


def compute(
    grads: Any,
    weights: Any = None,
    updates: Any = None,
    *,
    hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
    seed: int | None = None,
    compile: bool = False,
    optimizer: Any = None,
) -> torch.Tensor:
    """The stacked records ``[L, NUM_FIELDS]`` float32, on the gradients' device, rows in :func:`layer_names` order.

    ``grads``: a module, ``named_parameters()`` pairs, or ``{name: grad}`` (``None`` = missing, sparse COO and
    DTensor shards accepted). ``weights``: ``True`` (the parameters, with a module or pairs) or ``{name: tensor}``;
    ``updates``: ``{name: tensor or Delta(before, after)}``. ``seed`` (e.g. the step) seeds histogram sampling; by
    default it comes from the data. ``compile=True`` runs the statistics through ``torch.compile`` (dense inputs:
    each tensor read once; one host read of a flag per layer: the layers with a NaN/Inf, extreme magnitudes or a
    histogram sample that missed a sparse tensor's nonzeros are computed again eagerly). A module's or the pairs'
    parameter with ``requires_grad=False``, or in none of ``optimizer``'s ``param_groups``, gets the frozen record
    (:func:`record.frozen`), its ``.grad`` unread.
    """
    source = _source(grads)
    selection = _selection(source, optimizer)
    return _with_frozen_rows(_records(source, weights, updates, selection, hist_sample=hist_sample, seed=seed,
                                      compile=compile), selection)


def _source(grads: Any) -> Any:
    """A module's ``named_parameters()`` or the pairs given as a list (read more than once), or the dict."""
    if isinstance(grads, torch.nn.Module):
        return list(grads.named_parameters())
    return grads if isinstance(grads, Mapping) else list(grads)


def _selection(source: Any, optimizer: Any = None, watch: Any = None) -> Selection:
    """The frozen and stale rows of ``source`` (a ``{name: grad}`` dict has neither)."""
    if isinstance(source, Mapping):
        n = len(source)
        return Selection(frozen=(False,) * n, stale=(False,) * n, sizes=(0,) * n)
    return _torchparams.select(source, optimizer, watch)


def _records(source: Any, weights: Any, updates: Any, selection: Selection, *, hist_sample: int | None,
             seed: int | None, compile: bool = False) -> torch.Tensor:
    """The stacked records of the rows ``selection`` reads (not the frozen ones), in order; a stale row's gradient
    is missing. ``compile=True``: the flagged layers computed again before it returns (one host read)."""
    inputs = _inputs(source, weights, updates, selection, hist_sample=hist_sample, seed=seed)
    stacked, due = _device_record(inputs, compile)
    return stacked if due is None else _with_exact(stacked, due.cpu().numpy(), inputs)


def _inputs(source: Any, weights: Any, updates: Any, selection: Selection, *, hist_sample: int | None,
            seed: int | None) -> LayerInputs:
    """The :class:`LayerInputs` of the rows ``selection`` reads (a stale row's gradient ``None``)."""
    names, glist, wlist = named_gradients(source, weights is True)
    if isinstance(weights, Mapping):
        wlist = [weights.get(n) for n in names]
    ulist = [updates.get(n) for n in names] if isinstance(updates, Mapping) else [None] * len(names)
    live = selection.live
    glist = tuple(None if selection.stale[i] else local(glist[i]) for i in live)
    wlist = tuple(local(wlist[i]) for i in live)
    sizes = tuple(_size(g, w) or selection.sizes[i] for i, g, w in zip(live, glist, wlist, strict=True))
    offsets = None if seed is None else [ts.seed_offset(int(seed), i) for i in live]
    return LayerInputs(grads=glist, weights=wlist, updates=tuple(ulist[i] for i in live), sizes=sizes,
                       hist_sample=int(hist_sample or 0), seed=None, offsets=offsets)


def _device_record(inputs: LayerInputs, compile: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(stacked records, flags or None)``: the flags (``compile=True``) mark the layers to compute again eagerly
    (:func:`_with_exact`): a NaN/Inf or extreme magnitudes, or a sample that missed a sparse tensor's nonzeros."""
    if not inputs.grads:
        return torch.zeros((0, record.NUM_FIELDS), dtype=torch.float32), None
    if compile and not any(g is not None and g.is_sparse for g in inputs.grads):
        return _compiled_record(inputs)
    if torch.compiler.is_compiling():  # traced inside the caller's torch.compile
        counts, values, _ = _torchfused.records(inputs, exact_in_graph=True)
        return _stack(counts, values), None
    batched = _torcheager.compute(inputs)
    return (_per_layer(inputs) if batched is None else _stack(*batched)), None


def _compiled_record(inputs: LayerInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked records and their flags through ``torch.compile`` of :func:`_fused` (no host read)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_fused, dynamic=False)
    dev = next((g.device for g in inputs.grads if g is not None), torch.device("cpu"))
    ts.edges(dev)  # filled before tracing: a cache that changes under the compiled code would recompile it
    if inputs.offsets is not None:  # a tensor, so that a new seed does not recompile
        inputs = inputs._replace(offsets=torch.tensor(inputs.offsets, dtype=torch.int64, device=dev))
    return _compiled(inputs)


def _with_exact(stacked: torch.Tensor, redo: np.ndarray, inputs: LayerInputs) -> torch.Tensor:
    """``stacked`` with each layer flagged ``redo`` computed again eagerly (:func:`_torchfused.redo`)."""
    return _torchfused.redo(stacked, redo, inputs)


def _size(g: Any, w: Any) -> int:
    if g is not None:
        return g.numel()
    return w.numel() if w is not None else 0


def _with_frozen_rows(stacked: torch.Tensor, selection: Selection) -> torch.Tensor:
    """Every row's stacked record: ``stacked`` (the rows read) with the frozen rows, built on the host, put in
    their places (one small copy to the device, only when some row is frozen)."""
    frozen = [i for i, f in enumerate(selection.frozen) if f]
    if not frozen:
        return stacked
    out = torch.empty((len(selection.frozen), record.NUM_FIELDS), dtype=torch.float32, device=stacked.device)
    out[frozen] = torch.from_numpy(_core.frozen_stacked([selection.sizes[i] for i in frozen])).to(stacked.device)
    if selection.live:
        out[selection.live] = stacked
    return out


# --- merging shards and copying to the host -----------------------------------------------------------------


def merge(stacked: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Merge every rank's stacked records of its shards into the records of the full tensors (on every rank).

    Two collectives over ``group``: ``all_reduce(MAX)`` of max, -min and the max|.| of gradient, weight and update;
    then, with each relative sum of squares rescaled to the global max|.|, ``all_reduce(SUM)`` of the counts,
    histogram, ``hist_sample``, finite-weighted mean and sums of squares (float64: counts stay exact). The result
    equals :func:`record.merge_all` of the ranks' records.
    """
    import torch.distributed as dist

    def reduce(op: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=op, group=group)
            return t

        return run

    counts, v = _unstack(stacked)
    c, values = _devicestats.merge(ts.BE, counts, v.double(), reduce(dist.ReduceOp.MAX), reduce(dist.ReduceOp.SUM))
    return _stack(c.long(), values)


def to_memory(stacked: torch.Tensor | np.ndarray) -> np.ndarray:
    """Packed records -> memory-form rows ``[L, NUM_FIELDS]`` float64 on the host (the only host copy)."""
    return _core.decode_stacked(stacked.detach().cpu().numpy() if isinstance(stacked, torch.Tensor) else stacked)


def _host_rows(stacked: torch.Tensor, due: torch.Tensor | None, inputs: LayerInputs) -> np.ndarray:
    """:func:`to_memory` of the records, their flags (``compile=True``) copied with them: one copy, then the
    flagged layers computed again (a second read, on such steps only)."""
    if due is None:
        return to_memory(stacked)
    host = torch.cat([stacked, due[:, None].float()], 1).cpu().numpy()
    flags = host[:, -1] > 0
    return to_memory(_with_exact(stacked, flags, inputs) if flags.any() else host[:, :-1])


def _rank(group: Any = None) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def add_gradients(
    writer: Writer | None,
    step: int,
    grads: Any,
    weights: Any = True,
    updates: Any = None,
    *,
    sharded: bool = False,
    group: Any = None,
    name: str = "gradients",
    hist_sample: int | None = None,
    seed: int | None = None,
    compile: bool = False,
    optimizer: Any = None,
) -> np.ndarray | None:
    """Compute the records on the device, copy only them to the host and write them with ``writer``.

    Not distributed, or DDP (identical gradients on every rank, ``sharded=False``): rank 0 computes and writes;
    other ranks return ``None`` at once (their ``writer`` may be ``None``). ``sharded=True`` (FSDP / ZeRO / tensor
    parallel: each rank holds a shard of each gradient): every rank computes its shard's records, :func:`merge`
    combines them (every rank must call, with the same ``hist_sample``: ``None`` takes the writer's, or the
    default where a rank has no writer), rank 0 writes. Returns the memory-form rows on the writing rank. Given a
    module, each parameter's layer kind and activation (:mod:`tb_gradhealth.torch_kinds`) go in the tag's metadata.
    A parameter with ``requires_grad=False``, or in none of ``optimizer``'s ``param_groups``, is recorded frozen
    (:func:`record.frozen`): its row is built on the host, its ``.grad`` unread.
    """
    if not sharded and _rank(group) != 0:
        return None
    hs = (writer.hist_sample if writer is not None else record.DEFAULT_HIST_SAMPLE) if hist_sample is None \
        else hist_sample
    source = _source(grads)
    selection = _selection(source, optimizer)
    inputs = _inputs(source, weights, updates, selection, hist_sample=hs, seed=step if seed is None else seed)
    stacked, due = _device_record(inputs, compile)
    rows = _rows(stacked, selection, sharded, group, due=due, inputs=inputs)
    if rows is None:
        return None
    if writer is not None:
        names = layer_names(source)
        info = layer_info_for(grads, names) if isinstance(grads, torch.nn.Module) else ()
        writer.add_records(step, names, rows, name=name, layer_info=info, source=metadata.loop_source("torch"))
    return rows


def _rows(stacked: torch.Tensor, selection: Selection, sharded: bool, group: Any, *,
          due: torch.Tensor | None = None, inputs: LayerInputs | None = None) -> np.ndarray | None:
    """Every row's memory form from the stacked records of the rows read: with the frozen rows filled on the host;
    ``sharded``: the shards' records merged first, frozen rows included (their sizes add up), and ``None`` on
    the ranks other than 0. ``due`` (``compile=True``'s flags, for ``inputs``): copied with the records, the
    flagged layers computed again."""
    if sharded:
        if due is not None:
            stacked = _with_exact(stacked, due.cpu().numpy(), inputs)
        stacked = merge(_with_frozen_rows(stacked, selection), group)
    if _rank(group) != 0:
        return None
    if sharded:
        return to_memory(stacked)
    return _core.with_frozen(_host_rows(stacked, due, inputs), selection.frozen, selection.sizes)


class Pending(NamedTuple):
    """What :func:`before_step` hands :func:`after_step`."""

    #: the stacked records of the rows read (every row but the frozen ones)
    stacked: torch.Tensor
    #: the weights of those rows before the step, by name (``None``: updates not recorded)
    before: dict[str, torch.Tensor] | None
    selection: Selection


def before_step(params: Sequence[tuple[str, torch.nn.Parameter]], step: int, hist_sample: int,
                updates: bool = True, buffers: Sequence[torch.Tensor] | None = None, *,
                selection: Selection | None = None) -> Pending:
    """Just before an optimizer step: the gradients' and weights' stacked records and (``updates``) a snapshot of
    the weights, for :func:`after_step`: copied into ``buffers`` (tensors like the parameters read, reused from
    one logged step to the next: no new memory to fault in) or else into new tensors. ``selection``
    (:func:`tb_gradhealth._torchparams.select`: by default ``requires_grad`` alone): the frozen rows, neither read
    nor copied, and the stale ones, read as missing. Shared by :class:`StepRecorder` and the Lightning / Hugging
    Face callbacks."""
    selection = _torchparams.select(params) if selection is None else selection
    live = [params[i] for i in selection.live]
    weights = [p.detach() for _, p in live]
    # on a CPU the weights' norms are taken as the snapshot copies them: one read of the weights, not two
    fused = updates and buffers is not None and _torcheager.copies_on_cpu(weights, buffers)
    stacked = _records(params, not fused, None, selection, hist_sample=hist_sample, seed=step)
    if not updates:
        return Pending(stacked, None, selection)
    if buffers is None:
        return Pending(stacked, {n: w.clone() for (n, _), w in zip(live, weights, strict=True)}, selection)
    if fused:
        stacked[:, _WEIGHT_COLUMNS] = _torcheager.copy_norms(weights, buffers)
    else:
        torch._foreach_copy_(list(buffers), weights)
    return Pending(stacked, {n: b for (n, _), b in zip(live, buffers, strict=True)}, selection)


def after_step(pending: Pending, params: Sequence[tuple[str, torch.nn.Parameter]], sharded: bool = False,
               group: Any = None, in_place: bool = False) -> np.ndarray | None:
    """Just after the step: the applied update ``before - after`` joins the records, shards are merged
    (``sharded``), and the memory-form rows of every parameter (the frozen ones filled on the host) are returned
    on rank 0 (``None`` on the others). On a CPU with the compiled statistics the update is read as the difference
    of the two, never written; elsewhere with ``in_place`` the snapshot (float32) becomes the update, computed in
    it, and otherwise it is kept and the update is a new tensor."""
    stacked, before, selection = pending
    if before is not None and selection.live:
        live = [params[i] for i in selection.live]
        after = [p.detach() for _, p in live]
        norms = _torcheager.difference_norms([before[n] for n, _ in live], after)  # on a CPU: never written
        if norms is None and in_place:
            snapshot = [before[n] for n, _ in live]
            torch._foreach_sub_(snapshot, after)
            norms = _torcheager.norms([ts.flat(u) for u in snapshot])
        elif norms is None:
            norms = _torcheager.norms([ts.norm_input(Delta(before[n], a)) for (n, _), a in zip(live, after,
                                                                                               strict=True)])
        stacked[:, _UPDATE_COLUMNS] = norms
    return _rows(stacked, selection, sharded, group)


class StepRecorder(Stoppable):
    """Records the gradient the optimizer applies (after ``GradScaler`` unscaling) and the update it makes.

    Replace ``opt.step()`` (or ``scaler.step(opt); scaler.update()``) with ``recorder.step(step)``. On a logged
    step (one of the ``first`` steps, where onsets often lie, or ``step % every == 0``; by default the Keras
    callback's cadence, 100) it unscales the gradients (unless you already called ``scaler.unscale_``),
    computes their records on the device, snapshots the weights, runs the optimizer step, and records the update
    ``before - after``; one host copy writes it all. With a scaler it also writes the scalars ``amp/loss_scale``
    (the scale this step used) and ``amp/step_skipped`` (1 when the scaler skipped the step because a gradient
    was NaN/Inf: the record then shows those NaN/Inf counts and a zero update). Returns whether the optimizer
    step was applied.

    ``origin``: a :class:`tb_gradhealth.torch_origin.OriginFinder`; with ``step(step, batch=(x, y))`` the first
    recorded NaN/Inf gradient (without a scaler) has its update undone and its step replayed to find where it was
    made (docs/NAN_ORIGIN.md); it needs every step, so with ``origin`` ``every`` defaults to 1.

    Given a module, each parameter's layer kind and activation (:mod:`tb_gradhealth.torch_kinds`) are kept in the
    tags' metadata; ``step(step, loss=loss)`` records the training loss on logged steps. The diagnosis uses both,
    and the optimizer's class and momentum, kept there too.

    A parameter with ``requires_grad=False`` or in none of ``optimizer``'s ``param_groups`` is recorded frozen (its
    ``.grad`` unread, its weights not copied), read again at each logged step (gradual unfreezing); one whose
    ``.grad`` was not produced since the last step (a branch not taken, ``zero_grad(set_to_none=False)``) is
    recorded missing: :class:`tb_gradhealth._torchparams.GradWatch`, armed around logged steps only.

    ``activations=True`` (a module given; off by default: it reads every recorded layer's output) also records
    each layer's output at logged steps, beside its gradient (the forward record, docs/ACTIVATIONS.md): forward
    hooks (:mod:`tb_gradhealth._torchforward`) registered after the step before a logged one and removed after
    it, so unlogged steps run none; the outputs are reduced on their device and leave it as a few numbers and one
    bit a unit. Several forwards before one ``step`` (micro-batches) are parts of one batch. Under
    ``torch.distributed`` the writing rank records its own batch.

    ``stop_on`` (statuses of :data:`tb_gradhealth.health.FLAGS`, e.g. ``("nonfinite", "exploding")``): at each
    logged step, the diagnosis ``tb-gradhealth report --step S`` gives on the logdir at that step
    (:class:`tb_gradhealth.live.StopCheck`, with ``thresholds``); at the first step where a layer's current status
    is watched, :attr:`should_stop` turns True and :attr:`stop_event` says why (a :class:`StopEvent`, also logged):
    the loop reads the flag and ends. ``raise_on_stop=True`` raises :class:`StopTraining` (holding the event) from
    that :meth:`step` instead, after its optimizer step. It needs a ``writer`` (the check reads what it writes);
    under ``torch.distributed`` the writing rank decides: broadcast the flag if every rank must stop.
    """

    def __init__(
        self,
        writer: Writer | None,
        model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        *,
        scaler: Any = None,
        every: int | None = None,
        first: int = 10,
        updates: bool = True,
        sharded: bool = False,
        group: Any = None,
        name: str = "gradients",
        origin: Any = None,
        stop_on: Sequence[str] = (),
        thresholds: Any = None,
        raise_on_stop: bool = False,
        activations: bool = False,
    ) -> None:
        if activations and not isinstance(model, torch.nn.Module):
            raise ValueError("activations=True reads the layers' outputs through forward hooks: give the model as a "
                             "torch.nn.Module, not its parameters")
        self.writer, self.optimizer, self.scaler = writer, optimizer, scaler
        self.origin = origin
        self.params = list(model.named_parameters() if isinstance(model, torch.nn.Module) else model)
        #: each parameter's (layer kind, activation) where a module says it, kept in the tags' metadata
        self.layer_info = (layer_info_for(model, [n for n, _ in self.params]) if isinstance(model, torch.nn.Module)
                           else ())
        self.every = every if every is not None else (1 if origin is not None else 100)
        self.first, self.updates = first, updates
        self.sharded, self.group, self.name = sharded, group, name
        self._failsafe = Failsafe()
        self._reusable = updates and all(type(p.detach()) is torch.Tensor and p.dtype == torch.float32
                                         for _, p in self.params)
        #: the snapshot tensors of the weights read, and which rows they are
        self._snapshot: tuple[list[int], list[torch.Tensor]] | None = None
        #: whether each ``.grad`` is the step's own (host bookkeeping armed around logged steps)
        self._watch = _torchparams.GradWatch(self.params)
        #: what the records' metadata says of the loop: PyTorch, the optimizer's class and momentum
        self.source = metadata.loop_source("torch", optimizer)
        self._stop = StopCheck(stop_on, thresholds=thresholds, name=name) if stop_on else None
        if self._stop is not None and writer is not None:
            self._stop.watch(writer)
        self.raise_on_stop = bool(raise_on_stop)
        #: the layers' outputs at logged steps (``activations=True``), armed for the first step's forward
        self._forward = ForwardHooks(model) if activations and writer is not None and _rank(group) == 0 else None
        if self._forward is not None:
            self._forward.arm(True)

    @property
    def dropped_records(self) -> int:
        """Logged steps whose records were not written (the logdir could not be written for longer than the
        writer's queue holds, or the recording failed: each failure is logged once; training went on)."""
        writer = self.writer.dropped_records if self.writer is not None else 0
        return writer + self._failsafe.dropped_records

    def _check_stop(self, step: int) -> None:
        """``stop_on`` at a logged step whose records, loss and skip flag are written."""
        stop = self._stop
        if stop is None or stop.event is not None:
            return
        found = getattr(self.origin, "origin", None)
        event = self._failsafe.run("checking stop_on", stop.check, step, found)
        if event is None:
            return
        _log.warning("%s; training should stop (StepRecorder.should_stop)", event.message())
        if self.raise_on_stop:
            raise StopTraining(event)

    def _optimizer_step(self) -> bool:
        if self.scaler is None:
            self.optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return not self.scaler.get_scale() < before  # the scaler backs off exactly when it skips a step

    def _buffers(self, step: int, selection: Selection) -> list[torch.Tensor] | None:
        """The snapshot tensors of the weights read (every parameter but the frozen ones), kept while the next step
        is logged too (then its copy writes memory already in use) and given back otherwise; ``None`` where the
        snapshot cannot be reused (weights not plain float32 tensors, or no updates recorded)."""
        if not self._reusable:
            return None
        live = selection.live
        if self._snapshot is None or self._snapshot[0] != live:  # a parameter was frozen or unfrozen
            self._snapshot = (live, [torch.empty_like(self.params[i][1].detach()) for i in live])
        buffers = self._snapshot[1]
        if not self.logs(step + 1):
            self._snapshot = None
        return buffers

    def logs(self, step: int) -> bool:
        """Whether ``step`` is logged: one of the ``first`` steps, or a multiple of ``every``."""
        return step < self.first or step % self.every == 0

    def step(self, step: int, batch: Sequence[Any] | None = None, *, loss: Any = None) -> bool:
        """Run the optimizer step, recording it when ``step`` is logged. ``loss``: this step's training loss (a
        tensor or a float), written with :meth:`Writer.add_loss` on logged steps only (the one host read of it)."""
        try:
            return self._step(step, batch, loss)
        finally:  # from here on a .grad that backward does not reach is not the next step's
            self._failsafe.run("watching which gradients a step produces", self._watch.stepped, self.logs(step + 1))
            if self._forward is not None:  # the hooks run only in the forward of a logged step
                self._forward.clear()
                self._failsafe.run("arming the forward hooks", self._forward.arm, self.logs(step + 1))

    def _step(self, step: int, batch: Sequence[Any] | None, loss: Any) -> bool:
        if not self.logs(step):
            return self._optimizer_step()
        if self.scaler is not None:
            try:
                self.scaler.unscale_(self.optimizer)
            except RuntimeError:  # already unscaled this step (e.g. for clipping)
                pass
        if not self.sharded and _rank(self.group) != 0:
            return self._optimizer_step()
        scale = self.scaler.get_scale() if self.scaler is not None else None
        hs = self.writer.hist_sample if self.writer is not None else record.DEFAULT_HIST_SAMPLE
        safe = self._failsafe  # the optimizer step runs whatever the recording does
        if loss is not None and self.writer is not None:
            safe.run("recording the loss", self.writer.add_loss, step,
                     loss.detach() if isinstance(loss, torch.Tensor) else loss)
        selection = safe.run("selecting the parameters to read", _torchparams.select, self.params, self.optimizer,
                             self._watch, records=1)
        buffers = None if selection is None else self._buffers(step, selection)
        pending = None if selection is None else safe.run(
            "computing the gradient-health record", before_step, self.params, step, hs, self.updates, buffers,
            selection=selection, records=1)
        applied = self._optimizer_step()
        if pending is None:
            return applied
        in_place = buffers is not None and self.origin is None  # the origin finder undoes the update from the snapshot
        grads = safe.run("finishing the gradient-health record", after_step, pending, self.params, self.sharded,
                         self.group, in_place, records=1)
        if grads is None:
            return applied
        before = pending.before
        if self.origin is not None and self.scaler is None:  # where the first NaN/Inf was made (torch_origin)
            found = safe.run("finding where the NaN/Inf was made", self.origin.after_step, step, grads, self.params,
                             before, batch, self.writer.logdir if self.writer is not None else None)
            applied = applied and (found is None or before is None)  # the update was undone
        if self.writer is not None:
            safe.run("writing a gradient-health record", self.writer.add_records, step,
                     [n for n, _ in self.params], grads, name=self.name, layer_info=self.layer_info,
                     source=self.source, records=1)
            if self._forward is not None:
                safe.run("writing the forward records", self._forward.write, self.writer, step, name=self.name,
                         source=self.source, records=1)
            if scale is not None:
                safe.run("writing the loss scale", self.writer.add_scalars, step,
                         {"amp/loss_scale": scale, "amp/step_skipped": float(not applied)})
            self._check_stop(step)
        return applied
