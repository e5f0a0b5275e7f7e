"""The status words and their codes, and :class:`Thresholds`: every knob of the diagnosis with its range and the
reason for its default (docs/DIAGNOSIS.md)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any


class Status(IntEnum):
    """A layer's status, most severe first: the code is also the severity order (a lower code is worse). The JSON
    and the views carry the :attr:`word`. ``inert`` (a parameter that only ever receives round-off), ``healthy``
    and ``frozen`` (no gradient by the user's choice: ``requires_grad=False``, a parameter outside the optimizer)
    are not flags."""

    NONFINITE = 0
    EXPLODING = 1
    VANISHING = 2
    DEAD = 3
    MISSING = 4
    INERT = 5
    HEALTHY = 6
    FROZEN = 7

    @property
    def word(self) -> str:
        """The status as the JSON, the reasons and the views spell it ("vanishing")."""
        return self.name.lower()

    @property
    def is_flag(self) -> bool:
        """Whether the status counts as a problem (counted, ranked, gates the CLI through ``--fail-on``)."""
        return self < Status.INERT

    @classmethod
    def of(cls, word: str) -> Status:
        """The status spelt ``word`` (ValueError for a word that is none)."""
        try:
            return cls[word.upper()]
        except KeyError:
            raise ValueError(f"unknown status {word!r}: statuses are {', '.join(STATUSES)}") from None


#: Status words, most severe first: this is also the severity order.
STATUSES: tuple[str, ...] = tuple(s.word for s in Status)
#: The statuses that count as a problem (counted, ranked, gate the CLI by default through ``--fail-on``).
FLAGS: tuple[str, ...] = tuple(s.word for s in Status if s.is_flag)
NONFINITE, EXPLODING, VANISHING, DEAD, MISSING, INERT, HEALTHY, FROZEN = Status
FLAG_CODES: frozenset[Status] = frozenset(s for s in Status if s.is_flag)
ABSENT = -1


def _meta(default: float | int, lo: float, hi: float, step: float, description: str, log: bool = False) -> Any:
    return field(default=default, metadata={"min": lo, "max": hi, "step": step, "log": log, "doc": description})


def _note_above(default: float, step: float, ratio: str, why: str) -> Any:
    """A ratio note's upper line (never a status), edited on a log scale."""
    return _meta(default, 1e-30, 1e38, step, f"Note when {ratio} is above this{why}.", log=True)


def _note_below(default: float, step: float, ratio: str, why: str) -> Any:
    """A ratio note's lower line (never a status); 0 turns the note off."""
    return _meta(default, 0.0, 1.0, step, f"Note when {ratio} is below this{why} (0 turns it off).", log=True)


@dataclass(frozen=True)
class Thresholds:
    """Every knob of the diagnosis, with defaults justified in docs/DIAGNOSIS.md.

    Relative rules (decades from the median layer at the same step) are the default because raw gradient scale
    depends on loss reduction, batch size and loss scaling; the absolute backstops catch a network that is
    uniformly huge or tiny, where every layer sits near the median.
    """

    vanish_decades: float = _meta(
        3.0, 0.5, 30.0, 0.5, "Vanishing: RMS at least this many decades (powers of ten) below the reference (the "
        "median RMS of the layers nearest the loss) at the same step.")
    explode_decades: float = _meta(
        3.0, 0.5, 30.0, 0.5, "Exploding: RMS at least this many decades above the reference (the median RMS of "
        "the layers nearest the loss) at the same step.")
    update_decades: float = _meta(
        3.0, 0.0, 30.0, 0.5, "Where updates are recorded, a gradient far below (above) the reference is vanishing "
        "(exploding) only if the layer also learns that much slower (faster): its update RMS relative to its "
        "layer's weights at least this many decades from the reference layers' (an adaptive optimizer such as "
        "Adam rescales gradients of any size; 0 ignores updates).")
    inert_decades: float = _meta(
        4.0, 1.0, 30.0, 0.5, "Inert: a variable whose gradient RMS is at least this many decades below the other "
        "variables of its layer (same name prefix) and below the vanishing line gets only round-off, e.g. a bias "
        "directly before BatchNormalization (not a disease; the fix is use_bias=False).")
    explode_update_ratio: float = _meta(
        10.0, 1e-3, 1e38, 1.0, "Exploding: the applied update is more than this multiple of the weight's norm "
        "(the weights are blowing up: the learning rate is too high), where updates are recorded.", log=True)
    vanish_rms_below: float = _meta(
        1e-8, 0.0, 1.0, 1e-9, "Vanishing backstop: RMS below this absolute value (0 turns it off). A decade below "
        "Adam's epsilon (1e-7 in Keras), where Adam stops rescaling and updates shrink with the gradient.", log=True)
    explode_rms_above: float = _meta(
        1e19, 1e-30, 1e38, 1.0, "Exploding backstop: RMS above this absolute value. The default is where float32 "
        "arithmetic breaks: the square of the value overflows (3.4e38), so a norm or sum of squares computed in "
        "float32 (clipping, Adam's second moment) is Inf. Any lower absolute bound depends on the loss's scale "
        "(its reduction, the targets' units, loss scaling).", log=True)
    explode_max_abs_above: float = _meta(
        1e19, 1e-30, 1e38, 1.0, "Exploding backstop: max |g| above this absolute value (default: where its float32 "
        "square overflows; 6.5e4 is float16's own overflow, for float16 gradients).", log=True)
    growth_decades: float = _meta(
        2.0, 0.1, 30.0, 0.1, "Exploding by trend: RMS grew by at least this many decades above its lowest value of "
        "the previous growth_window logged steps, and half as many above their mean (catches a divergence "
        "before it reaches NaN; a one-step dip and recovery is not a trend).")
    growth_window: int = _meta(
        10, 2, 100000, 1, "Exploding by trend: the window, in logged steps, the growth is measured over.")
    sustain_steps: int = _meta(
        5, 1, 100000, 1, "Vanishing, dead and optimizer-skipped NaN/Inf steps must hold for this many consecutive "
        "logged steps (not when they follow another flag): one quiet step is not a disease.")
    dead_units: float = _meta(
        0.5, 0.01, 1.0, 0.05, "Dead units, where the layers' outputs are recorded: a rectifier (ReLU) layer is dead "
        "when at least this fraction of its units output exactly 0 for every input of the batch for sustain_steps "
        "logged steps, even though the units left still pass a gradient (half its width gone: the layer computes "
        "with the rest).")
    forward_growth: float = _meta(
        100.0, 2.0, 1e38, 10.0, "Forward blow-up, where the layers' outputs are recorded: the RMS of a layer's "
        "output at least this multiple of the first layer's, climbing through depth; named as the cause in the "
        "reasons of the exploding layers after it (each layer of a 4-layer climb multiplying by about 3).", log=True)
    update_ratio_above: float = _note_above(
        1e-1, 1e-3, "||update||/||weight||", " (rule of thumb ~1e-3, Karpathy): the learning rate is likely too high "
        "for the layer")
    update_ratio_below: float = _note_below(
        1e-5, 1e-6, "||update||/||weight||", " (rule of thumb ~1e-3): the layer barely learns")
    grad_ratio_above: float = _note_above(
        1e2, 1.0, "||grad||/||weight||", ": even SGD at lr 1e-3 would change the weights by 10% a step")
    grad_ratio_below: float = _note_below(
        1e-6, 1e-7, "||grad||/||weight||", ": even SGD at lr 1 would change the weights by less than 1e-6 a step")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_value(f, value)
            object.__setattr__(self, f.name, int(value) if _is_int_field(f) else float(value))

    @property
    def step_noise(self) -> float:
        """Minibatch noise of a log RMS, in decades: twice the trend's per-step slope (``2 * growth_decades /
        growth_window``, 0.4 by default). A rise by more than this is a rise, not a batch's jitter."""
        return 2.0 * self.growth_decades / self.growth_window

    @classmethod
    def from_mapping(cls, params: Mapping[str, Any]) -> Thresholds:
        """Thresholds from string (HTTP query, CLI) or numeric values; defaults for keys not given.

        An unknown key or a value that does not parse or lies outside the field's range raises ValueError naming
        the key and the value, so a caller can answer 400 / exit 2 with that message.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, raw in params.items():
            if key not in fields:
                raise ThresholdError(key, f"unknown threshold {key!r}: known thresholds are {', '.join(fields)}")
            try:
                values[key] = _parse(fields[key], raw)
            except ValueError as e:
                raise ThresholdError(key, str(e)) from None
        return cls(**values)

    def to_dict(self) -> dict[str, float | int]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def spec(cls) -> list[dict[str, Any]]:
        """One entry per field for UI controls and CLI flags: name, default, description, min, max, step.

        ``log`` (extra key) is true for absolute magnitudes best edited on a log scale; ``type`` is "int" or
        "float".
        """
        out = []
        for f in dataclasses.fields(cls):
            m = f.metadata
            out.append({
                "name": f.name,
                "default": f.default,
                "description": m["doc"],
                "min": m["min"],
                "max": m["max"],
                "step": m["step"],
                "log": m["log"],
                "type": "int" if f.type in (int, "int") else "float",
            })
        return out


class ThresholdError(ValueError):
    """A threshold that is unknown or whose value is not acceptable; :attr:`key` names it (the message says why)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _is_int_field(f: dataclasses.Field) -> bool:
    return f.type in (int, "int")


def _check_value(f: dataclasses.Field, value: Any) -> None:
    lo, hi = f.metadata["min"], f.metadata["max"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"threshold {f.name!r} must be a number, got {value!r}")
    if _is_int_field(f) and value != int(value):
        raise ValueError(f"threshold {f.name!r} must be an integer, got {value!r}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"threshold {f.name!r} must be between {lo:g} and {hi:g}, got {value!r}")


def _parse(f: dataclasses.Field, raw: Any) -> float | int:
    if isinstance(raw, bool):
        raise ValueError(f"threshold {f.name!r} must be a number, got {raw!r}")
    try:
        value = float(raw.strip()) if isinstance(raw, str) else float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"threshold {f.name!r} must be a number, got {raw!r}") from None
    if _is_int_field(f):
        if not math.isfinite(value) or value != int(value):
            raise ValueError(f"threshold {f.name!r} must be an integer, got {raw!r}")
        value = int(value)
    _check_value(f, value)
    return value
