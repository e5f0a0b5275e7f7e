"""Training progress as evidence: whether the loss moved over the diagnosed steps, where the loss is recorded.

A layer that barely learns (its update, or its gradient, tiny next to its weights) is only a disease when the
network does not learn either: a run whose loss stays flat while layers barely learn is flagged ``vanishing`` on
those layers, and a falling loss is stated beside a slow status (vanishing, dead) as evidence against it. Only
ratios of the loss to itself are used, so a loss times a constant reads the same; a loss that came down by a decade
or more early in the run has converged and is not "not learning".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth.health.levels import condemned_since, live_stats, median_where, update_stats
from tb_gradhealth.health.recovery import Losses, level
from tb_gradhealth.health.result import BASE, LayerHealth
from tb_gradhealth.health.thresholds import DEAD, EXPLODING, HEALTHY, NONFINITE, VANISHING, Thresholds
from tb_gradhealth.numbers import format_change

#: Fewer finite loss values than this say nothing about progress.
MIN_POINTS = 8
#: The median of the last quarter within this fraction of the first quarter's: the loss did not move.
FLAT = 0.05
#: A loss whose first quarter reached this many times its last quarter's median came down: it converged.
CAME_DOWN = 10.0


NOT_LEARNING_FIX = ("the loss is flat and this layer barely learns: raise the learning rate, or look for a saturated "
                    "activation (a sigmoid or tanh pinned at its bound: ReLU/GELU with He init, normalisation) or "
                    "an initialisation that starts it stuck")


ACCUMULATE_FIX = ("gradients accumulate: call optimizer.zero_grad() (or set the gradients to None) before every "
                  "backward pass, or check the gradient accumulation (reset after each applied step, divide by the "
                  "number of micro-batches)")
GROWING_LR_FIX = ("or a learning rate that grows step after step (a warm-up or schedule gone wrong): cap it, or lower "
                  "its peak")
#: The same finding where the loop zeroes its gradients itself (Keras ``fit()``): the fix is what that loop can do.
FIT_GROWTH_FIX = ("Keras fit() zeroes the gradients itself, so they grow because something adds to them: a custom "
                  "train_step that sums gradients over calls, a loss that grows with the step (a regulariser or "
                  "weight that ramps up), or a learning rate that grows step after step: cap it, or lower its peak")
#: Loops that compute a fresh gradient at every step: nothing the user writes can forget to zero it.
ZEROING_LOOPS = frozenset({"keras.fit"})


def growth_fixes(source: Mapping[str, str] | None) -> list[str]:
    """The fixes for gradients that grow with the updates, for the loop the writer recorded (``source``)."""
    if source and source.get("loop") in ZEROING_LOOPS:
        return [FIT_GROWTH_FIX]
    return [ACCUMULATE_FIX, GROWING_LR_FIX]


@dataclass(frozen=True)
class LossTrend:
    """How the loss moved over the diagnosed steps: ``change`` = last quarter's median / first quarter's - 1."""

    first_step: int
    last_step: int
    points: int
    change: float
    converged: bool
    #: where the run's answer is an episode that exploded (or went NaN/Inf) and has not recovered: the loss read
    #: against its level before that episode, not against a first quarter that may hold it (:func:`against_episode`)
    episode: dict[str, Any] | None = None

    @property
    def flat(self) -> bool:
        return abs(self.change) <= FLAT and not self.converged

    @property
    def falls(self) -> bool:
        return self.change < -FLAT

    def to_json(self) -> dict[str, Any]:
        return {"first_step": self.first_step, "last_step": self.last_step, "points": self.points,
                "change": self.change, "flat": self.flat, "falls": self.falls, "converged": self.converged,
                "episode": dict(self.episode) if self.episode is not None else None}


def against_episode(trend: LossTrend, losses: Losses, steps: np.ndarray, start: int, t: Thresholds) -> LossTrend:
    """``trend`` with the loss (``losses``: the recorded loss, as the recovery check reads it) read against its level
    before the episode that began at logged step ``start`` (``steps``: the run's logged steps): ``{"step": start,
    "before"`` (median of the loss over the ``growth_window`` logged steps before it), ``"now"`` (median of the last
    ``growth_window`` values up to the trend's last step), ``"ratio"``, ``"since"`` (logged steps since it
    began)``}``; ``trend`` as it is when the loss has no such values (an episode that began the run has no level
    before it) or is back below it. A run that never recovered from a blow-up reads as that, not as a change from a
    first quarter that holds the spike."""
    now = losses.log[:np.searchsorted(losses.steps, trend.last_step, side="right")][-t.growth_window:]
    pre = losses.before(steps, int(np.searchsorted(steps, start)), t.growth_window)
    if not pre.size or not now.size:
        return trend
    before, after = level(pre), level(now)
    if not after > before:
        return trend  # back below its level before: the quarters tell how it moved
    since = int(np.count_nonzero((steps >= start) & (steps <= trend.last_step)))
    return dataclasses.replace(trend, episode={"step": int(start), "before": before, "now": after,
                                               "ratio": after / before, "since": since})


def _up_to(steps: np.ndarray, loss: np.ndarray, at_step: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The loss values (and their steps) at or before ``at_step``; all of them when it is None."""
    steps, loss = np.asarray(steps, dtype=np.int64), np.asarray(loss, dtype=np.float64)
    if at_step is None:
        return steps, loss
    keep = steps <= at_step
    return steps[keep], loss[keep]


