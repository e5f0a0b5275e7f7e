"""JSON answers built from a run's series and its diagnosis: the one place the plugin's routes and the CLI share.

Pure functions of a :class:`~tb_gradhealth.reader.RunSeries` (no HTTP, no TensorFlow). A request that cannot be
answered raises :class:`RequestError` with the HTTP status a route would give it; the CLI turns it into a usage error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from tensorboard import errors as tb_errors

from tb_gradhealth import _tiers, health, record
from tb_gradhealth.progress import Progress
from tb_gradhealth.reader import RunSeries

#: Points a ``series`` / ``histograms`` answer holds at most (the last step always included).
MAX_POINTS = 500
#: Steps of the RMS sparkline history in ``health``.
HISTORY_POINTS = 64
SERIES_FIELDS = ("norm", "rms", "max_abs", "mean", "nan", "inf", "zero_fraction", "weight_norm", "grad_to_weight",
                 "update_to_weight", "noise")
#: What a number looks like in a query or a flag: ASCII digits only, no spaces, separators or trailing newline.
_INT_RE = re.compile(r"[0-9]{1,18}")
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


class RequestError(tb_errors.PublicError):
    """A request that cannot be answered, as a ``tensorboard.errors`` error: ``http_code`` (also ``status``) 400 for a
    bad parameter, 404 for an unknown run or layer, 503 when the data provider fails; ``parameter`` names the query
    parameter at fault (None when none is), for the JSON body ``{"error", "parameter"}`` the frontend reads."""

    def __init__(self, status: int, message: str, parameter: str | None = None):
        super().__init__(message)
        self.http_code = status
        self.message = message
        self.parameter = parameter

    @property
    def status(self) -> int:
        return self.http_code


def parse_step(raw: str | None, name: str = "step") -> int | None:
    """A step from text: ASCII digits only (``5%0A``, ``５``, ``1_000``, `` 5 `` are refused); None when absent."""
    if raw is None or raw == "":
        return None
    if not _INT_RE.fullmatch(raw):
        raise RequestError(400, f"parameter {name!r}: {raw!r} is not a non-negative integer", name)
    return int(raw)


def parse_thresholds(params: Mapping[str, Any]) -> health.Thresholds:
    """Thresholds from text values that must look like plain ASCII decimal numbers (else a 400 naming the key), then
    :meth:`health.Thresholds.from_mapping` for the names and ranges."""
    for key, raw in params.items():
        if isinstance(raw, str) and not _NUMBER_RE.fullmatch(raw):
            raise RequestError(400, f"threshold {key!r} must be a plain decimal number, got {raw!r}", key)
    try:
        return health.Thresholds.from_mapping(params)
    except ValueError as e:
        raise RequestError(400, f"threshold parameter: {e}", getattr(e, "key", None)) from e


def readable(series: RunSeries) -> RunSeries:
    """``series`` if it has at least one readable record, else RequestError 404 with the run's problems: every
    route answers a run whose records are all unreadable the same way."""
    if series.num_steps == 0:
        why = "; ".join(series.problems[:3]) or "no records"
        raise RequestError(404, f"run {series.run!r} has no readable records ({why})", "run")
    return series


def _floats(values: np.ndarray) -> list[float | None]:
    """JSON numbers, with NaN/Inf as null (JSON has no non-finite numbers)."""
    arr = np.asarray(values, dtype=np.float64)
    return [float(v) if math.isfinite(v) else None for v in arr.tolist()]


def pick_indices(n: int, limit: int, must: tuple[int, ...] = ()) -> np.ndarray:
    """At most ``limit`` indices of ``range(n)`` evenly spread, always with the last one and those in ``must``."""
    if n <= limit:
        return np.arange(n)
    extra = sorted({int(m) for m in must if 0 <= m < n} | {n - 1})
    base = np.linspace(0, n - 1, max(1, limit - len(extra))).round().astype(np.int64)
    return np.unique(np.concatenate([base, np.array(extra, dtype=np.int64)]))


def at_index(series: RunSeries, step: int | None) -> int:
    """Index of the latest logged step at or before ``step`` (the last step when None); RequestError if none."""
    readable(series)
    if step is None:
        return series.num_steps - 1
    k = int(np.searchsorted(series.steps, step, side="right")) - 1
    if k < 0:
        raise RequestError(400, f"parameter 'step': {step} is before the first logged step {series.first_step}",
                           "step")
    return k


def runs_payload(runs: list[RunSeries], problems: list[str]) -> dict[str, Any]:
    return {"runs": [s.summary() for s in runs], "problems": list(problems)}


def diagnose(series: RunSeries, thresholds: health.Thresholds, step: int | None,
             progress: Progress | None = None) -> health.RunHealth:
    """The run's diagnosis at the latest logged step <= ``step``: the one call behind ``tb-gradhealth report``, the
    tab and a live run's ``stop_on`` (:mod:`tb_gradhealth.live`), so all three say the same at a step. Evidence
    beside the records where they are recorded: the training loss, the optimizer's skipped steps and where a
    writer's replay found the first NaN/Inf made (``progress``), the layers' kinds (``series.layer_info``) and the
    training loop (``series.source``)."""
    k = at_index(series, step)
    progress = progress or Progress()
    return health.diagnose_run(series.layers, series.steps, series.records, thresholds,
                               at_step=int(series.steps[k]), progress=progress.loss, layer_info=series.layer_info,
                               skipped=progress.skipped, source=dict(series.source) or None,
                               nan_origin=progress.origin, activations=series.activations)


def loss_payload(loss: tuple[np.ndarray, np.ndarray] | None, at_step: int) -> dict[str, Any] | None:
    """``{"steps", "values"}``: the training loss at or before ``at_step`` for the tab's trend line, at most
    :data:`MAX_POINTS` of its steps evenly spread (the last one kept); None when no loss is recorded."""
    if loss is None:
        return None
    steps, values = loss
    end = int(np.searchsorted(steps, at_step, side="right"))
    if end == 0:
        return None
    idx = pick_indices(end, MAX_POINTS)
    return {"steps": [int(s) for s in steps[idx]], "values": _floats(values[idx])}


def health_payload(series: RunSeries, thresholds: health.Thresholds, step: int | None,
                   diagnosis: health.RunHealth | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """``{"run", **RunHealth.to_json(), "history_steps", "loss"}``, each layer with ``rms_history`` (sparklines)
    and, where the writer recorded it, its ``kind`` and ``activation``; ``loss``: :func:`loss_payload` of
    ``progress.loss``; ``forward_profile`` (:func:`health.depth_profile`) where the layers' outputs are recorded."""
    k = at_index(series, step)
    h = diagnosis if diagnosis is not None else diagnose(series, thresholds, step, progress)
    idx = pick_indices(k + 1, HISTORY_POINTS)
    rms = record.derived(series.records[idx])["rms"]  # [H, L]
    body = {"run": series.run, **h.to_json(), "history_steps": [int(s) for s in series.steps[idx]],
            "loss": loss_payload(progress.loss if progress is not None else None, int(series.steps[k]))}
    fw = health.Forward.of(series.activations)
    if fw is not None:
        body["forward_profile"] = health.depth_profile(fw, int(series.steps[k]))
    for layer in body["layers"]:
        layer["rms_history"] = _floats(rms[:, layer["index"]])
        kind, activation = series.layer_info.get(layer["layer"], ("", ""))
        if kind or activation:
            layer["kind"], layer["activation"] = kind, activation
    return body


