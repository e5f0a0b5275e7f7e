"""Diagnosis: from a run's per-layer records, decide which layers are sick, since when and how badly.

Pure numpy on top of :mod:`tb_gradhealth.record` (no TensorFlow, no TensorBoard), so the plugin, the CLI and any
script share one diagnosis. The rules and the reasons behind every default are in ``docs/DIAGNOSIS.md``.

Every rule is evaluated for every (logged step, layer) at once on ``[S, L]`` arrays, which gives each layer a raw
status per step. Vanishing and exploding are properties of the gradient's flow through depth, so they are judged
against the *reference*: the layers nearest the loss (where backprop starts), never a statistic that sinks with the
disease. The per-step statuses become *episodes* (runs of one status, slow diseases confirmed over several logged
steps); a layer's status is that of its last record, and ``first_step`` is the onset of its current chain of
episodes. ``layers`` are in network (forward) order: backprop computes gradients deepest layer first.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tb_gradhealth import record

#: Status words, most severe first: this is also the severity order. ``inert`` (a parameter that only ever receives
#: round-off) and ``healthy`` are not flags.
STATUSES: tuple[str, ...] = ("nonfinite", "exploding", "vanishing", "dead", "missing", "inert", "healthy")
#: The statuses that count as a problem (counted, ranked, gate the CLI by default through ``--fail-on``).
FLAGS: tuple[str, ...] = STATUSES[:5]
_CODE = {name: i for i, name in enumerate(STATUSES)}
NONFINITE, EXPLODING, VANISHING, DEAD, MISSING, INERT, HEALTHY = range(len(STATUSES))
FLAG_CODES = frozenset(_CODE[s] for s in FLAGS)
#: Raw code of a step whose NaN/Inf gradient the optimizer skipped (recorded update exactly zero): confirmed as
#: ``nonfinite`` only when it lasts ``sustain_steps``, like the slow statuses.
SKIPPED = len(STATUSES)
#: An exploding episode goes on while the layer's weight norm stays this many times its norm before the episode:
#: a blow-up of the weights that is not undone leaves the layer damaged even when its gradient looks normal again.
BLOWN_UP = 10.0
_ABSENT = -1
#: The reference layers are the last ``REFERENCE_FRACTION`` of the layers with a live gradient at a step, at least
#: ``REFERENCE_MIN`` of them: the layers nearest the loss, whose gradient has gone through the fewest Jacobians.
REFERENCE_FRACTION = 0.1
REFERENCE_MIN = 3
#: Trend and update rules skip tensors smaller than this: a one-element bias crossing zero has an RMS that dips by
#: decades and comes back, which says nothing about the network.
TREND_MIN_SIZE = 16
#: Severity = base of the status + a within-status part in [0, _SPAN): statuses never overlap.
_SPAN = 1000.0
_BASE = {code: (len(STATUSES) - 1 - code) * _SPAN for code in range(len(STATUSES))}
_ORDER = (
    "layers worst first: severity descending (nonfinite > exploding > vanishing > dead > missing > inert > "
    "healthy), ties by network index; first_bad is the layer ranked first when it is flagged, with the onset of "
    "its episode chain; onset is the first step any layer was flagged, ties to the deepest layer (backprop "
    "computes the deepest layer first)"
)


def _meta(default: float | int, lo: float, hi: float, step: float, description: str, log: bool = False) -> Any:
    return field(default=default, metadata={"min": lo, "max": hi, "step": step, "log": log, "doc": description})


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
        1e2, 1e-30, 1e38, 1.0, "Exploding backstop: RMS above this absolute value.", log=True)
    explode_max_abs_above: float = _meta(
        1e4, 1e-30, 1e38, 1.0, "Exploding backstop: max |g| above this absolute value (float16 overflows at 6.5e4).",
        log=True)
    growth_decades: float = _meta(
        2.0, 0.1, 30.0, 0.1, "Exploding by trend: RMS grew by at least this many decades above its lowest value of "
        "the previous growth_window logged steps, and half as many above their mean (catches a divergence "
        "before it reaches NaN; a one-step dip and recovery is not a trend).")
    growth_window: int = _meta(
        10, 2, 100000, 1, "Exploding by trend: the window, in logged steps, the growth is measured over.")
    sustain_steps: int = _meta(
        5, 1, 100000, 1, "Vanishing, dead and optimizer-skipped NaN/Inf steps must hold for this many consecutive "
        "logged steps (not when they follow another flag): one quiet step is not a disease.")
    update_ratio_above: float = _meta(
        1e-1, 1e-30, 1e38, 1e-3, "Note when ||update||/||weight|| is above this (rule of thumb ~1e-3, Karpathy): the "
        "learning rate is likely too high for the layer.", log=True)
    update_ratio_below: float = _meta(
        1e-5, 0.0, 1.0, 1e-6, "Note when ||update||/||weight|| is below this (rule of thumb ~1e-3): the layer "
        "barely learns (0 turns it off).", log=True)
    grad_ratio_above: float = _meta(
        1e2, 1e-30, 1e38, 1.0, "Note when ||grad||/||weight|| is above this: even SGD at lr 1e-3 would change the "
        "weights by 10% a step.", log=True)
    grad_ratio_below: float = _meta(
        1e-6, 0.0, 1.0, 1e-7, "Note when ||grad||/||weight|| is below this: even SGD at lr 1 would change the "
        "weights by less than 1e-6 a step (0 turns it off).", log=True)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _check_value(f, value)
            object.__setattr__(self, f.name, int(value) if _is_int_field(f) else float(value))

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
                raise ValueError(f"unknown threshold {key!r}: known thresholds are {', '.join(fields)}")
            f = fields[key]
            values[key] = _parse(f, raw)
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


# --- results ----------------------------------------------------------------------------------------------------


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

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "index": self.index,
            "status": self.status,
            "severity": _json_float(self.severity),
            "reasons": list(self.reasons),
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
            "summary": {"counts": self.counts, "first_bad": self.first_bad, "onset": self.onset,
                        "timeline": [dict(e) for e in self.timeline], "order": _ORDER},
            "layers": [lh.to_json() for lh in self.layers],
        }


# --- the per-step rules -------------------------------------------------------------------------------------------


def _log10(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where((x > 0) & np.isfinite(x), np.log10(np.where(x > 0, x, 1.0)), np.nan)


def _sorted_quantile(sorted_rows: np.ndarray, q: float) -> np.ndarray:
    """Quantile ``q`` of each row of a row-sorted array, ignoring NaN (sorted last); NaN for an all-NaN row.

    Linear interpolation between order statistics, as ``np.nanquantile`` does, without its per-row Python loop.
    """
    n = np.sum(~np.isnan(sorted_rows), axis=-1)
    pos = q * np.maximum(n - 1, 0)
    lo_i = np.floor(pos).astype(np.int64)
    hi_i = np.minimum(lo_i + 1, np.maximum(n - 1, 0))
    lo = np.take_along_axis(sorted_rows, lo_i[..., None], axis=-1)[..., 0]
    hi = np.take_along_axis(sorted_rows, hi_i[..., None], axis=-1)[..., 0]
    return np.where(n > 0, lo + (hi - lo) * (pos - lo_i), np.nan)


def _median_where(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Median over the last axis of ``values`` where ``mask`` (NaN where nothing is selected)."""
    rows = np.where(mask, values, np.nan)
    rows.sort(axis=-1)
    return _sorted_quantile(rows, 0.5)


