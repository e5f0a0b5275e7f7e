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
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth.health.levels import condemned_since, median_where, update_stats
from tb_gradhealth.health.result import BASE, LayerHealth
from tb_gradhealth.health.thresholds import DEAD, EXPLODING, HEALTHY, VANISHING, Thresholds

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


@dataclass(frozen=True)
class LossTrend:
    """How the loss moved over the diagnosed steps: ``change`` = last quarter's median / first quarter's - 1."""

    first_step: int
    last_step: int
    points: int
    change: float
    converged: bool

    @property
    def flat(self) -> bool:
        return abs(self.change) <= FLAT and not self.converged

    @property
    def falls(self) -> bool:
        return self.change < -FLAT

    def to_json(self) -> dict[str, Any]:
        return {"first_step": self.first_step, "last_step": self.last_step, "points": self.points,
                "change": self.change, "flat": self.flat, "falls": self.falls, "converged": self.converged}


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

    def swings(self, t: Thresholds) -> np.ndarray:
        """``[S]``: the per-batch loss swings by an order of magnitude or more (a rise of at least half the trend's
        growth line, ``growth_decades / 2``, within the window): a minibatch loss of a healthy run moves by a few
        tenths of a decade; one that jumps by decades follows gradients out of control."""
        with np.errstate(invalid="ignore"):
            return self.rise >= t.growth_decades / 2


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
    end = np.searchsorted(ls, steps, side="right")
    for k in range(n):
        swing = log[np.searchsorted(ls, steps[max(0, k - 2 * t.growth_window)], side="left"):end[k]]
        if swing.size >= 2:
            rise[k] = float(np.max(swing - np.minimum.accumulate(swing)))
        trend = log[np.searchsorted(ls, steps[max(0, k - t.growth_window)], side="left"):end[k]]
        if trend.size >= MIN_POINTS:
            half = trend.size // 2
            moved = 10.0 ** (float(np.median(trend[-half:])) - float(np.median(trend[:half]))) - 1.0
            rises[k], falls[k] = moved > FLAT, moved < -FLAT
    return LossWindows(rise, rises, falls)


def _barely_learns(lh: LayerHealth, t: Thresholds) -> str | None:
    if math.isfinite(lh.update_to_weight) and t.update_ratio_below > 0:
        if lh.update_to_weight < t.update_ratio_below:
            return f"its update is {lh.update_to_weight:.2g} of its weights"
        return None
    if math.isfinite(lh.grad_to_weight) and lh.grad_to_weight < t.grad_ratio_below:
        return f"its gradient is {lh.grad_to_weight:.2g} of its weights"
    return None


def weigh_progress(out: list[LayerHealth], trend: LossTrend | None, t: Thresholds) -> list[LayerHealth]:
    """The layers with the loss's trend used: the healthy layers that barely learn while the loss is flat are
    vanishing (from the first step the loss was recorded), and a falling loss is stated beside vanishing and dead
    layers."""
    if trend is None:
        return list(out)
    return [_weigh_one(lh, trend, t) for lh in out]


def _weigh_one(lh: LayerHealth, trend: LossTrend, t: Thresholds) -> LayerHealth:
    moved = f"{trend.change:+.1%} from the first to the last quarter of steps {trend.first_step}-{trend.last_step}"
    if lh.code == HEALTHY and trend.flat and (why := _barely_learns(lh, t)) is not None:
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

    @property
    def typical(self) -> float:
        known = self.growth[np.isfinite(self.growth)]
        return float(np.median(known)) if known.size else math.nan


def update_growth(steps: np.ndarray, records: np.ndarray) -> UpdateGrowth | None:
    """:class:`UpdateGrowth` of the records (None without recorded updates or with fewer than ``MIN_POINTS``
    logged steps)."""
    upd, _, _ = update_stats(records)
    with np.errstate(divide="ignore", invalid="ignore"):
        log = np.where((upd > 0) & np.isfinite(upd), np.log10(np.where(upd > 0, upd, 1.0)), np.nan)
    if steps.size < MIN_POINTS or not np.isfinite(log).any():
        return None
    q = max(2, steps.size // 4)
    known = np.isfinite(log)
    with np.errstate(invalid="ignore"):
        growth = median_where(log[-q:].T, known[-q:].T) - median_where(log[:q].T, known[:q].T)
        typical = median_where(log, known)
    above = ~(typical <= typical[0])  # NaN (no update at that step) does not break the rise
    if not above[-1]:
        return UpdateGrowth(growth, None, np.zeros(log.shape[1], dtype=np.int64))
    # the state the rising loss condemns, up to the last (flagged) step: the updates above their first size
    k0 = condemned_since(above, steps.size - 1, start=1)
    with np.errstate(invalid="ignore"):
        rose = log[k0:] > log[0]
    since = np.where(rose.any(axis=0), steps[k0 + np.argmax(rose, axis=0)], steps[k0])
    return UpdateGrowth(growth, int(steps[k0]), since.astype(np.int64), k0 == 1)


def weigh_growth(out: list[LayerHealth], trend: LossTrend | None, growth: UpdateGrowth | None,
                 last_step: int) -> list[LayerHealth]:
    """A loss that rises over the run while the updates grow steadily from the first logged step, and faster than
    the loss, is a blow-up the gradient rules need not see (gradients that accumulate because nothing zeroes them
    grow step after step, not by decades): every healthy layer whose update grew is ``exploding`` from the step its
    update first exceeded its first one, with the fix for accumulating gradients. A network that learns slowly
    at first shows neither: its updates shrink before they grow, and its loss falls. Ratios only: the loss's rise
    and the updates' growth in decades, against each other."""
    if trend is None or growth is None or not growth.steady or not trend.change > FLAT:
        return list(out)
    if not growth.typical > math.log10(1.0 + trend.change):
        return list(out)
    return [_grown(lh, trend, growth, last_step) for lh in out]


def _grown(lh: LayerHealth, trend: LossTrend, growth: UpdateGrowth, last_step: int) -> LayerHealth:
    """``lh`` exploding since its update first exceeded its first one, where it is healthy and its update grew."""
    g = growth.growth[lh.index]
    if lh.code != HEALTHY or not g > 0:
        return lh
    moved = f"{trend.change:+.1%} from the first to the last quarter of steps {trend.first_step}-{trend.last_step}"
    since = int(growth.since[lh.index])
    return dataclasses.replace(
        lh, status=EXPLODING.word, severity=BASE[EXPLODING] + 1.0, first_step=since, status_since=since,
        episodes=[*lh.episodes, {"status": EXPLODING.word, "from": since, "to": last_step}],
        fixes=[ACCUMULATE_FIX, GROWING_LR_FIX],
        reasons=[f"the loss rose ({moved}) while this layer's updates grew {10.0 ** g:.1f}x ({g:.2f} decades, "
                 f"the median layer's {growth.typical:.2f}: faster than the loss) since step {since}: "
                 f"the steps drive the loss up, as when gradients accumulate instead of being zeroed (or a "
                 f"learning rate grows step after step)",
                 *lh.reasons])
