"""The public result of a diagnosis: :class:`LayerHealth` per layer and :class:`RunHealth` per run (JSON form included),
and the severity scale that orders the layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tb_gradhealth.health.thresholds import STATUSES, Thresholds

#: Severity = base of the status + a within-status part in [0, _SPAN): statuses never overlap.
_SPAN = 1000.0
_BASE = {code: (len(STATUSES) - 1 - code) * _SPAN for code in range(len(STATUSES))}
_ORDER = (
    "layers worst first: severity descending (nonfinite > exploding > vanishing > dead > missing > inert > "
    "healthy), ties by network index, except that the cause comes first: among the layers with the most severe "
    "status, the one whose chain of episodes began first (ties to the deepest layer; for vanishing, to the deepest "
    "within a decade of the most vanished); first_bad is the layer ranked first when it is flagged, with the onset "
    "of its episode chain; onset is the first step any layer was flagged, ties to the deepest layer (backprop "
    "computes the deepest layer first)"
)


def _json_float(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
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

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "index": self.index,
            "status": self.status,
            "severity": _json_float(self.severity),
            "reasons": list(self.reasons),
            "fixes": list(self.fixes),
            "first_step": self.first_step,
            "status_since": self.status_since,
            "episodes": [dict(e) for e in self.episodes],
            "step": self.step,
            **{k: _json_float(getattr(self, k)) for k in ("norm", "rms", "max_abs", "mean")},
            "nan": int(self.nan),
            "inf": int(self.inf),
            **{k: _json_float(getattr(self, k)) for k in (
                "zero_fraction", "grad_to_weight", "update_to_weight", "noise", "weight_norm")},
        }


@dataclass
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
            "summary": {"counts": self.counts, "first_bad": self.first_bad, "cause": self.cause, "onset": self.onset,
                        "timeline": [dict(e) for e in self.timeline], "order": _ORDER,
                        "loss_trend": self.loss_trend},
            "layers": [lh.to_json() for lh in self.layers],
        }
