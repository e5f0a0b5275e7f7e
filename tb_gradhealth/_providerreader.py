"""Runs read through a TensorBoard data provider (the plugin's source when TensorBoard serves the data): the
sampling the loader applies, the tags read in groups whose answers fit the data server's message limit, and the
decoded runs cached until the provider reports new data.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from tensorboard import errors as tb_errors
from tensorboard.data import provider as tb_provider

from tb_gradhealth import metadata, record
from tb_gradhealth._assembly import RunSeries, TagData, TagPoint, assemble
from tb_gradhealth._streams import split_streams
from tb_gradhealth.problems import Kind, Problem, any_of_kind

#: ``downsample`` meaning "every sample the loader kept": TensorBoard's hint 0 means all, but a data provider
#: passed ``downsample=0`` returns nothing, so 0 must become a large number.
SAMPLE_ALL = 2**31 - 1
#: Samples per tag the loaders keep for a plugin without a ``--samples_per_plugin`` entry: the Python
#: multiplexer's ``DEFAULT_SIZE_GUIDANCE[TENSORS]`` and the Rust data server's default for tensor series.
PYTHON_LOADER_DEFAULT = 10
RUST_LOADER_DEFAULT = 100
#: Seconds a data provider's tensor listing is reused: new steps show up this much later at most (TensorBoard itself
#: reloads the logdir every 5 s by default).
LISTING_TTL_S = 1.0

#: Errors a data provider call may raise (TensorBoard's public errors, I/O, and gRPC errors of the data server).
try:  # grpc ships with tensorboard, but the reader must not depend on it
    import grpc

    PROVIDER_ERRORS: tuple[type[BaseException], ...] = (tb_errors.PublicError, OSError, grpc.RpcError)
except ImportError:  # pragma: no cover - grpc is a tensorboard dependency
    grpc = None
    PROVIDER_ERRORS = (tb_errors.PublicError, OSError)

_log = logging.getLogger("tb_gradhealth.reader")


def sampling(data_provider: Any, hint: int | None) -> tuple[int, int | None]:
    """``(downsample, sample_limit)`` for ``read_tensors`` from ``--samples_per_plugin=gradhealth=N``.

    ``downsample`` is always an int > 0 (hint 0 means all). Without a hint the loader keeps its default number of
    samples per tag (10 in the Python multiplexer, 100 in the Rust data server): we ask for all it has and report
    that limit so the dashboard can say how to keep every step.
    """
    if hint is not None and hint > 0:
        return int(hint), int(hint)
    if hint == 0:
        return SAMPLE_ALL, None
    return SAMPLE_ALL, _loader_default(data_provider)


def _loader_default(data_provider: Any) -> int | None:
    """The samples per tag TensorBoard's loader behind ``data_provider`` keeps by default (None: unknown)."""
    try:
        from tensorboard.backend.event_processing.data_provider import MultiplexerDataProvider
        from tensorboard.data.grpc_provider import GrpcDataProvider
    except ImportError:  # pragma: no cover - a TensorBoard without one of its loaders
        return None
    if isinstance(data_provider, GrpcDataProvider):
        return RUST_LOADER_DEFAULT
    if isinstance(data_provider, MultiplexerDataProvider):
        return PYTHON_LOADER_DEFAULT
    return None


#: The largest answer the reader asks the data provider for at once, estimated from the tags' sizes (TensorBoard's
#: data server answers at most 256 MB per read; the estimate assumes every record is as large as it can be).
READ_BUDGET_BYTES = 128 << 20
#: The most bytes one layer's record takes in an answer: the disk row at its widest (every histogram bin) plus
#: slack for the tensor's framing, shared by the rows of a step.
WORST_ROW_BYTES = 4 * (record.DISK_HIST_START + record.HIST_BINS) + 8


