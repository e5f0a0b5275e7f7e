"""The ``gradhealth`` TensorBoard plugin: thin HTTP routes over :mod:`reader` (data) and :mod:`health` (diagnosis).

Every route validates its query, calls a pure function of :mod:`_payloads` that turns a
:class:`~tb_gradhealth.reader.RunSeries` into JSON, and answers through ``http_util.Respond``. Every failure mode
is explicit: a bad parameter is a 400 naming it, an unknown run or layer a 404, a data provider that fails a 503; a
corrupt or truncated file is a problem line in ``runs``, not an error. The routes are documented in docs/API.md.
Imports no TensorFlow.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import mimetypes
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tensorboard import context as tb_context
from tensorboard import errors as tb_errors
from tensorboard import plugin_util
from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers

from tb_gradhealth import health, metadata, origin, progress
from tb_gradhealth._filereader import FileReader
from tb_gradhealth._payloads import (
    RequestError,
    at_index,
    diagnose,
    health_payload,
    histograms_payload,
    parse_step,
    parse_thresholds,
    profile_index,
    profile_payload,
    runs_payload,
    series_payload,
)
from tb_gradhealth._streams import run_of
from tb_gradhealth.reader import ProviderError, ProviderReader, RunSeries

_log = logging.getLogger(__name__)
#: Different diagnoses computed at the same time at most (each holds a few arrays the size of the run's records).
DIAGNOSES_AT_ONCE = 2
#: Diagnoses (with their JSON) kept for warm requests.
HEALTH_CACHE_ENTRIES = 32

#: Extensions the static route serves (anything else in the frontend directory is not served).
_STATIC_EXTENSIONS = frozenset({".js", ".mjs", ".css", ".html", ".json", ".svg", ".png", ".txt"})


@functools.cache
def _mime_types() -> mimetypes.MimeTypes:
    """Python's built-in type table, not the machine's ``/etc/mime.types`` (so every machine serves the same
    types), with JavaScript as ``text/javascript`` (RFC 9239; older Pythons say ``application/javascript``)."""
    types = mimetypes.MimeTypes(filenames=())
    for ext in (".js", ".mjs"):
        types.add_type("text/javascript", ext)
    return types


def _content_type(path: str) -> str:
    return _mime_types().guess_type(path)[0] or "application/octet-stream"


def _static_dir() -> str | None:
    """Where the frontend files are: ``tb_gradhealth/static/`` in an installed package (copied there by setup.py),
    else the checkout's top-level ``frontend/`` (editable and development installs); None when neither exists."""
    here = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(here, "static"), os.path.join(os.path.dirname(here), "frontend")):
        if os.path.isfile(os.path.join(candidate, "index.js")):
            return candidate
    return None


# --- request parsing ----------------------------------------------------------------------------------------------


def _required(args: Mapping[str, str], name: str) -> str:
    value = args.get(name)
    if value is None or value == "":
        raise RequestError(400, f"missing parameter '{name}'", name)
    return value


def _step(args: Mapping[str, str]) -> int | None:
    return parse_step(args.get("step"))


def _thresholds(args: Mapping[str, str], known: tuple[str, ...]) -> health.Thresholds:
    """Thresholds from every query parameter that is not one of ``known`` (an unknown name is a 400 naming it)."""
    return parse_thresholds({k: v for k, v in args.items() if k not in known})


def _no_extra(args: Mapping[str, str], known: tuple[str, ...]) -> None:
    for k in args:
        if k not in known:
            raise RequestError(400, f"unknown parameter {k!r} (this route takes {', '.join(known)})", k)


def _json_route(method: Callable[[Any, Any], Any]) -> Callable:
    """A route answering ``method(self, request)`` as JSON (a ``str`` is sent as is); a ``tensorboard.errors``
    error it raises becomes its HTTP status with the body ``{"error", "parameter"}``, any other exception a 500 with
    the same body (and the traceback in TensorBoard's log)."""

    @wrappers.Request.application
    @functools.wraps(method)
    def serve(self: Any, request: Any) -> wrappers.Response:
        try:
            body, code = method(self, request), 200
        except tb_errors.PublicError as e:
            body = {"error": getattr(e, "message", str(e)), "parameter": getattr(e, "parameter", None)}
            code = e.http_code
        except Exception as e:  # a bug: still a JSON answer, with the traceback in TensorBoard's log
            _log.exception("gradhealth: %s failed", request.full_path)
            body, code = {"error": f"internal error {type(e).__name__}: {e}", "parameter": None}, 500
        if isinstance(body, Answer):
            if _GZIP_OK.search(request.headers.get("Accept-Encoding", "")):
                return http_util.Respond(request, body.gzipped, "application/json", code=code,
                                         content_encoding="gzip")
            return http_util.Respond(request, body.raw, "application/json", code=code)
        if not isinstance(body, str):
            body = json.dumps(body, allow_nan=False)
        return http_util.Respond(request, body, "application/json", code=code)

    return serve