def loss_trend(steps: np.ndarray, loss: np.ndarray, at_step: int | None = None) -> LossTrend | None:
    """The loss's trend at or before ``at_step`` (None: too few finite values, a loss that is not positive, or one
    whose latest value is NaN/Inf)."""
    steps, loss = _up_to(steps, loss, at_step)
    if loss.size and not np.isfinite(loss[-1]):
        return None  # a loss gone NaN/Inf is not flat: the gradients' nonfinite rules speak
    keep = np.isfinite(loss)
    steps, loss = steps[keep], loss[keep]
    if loss.size < MIN_POINTS or np.any(loss <= 0):
        return None
    q = max(2, loss.size // 4)
    first, last = float(np.median(loss[:q])), float(np.median(loss[-q:]))
    return LossTrend(int(steps[0]), int(steps[-1]), int(loss.size), last / first - 1.0,
                     float(loss[:q].max()) >= CAME_DOWN * last)


def loss_blowup(steps: np.ndarray, loss: np.ndarray, at_step: int | None = None) -> dict[str, Any] | None:
    """Where the loss went NaN/Inf for good, for the views (the trend is None then): ``{"step"`` (first step of the
    trailing NaN/Inf stretch), ``"last_finite_step"``, ``"last_finite"`` and ``"ratio"`` (the last finite value
    over the median of the first quarter of the finite values, None when there are fewer than two or the loss is
    not positive)``}``; None when the latest loss value at or before ``at_step`` is finite or there is none."""
    steps, loss = _up_to(steps, loss, at_step)
    if not loss.size or np.isfinite(loss[-1]):
        return None
    finite = np.flatnonzero(np.isfinite(loss))
    if not finite.size:
        return {"step": int(steps[0]), "last_finite_step": None, "last_finite": None, "ratio": None}
    start = int(finite[-1]) + 1
    values = loss[finite]
    early = float(np.median(values[:max(1, values.size // 4)]))
    ratio = float(values[-1]) / early if values.size >= 2 and np.all(values > 0) else None
    return {"step": int(steps[start]), "last_finite_step": int(steps[finite[-1]]), "last_finite": float(values[-1]),
            "ratio": ratio}


class LossWindows(NamedTuple):
    """The loss around each logged step of the records, as evidence the per-step rules weigh (``[S]`` each)."""

    #: the largest rise of log10 loss, from a value to a later one, over the loss values of the last
    #: ``2 * growth_window`` logged steps (decades; NaN where fewer than two finite positive values)
    rise: np.ndarray
    #: over the last ``growth_window`` logged steps, the median of the later half of the loss values is more than
    #: ``FLAT`` above (``rises``) or below (``falls``) the median of the earlier half; False while the window holds
    #: fewer than ``MIN_POINTS`` values (two minibatch losses against two move by more than ``FLAT`` by chance)
    rises: np.ndarray
    falls: np.ndarray
    #: decades the latest loss value at or before the step sits above the median of the values over the previous
    #: ``growth_window`` logged steps (NaN where there are none), and whether it is also above the loss's early level
    #: (the median of its first ``MIN_POINTS`` values, of those recorded by the step before then): a loss back above
    #: where training started has lost its progress, which a noisy loss near its floor (a spike from 0.004 to 0.25
    #: beside a start at 0.65) has not
    jump: np.ndarray | None = None
    above_start: np.ndarray | None = None
    #: the largest loss value over the swing's window (the last ``2 * growth_window`` logged steps) is above the
    #: loss's early level: a swing that reaches above where training started
    peak_above_start: np.ndarray | None = None

    def runs_away(self, t: Thresholds) -> np.ndarray:
        """``[S]``: the loss jumped by an order of magnitude or more (half the trend's growth line,
        ``growth_decades / 2``) above its level over the previous window, to above where training started, at this
        logged step and the one before: a divergence whatever the optimizer and whatever the gradients show (units
        that died in the blow-up pass no gradient at all). One batch far above the rest is a hard batch, not a
        blow-up: the median of the window is not moved by it, and the next value is back down."""
        out = np.zeros(self.rise.shape, dtype=bool)
        if self.jump is None or self.above_start is None:
            return out
        with np.errstate(invalid="ignore"):
            high = (self.jump >= t.growth_decades / 2) & self.above_start
        out[1:] = high[1:] & high[:-1]
        return out

    def swings(self, t: Thresholds) -> np.ndarray:
        """``[S]``: the per-batch loss swings by an order of magnitude or more (a rise of at least half the trend's
        growth line, ``growth_decades / 2``, within the window) up to above where training started: a minibatch loss
        of a healthy run moves by a few tenths of a decade; one that jumps by decades follows gradients out of
        control. Near its floor a loss's ratios are noise (a converged classifier's per-batch loss between 0.004
        and 0.25, beside a start at 0.65): a swing that stays below the loss's early level is no blow-up."""
        with np.errstate(invalid="ignore"):
            peak = self.peak_above_start if self.peak_above_start is not None else True
            return (self.rise >= t.growth_decades / 2) & peak


def loss_windows(steps: np.ndarray, progress: tuple[np.ndarray, np.ndarray], t: Thresholds) -> LossWindows:
    """:class:`LossWindows` at each of the records' ``steps`` from the recorded ``(steps, loss)``: only the loss
    values at or before each step count (the evidence a live run had then), and only ratios of the loss to itself
    (a loss times a constant reads the same). Non-positive and NaN/Inf values are left out."""
    ls, lv = np.asarray(progress[0], dtype=np.int64), np.asarray(progress[1], dtype=np.float64)
    keep = np.isfinite(lv) & (lv > 0)
    ls, log = ls[keep], np.log10(lv[keep])
    order = np.argsort(ls, kind="stable")
    ls, log = ls[order], log[order]
    steps = np.asarray(steps, dtype=np.int64)
    n = steps.size
    rise, rises, falls = np.full(n, np.nan), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    jump, above_start, peak_above = np.full(n, np.nan), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    end = np.searchsorted(ls, steps, side="right")
    for k in range(n):
        # where training started, from the values at or before the step only (no later loss is read)
        start = float(np.median(log[:min(MIN_POINTS, end[k])])) if end[k] else math.nan
        before = log[np.searchsorted(ls, steps[max(0, k - t.growth_window)], side="left"):
                     np.searchsorted(ls, steps[k], side="left")]
        if end[k] and before.size:
            jump[k] = float(log[end[k] - 1] - np.median(before))
            above_start[k] = bool(log[end[k] - 1] > start)
        swing = log[np.searchsorted(ls, steps[max(0, k - 2 * t.growth_window)], side="left"):end[k]]
        if swing.size >= 2:
            rise[k] = float(np.max(swing - np.minimum.accumulate(swing)))
            peak_above[k] = bool(swing.max() > start)
        trend = log[np.searchsorted(ls, steps[max(0, k - t.growth_window)], side="left"):end[k]]
        if trend.size >= MIN_POINTS:
            half = trend.size // 2
            moved = 10.0 ** (float(np.median(trend[-half:])) - float(np.median(trend[:half]))) - 1.0
            rises[k], falls[k] = moved > FLAT, moved < -FLAT
    return LossWindows(rise, rises, falls, jump, above_start, peak_above)


def _barely_learns(upd: float, grad: float, t: Thresholds, by_update: bool = True) -> str | None:
    """Why the layer barely learns: its update (``upd``: ||update|| / ||weight||, where recorded and ``by_update``),
    or else its gradient (``grad``: ||gradient|| / ||weight||), tiny beside its weights; None when it does not. Both
    at the layer's last record with a gradient: a step it sat out (an idle expert) moved nothing by design. A network
    stalled by its learning rate (every update tiny) says nothing about one layer's update: there only a gradient
    tiny beside its weights does."""
    if by_update and math.isfinite(upd) and t.update_ratio_below > 0:
        if upd < t.update_ratio_below:
            return f"its update is {upd:.2g} of its weights"
        return None
    if math.isfinite(grad) and grad < t.grad_ratio_below:
        return f"its gradient is {grad:.2g} of its weights"
    return None


STALLED_FIX = ("the gradients are huge for their weights and only a tiny learning rate keeps them from blowing the "
               "weights up: fix their scale (initialise at He/Glorot scale, normalise, check the loss's and the "
               "targets' scale) instead of hiding them behind the learning rate")


def weigh_progress(out: list[LayerHealth], trend: LossTrend | None, t: Thresholds,
                   proportional: bool = False, scaled: tuple[np.ndarray, np.ndarray] | None = None,
                   own: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[list[LayerHealth], frozenset[str]]:
    """The layers with the loss's trend used: a healthy layer that barely learns while the loss is flat is
    vanishing (from the first step the loss was recorded), unless its gradient is large beside its weights
    (:func:`_large`: a vanishing gradient is never one that a usual learning rate would turn into steps that replace
    a tenth of the weights). Under an optimizer whose update follows the gradient (``proportional``: plain SGD),
    when the whole network barely learns while the loss does not fall, every layer whose gradient is that large is
    exploding, held back only by a learning rate far too small for it. ``scaled``: ``([L]`` gradient RMS, ``[L]``
    update RMS``)`` over the weight RMS of each variable's layer at its last record with a gradient: a bias that
    starts at zero is measured against its kernel's weights, not its own. ``own``: ``([L]`` ||update|| / ||weight||,
    ``[L]`` ||gradient|| / ||weight||``)`` of each variable at that record (default: the layers' latest figures).
    A falling loss is stated beside vanishing and dead layers.
    Returns the layers and those found exploding that way (their gradients' size, not their depth, names the
    cause)."""
    if trend is None:
        return list(out), frozenset()
    grad, upd = scaled if scaled is not None else (np.full(len(out), np.nan), np.full(len(out), np.nan))
    stalled = proportional and _network_stalled(upd, trend, t)
    # Where the learning rate holds back gradients too large for it, every update is tiny because of it: that is
    # the finding, and no other layer's tiny update makes it "not learning" on its own.
    held_back = stalled and any(_large(float(grad[lh.index]), t) for lh in out if lh.code == HEALTHY)
    if own is None:
        own = (np.array([lh.update_to_weight for lh in out]), np.array([lh.grad_to_weight for lh in out]))
    weighed = [_weigh_one(lh, trend, t, stalled, float(grad[lh.index]), (float(own[0][k]), float(own[1][k])),
                          by_update=not held_back) for k, lh in enumerate(out)]
    return weighed, frozenset(b.layer for a, b in zip(out, weighed, strict=True)
                              if a.code == HEALTHY and b.code == EXPLODING)


#: The learning rate plain SGD is usually given (Keras' default): the yardstick of a gradient "large beside its
#: weights" when the run's own learning rate is far below any usual one.
USUAL_SGD_LR = 1e-2


def _large(grad: float, t: Thresholds) -> bool:
    """A gradient large beside its layer's weights (``grad``: gradient RMS over their RMS): at a usual SGD learning
    rate (:data:`USUAL_SGD_LR`) each step would move them by more than ``update_ratio_above`` of their size (the
    line past which a learning rate is too high for a layer). Never a vanishing gradient, whatever the learning
    rate the run used."""
    return math.isfinite(grad) and grad * USUAL_SGD_LR >= t.update_ratio_above


def _network_stalled(upd: np.ndarray, trend: LossTrend, t: Thresholds) -> bool:
    """The network barely learns (the median variable's update is below ``update_ratio_below`` of its layer's
    weights: ``upd``) while the loss does not fall: a learning rate that keeps every step tiny."""
    if trend.falls or trend.converged:
        return False
    known = upd[np.isfinite(upd)]
    return bool(known.size) and float(np.median(known)) < t.update_ratio_below


def _weigh_one(lh: LayerHealth, trend: LossTrend, t: Thresholds, stalled: bool, grad: float,
               own: tuple[float, float], by_update: bool = True) -> LayerHealth:
    moved = f"{format_change(trend.change)} from the first to the last quarter of steps {trend.first_step}-" \
            f"{trend.last_step}"
    if lh.code == HEALTHY and stalled and _large(grad, t):
        lr = own[0] / own[1]
        excess = math.log10(grad * USUAL_SGD_LR / t.update_ratio_above)
        return dataclasses.replace(
            lh, status=EXPLODING.word, severity=BASE[EXPLODING] + min(998.0, 1.0 + excess), first_step=trend.first_step,
            status_since=trend.first_step, fixes=[STALLED_FIX],
            reasons=[f"its gradient RMS is {grad:.2g}x its layer's weight RMS while the loss does not move "
                     f"({moved}) and each update is {own[0]:.2g} of them: the learning rate (update "
                     f"over gradient: {lr:.2g}) is far too small for gradients this large, which would blow the "
                     f"weights up at any usual one (at lr {USUAL_SGD_LR:g} each step would move them "
                     f"{grad * USUAL_SGD_LR:.2g}x their size)", *lh.reasons])
    if (lh.code == HEALTHY and trend.flat and (why := _barely_learns(*own, t, by_update=by_update)) is not None
            and not _large(grad, t)):
        return dataclasses.replace(
            lh, status=VANISHING.word, severity=BASE[VANISHING] + 1.0, first_step=trend.first_step,
            status_since=trend.first_step, fixes=[NOT_LEARNING_FIX],
            reasons=[f"not learning: the loss did not move ({moved}) while this layer barely learns ({why})",
                     *lh.reasons])
    if lh.code in (VANISHING, DEAD) and trend.falls:
        return dataclasses.replace(lh, reasons=[
            *lh.reasons, f"note: the loss falls ({moved}), so the network learns; this layer's {lh.status} gradient "
            f"costs it {'capacity' if lh.code == DEAD else 'speed'}, not all progress"])
    return lh



@dataclass(frozen=True)
class UpdateGrowth:
    """How each layer's applied update grew over the diagnosed steps: ``growth`` = median log10 update RMS of the
    last quarter of the logged steps minus the first quarter's (NaN where not recorded); ``onset``, the first
    logged step from which the median layer's update stays above its size at the first logged step (``steady``:
    from the second logged step on, every update of the median layer is larger than the first one), and per layer
    ``since``: the first logged step at or after ``onset`` at which its own update is above its first one.
    ``onset`` is where the state that a rising loss condemns began (:func:`levels.condemned_since`): the first step
    of the unbroken stretch, ending at the last (flagged) step, over which the median layer's update is above its
    first one."""

    growth: np.ndarray  # [L] decades
    onset: int | None
    since: np.ndarray  # [L] int step (``onset`` where the layer's own update never rose above its first)
    steady: bool = False
    #: decades the median variable's gradient RMS grew over the same quarters: a gradient that accumulates grows
    #: with its update; momentum's velocity, Adam's bias correction and a growing learning rate grow the update alone
    gradient: float = math.nan

    @property
    def typical(self) -> float:
        known = self.growth[np.isfinite(self.growth)]
        return float(np.median(known)) if known.size else math.nan


def update_growth(steps: np.ndarray, records: np.ndarray) -> UpdateGrowth | None:
    """:class:`UpdateGrowth` of the records (None without recorded updates or with fewer than ``MIN_POINTS``
    logged steps)."""
    upd, _, _ = update_stats(records)
    v = live_stats(records)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.where((upd > 0) & np.isfinite(upd), np.log10(np.where(upd > 0, upd, 1.0)), np.nan)
        log_grad = np.where(v["live"], np.log10(np.where(v["live"], v["rms"], 1.0)), np.nan)
    if steps.size < MIN_POINTS or not np.isfinite(log).any():
        return None
    q = max(2, steps.size // 4)
    known = np.isfinite(log)
    with np.errstate(invalid="ignore"):
        growth = median_where(log[-q:].T, known[-q:].T) - median_where(log[:q].T, known[:q].T)
        typical = median_where(log, known)
        ok = np.isfinite(log_grad)
        grad_growth = median_where(log_grad[-q:].T, ok[-q:].T) - median_where(log_grad[:q].T, ok[:q].T)
        grad_typical = float(median_where(grad_growth, np.isfinite(grad_growth)))
    above = ~(typical <= typical[0])  # NaN (no update at that step) does not break the rise
    if not above[-1]:
        return UpdateGrowth(growth, None, np.zeros(log.shape[1], dtype=np.int64), gradient=grad_typical)
    # the state the rising loss condemns, up to the last (flagged) step: the updates above their first size
    k0 = condemned_since(above, steps.size - 1, start=1)
    with np.errstate(invalid="ignore"):
        rose = log[k0:] > log[0]
    since = np.where(rose.any(axis=0), steps[k0 + np.argmax(rose, axis=0)], steps[k0])
    return UpdateGrowth(growth, int(steps[k0]), since.astype(np.int64), k0 == 1, grad_typical)


def weigh_growth(out: list[LayerHealth], trend: LossTrend | None, growth: UpdateGrowth | None,
                 last_step: int, source: Mapping[str, str] | None = None) -> list[LayerHealth]:
    """A loss that rises over the run while the updates grow steadily from the first logged step, faster than the
    loss, and the gradients grow with them (at least half as many decades) is a blow-up the gradient rules need not
    see (gradients that accumulate because nothing zeroes them grow step after step, not by decades): every healthy
    layer whose update grew is ``exploding`` from the step its update first exceeded its first one, with the fix
    for accumulating gradients. Updates that grow while the gradients do not are the optimizer's own warm-up
    (momentum's velocity, Adam's bias correction) or a learning-rate schedule, never accumulation. A network that
    learns slowly at first shows neither: its updates shrink before they grow, and its loss falls. Ratios only: the
    loss's rise and the updates' and gradients' growth in decades, against each other. The fixes are those the
    recorded loop (``source``) can apply (Keras ``fit()`` cannot forget to zero its gradients). Only where the
    gradient rules see no blow-up: where they do, a rising loss with growing updates is that blow-up seen from the
    loss (it reads the run's trend at its last step, which a later step can turn), not a second cause begun
    earlier."""
    if trend is None or growth is None or not growth.steady or not trend.change > FLAT:
        return list(out)
    if any(lh.code in (EXPLODING, NONFINITE) for lh in out):
        return list(out)
    if not growth.typical > math.log10(1.0 + trend.change) or not growth.gradient >= growth.typical / 2:
        return list(out)
    fixes = growth_fixes(source)
    return [_grown(lh, trend, growth, last_step, fixes) for lh in out]


def _grown(lh: LayerHealth, trend: LossTrend, growth: UpdateGrowth, last_step: int, fixes: list[str]
           ) -> LayerHealth:
    """``lh`` exploding since its update first exceeded its first one, where it is healthy and its update grew."""
    g = growth.growth[lh.index]
    if lh.code != HEALTHY or not g > 0:
        return lh
    moved = f"{format_change(trend.change)} from the first to the last quarter of steps {trend.first_step}-" \
            f"{trend.last_step}"
    since = int(growth.since[lh.index])
    return dataclasses.replace(
        lh, status=EXPLODING.word, severity=BASE[EXPLODING] + 1.0, first_step=since, status_since=since,
        episodes=[*lh.episodes, {"status": EXPLODING.word, "from": since, "to": last_step}],
        fixes=list(fixes),
        reasons=[f"the loss rose ({moved}) while this layer's updates grew {10.0 ** g:.1f}x ({g:.2f} decades, "
                 f"the median layer's {growth.typical:.2f}: faster than the loss) and the gradients with them "
                 f"({growth.gradient:.2f} decades) since step {since}: the steps drive the loss up, as when "
                 f"gradients accumulate instead of being zeroed",
                 *lh.reasons])
