"""Reasons in plain language for each status, the notes beside them, each layer's severity and the run's first_bad."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health import thresholds as th
from tb_gradhealth.health.answer import deepest_first
from tb_gradhealth.health.episodes import CHAIN_GAP, Track, flagged_episodes
from tb_gradhealth.health.fixes import fixes
from tb_gradhealth.health.kinds import RECTIFIERS, SATURATING
from tb_gradhealth.health.optimizer import optimizer_notes
from tb_gradhealth.health.recovery import Lasting
from tb_gradhealth.health.result import BASE, SPAN, LayerHealth
from tb_gradhealth.health.rules import ROUNDOFF, Steps


def layer_health(ev: Steps, steps: np.ndarray, layers: Sequence[str], i: int, d: dict[str, np.ndarray],
                  origin: tuple[int, int, int] | None, t: th.Thresholds, track: Track | None,
                  info: tuple[str, str] = ("", ""), pace: tuple[np.ndarray, np.ndarray] | None = None) -> LayerHealth:
    """One layer's diagnosis: status, reasons, severity, fixes (for its kind and activation ``info`` where the writer
    recorded them), chain start and the onset of its current status. ``pace``: ``([L]`` update/weight, ``[L]``
    grad/weight``)`` of each variable's layer, which its ratio notes read (default: its own, in ``d``)."""
    name = layers[i]
    if track is None and ev.recorded[:, i].any():  # recorded only at steps the optimizer skipped
        note = (_past_nonfinite_note(ev.nonfinite[:, i], ev.skipped[:, i], steps) if ev.skipped[:, i].any() else
                "note: recorded only at steps the optimizer skipped so far: no evidence of any status yet")
        return LayerHealth(layer=name, index=i, status=th.HEALTHY.word, severity=0.0, first_step=None, step=None,
                           reasons=[note])
    if track is None:
        return LayerHealth(layer=name, index=i, status=th.MISSING.word, severity=BASE[th.MISSING] + 1.0,
                           reasons=[f"no record of this layer at or before step {int(steps[-1])}"], first_step=None,
                           step=None)
    code = track.code
    s = int(track.rows[-1])
    last = track.runs[-1]
    chain = track.chain_start()
    ctx = _Ctx(ev=ev, steps=steps, s=s, i=i, run_len=last[2] - last[1] + 1,
               run_first_step=int(steps[track.rows[last[1]]]), t=t,
               before_row=int(track.rows[last[1] - 1]) if last[1] > 0 else int(track.rows[0]),
               status=th.STATUSES[code], activation=info[1], carried=track.lasting.get(last[1]),
               quiet=track.quiet, swept=_swept(track, last[1], steps, layers))
    reasons, excess = _reasons(code, ctx, d, i)
    reasons += _confirmation_notes(code, track, ctx, t)
    idle = _idle(ev, track, i)
    if idle and code not in (th.MISSING, th.DEAD):
        reasons.append(_idle_note(idle, len(track.rows), bool(ev.routed[s])))
    ever_nonfinite = ev.nonfinite[:, i]
    if code != th.NONFINITE and ever_nonfinite.any():
        reasons.append(_past_nonfinite_note(ever_nonfinite, ev.skipped[:, i], steps))
    if origin is not None and (code == th.NONFINITE or (origin[1] == i and code in th.FLAG_CODES)):
        reasons.append(_origin_note(origin, i, layers, steps))
    # a dead, NaN or missing gradient (now, or at an unconfirmed last step) makes the ratios moot
    if code in (th.EXPLODING, th.VANISHING, th.HEALTHY) and not ev.idle[s, i] and (
            ev.raw[s, i] not in (th.MISSING, th.DEAD, th.NONFINITE) or _units_dead_at(ev, s, i)):
        reasons.extend(_ratio_notes(d, i, t, pace))
        reasons.extend(optimizer_notes(ev, s, i))
    flagged = code in th.FLAG_CODES
    severity = _severity(code, excess, last[2] - chain + 1, origin is not None and origin[1] == i
                         and track.rows[chain] <= origin[0])
    nan_here = origin is not None and origin[1] == i
    first_step = int(steps[track.rows[chain]]) if flagged else None
    since = int(steps[track.rows[max(last[1], chain)]]) if flagged else None
    episodes = flagged_episodes(track, steps)
    if flagged and first_step is not None and since is not None and first_step < since:
        reasons.append(_chain_note(episodes, first_step, th.STATUSES[code], since))
        if track.joined:
            reasons.append(f"note: dated from step {first_step}, where its gradient began to rise out of its "
                           f"range while another layer's blow-up went on: the same blow-up reached it there")
    return LayerHealth(
        layer=name, index=i, status=th.STATUSES[code], severity=float(severity), reasons=reasons,
        fixes=fixes(code, ev, track, i, nan_here, info) if code not in (th.HEALTHY, th.FROZEN) else [],
        first_step=first_step, step=int(steps[s]), status_since=since, episodes=episodes,
        size=int(d["size"][i]) if np.isfinite(d["size"][i]) else 0,
        **{k: float(d[k][i]) for k in ("norm", "rms", "max_abs", "mean", "zero_fraction", "grad_to_weight",
                                       "update_to_weight", "noise", "weight_norm")},
        nan=int(d["nan"][i]), inf=int(d["inf"][i]), idle_steps=idle, logged_steps=len(track.rows),
    )