def _layer_rows(series: RunSeries, layer: str, fields: int = record.NUM_FIELDS
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(first step, last step, rows [n, fields], steps in each row)`` where the layer has a record (the first
    ``fields`` fields: the counts and values alone are ``record.HIST_START``); each row is one step unless a long
    run's older steps were merged (``series.window_steps``: the rows come back as their windows' sums);
    RequestError 404 for an unknown layer."""
    j = readable(series).layer_index(layer)
    if j is None:
        raise RequestError(404, f"parameter 'layer': run {series.run!r} has no layer {layer!r}", "layer")
    present = ~np.isnan(series.records[:, j, record.INDEX["size"]])
    steps, rows = series.steps[present], series.records[present, j, :fields]
    if series.window_steps is None or series.window_last is None:
        return steps, steps, rows, np.ones(rows.shape[0], np.int64)
    weight = series.window_steps[present, j].astype(np.int64)
    return steps, series.window_last[present], _tiers.window_sums(rows, weight), weight


def window_starts(rows: np.ndarray, limit: int = MAX_POINTS) -> np.ndarray:
    """Start indices of at most ``limit`` windows of consecutive rows covering them all: one row each when they
    fit; else windows of about equal length, the last row alone (the current state) and a window starting exactly
    at the first row with a NaN/Inf, so its step is the chart's point there (onsets are exact)."""
    n = rows.shape[0]
    if n <= limit:
        return np.arange(n)
    nonfinite = record.nonfinite_count(rows) > 0
    must = {0, n - 1} | ({int(np.argmax(nonfinite))} if nonfinite.any() else set())
    base = np.linspace(0, n - 1, limit - len(must), endpoint=False).round().astype(np.int64)
    return np.unique(np.concatenate([base, np.array(sorted(must), dtype=np.int64)]))


