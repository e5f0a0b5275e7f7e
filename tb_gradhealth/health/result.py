"""The public result of a diagnosis: :class:`LayerHealth` per layer and :class:`RunHealth` per run (JSON form included),
and the severity scale that orders the layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tb_gradhealth.health.thresholds import HEALTHY, STATUSES, Status, Thresholds

#: Severity = base of the status + a within-status part in [0, SPAN): statuses never overlap. A frozen parameter
#: (no gradient by the user's choice) ranks with the healthy ones.
SPAN = 1000.0
BASE = {code: max(0, HEALTHY - code) * SPAN for code in range(len(STATUSES))}
_ORDER = (
    "rank 1 is the run's answer, the cause (rank_reason \"cause\"; it may have a lower severity than rank 2): "
    "among the layers with the most severe status, the one whose chain of episodes began first (ties to the deepest "
    "layer, named by its largest variable; for vanishing, to the most vanished layer, or to the layer where the "
    "gradient is cut when a cliff of more than a decade separates it from the next deeper layer); the other layers "
    "follow worst first: severity descending (nonfinite > exploding > vanishing > dead > missing > inert > "
    "healthy), ties by network index (rank_reason \"severity\"); first_bad, cause and timeline[0] name the same "
    "layer as the answer; onset is the first step any layer was flagged, ties to the deepest layer"
)


def _copy(answer: dict[str, Any] | None) -> dict[str, Any] | None:
    """A copy of the answer whose lists can be changed without changing the diagnosis."""
    if answer is None:
        return None
    return {**answer, "chain": [dict(e) for e in answer["chain"]], "fixes": list(answer["fixes"])}


def json_float(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(frozen=True, kw_only=True)
class LayerHealth:
    """The diagnosis of one layer (variable); numbers are those of its last record at or before the step."""

    layer: str
    index: int
    status: str
    severity: float
    reasons: list[str]
    first_step: int | None
    step: int | None
    status_since: int | None = None
    episodes: list[dict[str, Any]] = field(default_factory=list)
    norm: float = math.nan
    rms: float = math.nan
    max_abs: float = math.nan
    mean: float = math.nan
    nan: int = 0
    inf: int = 0
    zero_fraction: float = math.nan
    grad_to_weight: float = math.nan
    update_to_weight: float = math.nan
    noise: float = math.nan
    weight_norm: float = math.nan
    #: what to do about the status, cause first (empty when healthy)
    fixes: list[str] = field(default_factory=list)
    #: values in the last record (0 when the layer has none)
    size: int = 0
    #: 1-based position in the run's ranking, and why it is there: "cause" (the run's answer), else "severity"
    rank: int = 0
    rank_reason: str = "severity"
    #: where the last record has NaN/Inf: the latest record whose values were all finite,
    #: ``{"step", "rms", "max_abs", "norm"}``; None otherwise (or when no record was finite)
    last_finite: dict[str, Any] | None = None
    #: logged steps at which it had no gradient or an all-zero one, of the logged steps it has a record at (a
    #: parameter used at some steps only: an expert, a branch, embedding rows)
    idle_steps: int = 0
    logged_steps: int = 0

    @property
    def code(self) -> Status:
        """:attr:`status` as a :class:`Status`, for comparisons (the field keeps the word the JSON carries)."""
        return Status.of(self.status)

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "index": self.index,
            "status": self.status,
            "severity": json_float(self.severity),
            "reasons": list(self.reasons),
            "fixes": list(self.fixes),
            "first_step": self.first_step,
            "status_since": self.status_since,
            "episodes": [dict(e) for e in self.episodes],
            "step": self.step,
            **{k: json_float(getattr(self, k)) for k in ("norm", "rms", "max_abs", "mean")},
            "nan": int(self.nan),
            "inf": int(self.inf),
            "size": int(self.size),
            "rank": int(self.rank),
            "rank_reason": self.rank_reason,
            "last_finite": dict(self.last_finite) if self.last_finite is not None else None,
            "idle_steps": int(self.idle_steps),
            "logged_steps": int(self.logged_steps),
            **{k: json_float(getattr(self, k)) for k in (
                "zero_fraction", "grad_to_weight", "update_to_weight", "noise", "weight_norm")},
        }


@dataclass(frozen=True, kw_only=True)
class RunHealth:
    """A run's diagnosis at one step: every layer, worst first."""

    step: int | None
    thresholds: Thresholds
    layers: list[LayerHealth]
    first_bad: dict[str, Any] | None = None
    onset: dict[str, Any] | None = None
    timeline: list[dict[str, Any]] = field(default_factory=list)
    #: the episode that started the chain the worst layers are in: layer, its first status and step, its status
    #: now, and the story ("exploding from step 1 -> dead from 3")
    cause: dict[str, Any] | None = None
    #: how the training loss moved up to the step, where it is recorded (``LossTrend.to_json``), else None
    loss_trend: dict[str, Any] | None = None
    #: the run's answer (:func:`tb_gradhealth.health.answer.run_answer`): the cause layer, since when, its story,
    #: fixes and the headline every view prints; None when no layer is flagged
    answer: dict[str, Any] | None = None
    #: episodes that began before the answer's chain (``timeline`` entries, labelled "earlier, ...")
    earlier: list[dict[str, Any]] = field(default_factory=list)
    #: where the loss went NaN/Inf for good (:func:`tb_gradhealth.health.progress.loss_blowup`), else None
    loss_nonfinite: dict[str, Any] | None = None

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for lh in self.layers:
            counts[lh.status] += 1
        return counts

    def by_layer(self) -> dict[str, LayerHealth]:
        return {lh.layer: lh for lh in self.layers}

    def statuses(self) -> list[str]:
        """Statuses in network order (for the depth profile)."""
        out = [""] * len(self.layers)
        for lh in self.layers:
            out[lh.index] = lh.status
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "thresholds": self.thresholds.to_dict(),
            "threshold_spec": Thresholds.spec(),
            "summary": {"counts": self.counts, "answer": _copy(self.answer), "first_bad": self.first_bad,
                        "cause": self.cause, "onset": self.onset, "timeline": [dict(e) for e in self.timeline],
                        "earlier": [dict(e) for e in self.earlier], "order": _ORDER, "loss_trend": self.loss_trend,
                        "loss_nonfinite": dict(self.loss_nonfinite) if self.loss_nonfinite else None},
            "layers": [lh.to_json() for lh in self.layers],
        }