def _swept(track: Track, run: int, steps: np.ndarray, layers: Sequence[str]) -> tuple[int, str, float] | None:
    """The blow-up the layer's run starting at position ``run`` belongs to (:func:`episodes.sweep_blowup`), as its
    reason names it: its step, the variables it began in (the last in network order first, two named) and how far
    this one's gradient had risen there."""
    if run not in track.swept:
        return None
    row, began, rose = track.swept[run]
    names = " and ".join(layers[c] for c in began[:2])
    more = len(began) - 2
    return int(steps[row]), names + (f" and {more} other variable{'s' if more > 1 else ''}" if more > 0 else ""), rose


def _idle_note(idle: int, n: int, routed: bool) -> str:
    """How often a parameter had no gradient, where no flagged episode explains it (``routed``: the run chooses
    its gradient paths step by step, :func:`tb_gradhealth.health.rules.routed`)."""
    if idle == n and routed:
        return (f"note: no gradient at any of its {n} logged steps so far, while other parameters of this run get "
                f"one at some steps only (routing): idle so far, not missing; one that never gets a gradient is a "
                f"path the run never takes (an expert its router never picks: balance the routing)")
    return (f"note: no gradient at {idle} of {n} logged steps ({idle / n:.0%}): used at some steps only (expert "
            f"routing, a branch not taken, embedding rows), not missing or dead")


def _idle(ev: Steps, track: Track, i: int) -> int:
    """Logged steps at which the layer had no gradient or an all-zero one (a ``None`` or zero ``.grad``) outside
    its flagged episodes: idle at times, where no confirmed status explains it."""
    idle = ev.columns("idle")[i, track.rows].copy()
    for code, a, b in track.runs:
        if code in th.FLAG_CODES:
            idle[a:b + 1] = False
    return int(np.count_nonzero(idle))


def _confirmation_notes(code: int, track: Track, ctx: _Ctx, t: th.Thresholds) -> list[str]:
    """A trailing slow run not yet confirmed, and a slow status confirmed over fewer steps on a short run."""
    notes = []
    if track.unconfirmed is not None:
        need = t.sustain_steps if track.unconfirmed[0] in (th.DEAD, th.MISSING) else track.need
        units = track.unconfirmed[0] == th.DEAD and _units_dead_at(ctx.ev, ctx.s, ctx.i)
        notes.append(_unconfirmed_note(track.unconfirmed, ctx, min(need, t.sustain_steps), units))
    if code == th.VANISHING and track.need < t.sustain_steps:
        notes.append(f"note: a short run ({len(track.rows)} logged step(s)): confirmed over {track.need} logged "
                     f"step(s) instead of {t.sustain_steps}, so less certain; more logged steps would confirm it")
    return notes


def _severity(code: int, excess: float, persistence: int, nan_started_here: bool) -> float:
    """Base of the status plus how far beyond its line and for how many logged steps of its chain; the layer where
    NaN/Inf started ranks first while it is flagged, whatever it turned into since (a layer whose weights became NaN
    often has an all-zero gradient afterwards)."""
    if code == th.INERT:
        return BASE[th.INERT] + 1.0
    if code in (th.HEALTHY, th.FROZEN):
        return 0.0
    if nan_started_here:
        return BASE[th.NONFINITE] + SPAN - 1.0
    return BASE[code] + min(SPAN - 2.0, (1.0 + excess) * persistence)


def chain_worst(lh: LayerHealth) -> th.Status:
    """The most severe status of the layer's current chain of episodes (its current status where it has none): a
    layer that exploded and whose units then died is still the one that exploded."""
    if lh.first_step is None:
        return lh.code
    return min((th.Status.of(e["status"]) for e in lh.episodes if e["to"] >= lh.first_step), default=lh.code)


