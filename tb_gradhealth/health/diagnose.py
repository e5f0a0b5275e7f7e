"""``diagnose_run``: from a run's per-layer records to its :class:`~tb_gradhealth.health.result.RunHealth`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health.answer import assign_ranks, deepest_first, group_depth, legacy_fields, run_answer
from tb_gradhealth.health.episodes import follow_siblings, join_blowup, onset, run_timeline, sweep_blowup, track
from tb_gradhealth.health.forward import Forward, read_units, with_activations
from tb_gradhealth.health.kinds import explain_kinds
from tb_gradhealth.health.levels import in_named_layer, layer_groups
from tb_gradhealth.health.optimizer import global_clip_note
from tb_gradhealth.health.outputs import explain_outputs
from tb_gradhealth.health.progress import (
    LossTrend,
    against_episode,
    loss_blowup,
    loss_trend,
    loss_windows,
    update_growth,
    weigh_growth,
    weigh_progress,
)
from tb_gradhealth.health.reasons import cause_first, layer_health
from tb_gradhealth.health.recovery import Losses
from tb_gradhealth.health.result import BASE, LayerHealth, RunHealth
from tb_gradhealth.health.rules import Steps, evaluate
from tb_gradhealth.health.thresholds import EXPLODING, HEALTHY, MISSING, NONFINITE, VANISHING, Thresholds


def _check_inputs(layers: Sequence[str], steps: np.ndarray, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps = np.asarray(steps)
    records = np.asarray(records, dtype=np.float64)
    if records.ndim != 3 or records.shape[2] != record.NUM_FIELDS:
        raise ValueError(f"records must have shape [steps, layers, {record.NUM_FIELDS}], got {records.shape}")
    if steps.shape != (records.shape[0],):
        raise ValueError(f"steps must have shape [{records.shape[0]}] (one per record row), got {steps.shape}")
    if len(layers) != records.shape[1]:
        raise ValueError(f"{len(layers)} layer names for {records.shape[1]} record columns")
    if steps.size > 1 and np.any(np.diff(steps) <= 0):
        raise ValueError("steps must be ascending and unique")
    return steps.astype(np.int64), records


def diagnose_run(
    layers: Sequence[str],
    steps: np.ndarray,
    records: np.ndarray,
    thresholds: Thresholds = Thresholds(),  # noqa: B008 - frozen, immutable default
    at_step: int | None = None,
    progress: tuple[np.ndarray, np.ndarray] | None = None,
    layer_info: Mapping[str, tuple[str, str]] | None = None,
    skipped: tuple[np.ndarray, np.ndarray] | None = None,
    source: Mapping[str, str] | None = None,
    nan_origin: tuple[int, str | None] | None = None,
    activations: Any = None,
) -> RunHealth:
    """Diagnose every layer of a run from its records, using the logged steps at or before ``at_step``.

    ``layers``: names in network (forward) order; ``steps``: int [S] ascending unique; ``records``: float64
    ``[S, L, record.NUM_FIELDS]`` memory form, a layer's row all-NaN at a step where it has no record.
    ``at_step`` (default: the last step) must not precede the first step (ValueError naming ``step``).
    A layer without any record up to the step is reported ``missing``. ``progress``: ``(steps, loss)`` of the
    training loss where it is recorded (:mod:`tb_gradhealth.progress` reads it), evidence beside the gradients.
    ``layer_info``: ``{layer: (kind, activation)}`` where the writer knew the model (:mod:`tb_gradhealth.layerinfo`),
    named in the reasons and used to pick the fixes. ``skipped``: ``(steps, flags)`` where the writer knew whether
    the optimizer applied the step (``amp/step_skipped``: 1 skipped, e.g. by a loss scaler after an overflow; 0
    applied), the only evidence of a skip besides the records that follow it. ``source``: what the writer knew of
    the training loop (:data:`tb_gradhealth.metadata.Content.source`: ``{"loop": "keras.fit", "optimizer": "SGD",
    ...}``), used to word the fixes for the loop the user runs; its ``clip_norm`` (the global norm the loop clips the
    gradients to): a step clipped to it is no evidence that the update feeds the next gradient.
    ``nan_origin``: ``(step, layer)`` where the writer replayed its first NaN/Inf step and found the layer that
    made it (:mod:`tb_gradhealth.origin`; ``layer`` None when it was made outside any layer): the answer then names
    that layer, which every gradient record of that step (NaN in every layer when it was made on the way forward)
    cannot tell. ``activations``: the layers' outputs
    where the writer recorded them (:class:`tb_gradhealth.health.forward.Forward`, a tuple ``(outputs, steps,
    records[, info])`` or a :class:`tb_gradhealth.reader.ActivationSeries`): a layer most of whose rectifier units
    are dead is ``dead``, a saturating layer's vanishing reason quotes its saturated fraction, a forward blow-up is
    named as the cause of the exploding layers after it, and each layer carries its output's latest fields
    (``forward``); a layer without such a record reads as without them.
    """
    steps, records = _up_to(*_check_inputs(layers, steps, records), at_step)
    t = thresholds
    if steps.size == 0 or len(layers) == 0:
        out = [LayerHealth(layer=name, index=i, status=MISSING.word, severity=BASE[MISSING],
                           reasons=["no record of this layer"], first_step=None, step=None)
               for i, name in enumerate(layers)]
        return RunHealth(step=None, thresholds=t, layers=out)
    depth, groups = group_depth(layers), layer_groups(layers)
    windows = loss_windows(steps, progress, t) if progress is not None else None
    fw = Forward.of(activations)
    units = read_units(fw, layers, steps) if fw is not None else None
    ev = evaluate(records, layers, t, windows, _told(steps, skipped), units.dead if units is not None else None,
                  clip_norm(source), units.saturated if units is not None else None)
    losses = Losses.of(progress)
    out, borrowed, forward, started, reached = _layer_healths(ev, steps, records, layers, t, depth, groups,
                                                              with_activations(layer_info or {}, units, layers),
                                                              losses, _made_in(nan_origin, steps))
    trend = loss_trend(progress[0], progress[1], int(steps[-1])) if progress is not None else None
    out, stalled = _add_evidence(out, ev, records, t, trend, layer_info, groups)
    out = weigh_growth(out, trend, update_growth(steps, records) if trend is not None else None, int(steps[-1]),
                       source)
    if fw is not None and units is not None:
        out = explain_outputs(out, fw, units, t, int(steps[-1]))
    out = _last_finite(out, steps, records)
    ranked, is_cause = cause_first(sorted(out, key=lambda lh: (-lh.severity, lh.index)), borrowed, depth, forward,
                                   started, stalled, reached)
    answer = run_answer(ranked, is_cause, (int(steps[0]), int(steps[-1])))
    if trend is not None and losses is not None and answer is not None \
            and answer["status"] in (EXPLODING.word, NONFINITE.word):
        trend = against_episode(trend, losses, steps, int(answer["step"]), t)
    ranked = assign_ranks(ranked, answer)
    first_bad, cause = legacy_fields(answer)
    timeline, earlier = run_timeline(out, answer, depth)
    blowup = loss_blowup(progress[0], progress[1], int(steps[-1])) if progress is not None else None
    if blowup is not None:
        bad = np.flatnonzero((ev.nonfinite & ~ev.skipped).any(axis=1))
        blowup["gradients_step"] = int(steps[bad[0]]) if bad.size else None
    return RunHealth(step=int(steps[-1]), thresholds=t, layers=ranked, first_bad=first_bad, onset=onset(out),
                     timeline=timeline, cause=cause, loss_trend=trend.to_json() if trend is not None else None,
                     answer=answer, earlier=earlier, loss_nonfinite=blowup)


def clip_norm(source: Mapping[str, str] | None) -> float | None:
    """The global norm the loop clips the recorded gradients to, where its writer states one
    (``source["clip_norm"]``), else None."""
    try:
        value = float((source or {}).get("clip_norm", "nan"))
    except ValueError:
        return None
    return value if value > 0 and np.isfinite(value) else None


def _told(steps: np.ndarray, skipped: tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """``[S]`` the writer's word on each logged step: 1 the optimizer skipped it, 0 applied it, NaN not said."""
    if skipped is None:
        return None
    at, flags = np.asarray(skipped[0], dtype=np.int64), np.asarray(skipped[1], dtype=np.float64)
    out = np.full(steps.shape, np.nan)
    k = np.searchsorted(at, steps)
    hit = (k < at.size) & (at[np.minimum(k, at.size - 1)] == steps) if at.size else np.zeros(steps.shape, bool)
    out[hit] = np.where(flags[k[hit]] > 0.5, 1.0, 0.0)
    return out


