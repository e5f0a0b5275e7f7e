"""Runs read by the plugin straight from a logdir's event files, incrementally: only what was appended is read.

TensorBoard's data server keeps every record it serves in memory (about the logdir's size) and hands a run over in
one more copy, so at 10^7-10^8 layer-steps those copies are most of the plugin's memory. When TensorBoard serves one
logdir, the plugin's loader asks the data server to keep one record per tag (enough to list the tab) and the plugin
reads the event files through this module: each file from the byte where the last read stopped, in chunks of
:data:`CHUNK_BYTES`, each chunk decoded and appended to the run's records, which grow in place (rows already read
are never written again, so a series handed out earlier stays valid). A run whose new data is not a plain append of
later steps of one layer list (a restart, new layers, several streams, a damaged record) is read whole again, as
the CLI reads it (:func:`reader.assemble` over :func:`reader.read_run_dir`), so both give the same answers.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tb_gradhealth import _storage, _tiers, metadata, record
from tb_gradhealth._assembly import RunSeries, TagData, assemble
from tb_gradhealth._eventfile import ScanEnd, scan_framed
from tb_gradhealth._logdirreader import add_event, find_runs, read_run_dir
from tb_gradhealth._providerreader import LISTING_TTL_S, ProviderError
from tb_gradhealth._streams import run_of, split_streams
from tb_gradhealth.problems import Kind, any_of_kind

#: Bytes of an event file read and decoded at a time: the most disk-form data held besides the records.
CHUNK_BYTES = 32 << 20
#: Decoded runs kept (bytes of their records); beyond it the least recently used run is dropped and read again
#: when asked for (the run last read is always kept, whatever its size).
CACHE_BYTES = 1 << 30
#: Rows of the old buffer merged at a time when a long run's older steps merge into windows (bounds the temporaries).
_MERGE_ROWS = 8
#: A run still being written grows in place into this much room beyond its steps (untouched room costs no memory).
HEADROOM = 1.25


class NotAnAppend(Exception):
    """The new data of a run is not a plain append of later steps of one layer list: read the run whole."""


@dataclass
class _Store:
    """One series' records as :func:`reader.new_records` lays them out (``[F, capacity, L]``, lazily zeroed), of
    which the first ``n`` rows are final: appends write only further rows. Past :func:`_tiers.row_budget` rows the
    older ones are merged into windows (:mod:`tb_gradhealth._tiers`) in a new buffer, so a series handed out earlier
    stays valid: ``weights`` ``[capacity, L]`` counts the steps of each row (0 where a layer has no record),
    ``last`` the last step of each row, the first ``old`` rows are windows of about ``width`` steps."""

    layers: tuple[str, ...]
    buf: np.ndarray
    steps: np.ndarray
    weights: np.ndarray
    last: np.ndarray
    budget: int
    n: int = 0
    old: int = 0
    width: int = 1
    pinned_step: int | None = None
    touched: np.ndarray = field(default_factory=lambda: np.zeros(record.NUM_FIELDS, dtype=bool))

    @classmethod
    def new(cls, layers: tuple[str, ...], capacity: int, budget: tuple[int, int] = (_tiers.LAYER_STEPS,
                                                                                 _tiers.MIN_ROWS)) -> _Store:
        budget = _tiers.row_budget(len(layers), *budget)
        capacity = min(capacity, budget + budget // 2)
        return cls(layers, np.zeros((record.NUM_FIELDS, capacity, len(layers))), np.zeros(capacity, np.int64),
                   np.zeros((capacity, len(layers)), np.int32), np.zeros(capacity, np.int64), budget)

    def append(self, part: RunSeries, more_steps: int) -> None:
        """Copy ``part`` (later steps, same layers) after the final rows, with room for ``more_steps`` beyond when
        it must grow. Only the planes of fields some record of the run set are written: a count that is zero
        everywhere so far (NaN, Inf, missing: the usual case) and the histogram bins no record used take no memory.
        (Decoding straight into the rows would write those zeros too: +0.4 GB at 10M layer-steps.)"""
        if part.layers != self.layers:
            raise NotAnAppend("other layers")
        if self.n and part.steps[0] <= self.steps[self.n - 1]:
            raise NotAnAppend("steps went back")
        end = self.n + part.num_steps
        if end > self.steps.size:
            self._grow(min(int((end + more_steps) * HEADROOM) + 64, max(end, self.budget + self.budget // 2)))
        planes = part.records.transpose(2, 0, 1)  # [F, s, L], the part's own field-by-field layout
        for f in range(record.NUM_FIELDS):
            if self.touched[f] or np.any(planes[f] != 0):
                self.buf[f, self.n : end] = planes[f]
                self.touched[f] = True
        self.steps[self.n : end] = part.steps
        self.last[self.n : end] = part.steps
        self.weights[self.n : end] = ~np.isnan(planes[record.INDEX["size"]])
        if self.pinned_step is None:
            bad = np.flatnonzero(np.nan_to_num(record.nonfinite_count(part.records)).any(axis=1))
            self.pinned_step = int(part.steps[bad[0]]) if bad.size else None
        self.n = end
        if self.n > self.budget:
            self._compact()

    def _grow(self, capacity: int) -> None:
        buf = np.zeros((record.NUM_FIELDS, capacity, len(self.layers)))
        for f in np.flatnonzero(self.touched):
            buf[f, : self.n] = self.buf[f, : self.n]
        self.buf = buf
        self.steps, self.last, self.weights = (_grown(a, self.n, capacity) for a in (self.steps, self.last,
                                                                                       self.weights))

    def _compact(self) -> None:
        """Merge the older rows into windows (:func:`_tiers.plan`), into a new buffer of the same capacity."""
        pinned = None
        if self.pinned_step is not None:
            pinned = int(np.searchsorted(self.steps[: self.n], self.pinned_step))
        groups, old, width = _tiers.plan(self.n, self.old, self.width, self.budget, pinned)
        buf = np.zeros(self.buf.shape)  # lazily zeroed (zeros_like writes every page: the untouched planes too)
        steps, last, weights = np.zeros_like(self.steps), np.zeros_like(self.last), np.zeros_like(self.weights)
        used = np.flatnonzero(self.touched)
        # The fields a window is merged over: every field before the histogram, and the bins some record used
        # (the others are zero in every row, and stay zero): a run's gradients span a few decades of the 77.
        cols = np.concatenate([np.arange(record.HIST_START), used[used >= record.HIST_START]])
        write = [(j, f) for j, f in enumerate(cols) if self.touched[f]]
        starts = np.array([s for s, _ in groups])
        lengths = np.array([e - s for s, e in groups])
        steps[: len(groups)], last[: len(groups)] = self.steps[starts], self.last[starts + lengths - 1]
        for k in np.unique(lengths):
            new = np.flatnonzero(lengths == k)
            for block in np.array_split(new, max(1, new.size * k // _MERGE_ROWS)):
                rows = starts[block][:, None] + np.arange(k)  # [B, k] rows of the old buffer
                if k == 1:
                    for f in used:
                        buf[f, block] = self.buf[f, rows[:, 0]]
                    weights[block] = self.weights[rows[:, 0]]
                    continue
                planes = self.buf[np.ix_(cols, rows.ravel())].reshape(len(cols), *rows.shape, len(self.layers))
                rec, weights[block] = _tiers.mean_step(planes.transpose(2, 1, 3, 0),
                                                      self.weights[rows].transpose(1, 0, 2))
                for j, f in write:
                    buf[f, block] = rec[..., j]
        self.buf, self.steps, self.last, self.weights = buf, steps, last, weights
        self.n, self.old, self.width = len(groups), old, width

    def series(self, name: str, tags: tuple[str, ...], layer_info: Mapping[str, tuple[str, str]],
               source: Mapping[str, str]) -> RunSeries:
        merged = self.old > 0
        notes = (f"steps {int(self.steps[0])}-{int(self.last[self.old - 1])} are kept as {self.old} merged windows of "
                 f"up to {self.width} steps (a run of more than {self.budget} logged steps of "
                 f"{len(self.layers)} layers); onsets there are exact to their window; "
                 "tb-gradhealth report reads every step",) if merged else ()
        return RunSeries(run=name, layers=self.layers, steps=self.steps[: self.n],
                         records=self.buf[:, : self.n, :].transpose(1, 2, 0), tags=tags, notes=notes,
                         window_steps=self.weights[: self.n] if merged else None,
                         window_last=self.last[: self.n] if merged else None,
                         resident_bytes=int(self.touched.sum()) * self.n * len(self.layers) * 8,
                         layer_info=layer_info, source=source)


def _grown(a: np.ndarray, n: int, capacity: int) -> np.ndarray:
    out = np.zeros((capacity,) + a.shape[1:], a.dtype)
    out[:n] = a[:n]
    return out


@dataclass
class _Run:
    """What was read of one run directory: where each file was read up to, the tags seen (their metadata comes
    with their first record only) and the series, grown in place (``store``) or read whole."""

    offsets: dict[str, int] = field(default_factory=dict)
    known: dict[str, bytes] = field(default_factory=dict)
    store: _Store | None = None
    whole: bool = False  # not a plain append once: read whole at every change from now on
    series: dict[str, RunSeries] = field(default_factory=dict)
    sizes: tuple[tuple[str, int], ...] = ()
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.series.values())


class FileReader:
    """The plugin's runs from the event files of ``logdir`` (a path or fsspec URL), with the interface of
    :class:`reader.ProviderReader` (``run``, ``summaries``, ``has_data``; the request context and experiment id
    are not needed). Listings are reused for ``listing_ttl`` seconds; safe to call from request threads."""

    def __init__(self, logdir: str, storage_options: Mapping[str, Any] | None = None, *,
                 cache_bytes: int = CACHE_BYTES, listing_ttl: float = LISTING_TTL_S,
                 chunk_bytes: int = CHUNK_BYTES, layer_steps: int = _tiers.LAYER_STEPS,
                 min_rows: int = _tiers.MIN_ROWS):
        self.logdir, self._options = logdir, storage_options
        self._budget = (layer_steps, min_rows)  # records a run keeps before its older steps merge (tiers)
        self._cache_bytes, self._listing_ttl, self._chunk = cache_bytes, listing_ttl, chunk_bytes
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._summaries: dict[str, tuple[tuple, list[dict[str, Any]]]] = {}
        self._names: dict[str, str] = {}  # series name -> run directory
        #: A series read again after eviction, from the same bytes, keeps its generation (the plugin's cached
        #: diagnoses key on it). Small: one number per series and file sizes.
        self._generations: dict[str, tuple[tuple, int]] = {}
        self._listing: tuple[float, dict[str, list[str]]] | None = None
        self._lock = threading.Lock()
        self._listing_lock = threading.Lock()

    def has_data(self, ctx: Any = None, experiment_id: str = "") -> bool:
        return any(self.summaries(ctx, experiment_id))

    def run(self, ctx: Any, experiment_id: str, name: str) -> RunSeries | None:
        """The named series (a run, or ``"<run> [<stream>]"``), read up to what the files hold now; None when
        the logdir has no gradient-health data for it."""
        try:
            listing = self.listing()
            for run_dir in self._dirs_for(name, listing):
                got = self._read(run_dir, listing[run_dir]).get(name)
                if got is not None:
                    return got
            return None
        except (OSError, _storage.StorageError) as e:
            raise ProviderError(f"could not read the event files: {e}") from e

    def summaries(self, ctx: Any = None, experiment_id: str = "") -> list[dict[str, Any]]:
        """:meth:`RunSeries.summary` of every series, sorted by name; a run's summaries are kept until its files
        change, so listing many large runs does not read again the runs the cache let go."""
        try:
            return self._summaries_now()
        except (OSError, _storage.StorageError) as e:
            raise ProviderError(f"could not read the event files: {e}") from e

    def _summaries_now(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for run_dir, paths in sorted(self.listing().items()):
            key = self._sizes(paths)
            with self._lock:
                hit = self._summaries.get(run_dir)
            if hit is None or hit[0] != key:
                hit = (key, [s.summary() for s in self._read(run_dir, paths).values()])
                with self._lock:
                    self._summaries[run_dir] = hit
            out.extend(hit[1])
        return sorted(out, key=lambda s: s["run"])

    def listing(self) -> dict[str, list[str]]:
        """``{run directory: [event files]}``, at most ``listing_ttl`` seconds old."""
        with self._listing_lock:
            now = time.monotonic()
            if self._listing is None or now - self._listing[0] >= self._listing_ttl:
                self._listing = (now, find_runs(self.logdir, self._options))
            return self._listing[1]


    def _dirs_for(self, name: str, listing: Mapping[str, list[str]]) -> list[str]:
        with self._lock:
            known = self._names.get(name)
        guesses = [known, name, run_of(name)]
        return list(dict.fromkeys(d for d in guesses if d is not None and d in listing))

    def _sizes(self, paths: Sequence[str]) -> tuple[tuple[str, int], ...]:
        return tuple((p, _storage.size(p, self._options)) for p in paths)

    def _read(self, run_dir: str, paths: Sequence[str]) -> dict[str, RunSeries]:
        """The run's series, after reading what was appended to its files since the last read."""
        with self._lock:
            state = self._runs.setdefault(run_dir, _Run())
            self._runs.move_to_end(run_dir)
        with state.lock:
            sizes = self._sizes(paths)
            if sizes != state.sizes:
                try:
                    if state.whole:
                        raise NotAnAppend("read whole")
                    self._append(run_dir, state, sizes)
                except NotAnAppend:
                    self._read_whole(run_dir, state, paths)
                state.sizes = sizes
                self._keep_generations(state, sizes)
            series = dict(state.series)
        with self._lock:
            self._names.update({name: run_dir for name in series})
            self._evict()
        return series

    def _keep_generations(self, state: _Run, sizes: tuple) -> None:
        """A series read again from the same bytes (after eviction) takes the generation it had."""
        with self._lock:
            for name, s in state.series.items():
                known = self._generations.get(name)
                first = known[1] if known is not None and known[0] == sizes else s.generation
                self._generations[name] = (sizes, first)
                if first != s.generation:
                    state.series[name] = dataclasses.replace(s, generation=first)

    def _read_whole(self, run_dir: str, state: _Run, paths: Sequence[str]) -> None:
        """The CLI's reading of a run (:func:`reader.read_run_dir`, :func:`reader.assemble`), without the problem
        of a file that ends in a partial record: the next read resumes there."""
        problems: list[str] = []
        tags = {td.tag: td for td in read_run_dir(paths, problems, self._options)}
        problems = [p for p in problems if getattr(p, "kind", None) is not Kind.PARTIAL]  # the next read resumes there
        state.whole, state.store, state.offsets, state.known = True, None, {}, {}
        if not tags:
            state.series = {run_dir: assemble(run_dir, [], problems=problems)} if any_of_kind(
                problems, Kind.RECORDS) else {}
            return
        state.series = {name: assemble(name, [tags[t] for t in stream_tags], problems=problems, consume=True)
                        for name, stream_tags in split_streams(run_dir, tags).items()}

    def _append(self, run_dir: str, state: _Run, sizes: tuple[tuple[str, int], ...]) -> None:
        """Read every file from where the last read stopped, chunk by chunk, into the run's store."""
        if set(state.offsets) - {p for p, _ in sizes}:
            raise NotAnAppend("a file went away")
        total = sum(size for _, size in sizes)
        done = sum(state.offsets.values())
        for path, size in sizes:
            offset = state.offsets.get(path, 0)
            if size < offset:
                raise NotAnAppend("a file shrank")
            length = self._chunk
            while offset < size:
                data = _storage.read_range(path, offset, length, self._options)
                if not data:  # the file shrank since it was listed
                    break
                tags = {tag: TagData(tag, content) for tag, content in state.known.items()}
                orphans: dict[str, int] = {}
                problems: list[str] = []
                where = ScanEnd()
                for _, payload in scan_framed(data, offset, path, problems, where):
                    if not add_event(payload, tags, orphans):
                        raise NotAnAppend("an event does not parse")
                if problems or orphans or where.stop == "corrupt":
                    raise NotAnAppend("damaged data")
                if where.end == offset:  # no whole record: the file is still being written, or a record is longer
                    if offset + len(data) >= size:
                        break
                    length *= 2
                    continue
                chunk = where.end - offset
                offset, length = where.end, self._chunk
                state.offsets[path] = offset
                done += chunk
                self._add_chunk(run_dir, state, tags, (total - done) / chunk)
            state.offsets[path] = offset

    def _add_chunk(self, run_dir: str, state: _Run, tags: dict[str, TagData], chunks_left: float) -> None:
        """Append a chunk's records to the run's store; ``chunks_left``: about how many more chunks the files hold
        now (the store is made with room for them)."""
        state.known.update({tag: td.content for tag, td in tags.items()})
        if not state.known:  # nothing of this plugin yet (the file's version event, other summaries)
            return
        streams = split_streams(run_dir, state.known)
        if len(streams) != 1:
            raise NotAnAppend("several streams")
        try:
            contents = [metadata.decode_content(c) for c in state.known.values()]
        except ValueError as e:
            raise NotAnAppend("unreadable tag metadata") from e
        layer_lists = {c.layers for c in contents}
        if len(layer_lists) != 1:
            raise NotAnAppend("several layer lists")
        with_points = [td for td in tags.values() if td.points]
        if not with_points:
            return
        points = sum(len(td.points) for td in with_points)
        if state.store is None:
            (layers,) = layer_lists
            state.store = _Store.new(tuple(layers), int(points * (1 + chunks_left) * HEADROOM) + 64,
                                     self._budget)
        store = state.store
        part = assemble(run_dir, with_points, consume=True)
        if part.problems or part.notes or part.num_steps == 0:
            raise NotAnAppend("damaged records or a restart")
        store.append(part, math.ceil(points * chunks_left))
        info = {layer: kind for c in contents for layer, kind in zip(c.layers, c.layer_info, strict=False)}
        source = {k: v for _, c in sorted(zip(state.known, contents, strict=True), key=lambda tc: tc[0])
                  for k, v in c.source.items()}  # as assemble reads it: the tags by name
        state.series = {run_dir: store.series(run_dir, tuple(sorted(state.known)), info, source)}

    def _evict(self) -> None:
        """Drop the least recently used runs beyond ``cache_bytes`` (always keeping the last one read)."""
        total = sum(r.nbytes for r in self._runs.values())
        while total > self._cache_bytes and len(self._runs) > 1:
            _, old = self._runs.popitem(last=False)
            total -= old.nbytes