def cause_first(ranked: list[LayerHealth], borrowed: frozenset[str] = frozenset(), depth: np.ndarray | None = None,
                forward: frozenset[str] = frozenset(), started: frozenset[str] = frozenset(),
                stalled: frozenset[str] = frozenset(), reached: Mapping[str, frozenset[int]] | None = None
                ) -> tuple[list[LayerHealth], bool]:
    """The ranking with the cause first, and whether it has one: among the flagged layers whose chain of episodes
    reached the most severe status (:func:`chain_worst`), the one whose chain began first (ties: see
    :func:`_culprit`). A learning rate that explodes every layer at step 1 and kills their ReLUs by step 3 is told as
    "exploding from step 1 -> dead from 3", not as "dead since 1", and stays so while another layer explodes later:
    the units that died are part of the chain, not its cause. ``borrowed``: layers whose onset is a larger variable's
    of their layer (a small tensor follows its layer); the onset is their layer's, not evidence of their own, so they
    are the cause only when nothing else ties.
    ``depth``: :func:`~tb_gradhealth.health.answer.group_depth` of the layers (default: each variable its own
    layer). ``forward``: layers whose explosion the huge-inputs rule read (see :func:`_culprit`). Evidence that names
    a layer beyond its depth decides first: ``started``, the layer where the first NaN/Inf started (a writer's replay
    saw the layer that made it, or backprop's order), the answer of a chain that reached NaN/Inf wherever another
    began; then, among those tied, ``stalled``, layers exploding under a learning
    rate far too small for their gradients (among the tied, the highest severity: the gradient largest beside its
    weights). ``reached``: the first steps of each layer's episodes that are another layer's blow-up
    (:func:`episodes.sweep_blowup`), no evidence of its own. The answer's words are
    :func:`tb_gradhealth.health.answer.run_answer`'s."""
    if not ranked or not ranked[0].code.is_flag:
        return ranked, False
    if depth is None:
        depth = np.arange(max(lh.index for lh in ranked) + 1)
    worst = min(chain_worst(lh) for lh in ranked if lh.code.is_flag)
    chains = [lh for lh in ranked if lh.code.is_flag and chain_worst(lh) == worst and lh.first_step is not None]
    began = min((lh.first_step for lh in chains), default=None)
    tied = [lh for lh in chains if lh.first_step == began]
    tied = [lh for lh in tied if lh.layer not in borrowed] or tied
    # NaN/Inf: the layer where it started (a replay saw it made there, or backprop reached it first) is the answer
    # even when another layer's chain began a step earlier: the chain that ends in NaN is told from where NaN began
    first_nan = [lh for lh in (chains if worst == th.NONFINITE else tied) if lh.layer in started]
    if first_nan:
        top = first_nan[0]
    elif any(lh.layer in stalled for lh in tied):
        top = max(tied, key=lambda lh: (lh.severity, -lh.index))
    else:
        top = _culprit(tied, worst, ranked, depth, forward, began, reached) if chains else ranked[0]
    return [top] + [lh for lh in ranked if lh is not top], True


#: Vanishing layers within this many decades of the most vanished one sit on the same plateau of the flow; a rise of
#: more than this from the plateau's deepest layer to the next deeper one is a cliff: the gradient is cut there.
PLATEAU_DECADES = 1.0


def _culprit(tied: list[LayerHealth], status: th.Status, ranked: list[LayerHealth], depth: np.ndarray,
             forward: frozenset[str] = frozenset(), began: int | None = None,
             reached: Mapping[str, frozenset[int]] | None = None) -> LayerHealth:
    """Where a chain that began at one step on several layers started, named by that layer's largest tied variable
    (:func:`deepest_first`). Exploding, NaN and the rest: the deepest layer, which backprop reaches first; but an
    explosion the huge-inputs rule read (``forward``: the activations blew up on their way forward, and every later
    layer's gradient is large because its inputs are) started where the forward pass does: the first tied layer of
    those in network order. Vanishing: see :func:`_vanishing_layer`."""
    if status == th.VANISHING:
        tied = _vanishing_layer(tied, ranked, depth) or tied
    size = np.zeros(len(depth))
    for lh in ranked:
        size[lh.index] = lh.size
    ahead = [lh for lh in tied if lh.layer in forward] if status == th.EXPLODING else []
    if ahead:
        first = min(int(depth[lh.index]) for lh in ahead)
        tied = [lh for lh in ahead if int(depth[lh.index]) == first]
    elif status == th.EXPLODING:
        tied = _behind_the_head(tied, ranked, depth, began, reached) or tied
    return max(tied, key=lambda lh: deepest_first(depth, size, lh.index))


