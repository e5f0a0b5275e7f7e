"""The ``gradhealth`` TensorBoard plugin: thin HTTP routes over :mod:`reader` (data) and :mod:`health` (diagnosis).

Every route validates its query, calls a pure function that turns a :class:`~tb_gradhealth.reader.RunSeries` into
JSON, and answers through ``http_util.Respond``. Every failure mode is explicit: a bad parameter is a 400 naming it,
an unknown run or layer a 404, a data provider that fails a 503; a corrupt or truncated file is a problem line in
``runs``, not an error. The routes are documented in docs/API.md. Imports no TensorFlow.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from tensorboard import context as tb_context
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_gradhealth import health, metadata, record
from tb_gradhealth.reader import ProviderError, ProviderReader, RunSeries

#: Points a ``series`` / ``histograms`` answer holds at most (the last step always included).
MAX_POINTS = 500
#: Steps of the RMS sparkline history in ``health``.
HISTORY_POINTS = 64
SERIES_FIELDS = ("norm", "rms", "max_abs", "mean", "nan", "inf", "zero_fraction", "weight_norm", "grad_to_weight",
                 "update_to_weight", "noise")
_STATIC_TYPES = {
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".css": "text/css",
    ".html": "text/html",
    ".json": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".txt": "text/plain",
}
_INT_RE = re.compile(r"^[0-9]{1,18}$")


def _static_dir() -> str | None:
    """Where the frontend files are: ``tb_gradhealth/static/`` in an installed package (copied there by setup.py),
    else the checkout's top-level ``frontend/`` (editable and development installs); None when neither exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "static"), os.path.join(os.path.dirname(here), "frontend")):
        if os.path.isfile(os.path.join(candidate, "index.js")):
            return candidate
    return None