def _history(records: np.ndarray) -> tuple[np.ndarray, ...]:
    """size, missing, NaN+Inf count, zero count, RMS and max|g| over ``[S, L]``: the few fields the rules need.

    The same formulas as :func:`record.derived` (a test checks they agree), computed without the other ~15
    quantities ``derived`` returns: this is the bulk of the diagnosis on large runs.
    """
    f = record.INDEX
    size = records[..., f["size"]]
    n = record.finite_count(records)
    m = record.max_abs(records)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(n > 0, m * np.sqrt(records[..., f["ssq_rel"]] / np.where(n > 0, n, 1)), np.nan)
    return size, records[..., f["missing"]], size - n, records[..., f["zero"]], rms, m


def _update_stats(records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """RMS of the applied update, ||update|| / ||weight|| and ||weight||, NaN where not recorded (the ratio also
    where the weight is 0)."""
    f = record.INDEX
    if np.isnan(records[..., f["update_max_abs"]]).all() and np.isnan(records[..., f["weight_max_abs"]]).all():
        nan = np.full(records.shape[:-1], np.nan)
        return nan, nan, nan
    with np.errstate(invalid="ignore", divide="ignore"):
        upd = records[..., f["update_max_abs"]] * np.sqrt(records[..., f["update_ssq_rel"]])
        weight = records[..., f["weight_max_abs"]] * np.sqrt(records[..., f["weight_ssq_rel"]])
        size = records[..., f["size"]]
        rms = np.where(size > 0, upd / np.sqrt(np.where(size > 0, size, 1.0)), np.nan)
        ok = (weight > 0) & np.isfinite(weight) & np.isfinite(upd)
        return rms, np.where(ok, upd / np.where(ok, weight, 1.0), np.nan), weight


def layer_groups(layers: Sequence[str]) -> list[np.ndarray]:
    """Column indices of the variables of one layer (same name up to the last ``/`` or ``.``), for layers with two
    or more variables: ``conv1/kernel`` and ``conv1/bias`` receive the same upstream gradient."""
    by: dict[str, list[int]] = {}
    for i, name in enumerate(layers):
        cut = max(name.rfind("/"), name.rfind("."))
        if cut > 0:
            by.setdefault(name[:cut], []).append(i)
    return [np.array(v) for v in by.values() if len(v) > 1]


def _loudest_sibling(log_rms: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]``: the largest log RMS among the *other* variables of each variable's layer (NaN if none)."""
    out = np.full(log_rms.shape, np.nan)
    for cols in groups:
        sub = np.where(np.isnan(log_rms[:, cols]), -np.inf, log_rms[:, cols])
        order = np.sort(sub, axis=1)
        top, second = order[:, -1], order[:, -2]
        others = np.where(sub >= top[:, None], second[:, None], top[:, None])
        out[:, cols] = np.where(np.isfinite(others), others, np.nan)
    return out


def _layer_weight_scale(weight_norm: np.ndarray, size: np.ndarray, groups: list[np.ndarray]) -> np.ndarray:
    """``[S, L]`` log10 of the largest weight RMS among the variables of each variable's layer: the scale its
    update is measured against (a bias that starts at zero moves relative to its kernel, not to itself)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        own = _log10(weight_norm / np.sqrt(np.where(size > 0, size, np.nan)))
    out = own.copy()
    for cols in groups:
        out[:, cols] = np.nanmax(np.where(np.isnan(own[:, cols]), -np.inf, own[:, cols]), axis=1)[:, None]
    return np.where(np.isfinite(out), out, np.nan)


def _reference(log_values: np.ndarray, signal: np.ndarray) -> np.ndarray:
    """``[S]``: median of ``log_values`` over the reference layers: the last ``REFERENCE_FRACTION`` (at least
    ``REFERENCE_MIN``) of the layers with ``signal`` at each step, i.e. those nearest the loss."""
    n = signal.sum(axis=1)
    k = np.maximum(REFERENCE_MIN, np.ceil(REFERENCE_FRACTION * n)).astype(np.int64)
    from_end = np.cumsum(signal[:, ::-1], axis=1)[:, ::-1]
    return _median_where(log_values, signal & (from_end <= k[:, None]))


def _window_stats(log_rms: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """``[S, L]`` minimum and mean of each column over the previous ``window`` rows (not the row itself), NaN
    ignored (NaN where the window has no value)."""
    padded = np.concatenate([np.full((window,) + log_rms.shape[1:], np.nan), log_rms])
    low = np.empty(log_rms.shape)
    for a in range(0, log_rms.shape[0], _BLOCK):
        b = min(a + _BLOCK, log_rms.shape[0])
        win = np.lib.stride_tricks.sliding_window_view(padded[a:b + window - 1], window, axis=0)
        low[a:b] = np.fmin.reduce(win, axis=-1)
    known = ~np.isnan(padded)
    total = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(np.where(known, padded, 0.0), axis=0)])
    count = np.concatenate([np.zeros((1,) + log_rms.shape[1:]), np.cumsum(known, axis=0)])
    n = count[window:-1] - count[:-window - 1]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, (total[window:-1] - total[:-window - 1]) / np.where(n > 0, n, 1), np.nan)
    return low, mean


#: Logged steps evaluated together: keeps the temporaries of one block in cache.
_BLOCK = 64
_FLAG_NAMES = ("present", "nonfinite", "exp_rel", "exp_rms", "exp_max", "exp_trend", "exp_update", "van_rel",
               "van_abs", "learns", "inert")


@dataclass
class _Steps:
    """The rules evaluated on ``[S, L]`` records (or ``[1, L]`` for a single step)."""

    raw: np.ndarray  # int8 status code per (step, layer); _ABSENT where no record
    size: np.ndarray
    rms: np.ndarray  # RMS of the nonzero finite values: a sparse gradient is judged on the rows that got one
    max_abs: np.ndarray
    log_rms: np.ndarray  # NaN where the gradient is not live (absent, missing, nonfinite, all-zero)
    ref: np.ndarray  # [S] log10 RMS of the reference layers (nearest the loss)
    log_upd: np.ndarray  # log10 learning rate: update RMS / weight RMS of its layer, NaN where not recorded
    ref_upd: np.ndarray  # [S] log10 learning rate of the reference layers
    upd_ratio: np.ndarray  # ||update|| / ||weight||, NaN where not recorded
    weight_norm: np.ndarray  # ||weight||, NaN where not recorded
    sibling: np.ndarray  # log10 RMS of the loudest other variable of the same layer
    base: np.ndarray  # log10 RMS the trend is measured from (lowest of the previous window)
    flags: dict[str, np.ndarray]

    def __getattr__(self, name: str) -> np.ndarray:
        try:
            return self.__dict__["flags"][name]
        except KeyError:
            raise AttributeError(name) from None

    def dec(self, s: int, i: int) -> float:
        return float(self.log_rms[s, i] - self.ref[s])

    def columns(self, name: str) -> np.ndarray:
        """``[L, S]`` contiguous copy of a per-(step, layer) array, made once: the per-layer passes read columns."""
        cache = self.__dict__.setdefault("_columns", {})
        if name not in cache:
            cache[name] = np.ascontiguousarray(getattr(self, name).T)
        return cache[name]


def _live(records: np.ndarray) -> dict[str, np.ndarray]:
    """Per (step, layer): presence, missing, NaN/Inf, all-zero and the RMS of the nonzero finite values."""
    size, missing, nonfinite_count, zero, _, max_abs = _history(records)
    present = ~np.isnan(size)
    missing = present & (missing > 0.5)
    values = present & ~missing
    nonfinite = values & (nonfinite_count > 0)
    dead = values & ~nonfinite & (size > 0) & (zero >= size)
    nonzero = size - nonfinite_count - zero
    with np.errstate(invalid="ignore", divide="ignore"):
        ssq = records[..., record.INDEX["ssq_rel"]]
        rms = np.where(nonzero > 0, max_abs * np.sqrt(ssq / np.where(nonzero > 0, nonzero, 1)), np.nan)
    live = values & ~nonfinite & ~dead & (rms > 0)
    return {"present": present, "missing": missing, "nonfinite": nonfinite, "dead": dead, "live": live,
            "size": np.where(present, size, 0.0), "rms": rms, "max_abs": max_abs}


def _evaluate(records: np.ndarray, layers: Sequence[str], t: Thresholds) -> _Steps:
    """Every rule at every (logged step, layer); see docs/DIAGNOSIS.md for each rule's reason."""
    v = _live(records)
    live, rms, size = v["live"], v["rms"], v["size"]
    log_rms = np.where(live, _log10(rms), np.nan)
    sibling = _loudest_sibling(log_rms, layer_groups(layers))
    quiet_sibling = live & (log_rms <= sibling - t.inert_decades)
    ref = _reference(log_rms, live & ~quiet_sibling)
    dec = log_rms - ref[:, None]
    low = (dec <= -t.vanish_decades) | (rms < t.vanish_rms_below)
    inert = quiet_sibling & low
    signal = live & ~inert
    upd_rms, upd_ratio, weight_norm = _update_stats(records)
    # NaN/Inf that the optimizer did not apply (dynamic loss scaling): no update at all, finite weights. (A NaN
    # update has no finite element either, but the weights it produced are NaN at the next step: see _confirm.)
    # The optimizer skips a whole step, so one layer with that signature and no layer updated mark the step.
    signature = v["nonfinite"] & (upd_rms == 0) & (weight_norm > 0) & np.isfinite(weight_norm)
    step_skipped = signature.any(axis=1) & ~(upd_rms > 0).any(axis=1)
    skipped = v["nonfinite"] & step_skipped[:, None]
    groups = layer_groups(layers)
    log_upd = _log10(upd_rms) - _layer_weight_scale(weight_norm, size, groups)
    ref_upd = _reference(np.where(signal, log_upd, np.nan), signal & np.isfinite(log_upd))
    with np.errstate(invalid="ignore"):
        speed = log_upd - ref_upd[:, None]  # NaN where updates are not recorded: the gradient rules alone decide
        learns = (t.update_decades > 0) & (speed > -t.update_decades)
        calm = (t.update_decades > 0) & (speed < t.update_decades)
    log_sig = np.where(signal, log_rms, np.nan)
    base, typical = _window_stats(log_sig, t.growth_window)
    ref_growth = ref - _window_stats(ref[:, None], t.growth_window)[0][:, 0]
    big = size >= TREND_MIN_SIZE
    with np.errstate(invalid="ignore"):
        flags = {
            "present": v["present"], "nonfinite": v["nonfinite"], "skipped": skipped, "inert": inert,
            "learns": learns, "calm": calm,
            "exp_rel": signal & (dec >= t.explode_decades) & ~calm,
            # The absolute bounds judge a layer the reference cannot (the whole network is huge); a layer far above
            # the reference is judged by the relative rule and its learning rate (a fresh first convolution on raw
            # pixels under Adam exceeds the bounds for a step and is healthy).
            "exp_rms": live & (rms > t.explode_rms_above) & ~(dec >= t.explode_decades),
            "exp_max": live & (v["max_abs"] > t.explode_max_abs_above) & ~(dec >= t.explode_decades),
            "exp_update": live & big & (upd_ratio > t.explode_update_ratio),
            "exp_trend": signal & big & (log_sig - base >= t.growth_decades)
            & (log_sig - typical >= t.growth_decades / 2) & ((dec >= -1.0) | (ref_growth >= t.growth_decades)[:, None]),
            "van_rel": signal & (dec <= -t.vanish_decades) & ~learns,
            "van_abs": signal & (rms < t.vanish_rms_below) & ~learns,
        }
    exploding = flags["exp_rel"] | flags["exp_rms"] | flags["exp_max"] | flags["exp_update"] | flags["exp_trend"]
    raw = np.full(live.shape, HEALTHY, dtype=np.int8)
    raw[inert] = INERT
    raw[flags["van_rel"] | flags["van_abs"]] = VANISHING
    raw[exploding] = EXPLODING
    raw[v["dead"]] = DEAD
    raw[v["nonfinite"]] = NONFINITE
    raw[skipped] = SKIPPED
    raw[v["missing"]] = MISSING
    raw[~v["present"]] = _ABSENT
    return _Steps(raw=raw, size=size, rms=rms, max_abs=v["max_abs"], log_rms=log_rms, ref=ref, log_upd=log_upd,
                  upd_ratio=upd_ratio, weight_norm=weight_norm,
                  ref_upd=ref_upd, sibling=sibling, base=base, flags=flags)


# --- episodes -------------------------------------------------------------------------------------------------------


@dataclass
class _Track:
    """One layer's statuses over its present rows, as runs ``(code, first_row, last_row)`` after confirmation."""

    rows: np.ndarray  # row indices (into steps) where the layer has a record
    runs: list[tuple[int, int, int]]  # (code, first position, last position) into ``rows``
    unconfirmed: tuple[int, int] | None  # (code, length) of a trailing slow run not yet confirmed
    chain_from: int | None = None  # a position where the chain starts instead (a small tensor follows its layer)

    @property
    def code(self) -> int:
        return self.runs[-1][0] if self.runs else MISSING

    def chain_start(self) -> int:
        """Position where the trailing chain of flagged runs starts (the last run's start when it is not flagged)."""
        k = len(self.runs) - 1
        if self.runs[k][0] not in FLAG_CODES:
            return self.runs[k][1]
        while k > 0 and self.runs[k - 1][0] in FLAG_CODES:
            k -= 1
        return self.runs[k][1] if self.chain_from is None else self.chain_from


def _runs(codes: np.ndarray) -> list[list[int]]:
    if codes.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(codes)) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts - 1, [codes.size - 1]])
    return [[int(codes[a]), int(a), int(b)] for a, b in zip(starts, ends, strict=True)]