def tag_bytes(tag: str, ts: Any, downsample: int) -> int | None:
    """The largest answer one tag can give: its step block (:func:`metadata.tag_for`) bounds its steps, its
    metadata gives its layers. None when unknown (a tag of every step, unreadable metadata)."""
    block = metadata.tag_block(tag)
    if block is None:
        return None
    try:
        n_layers = len(metadata.decode_content(ts.plugin_content).layers)
    except ValueError:
        return None
    span = metadata.block_steps(n_layers)
    steps = min(span, downsample, max(1, int(ts.max_step) - block * span + 1))
    return steps * max(1, n_layers) * WORST_ROW_BYTES


def read_groups(tag_map: Mapping[str, Any], downsample: int, budget: int) -> list[tuple[list[str], int]]:
    """The run's tags in groups to read together, each with its ``downsample``: step-block tags packed up to
    ``budget`` bytes of largest possible answer, every tag of unknown size alone."""
    groups: list[tuple[list[str], int]] = []
    current: list[str] = []
    size = 0
    for tag in sorted(tag_map):
        est = tag_bytes(tag, tag_map[tag], downsample)
        if est is None:
            groups.append(([tag], downsample))
            continue
        if current and size + est > budget:
            groups.append((current, downsample))
            current, size = [], 0
        current.append(tag)
        size += est
    if current:
        groups.append((current, downsample))
    return groups