#: What TensorBoard's ``http_util`` accepts as "gzip welcome" in ``Accept-Encoding`` (gzip, x-gzip or *, not q=0).
_GZIP_OK = re.compile(r"(?:^|,|\s)(?:(?:x-)?gzip|\*)(?!;q=0)(?:\s|,|$)")


@dataclass(frozen=True)
class Answer:
    """A JSON answer encoded once (UTF-8, and gzip as TensorBoard would) for every request that shares it: a large
    run's ``health`` answer is megabytes, and compressing it per request would cost more than the diagnosis."""

    raw: bytes
    gzipped: bytes

    @classmethod
    def of(cls, body: Any) -> Answer:
        raw = json.dumps(body, allow_nan=False).encode("utf-8")
        return cls(raw, gzip.compress(raw, compresslevel=3, mtime=0))


# --- the plugin ---------------------------------------------------------------------------------------------------


class GradHealthPlugin(base_plugin.TBPlugin):
    """The "Gradient Health" tab: ranked per-layer gradient diagnosis for every run."""

    plugin_name = metadata.PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext):
        self._context = context
        self._reader: FileReader | ProviderReader
        if getattr(context.flags, READ_FILES, False) and context.logdir:
            self._reader = FileReader(context.logdir)
        else:
            hint = (context.sampling_hints or {}).get(metadata.PLUGIN_NAME)
            self._reader = ProviderReader(context.data_provider, hint)
        self._health_cache: OrderedDict[tuple, tuple[health.RunHealth, Answer]] = OrderedDict()
        self._health_lock = threading.Lock()
        self._flights: dict[tuple, _Flight] = {}
        self._slots = threading.BoundedSemaphore(DIAGNOSES_AT_ONCE)
        self._progress = (progress.ProviderProgress(context.data_provider) if context.data_provider is not None
                          else None)

    # TBPlugin API
    def get_plugin_apps(self) -> dict[str, Callable]:
        apps = {
            "/runs": self._serve_runs,
            "/health": self._serve_health,
            "/series": self._serve_series,
            "/histograms": self._serve_histograms,
            "/profile": self._serve_profile,
            "/nan_origin": self._serve_nan_origin,
            "/*": self._serve_static,
        }
        return {route: _read_only(app) for route, app in apps.items()}

    def is_active(self) -> bool:
        """Cheap: TensorBoard's plugin listing already asks the data provider which plugins have data
        (``list_plugins``, one call for all plugins), so this is only a fallback for hosts that skip that. The data
        provider answers it even when the plugin reads the files (its data server keeps one record per tag)."""
        if self._context.data_provider is not None:
            return ProviderReader(self._context.data_provider).has_data(tb_context.RequestContext(), "")
        return isinstance(self._reader, FileReader) and self._reader.has_data()

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

    def _diagnosis(self, request: Any, series: RunSeries, t: health.Thresholds, step: int | None
                   ) -> tuple[health.RunHealth, Answer]:
        """The diagnosis and its encoded ``health`` answer, cached per (run data, thresholds, step): the data part of
        the key is the series' generation, which changes whenever the reader decodes new data.

        Single-flight: concurrent requests with one key share one computation (the first computes, the others wait
        for its result), and at most :data:`DIAGNOSES_AT_ONCE` different keys are computed at a time, so memory
        stays bounded however many tabs ask at once."""
        k = at_index(series, step)
        found = self._run_progress(request, series.run)
        seen = found.seen()  # the loss or the skipped steps moved on
        key = (plugin_util.experiment_id(request.environ), series.run, series.generation, t, k, seen)
        with self._health_lock:
            hit = self._health_cache.get(key)
            if hit is not None:
                self._health_cache.move_to_end(key)
                return hit
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
        if not leader:
            return flight.wait()
        try:
            with self._slots:
                h = diagnose(series, t, int(series.steps[k]), found)
                answer = Answer.of(health_payload(series, t, int(series.steps[k]), h, found))
            flight.result = (h, answer)
            with self._health_lock:
                self._health_cache[key] = flight.result
                while len(self._health_cache) > HEALTH_CACHE_ENTRIES:
                    self._health_cache.popitem(last=False)
            return flight.result
        except BaseException as e:
            flight.error = e
            raise
        finally:
            with self._health_lock:
                self._flights.pop(key, None)
            flight.done.set()

    def _run_progress(self, request: Any, run: str) -> progress.Progress:
        """The run's training loss, skipped steps and replayed NaN origin where a writer recorded them
        (:mod:`tb_gradhealth.progress`); a data provider that cannot answer costs the evidence, not the diagnosis."""
        if self._progress is None:
            return progress.Progress()
        try:
            found = self._progress.get(plugin_util.context(request.environ),
                                       plugin_util.experiment_id(request.environ), run_of(run))
            return found.with_origin(self._first_origin(request, run, []))
        except Exception:  # noqa: BLE001 - the data provider's own failure: the gradients alone speak
            _log.warning("gradhealth: reading the progress of run %r failed", run, exc_info=True)
            return progress.Progress()

    def _first_origin(self, request: Any, run: str, problems: list[str]) -> origin.NanOrigin | None:
        """Where a writer's replay found the run's first NaN/Inf made (:mod:`tb_gradhealth.origin`), or None; the
        data provider's failure raises."""
        return origin.first(origin.read_provider(self._context.data_provider, plugin_util.context(request.environ),
                                                 plugin_util.experiment_id(request.environ), run_of(run), problems))

    # routes
    @_json_route
    def _serve_runs(self, request: Any) -> dict[str, Any]:
        _no_extra(request.args, ())
        ctx = plugin_util.context(request.environ)
        eid = plugin_util.experiment_id(request.environ)
        try:
            return {"runs": self._reader.summaries(ctx, eid), "problems": []}
        except ProviderError as e:
            return runs_payload([], [str(e)])

    @_json_route
    def _serve_health(self, request: Any) -> Answer:
        run = _required(request.args, "run")
        step = _step(request.args)
        t = _thresholds(request.args, ("run", "step"))
        return self._diagnosis(request, self._series(request, run), t, step)[1]

    @_json_route
    def _serve_series(self, request: Any) -> dict[str, Any]:
        run = _required(request.args, "run")
        layer = _required(request.args, "layer")
        t = _thresholds(request.args, ("run", "layer"))
        return series_payload(self._series(request, run), layer, t)

    @_json_route
    def _serve_histograms(self, request: Any) -> dict[str, Any]:
        _no_extra(request.args, ("run", "layer"))
        run = _required(request.args, "run")
        layer = _required(request.args, "layer")
        return histograms_payload(self._series(request, run), layer)

    @_json_route
    def _serve_profile(self, request: Any) -> dict[str, Any]:
        run = _required(request.args, "run")
        step = _step(request.args)
        t = _thresholds(request.args, ("run", "step"))
        series = self._series(request, run)
        h, _ = self._diagnosis(request, series, t, int(series.steps[profile_index(series, step)]))
        return profile_payload(series, t, step, h)

    @_json_route
    def _serve_nan_origin(self, request: Any) -> dict[str, Any]:
        """Where the run's first NaN/Inf was made (:mod:`tb_gradhealth.origin`): ``{"run", "origin", "problems"}``,
        ``origin`` null when none was stored."""
        _no_extra(request.args, ("run",))
        run = _required(request.args, "run")  # a run's other streams ("run [probe_gradients]") share its directory
        problems: list[str] = []
        try:
            found = self._first_origin(request, run, problems)
        except Exception as e:  # noqa: BLE001 - the data provider's own failure: the tab shows no origin
            return {"run": run, "origin": None, "problems": [f"origin unreadable: {e}"]}
        return {"run": run, "origin": found.to_json() if found else None, "problems": problems}

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
        return http_util.Respond(request, content, _content_type(resolved))