def _merge_equal(runs: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for r in runs:
        if out and out[-1][0] == r[0]:
            out[-1][2] = r[2]
        else:
            out.append(list(r))
    return out


#: A healthy stretch of at most this many logged steps between two flagged episodes does not end the chain: one
#: quiet minibatch in the middle of a divergence is not a recovery.
CHAIN_GAP = 2


def _confirm(runs: list[list[int]], need: int) -> tuple[int, int] | None:
    """Relabel in place the runs that need confirmation; returns the trailing unconfirmed slow run, if any.

    A vanishing or dead run shorter than ``need`` logged steps is healthy, unless it directly follows a flagged
    run: a layer that is already sick needs no confirmation (a saturating layer collapsing to zero inside a
    divergence). Skipped NaN/Inf steps are nonfinite when they last ``need`` steps or NaN follows them. A healthy
    stretch of at most ``CHAIN_GAP`` steps between two flagged runs continues the first.
    """
    unconfirmed = None
    for k, r in enumerate(runs):
        short = r[2] - r[1] + 1 < need
        after_flag = k > 0 and runs[k - 1][0] in FLAG_CODES
        if r[0] == SKIPPED:
            leads_to_nan = k + 1 < len(runs) and runs[k + 1][0] == NONFINITE
            r[0] = NONFINITE if leads_to_nan or not short else HEALTHY

        elif r[0] in (VANISHING, DEAD) and short and not after_flag:
            if k == len(runs) - 1:
                unconfirmed = (r[0], r[2] - r[1] + 1)
            r[0] = HEALTHY
    for k in range(1, len(runs) - 1):
        r = runs[k]
        if r[0] == HEALTHY and r[2] - r[1] + 1 <= CHAIN_GAP and runs[k - 1][0] in FLAG_CODES \
                and runs[k + 1][0] in FLAG_CODES:
            r[0] = runs[k - 1][0]
    return unconfirmed


def _backdate(runs: list[list[int]], col: np.ndarray, t: Thresholds) -> None:
    """An exploding run after a healthy one starts where the layer's RMS left its floor: the step after the last
    one within twice the trend's own per-step slope (``2 * growth_decades / growth_window``, 0.4 decades) of the
    lowest RMS of the ``growth_window`` steps before the run. A quiet minibatch in the middle of the rise does not
    move the onset; minibatch noise (a few tenths of a decade) does not start it."""
    rise = 2.0 * t.growth_decades / t.growth_window
    w = t.growth_window
    for k in range(1, len(runs)):
        code, first, _ = runs[k]
        prev = runs[k - 1]
        if code != EXPLODING or prev[0] != HEALTHY:
            continue
        lo = max(prev[1], first - w)
        window = col[lo:first]
        if not np.isfinite(window).any():
            continue
        floor = np.nanmin(window)
        at_floor = np.flatnonzero(window <= floor + rise)
        j = lo + int(at_floor[-1]) + 1
        runs[k][1], prev[2] = j, min(prev[2], j - 1)


def _blown_up(runs: list[list[int]], weight: np.ndarray) -> None:
    """An exploding run goes on over the healthy steps after it while the weight norm stays ``BLOWN_UP`` times its
    norm before the run (or at its first step): the blow-up was not undone."""
    for k in range(len(runs) - 1):
        code, first, last = runs[k]
        nxt = runs[k + 1]
        if code != EXPLODING or nxt[0] != HEALTHY:
            continue
        before = weight[first - 1] if first > 0 else weight[first]
        if not before > 0:
            continue
        j = last
        while j + 1 <= nxt[2] and weight[j + 1] >= BLOWN_UP * before:
            j += 1
        if j > last:
            runs[k][2], nxt[1] = j, j + 1


def _track(ev: _Steps, i: int, t: Thresholds) -> _Track:
    """The layer's confirmed runs over the steps where it has a record."""
    rows = np.flatnonzero(ev.columns("present")[i])
    runs = _runs(ev.columns("raw")[i, rows].astype(np.int64))
    unconfirmed = _confirm(runs, t.sustain_steps)
    runs = _merge_equal(runs)
    _backdate(runs, ev.columns("log_rms")[i, rows], t)
    _blown_up(runs, ev.columns("weight_norm")[i, rows])
    runs = _merge_equal([r for r in runs if r[2] >= r[1]])
    return _Track(rows, [tuple(r) for r in runs], unconfirmed)


def _episodes(track: _Track, steps: np.ndarray) -> list[dict[str, Any]]:
    return [{"status": STATUSES[code], "from": int(steps[track.rows[a]]), "to": int(steps[track.rows[b]])}
            for code, a, b in track.runs if code not in (HEALTHY, INERT)]


# --- diagnosis ------------------------------------------------------------------------------------------------------


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
) -> RunHealth:
    """Diagnose every layer of a run from its records, using the logged steps at or before ``at_step``.

    ``layers``: names in network (forward) order; ``steps``: int [S] ascending unique; ``records``: float64
    ``[S, L, record.NUM_FIELDS]`` memory form, a layer's row all-NaN at a step where it has no record.
    ``at_step`` (default: the last step) must not precede the first step (ValueError naming ``step``).
    A layer without any record up to the step is reported ``missing``.
    """
    steps, records = _check_inputs(layers, steps, records)
    t = thresholds
    if at_step is not None:
        end = int(np.searchsorted(steps, at_step, side="right"))
        if end == 0 and steps.size:
            raise ValueError(f"step {at_step} is before the first logged step {int(steps[0])}")
        steps, records = steps[:end], records[:end]
    if steps.size == 0 or len(layers) == 0:
        out = [LayerHealth(name, i, "missing", _BASE[MISSING], ["no record of this layer"], None, None)
               for i, name in enumerate(layers)]
        return RunHealth(None, t, out)
    ev = _evaluate(records, layers, t)
    # A skipped NaN/Inf step counts when NaN/Inf follows it at the next step (the update was NaN, not skipped).
    follows = np.zeros_like(ev.nonfinite)
    follows[:-1] = ev.nonfinite[1:]
    origin = _nonfinite_origin(ev.nonfinite & ~(ev.skipped & ~follows))
    present = ev.present
    s_count = present.shape[0]
    last_rows = np.where(present.any(axis=0), s_count - 1 - np.argmax(present[::-1], axis=0), 0)
    d = record.derived(records[last_rows, np.arange(len(layers))])
    tracks = [_track(ev, i, t) if ev.columns("present")[i].any() else None for i in range(len(layers))]
    _follow_siblings(tracks, ev, layers)
    out = [_layer_health(ev, steps, layers, i, d, origin, t, tracks[i]) for i in range(len(layers))]
    ranked = sorted(out, key=lambda lh: (-lh.severity, lh.index))
    return RunHealth(int(steps[-1]), t, ranked, _first_bad(ranked), _onset(out), _timeline(out))