class RequestError(Exception):
    """A request that cannot be answered: ``status`` 400 (bad parameter), 404 (unknown run/layer) or 503."""

    def __init__(self, status: int, message: str, parameter: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.parameter = parameter


# --- pure functions: series → JSON ------------------------------------------------------------------------------


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
    if series.num_steps == 0:
        raise RequestError(404, f"run {series.run!r} has no readable records", "run")
    if step is None:
        return series.num_steps - 1
    k = int(np.searchsorted(series.steps, step, side="right")) - 1
    if k < 0:
        raise RequestError(400, f"parameter 'step': {step} is before the first logged step {series.first_step}",
                           "step")
    return k


def runs_payload(runs: list[RunSeries], problems: list[str]) -> dict[str, Any]:
    return {"runs": [s.summary() for s in runs], "problems": list(problems)}


def diagnose(series: RunSeries, thresholds: health.Thresholds, step: int | None) -> health.RunHealth:
    k = at_index(series, step)
    return health.diagnose_run(series.layers, series.steps, series.records, thresholds,
                               at_step=int(series.steps[k]))


def health_payload(series: RunSeries, thresholds: health.Thresholds, step: int | None,
                   diagnosis: health.RunHealth | None = None) -> dict[str, Any]:
    """``{"run", **RunHealth.to_json(), "history_steps"}``, each layer with ``rms_history`` (sparklines)."""
    k = at_index(series, step)
    h = diagnosis if diagnosis is not None else diagnose(series, thresholds, step)
    idx = pick_indices(k + 1, HISTORY_POINTS)
    rms = record.derived(series.records[idx])["rms"]  # [H, L]
    body = {"run": series.run, **h.to_json(), "history_steps": [int(s) for s in series.steps[idx]]}
    for layer in body["layers"]:
        layer["rms_history"] = _floats(rms[:, layer["index"]])
    return body


def _layer_rows(series: RunSeries, layer: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, rows [n, F])`` where the layer has a record; RequestError 404 for an unknown layer."""
    j = series.layer_index(layer)
    if j is None:
        raise RequestError(404, f"parameter 'layer': run {series.run!r} has no layer {layer!r}", "layer")
    rows = series.records[:, j]
    present = ~np.isnan(rows[:, record.INDEX["size"]])
    return series.steps[present], rows[present]


def _selection(rows: np.ndarray) -> np.ndarray:
    """≤ MAX_POINTS rows evenly spread, keeping the last step and the first step with NaN/Inf (never sampled away)."""
    nonfinite = (rows[:, record.INDEX["nan"]] + rows[:, record.INDEX["posinf"]] + rows[:, record.INDEX["neginf"]]) > 0
    must = (int(np.argmax(nonfinite)),) if nonfinite.any() else ()
    return pick_indices(rows.shape[0], MAX_POINTS, must)


def series_payload(series: RunSeries, layer: str, thresholds: health.Thresholds) -> dict[str, Any]:
    steps, rows = _layer_rows(series, layer)
    sel = _selection(rows)
    d = record.derived(rows[sel])
    return {
        "run": series.run,
        "layer": layer,
        "steps": [int(s) for s in steps[sel]],
        "total_steps": int(steps.size),
        "downsampled": bool(sel.size < steps.size),
        "fields": {name: _floats(d[name]) for name in SERIES_FIELDS},
        "thresholds": thresholds.to_dict(),
    }


def histograms_payload(series: RunSeries, layer: str) -> dict[str, Any]:
    steps, rows = _layer_rows(series, layer)
    sel = _selection(rows)
    rows = rows[sel]
    hist = rows[:, record.HIST_START :]
    nonempty = np.flatnonzero(np.any(hist != 0, axis=0))
    lo, hi = (int(nonempty[0]), int(nonempty[-1]) + 1) if nonempty.size else (0, 0)
    d = record.derived(rows)
    return {
        "run": series.run,
        "layer": layer,
        "steps": [int(s) for s in steps[sel]],
        "decades": [int(x) for x in record.HIST_BIN_LOG10_LO[lo:hi]],
        "counts": [_floats(r) for r in hist[:, lo:hi]],
        "zero": _floats(d["zero"]),
        "nonfinite": _floats(d["nan"] + d["inf"]),
        "exact": [bool(x) for x in d["hist_exact"]],
    }


def profile_payload(series: RunSeries, thresholds: health.Thresholds, step: int | None,
                    diagnosis: health.RunHealth | None = None) -> dict[str, Any]:
    """Per-layer norms in network order at the latest logged step ≤ ``step``, statuses of the full diagnosis."""
    k = at_index(series, step)
    h = diagnosis if diagnosis is not None else diagnose(series, thresholds, int(series.steps[k]))
    prof = health.profile(series.layers, series.records[k], thresholds, statuses=h.statuses())
    return {"run": series.run, "step": int(series.steps[k]), "steps": [int(s) for s in series.steps], **prof}


# --- request parsing ----------------------------------------------------------------------------------------------


def _required(args: Mapping[str, str], name: str) -> str:
    value = args.get(name)
    if value is None or value == "":
        raise RequestError(400, f"missing parameter '{name}'", name)
    return value


def _step(args: Mapping[str, str]) -> int | None:
    raw = args.get("step")
    if raw is None or raw == "":
        return None
    if not _INT_RE.match(raw):
        raise RequestError(400, f"parameter 'step': {raw!r} is not a non-negative integer", "step")
    return int(raw)


def _thresholds(args: Mapping[str, str], known: tuple[str, ...]) -> health.Thresholds:
    """Thresholds from every query parameter that is not one of ``known`` (an unknown name is a 400 naming it)."""
    params = {k: v for k, v in args.items() if k not in known}
    try:
        return health.Thresholds.from_mapping(params)
    except ValueError as e:
        # Thresholds names the offending key quoted ('key'); unquoted names in its message are the known ones.
        bad = next((k for k in params if repr(k) in str(e)), None)
        raise RequestError(400, f"threshold parameter: {e}", bad) from e


def _no_extra(args: Mapping[str, str], known: tuple[str, ...]) -> None:
    for k in args:
        if k not in known:
            raise RequestError(400, f"unknown parameter {k!r} (this route takes {', '.join(known)})", k)


# --- the plugin ---------------------------------------------------------------------------------------------------


class GradHealthPlugin(base_plugin.TBPlugin):
    """The "Gradient Health" tab: ranked per-layer gradient diagnosis for every run."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._context = context
        hint = (context.sampling_hints or {}).get(metadata.PLUGIN_NAME)
        self._reader = ProviderReader(context.data_provider, hint)
        self._health_cache: OrderedDict[tuple, tuple[health.RunHealth, str | None]] = OrderedDict()
        self._health_lock = threading.Lock()

    # TBPlugin API
    def get_plugin_apps(self) -> dict[str, Callable]:
        return {
            "/runs": self._serve_runs,
            "/health": self._serve_health,
            "/series": self._serve_series,
            "/histograms": self._serve_histograms,
            "/profile": self._serve_profile,
            "/*": self._serve_static,
        }

    def is_active(self) -> bool:
        """Cheap: TensorBoard's plugin listing already asks the data provider which plugins have data
        (``list_plugins``, one call for all plugins), so this is only a fallback for hosts that skip that."""
        if self._context.data_provider is None:
            return False
        return self._reader.has_data(tb_context.RequestContext(), "")

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="Gradient Health")

    # helpers
    def _series(self, request: Any, run: str) -> RunSeries:
        ctx = plugin_util.context(request.environ)
        eid = plugin_util.experiment_id(request.environ)
        try:
            series = self._reader.run(ctx, eid, run)
        except ProviderError as e:
            raise RequestError(503, str(e)) from e
        if series is None:
            raise RequestError(404, f"parameter 'run': no gradient-health data for run {run!r}", "run")
        return series

    def _diagnosis(self, request: Any, series: RunSeries, t: health.Thresholds, step: int | None,
                   want_json: bool) -> tuple[health.RunHealth, str | None]:
        """The diagnosis (and, for ``health``, its JSON text), cached per (run data, thresholds, step): the data
        part of the key is the series' generation, which changes whenever the reader decodes new data."""
        k = at_index(series, step)
        key = (plugin_util.experiment_id(request.environ), series.run, series.generation, t, k)
        with self._health_lock:
            hit = self._health_cache.get(key)
            if hit is not None and (hit[1] is not None or not want_json):
                self._health_cache.move_to_end(key)
                return hit
        h = diagnose(series, t, step)
        text = json.dumps(health_payload(series, t, step, h), allow_nan=False) if want_json else None
        with self._health_lock:
            self._health_cache[key] = (h, text)
            while len(self._health_cache) > 32:
                self._health_cache.popitem(last=False)
        return h, text

    def _respond(self, request: Any, produce: Callable[[], Any]) -> wrappers.Response:
        try:
            body, code = produce(), 200
        except RequestError as e:
            body, code = {"error": e.message, "parameter": e.parameter}, e.status
        if not isinstance(body, str):
            body = json.dumps(body, allow_nan=False)
        return http_util.Respond(request, body, "application/json", code=code)

    # routes
    @wrappers.Request.application
    def _serve_runs(self, request: Any) -> wrappers.Response:
        def produce() -> dict[str, Any]:
            _no_extra(request.args, ())
            ctx = plugin_util.context(request.environ)
            eid = plugin_util.experiment_id(request.environ)
            try:
                return runs_payload(self._reader.runs(ctx, eid), [])
            except ProviderError as e:
                return runs_payload([], [str(e)])

        return self._respond(request, produce)

    @wrappers.Request.application
    def _serve_health(self, request: Any) -> wrappers.Response:
        def produce() -> str:
            run = _required(request.args, "run")
            step = _step(request.args)
            t = _thresholds(request.args, ("run", "step"))
            series = self._series(request, run)
            return self._diagnosis(request, series, t, step, want_json=True)[1]

        return self._respond(request, produce)

    @wrappers.Request.application
    def _serve_series(self, request: Any) -> wrappers.Response:
        def produce() -> dict[str, Any]:
            run = _required(request.args, "run")
            layer = _required(request.args, "layer")
            t = _thresholds(request.args, ("run", "layer"))
            return series_payload(self._series(request, run), layer, t)

        return self._respond(request, produce)

    @wrappers.Request.application
    def _serve_histograms(self, request: Any) -> wrappers.Response:
        def produce() -> dict[str, Any]:
            _no_extra(request.args, ("run", "layer"))
            run = _required(request.args, "run")
            layer = _required(request.args, "layer")
            return histograms_payload(self._series(request, run), layer)

        return self._respond(request, produce)

    @wrappers.Request.application
    def _serve_profile(self, request: Any) -> wrappers.Response:
        def produce() -> dict[str, Any]:
            run = _required(request.args, "run")
            step = _step(request.args)
            t = _thresholds(request.args, ("run", "step"))
            series = self._series(request, run)
            k = at_index(series, step)
            h, _ = self._diagnosis(request, series, t, int(series.steps[k]), want_json=False)
            return profile_payload(series, t, step, h)

        return self._respond(request, produce)

    @wrappers.Request.application
    def _serve_static(self, request: Any) -> wrappers.Response:
        """Files of the frontend directory only: no path outside it, no hidden files, known types only."""
        path = request.path
        marker = f"/plugin/{metadata.PLUGIN_NAME}/"
        rel = path.split(marker, 1)[1] if marker in path else path.lstrip("/")
        static = _static_dir()
        resolved = _resolve_static(static, rel) if static else None
        if resolved is None:
            body = json.dumps({"error": f"no such file: {rel!r}", "parameter": None})
            return http_util.Respond(request, body, "application/json", code=404)
        with open(resolved, "rb") as f:
            content = f.read()
        return http_util.Respond(request, content, _STATIC_TYPES[os.path.splitext(resolved)[1].lower()])


def _resolve_static(static: str, rel: str) -> str | None:
    """The real path of ``rel`` inside ``static``, or None (traversal, hidden segment, unknown type, not a file)."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        return None
    if os.path.splitext(rel)[1].lower() not in _STATIC_TYPES:
        return None
    root = os.path.realpath(static)
    full = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([root, full]) != root or not os.path.isfile(full):
        return None
    return full


class GradHealthLoader(base_plugin.TBLoader):
    """Loader for ``tensorboard.program.TensorBoard(plugins=[...])`` and the ``tensorboard_plugins`` entry point
    (TensorBoard accepts either this loader or the plugin class itself there)."""

    def load(self, context: base_plugin.TBContext) -> GradHealthPlugin:
        return GradHealthPlugin(context)
