"""Diagnosis: from a run's per-layer records, decide which layers are sick, since when and how badly.

Pure numpy on top of :mod:`tb_gradhealth.record` (no TensorFlow, no TensorBoard), so the plugin, the CLI and any
script share one diagnosis. The rules and the reasons behind every default are in ``docs/DIAGNOSIS.md``.

Every rule is evaluated for every (logged step, layer) at once on ``[S, L]`` arrays, which gives each layer a
*raw status per step*; a layer's status is its raw status at its last record (at or before ``at_step``), confirmed
over several logged steps for the slow diseases (vanishing, dead), and ``first_step`` is where its trailing run of
that raw status began. Diagnosing 1,000 layers x 1,000 logged steps takes ~0.15 s warm (~0.35 s cold) on the
project's shared 2-core machine, ~40 MB of temporaries (``tests/test_health.py::test_scale_1000_by_1000`` prints
the figure on every run).

Order: ``layers`` are in network (forward) order. Backprop computes gradients deepest layer first, so when several
layers turn NaN/Inf at the same first step, the *deepest* of them (last in network order) is where it started;
the shallower ones only received it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tb_gradhealth import record

#: Status words, most severe first: this is also the severity order.
STATUSES: tuple[str, ...] = ("nonfinite", "exploding", "vanishing", "dead", "missing", "healthy")
_CODE = {name: i for i, name in enumerate(STATUSES)}
NONFINITE, EXPLODING, VANISHING, DEAD, MISSING, HEALTHY = range(len(STATUSES))
_ABSENT = -1
#: The relative exploding rule measures against this quantile of the layers' log RMS (the upper quartile), not the
#: median: when the lower half of a deep network vanishes, its median sinks into the vanishing part and would
#: make the normal layers near the loss look "exploding". A single outlier layer barely moves either quantile.
UPPER_QUANTILE = 0.75
#: Severity = base of the status + a within-status part in [0, _SPAN): statuses never overlap.
_SPAN = 1000.0
_BASE = {code: (len(STATUSES) - 1 - code) * _SPAN for code in range(len(STATUSES))}
_ORDER = (
    "layers worst first: severity descending (nonfinite > exploding > vanishing > dead > missing > healthy), "
    "ties by network index; first_bad is the most severe status's earliest onset, ties to the deepest layer "
    "(backprop computes the deepest layer first)"
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
        3.0, 0.5, 30.0, 0.5, "Vanishing: RMS at least this many decades (powers of ten) below the median layer's "
        "RMS at the same step.")
    explode_decades: float = _meta(
        3.0, 0.5, 30.0, 0.5, "Exploding: RMS at least this many decades above the upper-quartile layer's RMS (75th "
        "percentile of the layers) at the same step.")
    vanish_rms_below: float = _meta(
        1e-8, 0.0, 1.0, 1e-9, "Vanishing backstop: RMS below this absolute value (0 turns it off). A decade below "
        "Adam's epsilon (1e-7 in Keras), where Adam stops rescaling and updates shrink with the gradient.", log=True)
    explode_rms_above: float = _meta(
        1e2, 1e-30, 1e38, 1.0, "Exploding backstop: RMS above this absolute value.", log=True)
    explode_max_abs_above: float = _meta(
        1e4, 1e-30, 1e38, 1.0, "Exploding backstop: max |g| above this absolute value (float16 overflows at 6.5e4).",
        log=True)
    growth_decades: float = _meta(
        2.0, 0.1, 30.0, 0.1, "Exploding by trend: RMS grew by at least this many decades over growth_window logged "
        "steps (catches a divergence before it reaches NaN).")
    growth_window: int = _meta(
        10, 2, 100000, 1, "Exploding by trend: the window, in logged steps, the growth is measured over.")
    sustain_steps: int = _meta(
        5, 1, 100000, 1, "Vanishing and dead must hold for this many consecutive logged steps (fewer when the run "
        "has fewer): one quiet step is not a disease.")
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
            "summary": {"counts": self.counts, "first_bad": self.first_bad, "order": _ORDER},
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


@dataclass
class _Steps:
    """The rules evaluated on ``[S, L]`` records (or ``[1, L]`` for a single step)."""

    present: np.ndarray
    raw: np.ndarray  # int8 status code per (step, layer); _ABSENT where no record
    rms: np.ndarray
    max_abs: np.ndarray
    log_rms: np.ndarray  # NaN where RMS is 0, unknown or absent
    median: np.ndarray  # [S] log10 RMS of the median layer
    upper: np.ndarray  # [S] log10 RMS of the upper-quartile layer
    start: np.ndarray  # [S] row where each step's growth window starts
    exp_rel: np.ndarray
    exp_rms: np.ndarray
    exp_max: np.ndarray
    exp_trend: np.ndarray
    van_rel: np.ndarray
    van_abs: np.ndarray
    nonfinite: np.ndarray

    def dec(self, s: int, i: int) -> float:
        return float(self.log_rms[s, i] - self.median[s])

    def growth(self, s: int, i: int) -> float:
        return float(self.log_rms[s, i] - self.log_rms[self.start[s], i])


def _history(records: np.ndarray) -> tuple[np.ndarray, ...]:
    """size, missing, NaN+Inf count, zero count, RMS and max|g| over ``[S, L]``: the few fields the rules need.

    The same formulas as :func:`record.derived` (a test checks they agree), computed without the other ~15
    quantities ``derived`` returns: at 1,000 x 1,000 this is 4x faster, and it is the bulk of the diagnosis.
    """
    f = record.INDEX
    size = records[..., f["size"]]
    n = record.finite_count(records)
    m = record.max_abs(records)
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(n > 0, m * np.sqrt(records[..., f["ssq_rel"]] / np.where(n > 0, n, 1)), np.nan)
    return size, records[..., f["missing"]], size - n, records[..., f["zero"]], rms, m


#: Logged steps evaluated together: keeps the temporaries of one block in cache (~2x faster at 1,000 layers).
_BLOCK = 64


def _evaluate(records: np.ndarray, t: Thresholds) -> _Steps:
    shape = records.shape[:2]
    s_count = shape[0]
    flags = {k: np.zeros(shape, dtype=bool) for k in (
        "present", "exp_rel", "exp_rms", "exp_max", "exp_trend", "van_rel", "van_abs", "nonfinite")}
    rms, max_abs, log_rms = (np.empty(shape) for _ in range(3))
    median, upper = np.empty(s_count), np.empty(s_count)
    raw = np.empty(shape, dtype=np.int8)
    start = np.maximum(np.arange(s_count) - (t.growth_window - 1), 0)
    for a in range(0, s_count, _BLOCK):
        b = slice(a, min(a + _BLOCK, s_count))
        size, missing, nonfinite_count, zero, rms[b], max_abs[b] = _history(records[b])
        present = ~np.isnan(size)
        missing = present & (missing > 0.5)
        values = present & ~missing
        nonfinite = values & (nonfinite_count > 0)
        dead = values & ~nonfinite & (size > 0) & (zero >= size)
        log_rms[b] = lr = _log10(rms[b])
        ok_log = np.where(values & ~nonfinite, lr, np.nan)
        ok_log.sort(axis=-1)
        median[b] = _sorted_quantile(ok_log, 0.5)
        upper[b] = _sorted_quantile(ok_log, UPPER_QUANTILE)
        dec = lr - median[b, None]
        growth = lr - log_rms[start[b]]  # window starts are at or before each row: already computed
        median_growth = median[b] - median[start[b]]
        live = values & ~nonfinite & ~dead
        with np.errstate(invalid="ignore"):
            exp_rel = live & (lr - upper[b, None] >= t.explode_decades)
            exp_rms = live & (rms[b] > t.explode_rms_above)
            exp_max = live & (max_abs[b] > t.explode_max_abs_above)
            # Growth toward the median is recovery, not explosion: the trend rule needs the layer at or above the
            # median layer, or the whole network (its median) growing as fast.
            exp_trend = live & (growth >= t.growth_decades) & (
                (dec >= 0) | (median_growth >= t.growth_decades)[:, None])
            exploding = exp_rel | exp_rms | exp_max | exp_trend
            van_rel = live & (dec <= -t.vanish_decades)
            van_abs = live & (rms[b] < t.vanish_rms_below)
        r = np.full(present.shape, HEALTHY, dtype=np.int8)
        r[~exploding & (van_rel | van_abs)] = VANISHING
        r[exploding] = EXPLODING
        r[dead] = DEAD
        r[nonfinite] = NONFINITE
        r[missing] = MISSING
        r[~present] = _ABSENT
        raw[b] = r
        for k, v in (("present", present), ("exp_rel", exp_rel), ("exp_rms", exp_rms), ("exp_max", exp_max),
                     ("exp_trend", exp_trend), ("van_rel", van_rel), ("van_abs", van_abs), ("nonfinite", nonfinite)):
            flags[k][b] = v
    return _Steps(raw=raw, rms=rms, max_abs=max_abs, log_rms=log_rms, median=median, upper=upper, start=start,
                  **flags)


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
    n_layers = len(layers)
    if steps.size == 0 or n_layers == 0:
        out = [LayerHealth(name, i, "missing", _BASE[MISSING], ["no record of this layer"], None, None)
               for i, name in enumerate(layers)]
        return RunHealth(None, t, out, _first_bad(out))
    ev = _evaluate(records, t)
    s_count = steps.size
    cols = np.arange(n_layers)
    present = ev.present
    has_any = present.any(axis=0)
    last = np.where(has_any, s_count - 1 - np.argmax(present[::-1], axis=0), 0)
    cur = np.where(has_any, ev.raw[last, cols], MISSING)
    # The trailing run of the current raw status: present steps since the last present step with another status.
    breaks = present & (ev.raw != cur[None, :])
    any_break = breaks.any(axis=0)
    last_break = np.where(any_break, s_count - 1 - np.argmax(breaks[::-1], axis=0), -1)
    cum = np.cumsum(present, axis=0, dtype=np.int32)
    cum_at_break = np.where(last_break >= 0, cum[np.maximum(last_break, 0), cols], 0)
    run_len = cum[last, cols] - cum_at_break
    after = present & (np.arange(s_count)[:, None] > last_break[None, :])
    run_first = np.argmax(after, axis=0)
    n_present = cum[-1]
    need = np.minimum(t.sustain_steps, n_present)
    slow = (cur == VANISHING) | (cur == DEAD)
    unconfirmed = slow & (run_len < need)
    status = np.where(unconfirmed, HEALTHY, cur)

    rows = records[last, cols]  # [L, F]: each layer's last record
    d = record.derived(rows)
    ever_nonfinite = ev.nonfinite.any(axis=0)
    origin = _nonfinite_origin(ev.nonfinite)

    out: list[LayerHealth] = []
    for i, name in enumerate(layers):
        code = int(status[i])
        if not has_any[i]:
            step_i = int(steps[-1])
            out.append(LayerHealth(name, i, "missing", _BASE[MISSING] + 1.0,
                                   [f"no record of this layer at or before step {step_i}"], None, None))
            continue
        s = int(last[i])
        ctx = _Ctx(ev, steps, s, i, int(run_len[i]), int(steps[run_first[i]]), t)
        reasons, excess = _reasons(code, ctx, d, i)
        if unconfirmed[i]:
            reasons.append(_unconfirmed_note(int(cur[i]), ctx, int(need[i])))
        if code != NONFINITE and ever_nonfinite[i]:
            reasons.append(_past_nonfinite_note(ev.nonfinite[:, i], steps))
        if code == NONFINITE and origin is not None:
            reasons.append(_origin_note(origin, i, layers, steps))
        if code in (EXPLODING, VANISHING, HEALTHY):  # a dead, NaN or missing gradient makes the ratios moot
            reasons.extend(_ratio_notes(d, i, t))
        persistence = ctx.run_len
        severity = 0.0 if code == HEALTHY else _BASE[code] + min(_SPAN - 2.0, (1.0 + excess) * persistence)
        if code == NONFINITE and origin is not None and origin[1] == i and run_first[i] == origin[0]:
            severity = _BASE[NONFINITE] + _SPAN - 1.0  # the layer where it started ranks first
        out.append(LayerHealth(
            layer=name, index=i, status=STATUSES[code], severity=float(severity), reasons=reasons,
            first_step=None if code == HEALTHY else int(steps[run_first[i]]), step=int(steps[s]),
            norm=float(d["norm"][i]), rms=float(d["rms"][i]), max_abs=float(d["max_abs"][i]),
            mean=float(d["mean"][i]), nan=int(d["nan"][i]), inf=int(d["inf"][i]),
            zero_fraction=float(d["zero_fraction"][i]), grad_to_weight=float(d["grad_to_weight"][i]),
            update_to_weight=float(d["update_to_weight"][i]), noise=float(d["noise"][i]),
            weight_norm=float(d["weight_norm"][i]),
        ))
    ranked = sorted(out, key=lambda lh: (-lh.severity, lh.index))
    return RunHealth(int(steps[-1]), t, ranked, _first_bad(out))


def _first_bad(layers: list[LayerHealth]) -> dict[str, Any] | None:
    """The earliest onset of the most severe status present; ties to the deepest layer (backprop order)."""
    flagged = [lh for lh in layers if lh.status != "healthy"]
    if not flagged:
        return None
    worst = min(_CODE[lh.status] for lh in flagged)
    cands = [lh for lh in flagged if _CODE[lh.status] == worst]
    first = min(cands, key=lambda lh: (lh.first_step if lh.first_step is not None else math.inf, -lh.index))
    return {"layer": first.layer, "status": first.status, "step": first.first_step}


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

    def lasting(self) -> str:
        n = self.run_len
        if n <= 1:
            return f"at step {int(self.steps[self.s])}"
        return f"for the last {n} logged steps (since step {self.run_first_step})"


def _e(x: float) -> str:
    return f"{x:.1e}"


def _reasons(code: int, c: _Ctx, d: dict[str, np.ndarray], i: int) -> tuple[list[str], float]:
    """Plain-language reasons for the status and the excess (decades beyond the threshold) for the severity."""
    ev, s, t = c.ev, c.s, c.t
    rms, dec = float(ev.rms[s, i]), ev.dec(s, i)
    med = 10.0 ** float(ev.median[s]) if np.isfinite(ev.median[s]) else math.nan
    if code == NONFINITE:
        nan, inf, size = int(d["nan"][i]), int(d["inf"][i]), int(d["size"][i])
        frac = (nan + inf) / size if size else 1.0
        return [f"{nan:,} NaN and {inf:,} Inf of {size:,} gradient values at step {int(c.steps[s])}; NaN/Inf "
                f"{c.lasting()}"], frac
    if code == EXPLODING:
        reasons, excess = [], 0.0
        if ev.exp_rel[s, i]:
            above, upper = float(ev.log_rms[s, i] - ev.upper[s]), 10.0 ** float(ev.upper[s])
            reasons.append(f"RMS {_e(rms)} is {above:.1f} decades above the upper-quartile layer ({_e(upper)}) "
                           f"{c.lasting()}")
            excess = max(excess, above - t.explode_decades)
        if ev.exp_rms[s, i]:
            reasons.append(f"RMS {_e(rms)} is above the absolute bound {t.explode_rms_above:g}")
            excess = max(excess, math.log10(rms / t.explode_rms_above))
        if ev.exp_max[s, i]:
            m = float(ev.max_abs[s, i])
            reasons.append(f"max |g| {_e(m)} is above the absolute bound {t.explode_max_abs_above:g}")
            excess = max(excess, math.log10(m / t.explode_max_abs_above))
        if ev.exp_trend[s, i]:
            g = ev.growth(s, i)
            j = int(ev.start[s])
            reasons.append(f"RMS grew {10.0 ** g:,.0f}x ({g:.1f} decades) over the last {s - j + 1} logged steps, "
                           f"from {_e(float(ev.rms[j, i]))} at step {int(c.steps[j])} to {_e(rms)} at step "
                           f"{int(c.steps[s])}")
            excess = max(excess, g - t.growth_decades)
        return reasons, excess
    if code == VANISHING:
        reasons, excess = [], 0.0
        if ev.van_rel[s, i]:
            reasons.append(f"RMS {_e(rms)} is {-dec:.1f} decades below the median layer ({_e(med)}) {c.lasting()}")
            excess = max(excess, -dec - t.vanish_decades)
        if ev.van_abs[s, i]:
            reasons.append(f"RMS {_e(rms)} is below the absolute floor {t.vanish_rms_below:g} {c.lasting()}")
            excess = max(excess, math.log10(t.vanish_rms_below / max(rms, record.FLUSH_BELOW)))
        return reasons, excess
    if code == DEAD:
        size = int(d["size"][i])
        return [f"all {size:,} gradient values are exactly zero {c.lasting()}: no signal reaches this variable "
                f"(e.g. a dead ReLU, or a path cut by stop_gradient)"], 0.0
    if code == MISSING:
        return [f"no gradient reached this variable (None gradient) {c.lasting()}"], 0.0
    return [], 0.0


def _unconfirmed_note(code: int, c: _Ctx, need: int) -> str:
    what = "vanishing-level RMS" if code == VANISHING else "all-zero gradient"
    return (f"note: {what} at the last {c.run_len} logged step(s) (since step {c.run_first_step}); flagged as "
            f"{STATUSES[code]} once it lasts {need}")


def _past_nonfinite_note(col: np.ndarray, steps: np.ndarray) -> str:
    rows = np.flatnonzero(col)
    return (f"note: NaN/Inf earlier at {rows.size} logged step(s), first at step {int(steps[rows[0]])}, last at "
            f"step {int(steps[rows[-1]])}; finite since")


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

    Cheap (one step, no history): the status is the *instantaneous* one of that step's rules (relative and
    absolute bands, NaN/Inf, all-zero, missing; no trend, no sustain). Pass ``statuses`` (network order, e.g.
    ``RunHealth.statuses()``) to show the full diagnosis instead. A layer without a record at the step is
    ``missing``. Bands (JSON, None when unknown): ``median_rms``; ``vanishing_below`` = the larger of the relative
    and absolute vanishing lines; ``exploding_above`` = the smaller of the relative and absolute exploding lines.
    """
    rows = np.asarray(records_at_step, dtype=np.float64)
    if rows.ndim != 2 or rows.shape != (len(layers), record.NUM_FIELDS):
        raise ValueError(f"records_at_step must have shape [{len(layers)}, {record.NUM_FIELDS}], got {rows.shape}")
    if statuses is not None and len(statuses) != len(layers):
        raise ValueError(f"{len(statuses)} statuses for {len(layers)} layers")
    t = thresholds
    ev = _evaluate(rows[None], dataclasses.replace(t, growth_window=2))
    d = record.derived(rows)
    med_log, upper_log = float(ev.median[0]), float(ev.upper[0])
    median = 10.0 ** med_log if math.isfinite(med_log) else None
    vanish = max(median * 10.0 ** -t.vanish_decades, t.vanish_rms_below) if median else t.vanish_rms_below
    explode = t.explode_rms_above
    if math.isfinite(upper_log):
        explode = min(10.0 ** (upper_log + t.explode_decades), explode)
    out_layers = []
    for i, name in enumerate(layers):
        code = int(ev.raw[0, i])
        st = statuses[i] if statuses is not None else STATUSES[MISSING if code == _ABSENT else code]
        known = bool(ev.present[0, i])
        out_layers.append({"layer": name, "index": i, "norm": _json_float(d["norm"][i]),
                           "rms": _json_float(d["rms"][i]),
                           "max_abs": _json_float(d["max_abs"][i]) if known else None, "status": st})
    return {"layers": out_layers,
            "bands": {"median_rms": median, "vanishing_below": _json_float(vanish) if vanish > 0 else None,
                      "exploding_above": _json_float(explode)}}