def _too_large(e: BaseException) -> bool:
    """Whether a read failed because its answer exceeded the data server's gRPC message limit (the status
    ``RESOURCE_EXHAUSTED`` of the call's error)."""
    code = getattr(e, "code", None)
    return grpc is not None and isinstance(e, grpc.RpcError) and callable(code) and \
        code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _steps_in_budget(ts: Any, budget: int) -> int:
    try:
        n_layers = len(metadata.decode_content(ts.plugin_content).layers)
    except ValueError:
        n_layers = 1
    return max(1, budget // (max(1, n_layers) * WORST_ROW_BYTES))


class ProviderError(Exception):
    """The data provider failed to list or read (message says what); callers answer 503, not 500."""


class ProviderReader:
    """Reads runs through a data provider, caching decoded runs until the provider reports new data.

    The cache key of a run is its tags' ``(max_step, max_wall_time)`` from ``list_tensors`` (itself reused for
    ``listing_ttl`` seconds): a training job that writes a new step changes it, a warm request reuses the decoded
    arrays. Decoded runs are kept up to
    ``cache_bytes`` (least recently used evicted first). Safe to call from TensorBoard's request threads: a run is
    decoded once even when several requests ask for it at the same time.
    """

    def __init__(self, data_provider: Any, sampling_hint: int | None = None, *, cache_bytes: int = 4 << 30,
                 read_budget: int = READ_BUDGET_BYTES,
                 listing_ttl: float = LISTING_TTL_S):
        self._provider = data_provider
        self.read_budget = read_budget
        self._listing_ttl = listing_ttl
        self._listings: dict[str, tuple[float, dict[str, Mapping[str, Any]]]] = {}
        self.downsample, self.sample_limit = sampling(data_provider, sampling_hint)
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str, str], tuple[Any, RunSeries]] = OrderedDict()
        self._summaries: dict[tuple[str, str], tuple[Any, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._listing_lock = threading.Lock()
        self._run_locks: dict[tuple[str, str], threading.Lock] = {}

    def listing(self, ctx: Any, experiment_id: str) -> dict[str, Mapping[str, Any]]:
        """``{run: {tag: TensorTimeSeries}}`` of gradient-health tags, at most ``listing_ttl`` seconds old; raises
        :class:`ProviderError`. (A ``list_tensors`` call to the data server would otherwise be most of every warm
        request; the dashboard sends its requests in bursts, which share one listing.)"""
        with self._listing_lock:  # concurrent cold requests share one listing call
            return self._listing(ctx, experiment_id)

    def _listing(self, ctx: Any, experiment_id: str) -> dict[str, Mapping[str, Any]]:
        now = time.monotonic()
        with self._lock:
            hit = self._listings.get(experiment_id)
            if hit is not None and now - hit[0] < self._listing_ttl:
                return hit[1]
        try:
            listing = self._provider.list_tensors(ctx, experiment_id=experiment_id, plugin_name=metadata.PLUGIN_NAME)
        except PROVIDER_ERRORS as e:
            with self._lock:
                self._listings.pop(experiment_id, None)
            raise ProviderError(f"data provider could not list gradhealth tensors: {e}") from e
        with self._lock:
            self._listings[experiment_id] = (now, listing)
        return listing

    def has_data(self, ctx: Any, experiment_id: str) -> bool:
        try:
            return metadata.PLUGIN_NAME in (self._provider.list_plugins(ctx, experiment_id=experiment_id) or ())
        except PROVIDER_ERRORS:
            return False

    @staticmethod
    def fingerprint(tag_map: Mapping[str, Any]) -> tuple:
        return tuple(sorted((tag, ts.max_step, ts.max_wall_time) for tag, ts in tag_map.items()))

    @staticmethod
    def series_names(listing: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[str, dict[str, Any]]]:
        """``{series name: (run, {tag: TensorTimeSeries})}`` (see :func:`split_streams`)."""
        out = {}
        for run, tag_map in listing.items():
            for name, tags in split_streams(run, tag_map).items():
                out[name] = (run, {t: tag_map[t] for t in tags})
        return out

    def run(self, ctx: Any, experiment_id: str, run: str, listing: Mapping[str, Mapping[str, Any]] | None = None
            ) -> RunSeries | None:
        """The named series (a run, or ``"<run> [<stream>]"``; None when the provider has no gradhealth data for
        it); raises ProviderError."""
        listing = self.listing(ctx, experiment_id) if listing is None else listing
        entry = self.series_names(listing).get(run)
        if entry is None:
            return None
        run_dir, tag_map = entry
        key = (experiment_id, run)
        fp = (self.fingerprint(tag_map), self.downsample)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] == fp:
                self._cache.move_to_end(key)
                return hit[1]
            run_lock = self._run_locks.setdefault(key, threading.Lock())
        with run_lock:
            with self._lock:  # another thread may have decoded it meanwhile
                hit = self._cache.get(key)
                if hit is not None and hit[0] == fp:
                    return hit[1]
            series, ok = self._read(ctx, experiment_id, run_dir, tag_map, name=run)
            if ok:  # a failed read is retried by the next request, not cached until new data arrives
                with self._lock:
                    self._cache[key] = (fp, series)
                    self._cache.move_to_end(key)
                    self._evict()
            return series

    def summaries(self, ctx: Any, experiment_id: str) -> list[dict[str, Any]]:
        """:meth:`RunSeries.summary` of every run with gradhealth data, sorted by name; raises ProviderError.

        A summary is kept (it is small) until the provider reports new data for its run, so listing a logdir of
        many large runs does not read again the runs whose decoded records the cache let go."""
        listing = self.listing(ctx, experiment_id)
        out = []
        for run, (_, tag_map) in sorted(self.series_names(listing).items()):
            key = (experiment_id, run)
            fp = (self.fingerprint(tag_map), self.downsample)
            with self._lock:
                hit = self._summaries.get(key)
            if hit is None or hit[0] != fp:
                series = self.run(ctx, experiment_id, run, listing)
                if series is None:
                    continue
                hit = (fp, series.summary())
                if not any_of_kind(series.problems, Kind.PROVIDER):
                    with self._lock:
                        self._summaries[key] = hit
            out.append(hit[1])
        return out

    def runs(self, ctx: Any, experiment_id: str) -> list[RunSeries]:
        """Every run with gradhealth data, sorted by name; raises ProviderError if listing fails."""
        listing = self.listing(ctx, experiment_id)
        out = []
        for run in sorted(self.series_names(listing)):
            try:
                series = self.run(ctx, experiment_id, run, listing)
            except ProviderError:
                raise
            except Exception as e:  # a bug must not hide the other runs: this one is listed with the error
                _log.exception("gradhealth: reading run %r failed", run)
                series = assemble(run, [], problems=[f"could not be read: internal error {type(e).__name__}: {e} "
                                                     f"(traceback in TensorBoard's log)"])
            if series is not None:
                out.append(series)
        return out

    def _read(self, ctx: Any, experiment_id: str, run: str, tag_map: Mapping[str, Any], name: str
              ) -> tuple[RunSeries, bool]:
        """The run's series and whether the provider answered.

        TensorBoard's data server answers a read in one gRPC message of at most 256 MB (about 2 million layer-steps
        of records), so the run's tags are read in groups whose largest possible answer stays under
        ``read_budget`` (:func:`read_groups`): the writers split a run over step-block tags, so a run of any length
        is read whole. A single tag too large for one answer (written by an older version, or by the TPU
        ``host_call`` path, which writes one tag for every step) is read with evenly spaced steps instead, with a
        problem line saying so. The provider decodes every tensor of an answer and fails on the first malformed one: a
        group that fails so is read tag by tag, and only the tag holding it is lost (with a problem line).
        """
        points, problems, sampled, failure = self._read_points(ctx, experiment_id, run, tag_map)
        if failure is not None:
            unread = Problem(Kind.PROVIDER, f"data provider could not read this run: {failure}")
            return assemble(name, [], sample_limit=self.sample_limit, problems=[unread]), False
        tags = [TagData(tag, ts.plugin_content, points[tag]) for tag, ts in tag_map.items() if tag in points]
        del points
        series = assemble(name, tags, sample_limit=self.sample_limit, problems=problems, consume=True)
        if sampled:
            series = dataclasses.replace(series, maybe_downsampled=True)
        return series, True

    def _read_points(self, ctx: Any, experiment_id: str, run: str, tag_map: Mapping[str, Any]
                     ) -> tuple[dict[str, list[TagPoint]], list[str], bool, BaseException | None]:
        """``(points, problems, sampled, failure)``: each tag's ``(step, wall_time, tensor)`` points, read group by
        group as :meth:`_read` says; whether a tag was read with evenly spaced steps; and the provider's error when
        it could not read the run at all (then nothing else counts)."""
        points: dict[str, list[TagPoint]] = {}
        problems: list[str] = []
        sampled = False
        todo = read_groups(tag_map, self.downsample, self.read_budget)
        while todo:
            group, downsample = todo.pop(0)
            try:
                answer = self._read_tags(ctx, experiment_id, run, group, downsample)
            except (ValueError, TypeError) as e:
                if len(group) > 1:
                    todo[:0] = [([tag], downsample) for tag in group]
                else:
                    problems.append(f"tag {group[0]}: the data provider cannot decode one of its tensors ({e}); "
                                    f"the tag is skipped")
                continue
            except PROVIDER_ERRORS as e:
                if not _too_large(e) or (len(group) == 1 and downsample <= 1):
                    return points, problems, sampled, e
                if len(group) > 1:  # the estimate was wrong (an unexpected tag size): one tag at a time
                    todo[:0] = [([tag], downsample) for tag in group]
                    continue
                fewer = max(1, min(downsample // 2, _steps_in_budget(tag_map[group[0]], self.read_budget)))
                todo.insert(0, (group, fewer))
                if not sampled:
                    problems.append(
                        f"tag {group[0]}: too large for one answer of the data server; showing {fewer} evenly "
                        f"spaced steps of it (the writers of this version split runs into step-block tags, "
                        f"which are read whole)")
                sampled = True
                continue
            for tag in group:
                points.setdefault(tag, []).extend(TagPoint(d.step, d.wall_time, d.numpy) for d in answer.get(tag, ()))
            del answer  # the answer's arrays now live in ``points``
        return points, problems, sampled, None

    def _read_tags(self, ctx: Any, experiment_id: str, run: str, tags: list[str], downsample: int
                   ) -> dict[str, Any]:
        data = self._provider.read_tensors(
            ctx,
            experiment_id=experiment_id,
            plugin_name=metadata.PLUGIN_NAME,
            downsample=downsample,
            run_tag_filter=tb_provider.RunTagFilter(runs=[run], tags=tags),
        )
        return data.get(run, {})

    def _evict(self) -> None:
        total = sum(s.nbytes for _, s in self._cache.values())
        while total > self._cache_bytes and len(self._cache) > 1:
            _, (_, old) = self._cache.popitem(last=False)
            total -= old.nbytes
