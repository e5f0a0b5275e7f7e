"""The Keras callback's host-side step bookkeeping, with no TensorFlow in it: which train-function call must run
the capturing step, when to read the ring buffer back (:class:`StepBook`), and the batch loss recorded beside a
logged step (:class:`LossBook`).

Why on the host: the capturing step costs the statistics, so the host predicts, from the optimizer step it counts,
which calls contain a logged step (every ``period``-th optimizer step; ``period`` 0: the last step of each epoch),
and runs the plain step for the others. A call runs ``steps_per_execution`` steps. The device's count is read once
per epoch, and again whenever a read finds fewer records than predicted (steps skipped by a loss-scale optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["LossBook", "StepBook", "batch_loss", "ring_plan"]

#: The host reads the ring buffer once per this many capturing calls (at most), so that logging every step does
#: not pay a device read, a decode and an event write per step.
MAX_CALLS_PER_READ = 16
#: ... as long as the ring buffer stays below this size (it is rewritten, whole, by each store).
MAX_BUFFER_BYTES = 1 << 20


def ring_plan(update_freq: Any, spe: int, row_bytes: int, read_every_call: bool) -> tuple[int, int, int]:
    """``(period, slots, calls_per_read)``: the capture period (0: epoch mode), ring buffer size, read batching.

    Reads are batched only when every call logs (period <= steps per call), where the host's step prediction
    picks nothing; ``read_every_call`` (``stop_on``) reads after every call, to stop at the very step.
    ``row_bytes``: the bytes of one logged step's records in the ring buffer.
    """
    if update_freq == "epoch":
        return 0, spe + 1, 1
    period = int(update_freq)
    per_call = math.ceil(spe / period)  # logged steps one call may hold
    calls_per_read = 1
    if period <= spe and not read_every_call:
        calls_per_read = max(1, min(MAX_CALLS_PER_READ, MAX_BUFFER_BYTES // max(1, per_call * row_bytes)))
    return period, per_call * calls_per_read + 2, calls_per_read


@dataclass
class StepBook:
    """Where the host stands in ``fit``: its count of optimizer steps and what it owes the device.

    ``period``: log every ``period``-th step (0: epoch mode); ``spe``: steps per train-function call;
    ``epoch_steps``: steps per epoch (``None``: unknown); ``host_step``: the optimizer step before the first call.
    """

    period: int
    spe: int
    epoch_steps: int | None
    calls_per_read: int
    host_step: int
    #: the next call must run the capturing step (epoch mode)
    arm: bool = False
    epoch_armed: bool = False
    #: capturing calls since the ring buffer was last read
    pending: int = 0
    epoch_batch_end: int = -1
    #: the first call has ended (its capture, or the lack of one, has been checked)
    checked: bool = False
    last_mode: str = "plain"
    #: the capturing step raised once: plain steps only, until the next fit
    capture_failed: bool = False
    #: steps the next call runs (fewer than ``spe`` at the end of an epoch of known length)
    call_steps: int = 0

    def __post_init__(self) -> None:
        self.call_steps = self.call_steps or self.spe

    def epoch_begin(self, device_step: int) -> int | None:
        """A new epoch at the device's step count; the steps to record from now (epoch mode with an unknown
        epoch length: the first one), else ``None``."""
        self.host_step = device_step
        self.epoch_batch_end = -1
        self.epoch_armed = False
        if self.period == 0 and not self.epoch_steps:
            self.arm = True
            return 1
        return None

    def batch_begin(self, batch: int) -> int | None:
        """A call starts at the epoch's ``batch``: the steps to record from it on (epoch mode: when it runs the
        epoch's last step), else ``None``."""
        self.call_steps = min(self.spe, self.epoch_steps - batch) if self.epoch_steps else self.spe
        if self.period != 0 or not self.epoch_steps or self.epoch_armed:
            return None
        if batch + self.spe >= self.epoch_steps:
            self.arm = self.epoch_armed = True
            return self.epoch_steps - batch
        return None

    def call_logs(self) -> bool:
        """Whether the next call (``call_steps`` steps) may contain a logged step."""
        if self.arm:
            return True
        p = self.period
        return p > 0 and (self.host_step + self.call_steps) // p > self.host_step // p

    def next_mode(self, inert: bool = False) -> str:
        """``"capture"`` or ``"plain"`` for the next call: capture only a call that may hold a logged step, so
        that nothing of the capturing step is traced or compiled before a logged step needs it; ``inert``: plain."""
        capture = self.call_logs() and not inert and not self.capture_failed
        self.arm = False
        self.last_mode = "capture" if capture else "plain"
        return self.last_mode

    def batch_end(self, batch: int) -> tuple[bool, bool]:
        """``(first, read)``: whether this was the first call of the fit, and whether to read the ring buffer now."""
        self.host_step += batch - self.epoch_batch_end
        self.epoch_batch_end = batch
        first, self.checked = not self.checked, True
        if self.last_mode != "capture" or self.period == 0:
            return first, False
        self.pending += 1
        return first, self.pending >= self.calls_per_read

    def stop_capturing(self) -> None:
        """The statistics failed: this call counts as a plain one, and so does every later call of this fit."""
        self.capture_failed = True
        self.last_mode = "plain"

    def resync(self, device_step: int) -> None:
        """The device's step count, read again because a read found fewer records than predicted."""
        self.host_step = device_step

    def take_pending(self) -> int:
        """The capturing calls since the last read (now read: the count restarts)."""
        pending, self.pending = self.pending, 0
        return pending

    @staticmethod
    def lags(read: int, pending: int) -> bool:
        """Whether a read of ``read`` new records after ``pending`` capturing calls (each predicted to log) means
        the device's step count lags the host's: then the host re-reads it."""
        return read < pending