class _Flight:
    """One diagnosis being computed: the requests that want the same one wait for it here."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: tuple[health.RunHealth, Answer] | None = None
        self.error: BaseException | None = None

    def wait(self) -> tuple[health.RunHealth, Answer]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _read_only(app: Callable) -> Callable:
    """The WSGI ``app`` for GET (and HEAD, which HTTP requires wherever GET is served); any other method gets a 405
    JSON answer naming the allowed ones."""

    def serve(environ: dict[str, Any], start_response: Callable) -> Any:
        method = environ.get("REQUEST_METHOD", "GET")
        if method in ("GET", "HEAD"):
            return app(environ, start_response)
        body = json.dumps({"error": f"method {method} not allowed: this route answers GET", "parameter": None})
        response = wrappers.Response(body, status=405, content_type="application/json",
                                     headers={"Allow": "GET, HEAD"})
        return response(environ, start_response)

    return serve


def _resolve_static(static: str, rel: str) -> str | None:
    """The real path of ``rel`` inside ``static``, or None (traversal, hidden segment, unknown type, not a file)."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") or p.startswith(".") or "\\" in p or "\0" in p for p in parts):
        return None
    if os.path.splitext(rel)[1].lower() not in _STATIC_EXTENSIONS:
        return None
    root = os.path.realpath(static)
    full = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([root, full]) != root or not os.path.isfile(full):
        return None
    return full