def _follow_siblings(tracks: list[_Track | None], ev: _Steps, layers: Sequence[str]) -> None:
    """A tensor too small for a trend (a one-element bias) has an RMS of one or a few numbers, so its own onset is
    noise: when a larger variable of its layer has a flagged chain overlapping its current one, its chain starts
    where theirs did."""
    small = ev.size.max(axis=0) < TREND_MIN_SIZE
    for cols in layer_groups(layers):
        big = [tracks[int(c)] for c in cols if not small[c] and tracks[int(c)] is not None]
        for c in (int(c) for c in cols if small[c] and tracks[c] is not None):
            track = tracks[c]
            if track.code not in FLAG_CODES:
                continue
            a, z = track.rows[track.chain_start()], track.rows[track.runs[-1][2]]
            starts = []
            for other in big:
                if other.code in FLAG_CODES:
                    oa = other.rows[other.chain_start()]
                    if oa <= z and a <= other.rows[other.runs[-1][2]]:
                        starts.append(oa)
            if starts:
                track.chain_from = min(int(np.searchsorted(track.rows, min(starts))), len(track.rows) - 1)


def _layer_health(ev: _Steps, steps: np.ndarray, layers: Sequence[str], i: int, d: dict[str, np.ndarray],
                  origin: tuple[int, int, int] | None, t: Thresholds, track: _Track | None) -> LayerHealth:
    name = layers[i]
    if track is None:
        return LayerHealth(name, i, "missing", _BASE[MISSING] + 1.0,
                           [f"no record of this layer at or before step {int(steps[-1])}"], None, None)
    code = track.code
    s = int(track.rows[-1])
    last = track.runs[-1]
    chain = track.chain_start()
    ctx = _Ctx(ev, steps, s, i, last[2] - last[1] + 1, int(steps[track.rows[last[1]]]), t,
               int(track.rows[last[1] - 1]) if last[1] > 0 else int(track.rows[0]))
    reasons, excess = _reasons(code, ctx, d, i)
    if track.unconfirmed is not None:
        reasons.append(_unconfirmed_note(track.unconfirmed, ctx, t.sustain_steps))
    ever_nonfinite = ev.nonfinite[:, i]
    if code != NONFINITE and ever_nonfinite.any():
        reasons.append(_past_nonfinite_note(ever_nonfinite, ev.skipped[:, i], steps))
    if origin is not None and (code == NONFINITE or (origin[1] == i and code in FLAG_CODES)):
        reasons.append(_origin_note(origin, i, layers, steps))
    if code in (EXPLODING, VANISHING, HEALTHY):  # a dead, NaN or missing gradient makes the ratios moot
        reasons.extend(_ratio_notes(d, i, t))
    flagged = code not in (HEALTHY, INERT)
    persistence = last[2] - chain + 1
    severity = 0.0 if not flagged else _BASE[code] + min(_SPAN - 2.0, (1.0 + excess) * persistence)
    if code == INERT:
        severity = _BASE[INERT] + 1.0
    if flagged and origin is not None and origin[1] == i and track.rows[chain] <= origin[0]:
        # The layer where NaN/Inf started ranks first while it is flagged, whatever it turned into since (a layer
        # whose weights became NaN often has an all-zero gradient afterwards).
        severity = _BASE[NONFINITE] + _SPAN - 1.0
    return LayerHealth(
        layer=name, index=i, status=STATUSES[code], severity=float(severity), reasons=reasons,
        first_step=int(steps[track.rows[chain]]) if flagged else None, step=int(steps[s]),
        status_since=int(steps[track.rows[max(last[1], chain)]]) if flagged else None,
        episodes=_episodes(track, steps),
        **{k: float(d[k][i]) for k in ("norm", "rms", "max_abs", "mean", "zero_fraction", "grad_to_weight",
                                       "update_to_weight", "noise", "weight_norm")},
        nan=int(d["nan"][i]), inf=int(d["inf"][i]),
    )


