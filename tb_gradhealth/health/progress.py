"""Training progress as evidence: whether the loss moved over the diagnosed steps, where the loss is recorded.

A layer that barely learns (its update, or its gradient, tiny next to its weights) is only a disease when the
network does not learn either: a run whose loss stays flat while layers barely learn is flagged ``vanishing`` on
those layers, and a falling loss is stated beside a slow status (vanishing, dead) as evidence against it. Only
ratios of the loss to itself are used, so a loss times a constant reads the same; a loss that came down by a decade
or more early in the run has converged and is not "not learning".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tb_gradhealth.health.result import _BASE, LayerHealth
from tb_gradhealth.health.thresholds import VANISHING, Thresholds

#: Fewer finite loss values than this say nothing about progress.
MIN_POINTS = 8
#: The median of the last quarter within this fraction of the first quarter's: the loss did not move.
FLAT = 0.05
#: A loss whose first quarter reached this many times its last quarter's median came down: it converged.
CAME_DOWN = 10.0


NOT_LEARNING_FIX = ("the loss is flat and this layer barely learns: raise the learning rate, or look for a saturated "
                    "activation (a sigmoid or tanh pinned at its bound: ReLU/GELU with He init, normalisation) or "
                    "an initialisation that starts it stuck")


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


def loss_trend(steps: np.ndarray, loss: np.ndarray, at_step: int | None = None) -> LossTrend | None:
    """The loss's trend at or before ``at_step`` (None: too few finite values, a loss that is not positive, or one
    whose latest value is NaN/Inf)."""
    steps, loss = np.asarray(steps, dtype=np.int64), np.asarray(loss, dtype=np.float64)
    if at_step is not None:
        steps, loss = steps[steps <= at_step], loss[steps <= at_step]
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


def _barely_learns(lh: LayerHealth, t: Thresholds) -> str | None:
    if math.isfinite(lh.update_to_weight) and t.update_ratio_below > 0:
        if lh.update_to_weight < t.update_ratio_below:
            return f"its update is {lh.update_to_weight:.2g} of its weights"
        return None
    if math.isfinite(lh.grad_to_weight) and lh.grad_to_weight < t.grad_ratio_below:
        return f"its gradient is {lh.grad_to_weight:.2g} of its weights"
    return None


def weigh_progress(out: list[LayerHealth], trend: LossTrend | None, t: Thresholds) -> None:
    """Use the loss's trend in place: flag the healthy layers that barely learn while the loss is flat (vanishing,
    from the first step the loss was recorded), and state a falling loss beside vanishing and dead layers."""
    if trend is None:
        return
    moved = f"{trend.change:+.1%} from the first to the last quarter of steps {trend.first_step}-{trend.last_step}"
    for lh in out:
        if lh.status == "healthy" and trend.flat and (why := _barely_learns(lh, t)) is not None:
            lh.status = "vanishing"
            lh.severity = _BASE[VANISHING] + 1.0
            lh.first_step = lh.status_since = trend.first_step
            lh.fixes = [NOT_LEARNING_FIX]
            lh.reasons = [f"not learning: the loss did not move ({moved}) while this layer barely learns ({why})",
                          *lh.reasons]
        elif lh.status in ("vanishing", "dead") and trend.falls:
            lh.reasons.append(f"note: the loss falls ({moved}), so the network learns; this layer's "
                              f"{lh.status} gradient costs it {'capacity' if lh.status == 'dead' else 'speed'}, "
                              f"not all progress")