#: Attribute the loader sets on TensorBoard's flags when the plugin reads the event files itself.
READ_FILES = "gradhealth_reads_event_files"


def _samples_per_plugin(value: Any) -> dict[str, int]:
    """``--samples_per_plugin`` as a dict (the flag's parser makes one of ``plugin=N`` pairs; a
    ``configure(samples_per_plugin=...)`` keyword may be either form)."""
    if not isinstance(value, str):
        return dict(value or {})
    parsed: dict[str, int] = {}
    for token in value.split(","):
        if token.strip():
            key, _, num = token.strip().partition("=")
            try:
                parsed[key.strip()] = int(num)
            except ValueError as e:
                raise base_plugin.FlagsError(f"--samples_per_plugin: {token!r} is not plugin=N") from e
    return parsed


def serves_one_logdir(flags: Any) -> bool:
    """Whether TensorBoard reads one logdir itself (not ``--logdir_spec``, not an external data server), so that the
    plugin can read its event files directly."""
    return bool(getattr(flags, "logdir", "")) and not getattr(flags, "logdir_spec", "") and not getattr(
        flags, "grpc_data_provider", "")


def keep_every_step_by_default(flags: Any) -> None:
    """Every gradient-health step is served unless the user gave ``--samples_per_plugin=gradhealth=N``.

    When TensorBoard serves one logdir, the plugin reads its event files itself (:mod:`tb_gradhealth._filereader`,
    every step, incrementally) and the data server is told to keep one record per tag (``gradhealth=1``), only so
    that it lists the tab: its copy of every record would otherwise be about the logdir's size in memory. Otherwise
    (``--logdir_spec``, an external data server) the data server keeps every record (``gradhealth=0``): its loaders
    keep 100 tensors per tag (10 with ``--load_fast=false``) for a plugin without an entry, which loses the onset of
    a NaN. ``program.configure`` calls every loader's ``fix_flags`` before it builds the data ingester.
    """
    if not hasattr(flags, "samples_per_plugin"):
        return  # a TensorBoard program without the core plugin's flags: nothing to set
    value = _samples_per_plugin(flags.samples_per_plugin)
    if metadata.PLUGIN_NAME not in value:
        direct = serves_one_logdir(flags)
        value[metadata.PLUGIN_NAME] = 1 if direct else 0
        setattr(flags, READ_FILES, direct)
    flags.samples_per_plugin = value


class GradHealthLoader(base_plugin.TBLoader):
    """The ``tensorboard_plugins`` entry point (and what ``program.TensorBoard(plugins=[...])`` takes).

    A loader rather than the plugin class, because only a loader gets :meth:`fix_flags`: it makes plain
    ``tensorboard --logdir DIR`` serve every gradient-health step, read by the plugin from the event files (see
    :func:`keep_every_step_by_default`)."""

    def fix_flags(self, flags: Any) -> None:
        keep_every_step_by_default(flags)

    def load(self, context: base_plugin.TBContext) -> GradHealthPlugin:
        return GradHealthPlugin(context)