def _first_bad(ranked: list[LayerHealth]) -> dict[str, Any] | None:
    """The layer ranked first, when it is flagged, with the onset of its episode chain."""
    top = ranked[0] if ranked else None
    if top is None or top.status not in FLAGS:
        return None
    return {"layer": top.layer, "status": top.status, "step": top.first_step}


def _onset(layers: list[LayerHealth]) -> dict[str, Any] | None:
    """The first step any layer was flagged (any episode, current or past), ties to the deepest layer."""
    best = None
    for lh in layers:
        for e in lh.episodes:
            key = (e["from"], -lh.index)
            if best is None or key < best[0]:
                best = (key, {"layer": lh.layer, "status": e["status"], "step": e["from"]})
    return best[1] if best else None


def _timeline(layers: list[LayerHealth]) -> list[dict[str, Any]]:
    """When each status first appeared in the run, on which layer first (ties deepest), how many layers had it."""
    first: dict[str, tuple[tuple[int, int], str]] = {}
    count: dict[str, int] = {}
    for lh in layers:
        seen = set()
        for e in lh.episodes:
            key = (e["from"], -lh.index)
            if e["status"] not in first or key < first[e["status"]][0]:
                first[e["status"]] = (key, lh.layer)
            seen.add(e["status"])
        for st in seen:
            count[st] = count.get(st, 0) + 1
    items = sorted(first.items(), key=lambda kv: kv[1][0])
    return [{"status": st, "step": key[0], "layer": layer, "layers": count[st]} for st, (key, layer) in items]