def _behind_the_head(tied: list[LayerHealth], ranked: list[LayerHealth], depth: np.ndarray,
                     began: int | None = None, reached: Mapping[str, frozenset[int]] | None = None
                     ) -> list[LayerHealth]:
    """The tied variables outside the output layer, when its smallest variable (its bias) was not exploding at the
    step the tied chains began (``began``; None: its chain at all): a weight's gradient is its bias's times the
    layer's inputs, and the output bias's is the loss's own, which nothing amplifies; an output weight exploding
    beside a calm bias is large because its inputs are, and the layer before made them. Read at the onset, so a
    bias that joins the blow-up later does not move the cause to the head, nor does an episode of the bias that is
    only the blow-up reaching it (``reached``: its own gradient flagged nothing there). Empty when the model is one
    layer or nothing else ties."""
    last = int(depth.max())
    head = [lh for lh in ranked if int(depth[lh.index]) == last]
    if len(head) < 2:
        return []
    bias = min(head, key=lambda lh: (lh.size, -lh.index))
    blown = (th.EXPLODING.word, th.NONFINITE.word)
    if began is None and chain_worst(bias) in (th.EXPLODING, th.NONFINITE):
        return []
    own = [e for e in bias.episodes if e["from"] not in (reached or {}).get(bias.layer, ())]
    if began is not None and any(e["status"] in blown and e["from"] <= began <= e["to"] for e in own):
        return []
    return [lh for lh in tied if int(depth[lh.index]) != last]


def _levels(layers: list[LayerHealth]) -> dict[int, float]:
    return {lh.index: math.log10(lh.rms) for lh in layers if lh.rms > 0 and math.isfinite(lh.rms)}


def _vanishing_layer(tied: list[LayerHealth], ranked: list[LayerHealth], depth: np.ndarray) -> list[LayerHealth]:
    """The tied variables of the layer a vanishing chain is blamed on. The gradient falls on its way to the input, so
    the cause is where it is lowest: the most vanished layer (a smooth sigmoid decay: its input end, not a borderline
    layer near the line). Except at a cliff: when the deepest layer of the most vanished plateau (within
    ``PLATEAU_DECADES`` of the lowest) lies more than ``PLATEAU_DECADES`` below the next deeper layer, the gradient is
    cut there (a tiny multiplier, a stop_gradient'ed branch) and every shallower layer is as low because of it: the
    cut layer is named. Empty when no tied layer has a live RMS."""
    logs = _levels(tied)
    if not logs:
        return []
    low_i = min(logs, key=lambda i: (logs[i], -i))
    low = logs[low_i]
    edge = max((i for i, v in logs.items() if v <= low + PLATEAU_DECADES), key=lambda i: (depth[i], i))
    level = _levels(ranked)
    here = max(v for i, v in level.items() if depth[i] == depth[edge])
    deeper = [int(depth[i]) for i in level if depth[i] > depth[edge]]
    if deeper:
        nxt = min(deeper)
        if max(v for i, v in level.items() if depth[i] == nxt) - here > PLATEAU_DECADES:
            low_i = edge
    return [lh for lh in tied if depth[lh.index] == depth[low_i]]


@dataclass(frozen=True, kw_only=True)
class _Ctx:
    ev: Steps
    steps: np.ndarray
    s: int  # row of the layer's last record
    i: int  # layer
    run_len: int
    run_first_step: int
    t: th.Thresholds
    before_row: int = 0  # row just before the current run (its first row when it starts the layer's history)
    status: str = ""  # the layer's current status, named where the text says since when
    activation: str = ""  # the layer's activation where the writer recorded it
    carried: Lasting | None = None  # why the current run goes on past its rules: it has not recovered
    quiet: int = 0  # trailing quiet records the current exploding run holds pending
    #: ``(step, variables, decades)``: the current run is the blow-up that began in those variables at that step,
    #: which this one's gradient rose with by that many decades (no rule of its own flagged it)
    swept: tuple[int, str, float] | None = None

    def lasting_steps(self) -> str:
        """``for 140 logged steps since`` the current run began (``at step N`` for one)."""
        n = self.run_len
        return f"at step {int(self.steps[self.s])}" if n <= 1 else f"for {n} logged steps since then"

    def lasting(self) -> str:
        n = self.run_len
        if n <= 1:
            return f"at step {int(self.steps[self.s])}"
        since = f"{self.status} since" if self.status else "since"
        return f"for the last {n} logged steps ({since} step {self.run_first_step})"

    def ref_text(self) -> str:
        ref = float(self.ev.ref[self.s])
        return f"the layers nearest the loss ({_e(10.0 ** ref)})" if math.isfinite(ref) else "the reference"


