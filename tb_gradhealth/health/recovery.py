"""Recovery, measured: whether a layer that exploded (or went NaN/Inf) came back, read from the loss where it is
recorded and from the layer's own gradient and update where it is not.

An episode whose gradients look ordinary again has not necessarily recovered: a recurrent language model whose
loss jumped from 5 to 24 and then sits at 12 for the rest of the run has gradients of an ordinary size and weights
that moved a million times as far as its clipped twin's. So an exploding or nonfinite episode goes on until the
recorded loss is back to its level before the episode (within that level's own noise: the upper quartile of its
values over the ``growth_window`` logged steps before the episode); without a recorded loss, until the layer's
gradient and update are back in the range they had before it. Only ratios of the loss to itself are read.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tb_gradhealth.health.thresholds import Thresholds


class Losses(NamedTuple):
    """The recorded loss as the recovery check reads it: its finite positive values, by ascending step."""

    steps: np.ndarray  # int64 [n]
    log: np.ndarray  # log10 loss [n]

    @classmethod
    def of(cls, progress: tuple[np.ndarray, np.ndarray] | None) -> Losses | None:
        if progress is None:
            return None
        steps, values = np.asarray(progress[0], dtype=np.int64), np.asarray(progress[1], dtype=np.float64)
        keep = np.isfinite(values) & (values > 0)
        order = np.argsort(steps[keep], kind="stable")
        return cls(steps[keep][order], np.log10(values[keep][order]))

    def between(self, lo: int, hi: int) -> np.ndarray:
        """log10 loss of the values with ``lo <= step <= hi``."""
        return self.log[np.searchsorted(self.steps, lo, side="left"):np.searchsorted(self.steps, hi, side="right")]

    def before(self, logged: np.ndarray, first: int, window: int) -> np.ndarray:
        """log10 loss of the values over the ``window`` logged steps (``logged``) before position ``first``."""
        return self.between(int(logged[max(0, first - window)]), int(logged[first]) - 1)


def level(log: np.ndarray) -> float:
    """The loss's level over the values ``log`` (log10): the median of the values themselves. The one level an
    episode's loss is read against, by the run's loss line and by the reason of a layer that has not recovered."""
    return float(np.median(10.0 ** log))


class Lasting(NamedTuple):
    """Why an episode goes on after its rules stopped firing: the loss's level before it (the median of its values
    over the ``growth_window`` logged steps before the episode, the level the run's loss trend reads the episode
    against) and now (log10), or None where the layer's own gradient says so (no loss recorded). The decision reads
    the level with its noise (:meth:`Recovery.recovered`); these are the figures a person reads."""

    before: float | None
    now: float | None


class Recovery:
    """Answers, for one layer's episode, at which of its later logged steps it recovered."""

    def __init__(self, steps: np.ndarray, losses: Losses | None, log_rms: np.ndarray, log_upd: np.ndarray,
                 t: Thresholds) -> None:
        self.steps, self.losses, self.log_rms, self.log_upd, self.t = steps, losses, log_rms, log_upd, t

    def _before(self, first: int) -> np.ndarray | None:
        """log10 of the loss values over the ``growth_window`` logged steps before position ``first`` (its first
        value when the episode starts the run: a loss already rising into the episode moves a quartile less than
        its largest value); None without a recorded loss there."""
        if self.losses is None:
            return None
        pre = self.losses.before(self.steps, first, self.t.growth_window)
        if not pre.size:
            pre = self.losses.between(int(self.steps[0]), int(self.steps[first]))[:1]
        return pre if pre.size else None

    def loss_now(self, last: int, j: int) -> float | None:
        """log10 of the loss's level at position ``j`` after an episode whose raw flags ended at position ``last``:
        the median of its values after ``last``, over at most the ``growth_window`` logged steps up to ``j``."""
        if self.losses is None:
            return None
        lo = max(int(self.steps[last]) + 1, int(self.steps[max(0, j - self.t.growth_window + 1)]))
        now = self.losses.between(lo, int(self.steps[j]))
        return float(np.median(now)) if now.size else None

    def recovered(self, first: int, last: int, j: int) -> tuple[bool, Lasting]:
        """Whether the episode at positions ``first..last`` has recovered at position ``j > last``, and the figures
        that say so. With a recorded loss: the loss now (:meth:`loss_now`) at most its level before the episode with
        that level's own noise, the upper quartile of the values before it."""
        pre = self._before(first)
        now = self.loss_now(last, j) if pre is not None else None
        if pre is not None and now is not None:
            return now <= float(np.quantile(pre, 0.75)), Lasting(float(np.log10(level(pre))), now)
        return self._back_in_range(first, j), Lasting(None, None)

    def _back_in_range(self, first: int, j: int) -> bool:
        """The gradient's and the update's RMS at ``j`` within minibatch noise (``2 * growth_decades /
        growth_window``) of the largest they had over the ``growth_window`` logged steps before the episode (no
        such steps: the episode began the run, and its end is its own)."""
        pre = slice(max(0, first - self.t.growth_window), first)
        noise = 2.0 * self.t.growth_decades / self.t.growth_window
        for col in (self.log_rms, self.log_upd):
            hi = col[pre]
            hi = hi[np.isfinite(hi)]
            if hi.size and col[j] > hi.max() + noise:
                return False
        return True