def _nonfinite_origin(nonfinite: np.ndarray) -> tuple[int, int, int] | None:
    """(first step row with NaN/Inf, deepest layer nonfinite there, how many layers were) or None."""
    rows = np.flatnonzero(nonfinite.any(axis=1))
    if rows.size == 0:
        return None
    r = int(rows[0])
    bad = np.flatnonzero(nonfinite[r])
    return r, int(bad[-1]), int(bad.size)


# --- reasons --------------------------------------------------------------------------------------------------------


@dataclass
class _Ctx:
    ev: _Steps
    steps: np.ndarray
    s: int  # row of the layer's last record
    i: int  # layer
    run_len: int
    run_first_step: int
    t: Thresholds
    before_row: int = 0  # row just before the current run (its first row when it starts the layer's history)

    def lasting(self) -> str:
        n = self.run_len
        if n <= 1:
            return f"at step {int(self.steps[self.s])}"
        return f"for the last {n} logged steps (since step {self.run_first_step})"

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


def _exploding_reasons(c: _Ctx, d: dict[str, np.ndarray]) -> tuple[list[str], float]:
    ev, s, i, t = c.ev, c.s, c.i, c.t
    rms = float(ev.rms[s, i])
    reasons, excess = [], 0.0
    if ev.exp_rel[s, i]:
        above = c.ev.dec(s, i)
        reasons.append(f"{_rms_text(c, d)} is {above:.1f} decades above {c.ref_text()} {c.lasting()}: the "
                       f"gradient grows on its way back from the loss")
        lu, ru = float(ev.log_upd[s, i]), float(ev.ref_upd[s])
        if math.isfinite(lu) and math.isfinite(ru):
            reasons.append(f"it learns {lu - ru:.1f} decades faster than the layers nearest the loss (update RMS / "
                           f"weight RMS {_e(10.0 ** lu)} against {_e(10.0 ** ru)})")
        excess = max(excess, above - t.explode_decades)
    if ev.exp_rms[s, i]:
        reasons.append(f"{_rms_text(c, d)} is above the absolute bound {t.explode_rms_above:g}")
        excess = max(excess, math.log10(rms / t.explode_rms_above))
    if ev.exp_max[s, i]:
        m = float(ev.max_abs[s, i])
        reasons.append(f"max |g| {_e(m)} is above the absolute bound {t.explode_max_abs_above:g}")
        excess = max(excess, math.log10(m / t.explode_max_abs_above))
    if ev.exp_update[s, i]:
        r = float(ev.upd_ratio[s, i])
        reasons.append(f"the applied update is {r:,.3g}x the weight's norm: the weights are blowing up (learning "
                       f"rate too high for this layer)")
        excess = max(excess, math.log10(r / t.explode_update_ratio))
    if ev.exp_trend[s, i]:
        g = float(ev.log_rms[s, i] - ev.base[s, i])
        reasons.append(f"RMS grew {10.0 ** g:,.0f}x ({g:.1f} decades) within the last {t.growth_window} logged "
                       f"steps, from {_e(10.0 ** float(ev.base[s, i]))} to {_e(rms)} at step {int(c.steps[s])}")
        excess = max(excess, g - t.growth_decades)
    if not reasons:  # the episode goes on because the weights it blew up were not brought back
        w, w0 = float(ev.weight_norm[s, i]), float(ev.weight_norm[c.before_row, i])
        reasons.append(f"its weight norm {_e(w)} is still {w / w0:,.0f}x what it was before this episode began at "
                       f"step {c.run_first_step} ({_e(w0)}): the blow-up was not undone")
        excess = math.log10(w / w0) - 1.0
    return reasons, excess


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