def _e(x: float) -> str:
    return f"{x:.1e}"


def _rms_text(c: _Ctx, d: dict[str, np.ndarray]) -> str:
    """``RMS 1.0e-03``, saying when it is over the nonzero values only (a sparse gradient)."""
    rms = float(c.ev.rms[c.s, c.i])
    zero = float(d["zero_fraction"][c.i])
    return f"RMS {_e(rms)}" + (f" (over its {1 - zero:.0%} nonzero values)" if zero > 0.5 else "")


def _relative_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i = c.ev, c.s, c.i
    above = ev.dec(s, i)
    reasons = [f"{_rms_text(c, d)} is {above:.1f} decades above {c.ref_text()} {c.lasting()}: the gradient grows on "
               f"its way back from the loss"]
    lu, ru = float(ev.log_upd[s, i]), float(ev.ref_upd[s])
    if math.isfinite(lu) and math.isfinite(ru):
        reasons.append(f"it learns {lu - ru:.1f} decades faster than the layers nearest the loss (update RMS / "
                       f"weight RMS {_e(10.0 ** lu)} against {_e(10.0 ** ru)})")
    return reasons, above - c.t.explode_decades


def _rms_bound_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    rms = float(c.ev.rms[c.s, c.i])
    return ([f"{_rms_text(c, d)} is above the absolute bound {c.t.explode_rms_above:g}"],
            math.log10(rms / c.t.explode_rms_above))


def _max_bound_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    m = float(c.ev.max_abs[c.s, c.i])
    return ([f"max |g| {_e(m)} is above the absolute bound {c.t.explode_max_abs_above:g}"],
            math.log10(m / c.t.explode_max_abs_above))


def _update_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    r = float(c.ev.upd_ratio[c.s, c.i])
    return ([f"the applied update is {r:,.3g}x the weight's norm: the weights are blowing up (learning rate too high "
             f"for this layer)"], math.log10(r / c.t.explode_update_ratio))


def _feedback_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    r = 10.0 ** float(c.ev.log_upd[c.s, c.i])
    return ([f"each update moves the weights by {r:.2g}x their RMS and the gradient and the update have both grown "
             f"at every one of the last logged steps: the step feeds the next gradient (a learning rate too high "
             f"for this layer)"], math.log10(r / c.t.update_ratio_above))


def _trend_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i, t = c.ev, c.s, c.i, c.t
    g = float(ev.log_rms[s, i] - ev.base[s, i])
    return ([f"RMS grew {10.0 ** g:,.0f}x ({g:.1f} decades) within the last {t.growth_window} logged steps, from "
             f"{_e(10.0 ** float(ev.base[s, i]))} to {_e(float(ev.rms[s, i]))} at step {int(c.steps[s])}"],
            g - t.growth_decades)


def _capped_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    r = 10.0 ** float(c.ev.log_upd[c.s, c.i])
    return ([f"its gradient norm sits at its clip ({_e(float(c.ev.norm[c.s, c.i]))}) and each clipped update moves "
             f"the weights by {r:.2g}x their RMS, for at least {c.t.sustain_steps} logged steps: the clip, not the "
             f"gradient, sets every step (the gradient before clipping is not recorded); a learning rate too high, "
             f"held back by the clip"], math.log10(r / c.t.update_ratio_above))


def _swing_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    rise = float(c.ev.loss_rise[c.s])
    return ([f"the loss jumped {10.0 ** rise:,.0f}x ({rise:.1f} decades) within the last {2 * c.t.growth_window} "
             f"logged steps and keeps swinging by decades since this layer's gradient blew up: the blow-up goes on "
             f"(an adaptive optimizer keeps each step small, the gradients are still out of control)"],
            rise - c.t.growth_decades / 2)


def _volatile_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    g, rise, w = float(c.ev.grad_swing[c.s, c.i]), float(c.ev.loss_rise[c.s]), 2 * c.t.growth_window
    return ([f"its gradient RMS swung by {10.0 ** g:,.0f}x ({g:.1f} decades) within the last {w} logged steps while "
             f"the loss jumped {10.0 ** rise:,.0f}x: under an adaptive optimizer, which keeps each step small, "
             f"gradients that jump by decades from batch to batch with the loss are out of control"],
            g - c.t.growth_decades)


def _inputs_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i, t = c.ev, c.s, c.i, c.t
    gap, quiet = float(ev.head_gap[s]), float(ev.head_quiet[s])
    above = float(ev.log_rms[s, i]) - quiet
    return ([f"{_rms_text(c, d)} is {above:.1f} decades above the output layer's bias gradient ({_e(10.0 ** quiet)}, "
             f"the loss's own); that layer's weight gradient has sat {gap:.1f} decades above it for "
             f"{t.sustain_steps}+ logged steps, so its inputs are of the order of {_e(10.0 ** gap)}: the activations "
             f"blew up on their way forward, whatever the optimizer does with each step"], above - t.explode_decades)