def batch_loss(before: tuple[int, float], now: tuple[int, float]) -> float:
    """The mean loss of an epoch's batches ``k0+1 .. k`` from Keras' running means after ``k0`` and after ``k``
    batches (``before = (k0, m0)``, ``now = (k, m)``; Keras reports the loss as its mean since the epoch began).

    Why: a running mean lags, and by the end of a long epoch barely moves, so "the loss is flat" or "it falls"
    would be read from a smoothed series. With equal batches the sum after ``k`` batches is ``k * m``; a smaller
    last batch of an epoch makes that one value approximate. ``k <= k0`` (an epoch whose start was not seen): ``m``.
    """
    (k0, m0), (k, m) = before, now
    if k <= k0:
        return float(m)
    return (k * float(m) - k0 * float(m0)) / (k - k0)


@dataclass
class LossBook:
    """The batch loss behind Keras' running mean of an epoch: the batches and mean of the last call seen
    (``seen``), and the epoch's batches once the current call is done (``call_batches``)."""

    seen: tuple[int, Any] = (0, 0.0)
    call_batches: int = 0

    def epoch_begin(self) -> None:
        """Keras' running mean restarts with each epoch."""
        self.seen = (0, 0.0)

    def call_begin(self, batch: int, steps: int) -> None:
        """A call of ``steps`` batches starts at the epoch's ``batch`` (the call's first batch: the batch Keras
        passes ``on_train_batch_begin`` on every version, unlike ``on_train_batch_end``)."""
        self.call_batches = batch + steps

    def batch_loss(self, mean: Any) -> Any:
        """This call's batches' mean loss, from Keras' running ``mean`` after it; a ``mean`` that is no number is
        given back as it is (the writer says so, once, and writes nothing)."""
        seen, before = self.seen
        try:
            return batch_loss((seen, float(before)), (self.call_batches, float(mean)))
        except (TypeError, ValueError):
            return mean

    def saw(self, mean: Any) -> None:
        """Keras' running mean after this call, kept as given: read only when a later call logs."""
        self.seen = (self.call_batches, mean)