def _up_to(steps: np.ndarray, records: np.ndarray, at_step: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The logged steps at or before ``at_step`` (all of them when it is None) and their records."""
    if at_step is None:
        return steps, records
    end = int(np.searchsorted(steps, at_step, side="right"))
    if end == 0 and steps.size:
        raise ValueError(f"step {at_step} is before the first logged step {int(steps[0])}")
    return steps[:end], records[:end]


def _made_in(nan_origin: tuple[int, str | None] | None, steps: np.ndarray) -> tuple[int, str] | None:
    """``(step, layer)`` of a replayed NaN/Inf made in a layer, at a step the records have; else None."""
    if nan_origin is None or not nan_origin[1] or int(nan_origin[0]) not in set(steps.tolist()):
        return None
    return int(nan_origin[0]), str(nan_origin[1])


def _layer_healths(ev: Steps, steps: np.ndarray, records: np.ndarray, layers: Sequence[str], t: Thresholds,
                   depth: np.ndarray, groups: list[np.ndarray], info: Mapping[str, tuple[str, str]],
                   losses: Losses | None, made_in: tuple[int, str] | None = None
                   ) -> tuple[list[LayerHealth], frozenset[str], frozenset[str], frozenset[str],
                              dict[str, frozenset[int]]]:
    """Each layer's episodes, status, reasons, severity and fixes (for its kind, ``info``), in network order; the
    layers whose onset is another variable's (of their layer, or of a blow-up that reached them); those whose current
    chain the huge-inputs rule flagged (the activations blew up on their way forward); the one where the first NaN/Inf
    started; and the first steps of each layer's episodes that are another layer's blow-up, which reached it."""
    d = record.derived(records[_last_rows(ev.present), np.arange(len(layers))])
    pace = _layer_pace(d, ~ev.present.any(axis=0), groups)
    tracks = [track(ev, i, t, steps, losses) if ev.columns("present")[i].any() else None
              for i in range(len(layers))]
    began = np.array([tr.rows[tr.chain_start()] if tr is not None and tr.runs else np.inf for tr in tracks])
    origin = _first_nonfinite(ev.nonfinite & ~ev.skipped, depth, ev.size.max(axis=0), began,
                              _replayed(made_in, steps, layers))
    borrowed = follow_siblings(tracks, ev, layers) | join_blowup(tracks, ev, layers, t)
    borrowed |= sweep_blowup(tracks, ev, layers, t)
    reached = {layers[c]: frozenset(int(steps[tr.rows[a]]) for a in tr.swept)
               for c, tr in enumerate(tracks) if tr is not None and tr.swept}
    forward = frozenset(layers[i] for i, tr in enumerate(tracks)
                        if tr is not None and tr.runs and ev.exp_inputs[tr.rows[tr.chain_start():], i].any())
    started = frozenset({layers[origin[1]]}) if origin is not None else frozenset()
    return [layer_health(ev, steps, layers, i, d, origin, t, tracks[i], info.get(layers[i], ("", "")), pace)
            for i in range(len(layers))], borrowed, forward, started, reached


def _last_rows(present: np.ndarray) -> np.ndarray:
    """``[L]`` each layer's last row with a record (0 where it has none)."""
    return np.where(present.any(axis=0), present.shape[0] - 1 - np.argmax(present[::-1], axis=0), 0)


def _replayed(made_in: tuple[int, str] | None, steps: np.ndarray, layers: Sequence[str]) -> tuple[int, set[int]]:
    """``(row, variables)`` of the layer a writer's replay found making the first NaN/Inf; ``(-1, set())`` none."""
    if made_in is None:
        return -1, set()
    return int(np.searchsorted(steps, made_in[0])), {i for i, n in enumerate(layers) if in_named_layer(n, made_in[1])}


def _first_nonfinite(nonfinite: np.ndarray, depth: np.ndarray, size: np.ndarray, began: np.ndarray,
                     replayed: tuple[int, set[int]] = (-1, set())) -> tuple[int, int, int] | None:
    """(first step row with NaN/Inf, the layer where it started, how many layers were nonfinite there) or None.
    Backprop computes the deepest layer first, so the deepest nonfinite layer is where it started; of that layer's
    variables (a bias and its kernel receive one upstream gradient), the one whose chain of flags began first
    (``began``: its row), as the run's answer and timeline name it, then the largest (:func:`deepest_first`).
    Where a writer replayed that step (``replayed``: its row and the variables of the layer that made the NaN/Inf),
    that layer, whatever backprop's order says."""
    rows = np.flatnonzero(nonfinite.any(axis=1))
    if rows.size == 0:
        return None
    r = int(rows[0])
    bad = np.flatnonzero(nonfinite[r])
    made = [int(i) for i in bad if int(i) in replayed[1]] if replayed[0] == r else []
    if made:  # the replay saw where it was made: that layer, named by its largest variable
        return r, max(made, key=lambda i: deepest_first(depth, size, i)), int(bad.size)

    def first_in_deepest(i: int) -> tuple[float, ...]:
        layer_depth, *rest = deepest_first(depth, size, int(i))
        return (layer_depth, -began[i], *rest)

    return r, int(max(bad, key=first_in_deepest)), int(bad.size)


def _last_finite(out: list[LayerHealth], steps: np.ndarray, records: np.ndarray) -> list[LayerHealth]:
    """The layers with ``last_finite`` set where the last record holds NaN/Inf: the step and magnitudes of its
    latest record whose values were all finite (what the gradient was just before); None when it has none."""
    counts = record.nonfinite_count(records)  # [S, L], NaN where a layer has no record
    present = ~np.isnan(records[..., record.INDEX["size"]])
    with np.errstate(invalid="ignore"):
        finite = present & (counts == 0) & (record.finite_count(records) > 0)
    healed = []
    for lh in out:
        col = present[:, lh.index]
        good = np.flatnonzero(finite[:, lh.index])
        if not col.any() or counts[np.flatnonzero(col)[-1], lh.index] == 0 or good.size == 0:
            healed.append(lh)
            continue
        d = record.derived(records[good[-1], lh.index][None])
        healed.append(dataclasses.replace(lh, last_finite={
            "step": int(steps[good[-1]]), **{k: float(d[k][0]) for k in ("rms", "max_abs", "norm")}}))
    return healed


def _layer_pace(d: dict[str, np.ndarray], never: np.ndarray, groups: list[np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """``([L]`` ||update|| / ||weight||, ``[L]`` ||gradient|| / ||weight||``)`` of each variable's layer: those of
    its largest variable (its kernel: the bulk of its parameters), each at its last record with a gradient (``d``;
    NaN where it never had one). Whether a layer barely learns is the layer's figure: a bias set far from zero
    moves little beside itself while its kernel learns, and one that starts at zero moves a lot beside itself while
    its kernel does not."""
    upd, grad = (np.where(never, np.nan, d[k]) for k in ("update_to_weight", "grad_to_weight"))
    for cols in groups:
        main = cols[int(np.argmax(d["size"][cols]))]
        if not never[main]:
            upd[cols], grad[cols] = upd[main], grad[main]
    return upd, grad


def _add_evidence(out: list[LayerHealth], ev: Steps, records: np.ndarray, t: Thresholds, trend: LossTrend | None,
                  layer_info: Mapping[str, tuple[str, str]] | None, groups: list[np.ndarray]
                  ) -> tuple[list[LayerHealth], frozenset[str]]:
    """The layers with what the records alone do not hold: the training loss (read per layer, ``groups``: the
    columns of each layer's variables), the layers' kinds, the optimizer's global clip; and those the loss found
    exploding under a learning rate far too small for their gradients."""
    stalled: frozenset[str] = frozenset()
    if trend is not None:
        active = ev.present & ~ev.idle  # a step a layer sat out moved nothing by design
        rows, cols = _last_rows(active), np.arange(ev.present.shape[1])
        d = record.derived(records[rows, cols])
        never = ~active.any(axis=0)
        own = _layer_pace(d, never, groups)
        out, stalled = weigh_progress(out, trend, t, proportional=ev.proportional,
                                      scaled=(10.0 ** ev.log_grad[rows, cols], 10.0 ** ev.log_upd[rows, cols]),
                                      own=own)
    if layer_info:
        out = explain_kinds(out, layer_info)
    clip = global_clip_note(records)
    if not clip:
        return list(out), stalled
    return [dataclasses.replace(lh, reasons=[*lh.reasons, clip]) if lh.code in (EXPLODING, VANISHING, HEALTHY)
            else lh for lh in out], stalled