def _inert_reason(c: _Ctx) -> str:
    ev, s, i = c.ev, c.s, c.i
    gap = float(ev.sibling[s, i] - ev.log_rms[s, i])
    return (f"only round-off reaches this variable: its RMS {_e(float(ev.rms[s, i]))} is {gap:.1f} decades below "
            f"the other variables of its layer, a gradient that is zero in exact arithmetic (e.g. a bias directly "
            f"before BatchNormalization, which subtracts it again). Not a disease: the parameter is unused "
            f"(use_bias=False removes it)")


def _reasons(code: int, c: _Ctx, d: dict[str, np.ndarray], i: int) -> tuple[list[str], float]:
    """Plain-language reasons for the status and the excess (decades beyond the threshold) for the severity."""
    if code == NONFINITE:
        nan, inf, size = int(d["nan"][i]), int(d["inf"][i]), int(d["size"][i])
        frac = (nan + inf) / size if size else 1.0
        return [f"{nan:,} NaN and {inf:,} Inf of {size:,} gradient values at step {int(c.steps[c.s])}; NaN/Inf "
                f"{c.lasting()}"], frac
    if code == EXPLODING:
        return _exploding_reasons(c, d)
    if code == VANISHING:
        return _vanishing_reasons(c, d)
    if code == DEAD:
        size = int(d["size"][i])
        return [f"all {size:,} gradient values are exactly zero {c.lasting()}: no signal reaches this variable "
                f"(e.g. a dead ReLU, or a path cut by stop_gradient)"], 0.0
    if code == MISSING:
        return [f"no gradient reached this variable (None gradient) {c.lasting()}"], 0.0
    if code == INERT:
        return [_inert_reason(c)], 0.0
    dec = c.ev.dec(c.s, i)
    if c.ev.learns[c.s, i] and dec <= -c.t.vanish_decades:
        return [f"note: {_rms_text(c, d)} is {-dec:.1f} decades below {c.ref_text()}, but its updates keep pace "
                f"with theirs (an adaptive optimizer rescales it): it still learns"], 0.0
    if c.ev.calm[c.s, i] and dec >= c.t.explode_decades:
        return [f"note: {_rms_text(c, d)} is {dec:.1f} decades above {c.ref_text()}, but it learns at their pace "
                f"(an adaptive optimizer rescales it; early convolutions sum over many positions)"], 0.0
    return [], 0.0