def _runaway_why(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i, t = c.ev, c.s, c.i, c.t
    jump, g = float(ev.loss_jump[s]), float(ev.log_rms[s, i] - ev.base[s, i])
    return ([f"the loss jumped to {10.0 ** jump:,.3g}x its level over the previous {t.growth_window} logged steps, "
             f"above where training started, and this layer's gradient rose {10.0 ** g:,.3g}x with it: the training "
             f"diverges"], jump - t.growth_decades / 2)


#: Each exploding rule's flag and its reason with its excess (decades beyond its line), in the order they are told.
_EXPLODING_WHY = (("exp_rel", _relative_why), ("exp_rms", _rms_bound_why), ("exp_max", _max_bound_why),
                  ("exp_update", _update_why), ("exp_feedback", _feedback_why), ("exp_trend", _trend_why),
                  ("exp_capped", _capped_why), ("exp_inputs", _inputs_why), ("exp_runaway", _runaway_why),
                  ("exp_volatile", _volatile_why),
                  ("exp_swing", _swing_why))


def _exploding_reasons(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    reasons, excess = [], 0.0
    for flag, why in _EXPLODING_WHY:
        if getattr(c.ev, flag)[c.s, c.i]:
            texts, x = why(c, d)
            reasons += texts
            excess = max(excess, x)
    if reasons:
        return reasons, excess
    if c.swept is not None:
        step, began, rose = c.swept
        return ([f"at step {step}, where the blow-up of {began} began, its gradient stood {10.0 ** rose:,.3g}x above "
                 f"its lowest of the logged steps before (at most {c.t.growth_window}): it rose with that blow-up, "
                 f"which goes on, {c.lasting_steps()}"], 0.0)
    if c.carried is not None and c.carried.before is not None and c.carried.now is not None:
        ratio = 10.0 ** (c.carried.now - c.carried.before)
        return ([f"exploded at step {c.run_first_step} and has not recovered: the loss is {ratio:,.3g}x its level "
                 f"before step {c.run_first_step} ({_e(10.0 ** c.carried.now)} against {_e(10.0 ** c.carried.before)}"
                 f"), {c.lasting_steps()}"], math.log10(max(ratio, 1.0)))
    if c.carried is not None:
        return ([f"exploded at step {c.run_first_step} and has not recovered: its gradient or update is still above "
                 f"the range it had before, {c.lasting_steps()}"], 0.0)
    # The episode goes on because the weights it blew up were not brought back.
    w, w0 = float(c.ev.weight_norm[c.s, c.i]), float(c.ev.weight_norm[c.before_row, c.i])
    return ([f"its weight norm {_e(w)} is still {w / w0:,.0f}x what it was before this episode began at step "
             f"{c.run_first_step} ({_e(w0)}): the blow-up was not undone"], math.log10(w / w0) - 1.0)


def _vanishing_reasons(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i, t = c.ev, c.s, c.i, c.t
    reasons, excess = [], 0.0
    if ev.van_rel[s, i]:
        below = -ev.dec(s, i)
        reasons.append(f"{_rms_text(c, d)} is {below:.1f} decades below {c.ref_text()} {c.lasting()}")
        excess = max(excess, below - t.vanish_decades)
    if ev.van_abs[s, i]:
        rms = float(ev.rms[s, i])
        reasons.append(f"{_rms_text(c, d)} is below the absolute floor {t.vanish_rms_below:g} {c.lasting()}")
        excess = max(excess, math.log10(t.vanish_rms_below / max(rms, record.FLUSH_BELOW)))
    lu, ru = float(ev.log_upd[s, i]), float(ev.ref_upd[s])
    if math.isfinite(lu) and math.isfinite(ru):
        reasons.append(f"it learns {ru - lu:.1f} decades slower than the layers nearest the loss (update RMS / "
                       f"weight RMS {_e(10.0 ** lu)} against {_e(10.0 ** ru)})")
    return reasons, excess


def _dead_example(activation: str) -> str:
    """What makes an all-zero gradient, for the layer's activation where it is known."""
    act = activation.lower()
    if act in SATURATING:
        return f"its {act} units saturated: {act}' is exactly 0 in floating point; or a path cut by stop_gradient"
    if act in RECTIFIERS:
        return f"its {act} units died: zero output for every input of the batch; or a path cut by stop_gradient"
    return "e.g. dead ReLU units, saturated tanh/sigmoid units, or a path cut by stop_gradient"


def _units_dead_at(ev: Steps, s: int, i: int) -> bool:
    """Whether the variable's dead status at row ``s`` is its layer's dead units (its gradient is live there)."""
    return bool(ev.units_dead[s, i]) and not bool(ev.zero_grad[s, i])


def _dead_units_reason(c: _Ctx) -> str:
    """``71% of its units output 0 for every input of the batch ...``: the dead-units rule's evidence."""
    frac = float(c.ev.flags["dead_fraction"][c.s, c.i])
    act = f"its {c.activation} " if c.activation else "its "
    return (f"{frac:.0%} of {act}units output 0 for every input of the batch {c.lasting()}: the gradient still "
            f"flows through the units left, but the layer computes with {1 - frac:.0%} of its width")


def _inert_reason(c: _Ctx) -> str:
    ev, s, i = c.ev, c.s, c.i
    gap = float(ev.sibling[s, i] - ev.log_rms[s, i])
    return (f"only round-off reaches this variable: its RMS {_e(float(ev.rms[s, i]))} is {gap:.1f} decades below "
            f"the other variables of its layer, a gradient that is zero in exact arithmetic (e.g. a bias directly "
            f"before BatchNormalization, which subtracts it again). Not a disease: the parameter is unused "
            f"(use_bias=False removes it)")


def _quiet_reason(c: _Ctx) -> str:
    """An exploding episode whose last records are quiet, held open: a quiet minibatch or two inside a divergence is
    no recovery (:data:`episodes.CHAIN_GAP`)."""
    quiet = "its last record" if c.quiet == 1 else f"its last {c.quiet} records"
    return (f"exploding since step {c.run_first_step}; {quiet} raised no flag, but one or two quiet minibatches "
            f"inside a blow-up are no recovery: the episode ends once no flag is raised for more than {CHAIN_GAP} "
            f"logged steps")


def _reasons(code: int, c: _Ctx, d: dict[str, np.ndarray], i: int) -> tuple[list[str], float]:
    """Plain-language reasons for the status and the excess (decades beyond the threshold) for the severity."""
    if c.quiet:  # only an exploding run is held open over quiet records
        return [_quiet_reason(c)], 0.0
    if code == th.NONFINITE:
        nan, inf, size = int(d["nan"][i]), int(d["inf"][i]), int(d["size"][i])
        frac = (nan + inf) / size if size else 1.0
        return [f"{nan:,} NaN and {inf:,} Inf of {size:,} gradient values at step {int(c.steps[c.s])}; NaN/Inf "
                f"{c.lasting()}"], frac
    if code == th.EXPLODING:
        return _exploding_reasons(c, d)
    if code == th.VANISHING:
        return _vanishing_reasons(c, d)
    if code == th.DEAD and _units_dead_at(c.ev, c.s, i):
        return [_dead_units_reason(c)], 0.0
    if code == th.DEAD:
        size = int(d["size"][i])
        return [f"all {size:,} gradient values are exactly zero {c.lasting()}: no signal reaches this variable "
                f"({_dead_example(c.activation)})"], 0.0
    if code == th.MISSING:
        return [f"no gradient reached this variable (None gradient) {c.lasting()}"], 0.0
    if code == th.INERT:
        return [_inert_reason(c)], 0.0
    if code == th.FROZEN:
        return [f"frozen: no gradient is computed for it by the user's choice (requires_grad=False, trainable=False or "
                f"outside the optimizer) {c.lasting()}; not a disease"], 0.0
    dec = c.ev.dec(c.s, i)
    if c.ev.learns[c.s, i] and dec <= -c.t.vanish_decades:
        return [f"note: {_rms_text(c, d)} is {-dec:.1f} decades below {c.ref_text()}, but its updates keep pace "
                f"with theirs (an adaptive optimizer rescales it): it still learns"], 0.0
    if c.ev.van_passed[c.s, i]:
        return [f"note: {_rms_text(c, d)} is {-dec:.1f} decades below {c.ref_text()}, but the layer before it gets a "
                f"gradient within {c.t.vanish_decades:g} decades of theirs: the backward pass goes through this layer, "
                f"so its small gradient is its own parameters' or inputs' scale (a normalisation's gain), not a "
                f"vanishing one"], 0.0
    if c.ev.converged[c.s, i]:
        return ["note: the layers nearest the loss receive only round-off (their RMS is below "
                f"{ROUNDOFF:.1e} of the largest it has been): the model has converged, so vanishing is not judged"], 0.0
    if c.ev.calm[c.s, i] and dec >= c.t.explode_decades:
        return [f"note: {_rms_text(c, d)} is {dec:.1f} decades above {c.ref_text()}, but it learns at their pace "
                f"(an adaptive optimizer rescales it; early convolutions sum over many positions)"], 0.0
    return [], 0.0


def _unconfirmed_note(unconfirmed: tuple[int, int], c: _Ctx, need: int, units: bool = False) -> str:
    code, length = unconfirmed
    what = {th.VANISHING: "vanishing-level RMS", th.DEAD: "all-zero gradient"}.get(code, "no gradient")
    if units:
        what = f"{float(c.ev.flags['dead_fraction'][c.s, c.i]):.0%} of its units dead for every input of the batch"
    return (f"note: {what} at the last {length} logged step(s); flagged as {th.STATUSES[code]} once it lasts {need}")


def _past_nonfinite_note(col: np.ndarray, skipped: np.ndarray, steps: np.ndarray) -> str:
    rows = np.flatnonzero(col)
    span = f"first at step {int(steps[rows[0]])}, last at step {int(steps[rows[-1]])}"
    if skipped[rows].all():
        return (f"note: NaN/Inf at {rows.size} logged step(s) that the optimizer skipped (no update, as dynamic "
                f"loss scaling does after an overflow: the writer said so, or the run went on with finite "
                f"gradients), {span}; those steps are no evidence of any status")
    return f"note: NaN/Inf earlier at {rows.size} logged step(s), {span}; finite since"


def _origin_note(origin: tuple[int, int, int], i: int, layers: Sequence[str], steps: np.ndarray) -> str:
    r, first, count = origin
    step = int(steps[r])
    if i == first:
        if count == 1:
            return f"NaN/Inf started here: the only nonfinite layer at step {step}, the first step with NaN/Inf"
        return (f"NaN/Inf started here: at step {step}, the first step with NaN/Inf, {count} layers were nonfinite "
                f"and backprop computes gradients deepest layer first, so the deepest layer among them (this one) "
                f"went first; the shallower ones received it (or it came from the loss above)")
    return (f"the first layer to reach nonfinite was {layers[first]}, at step {step} (the deepest of the layers "
            f"nonfinite at the first step with NaN/Inf: backprop computes it first)")


def _chain_note(episodes: list[dict[str, Any]], first_step: int, status: str, since: int) -> str:
    """``trouble since step 31 (exploding from step 31 -> dead from step 47 -> nonfinite from step 54); nonfinite
    since step 54``: the chain's start beside the current status's own onset."""
    chain = [e for e in episodes if e["to"] >= first_step]
    story = " -> ".join(f"{e['status']} from step {max(e['from'], first_step)}" for e in chain)
    return f"trouble since step {first_step} ({story}); {status} since step {since}"


#: (ratio key, label, th.Thresholds field above, field below, why above, why below); ``{r}`` is the weight change of
#: one SGD step at lr 1e-3 in units of the weight norm.
_RATIO_RULES = (
    ("update_to_weight", "update/weight", "update_ratio_above", "update_ratio_below",
     " (rule of thumb ~1e-3, Karpathy): the learning rate is likely too high for this layer",
     " (rule of thumb ~1e-3, Karpathy): this layer barely learns"),
    ("grad_to_weight", "grad/weight", "grad_ratio_above", "grad_ratio_below",
     ": even SGD at lr 1e-3 would move the weights by {r:.2g}x their norm a step",
     ": the gradient is tiny next to the weights"),
)


def _ratio_notes(d: dict[str, np.ndarray], i: int, t: th.Thresholds,
                 pace: tuple[np.ndarray, np.ndarray] | None = None) -> list[str]:
    """The update/weight and grad/weight notes, read from the layer's figures (``pace``, in ``_RATIO_RULES``'
    order) where given: a bias that starts at zero has huge ratios of its own, one set far from zero tiny ones."""
    notes = []
    if not float(d["weight_norm"][i]) > 0:
        return notes
    for k, (key, label, above_field, below_field, why_above, why_below) in enumerate(_RATIO_RULES):
        v = float(pace[k][i]) if pace is not None else float(d[key][i])
        if v != float(d[key][i]):  # its layer's largest variable's: say so beside the variable's own figure
            label = f"its layer's {label}"
        if not math.isfinite(v):
            continue
        above, below = getattr(t, above_field), getattr(t, below_field)
        if v > above:
            notes.append(f"note: {label} {_e(v)} is above {above:g}" + why_above.format(r=v * 1e-3))
        elif v < below:
            notes.append(f"note: {label} {_e(v)} is below {below:g}" + why_below)
    return notes