def merge_windows(rows: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The merged record (:func:`record.merge`) of each window ``rows[starts[i]:starts[i + 1]]``: exact counts,
    extremes and sums of squares of every step in it, so no spike disappears from a chart with fewer points."""
    n = rows.shape[0]
    ends = np.append(starts[1:], n)
    if np.all(ends - starts == 1):
        return rows[starts]
    out = rows[starts].copy()
    for k in range(1, int(np.max(ends - starts))):
        live = starts + k < ends
        out[live] = record.merge(out[live], rows[starts[live] + k])
    return out


def _windowed(series: RunSeries, layer: str, fields: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(first step, last step, number of steps, merged record)`` of each chart window of a layer. Rows that are
    already merged windows of a long run (``series.window_steps``) count their steps and merge as their sums."""
    steps, last, rows, weight = _layer_rows(series, layer, fields)
    starts = window_starts(rows)
    ends = np.append(starts[1:], steps.size)
    count = np.add.reduceat(weight, starts) if starts.size else weight[:0]
    return steps[starts], last[ends - 1], count, merge_windows(rows, starts)


def _window_fields(first: np.ndarray, last: np.ndarray, count: np.ndarray, total: int) -> dict[str, Any]:
    return {
        "steps": [int(s) for s in first],
        "window_last": [int(s) for s in last],
        "window_steps": [int(c) for c in count],
        "total_steps": total,
        "merged": bool(np.any(count > 1)),
        "downsampled": False,  # windows merge every step; nothing is dropped
    }


def series_payload(series: RunSeries, layer: str, thresholds: health.Thresholds) -> dict[str, Any]:
    """The layer's fields at every logged step, or over ≤ MAX_POINTS merged windows of steps (``window_*``): NaN/Inf
    counts are the window's totals, ``max_abs`` its largest value, ``norm`` (and the weight and update norms) the
    root mean square of its steps' norms, ``rms``/``mean``/``zero_fraction`` over all its elements."""
    first, last, count, merged = _windowed(series, layer, record.HIST_START)
    d = record.derived(merged)
    per_step = np.sqrt(count)
    d["norm"] = d["norm"] / per_step
    d["weight_norm"] = d["weight_norm"] / per_step
    return {
        "run": series.run,
        "layer": layer,
        **_window_fields(first, last, count, int(count.sum())),
        "fields": {name: _floats(d[name]) for name in SERIES_FIELDS},
        "thresholds": thresholds.to_dict(),
        "outputs": output_history(series, layer),
    }


def output_history(series: RunSeries, layer: str) -> dict[str, Any] | None:
    """The layer's output over the logged steps where the writer recorded it (``health.forward.output_history``),
    None for a run without output records or a layer none of them speaks for."""
    fw = health.Forward.of(series.activations)
    return None if fw is None else health.output_history(fw, series.layers, layer, MAX_POINTS)


def histograms_payload(series: RunSeries, layer: str) -> dict[str, Any]:
    """The layer's decade histograms per logged step, or per merged window (as in ``series``): ``counts`` are the
    window's mean per step, ``zero`` and ``nonfinite`` its exact totals."""
    first, last, count, rows = _windowed(series, layer, record.NUM_FIELDS)
    hist = rows[:, record.HIST_START :] / count[:, None]
    lo, hi = record.hist_window(hist)
    d = record.derived(rows)
    return {
        "run": series.run,
        "layer": layer,
        **_window_fields(first, last, count, int(count.sum())),
        "decades": [int(x) for x in record.HIST_BIN_LOG10_LO[lo:hi]],
        "counts": [_floats(r) for r in hist[:, lo:hi]],
        "zero": _floats(d["zero"]),
        "nonfinite": _floats(d["nan"] + d["inf"]),
        "exact": [bool(x) for x in d["hist_exact"]],
    }


def profile_index(series: RunSeries, step: int | None) -> int:
    """The depth profile's step: the latest logged step ≤ ``step``; without a step, the last one where every layer
    that has a record there has finite values (a run that ended in NaN opens on the gradients just before it), else
    the last one with the most layers whose values are all finite (an all-NaN last step would draw an empty chart)."""
    k = at_index(series, step)
    if step is None:
        present = ~np.isnan(series.records[..., record.INDEX["size"]])
        with np.errstate(invalid="ignore"):
            finite = present & (record.nonfinite_count(series.records) == 0)
        shown = finite.sum(axis=1)
        every = np.flatnonzero(present.any(axis=1) & (shown == present.sum(axis=1)))
        if every.size:
            k = int(every[-1])
        elif shown.any():
            k = int(np.flatnonzero(shown == shown.max())[-1])
    return k


def profile_payload(series: RunSeries, thresholds: health.Thresholds, step: int | None,
                    diagnosis: health.RunHealth | None = None) -> dict[str, Any]:
    """Per-layer norms in network order at the latest logged step ≤ ``step`` (see :func:`profile_index`), statuses
    of the full diagnosis."""
    k = profile_index(series, step)
    h = diagnosis if diagnosis is not None else diagnose(series, thresholds, int(series.steps[k]))
    prof = health.profile(series.layers, series.records[k], thresholds, statuses=h.statuses())
    return {"run": series.run, "step": int(series.steps[k]), "steps": [int(s) for s in series.steps], **prof}