def _unconfirmed_note(unconfirmed: tuple[int, int], c: _Ctx, need: int) -> str:
    code, length = unconfirmed
    what = "vanishing-level RMS" if code == VANISHING else "all-zero gradient"
    return (f"note: {what} at the last {length} logged step(s); flagged as {STATUSES[code]} once it lasts {need}")


def _past_nonfinite_note(col: np.ndarray, skipped: np.ndarray, steps: np.ndarray) -> str:
    rows = np.flatnonzero(col)
    span = f"first at step {int(steps[rows[0]])}, last at step {int(steps[rows[-1]])}"
    if skipped[rows].all():
        return (f"note: NaN/Inf at {rows.size} logged step(s) that the optimizer skipped (its update was zero, as "
                f"dynamic loss scaling does after an overflow), {span}; not a disease")
    return f"note: NaN/Inf earlier at {rows.size} logged step(s), {span}; finite since"


def _origin_note(origin: tuple[int, int, int], i: int, layers: Sequence[str], steps: np.ndarray) -> str:
    r, first, count = origin
    step = int(steps[r])
    if i == first:
        if count == 1:
            return f"NaN/Inf started here: the only nonfinite layer at step {step}, the first step with NaN/Inf"
        return (f"NaN/Inf started here: at step {step}, the first step with NaN/Inf, {count} layers were nonfinite "
                f"and backprop computes gradients deepest layer first, so the deepest of them (this one) went "
                f"first; the shallower ones received it (or it came from the loss above)")
    return f"the first nonfinite layer was {layers[first]} at step {step} (deepest nonfinite layer, backprop order)"


#: (ratio key, label, Thresholds field above, field below, why above, why below); ``{r}`` is the weight change of
#: one SGD step at lr 1e-3 in units of the weight norm.
_RATIO_RULES = (
    ("update_to_weight", "update/weight", "update_ratio_above", "update_ratio_below",
     " (rule of thumb ~1e-3, Karpathy): the learning rate is likely too high for this layer",
     " (rule of thumb ~1e-3, Karpathy): this layer barely learns"),
    ("grad_to_weight", "grad/weight", "grad_ratio_above", "grad_ratio_below",
     ": even SGD at lr 1e-3 would move the weights by {r:.2g}x their norm a step",
     ": the gradient is tiny next to the weights"),
)


def _ratio_notes(d: dict[str, np.ndarray], i: int, t: Thresholds) -> list[str]:
    notes = []
    if not float(d["weight_norm"][i]) > 0:
        return notes
    for key, label, above_field, below_field, why_above, why_below in _RATIO_RULES:
        v = float(d[key][i])
        if not math.isfinite(v):
            continue
        above, below = getattr(t, above_field), getattr(t, below_field)
        if v > above:
            notes.append(f"note: {label} {_e(v)} is above {above:g}" + why_above.format(r=v * 1e-3))
        elif v < below:
            notes.append(f"note: {label} {_e(v)} is below {below:g}" + why_below)
    return notes


# --- depth profile --------------------------------------------------------------------------------------------------


def profile(
    layers: Sequence[str],
    records_at_step: np.ndarray,
    thresholds: Thresholds = Thresholds(),  # noqa: B008 - frozen, immutable default
    statuses: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Per-layer norm/rms/max_abs/status at one step, in network order, plus the healthy band's lines.

    Cheap (one step, no history): the status is the *instantaneous* one of that step's rules (no trend, no
    sustain). Pass ``statuses`` (network order, e.g. ``RunHealth.statuses()``) to show the full diagnosis instead.
    A layer without a record at the step is ``missing``. Bands (JSON, None when unknown): ``reference_rms`` (the
    layers nearest the loss), ``median_rms``; ``vanishing_below`` = the larger of the relative and absolute
    vanishing lines; ``exploding_above`` = the smaller of the relative and absolute exploding lines.
    """
    rows = np.asarray(records_at_step, dtype=np.float64)
    if rows.ndim != 2 or rows.shape != (len(layers), record.NUM_FIELDS):
        raise ValueError(f"records_at_step must have shape [{len(layers)}, {record.NUM_FIELDS}], got {rows.shape}")
    if statuses is not None and len(statuses) != len(layers):
        raise ValueError(f"{len(statuses)} statuses for {len(layers)} layers")
    t = thresholds
    ev = _evaluate(rows[None], layers, t)
    d = record.derived(rows)
    ref_log = float(ev.ref[0])
    live = ev.log_rms[0][np.isfinite(ev.log_rms[0])]
    median = 10.0 ** float(np.median(live)) if live.size else None
    ref = 10.0 ** ref_log if math.isfinite(ref_log) else None
    vanish = max(ref * 10.0 ** -t.vanish_decades, t.vanish_rms_below) if ref else t.vanish_rms_below
    explode = min(ref * 10.0 ** t.explode_decades, t.explode_rms_above) if ref else t.explode_rms_above
    out_layers = []
    for i, name in enumerate(layers):
        code = int(ev.raw[0, i])
        st = statuses[i] if statuses is not None else STATUSES[MISSING if code == _ABSENT else code]
        known = bool(ev.present[0, i]) and d["finite"][i] > 0
        out_layers.append({"layer": name, "index": i, "norm": _json_float(d["norm"][i]) if known else None,
                           "rms": _json_float(d["rms"][i]) if known else None,
                           "max_abs": _json_float(d["max_abs"][i]) if known else None, "status": st})
    return {"layers": out_layers,
            "bands": {"reference_rms": ref, "median_rms": median,
                      "vanishing_below": _json_float(vanish) if vanish > 0 else None,
                      "exploding_above": _json_float(explode)}}
