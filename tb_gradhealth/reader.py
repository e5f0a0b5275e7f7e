"""Gradient-health summaries → one :class:`RunSeries` per run, from a TensorBoard data provider or a logdir.

Two sources share one assembly (:func:`assemble`): the plugin reads through ``context.data_provider`` (whichever
loader TensorBoard runs: the Rust data server or the Python multiplexer), and the CLI reads event files directly
(:func:`read_logdir`), so a CI job needs no server. Neither imports TensorFlow: the logdir reader parses TFRecord
framing itself, because TensorBoard's ``event_file_loader`` goes through ``tensorboard.compat.tf``, which imports
TensorFlow whenever it is installed.

What can go wrong in a logdir is reported, never raised: an unreadable tag metadata, a record of a future format
version, a tensor of the wrong shape, a corrupt or truncated event file each become a line in ``problems`` and the
rest of the run is still read. A file that ends in a partial record (a writer mid-write, or a truncated copy) is
read up to that record.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError
from tensorboard import errors as tb_errors
from tensorboard.compat.proto import event_pb2
from tensorboard.data import provider as tb_provider
from tensorboard.util import tensor_util

from tb_gradhealth import _storage, metadata, record
from tb_gradhealth._eventfile import iter_framed
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
    PROVIDER_ERRORS = (tb_errors.PublicError, OSError)


_GENERATIONS = itertools.count(1)
_log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class RunSeries:
    """Every gradient-health record of one run.

    ``layers`` in network order (the union of all tags' layer lists); ``steps`` int64 ``[S]`` ascending unique;
    ``records`` float64 ``[S, L, record.NUM_FIELDS]`` memory form with a layer's row all-NaN at a step where it
    has no record. ``sample_limit``: samples per tag the loader keeps (None: all); ``maybe_downsampled``: some tag
    reached that limit, so older steps may have been dropped.
    """

    run: str
    layers: tuple[str, ...]
    steps: np.ndarray
    records: np.ndarray
    problems: tuple[str, ...] = ()
    #: What the reader did that loses nothing unexpected (a restart's superseded steps), for the record.
    notes: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    sample_limit: int | None = None
    maybe_downsampled: bool = False
    #: Unique per assembled series: caches of derived results key on it (the reader makes a new series, with a new
    #: generation, whenever the data provider reports new data for the run).
    generation: int = field(default_factory=lambda: next(_GENERATIONS))
    #: Bytes of ``records`` in memory when it is stored field by field (:func:`new_records`): the planes of
    #: histogram bins no record uses take none. None: all of ``records.nbytes``.
    resident_bytes: int | None = None
    #: Where older steps were merged into windows (:mod:`tb_gradhealth._tiers`; the plugin's copy of a long run):
    #: int ``[S, L]`` steps each row holds (its record is their mean step; 0 where the layer has no record) and
    #: int64 ``[S]`` the last step of each row (``steps`` holds the first). None: one step a row.
    window_steps: np.ndarray | None = None
    window_last: np.ndarray | None = None
    #: ``{layer: (kind, activation)}`` where the writer knew the model (:mod:`tb_gradhealth.layerinfo`), else empty.
    layer_info: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    _index: dict[str, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._index.update({name: i for i, name in enumerate(self.layers)})

    def layer_index(self, layer: str) -> int | None:
        return self._index.get(layer)

    @property
    def num_steps(self) -> int:
        return int(self.steps.size)

    @property
    def first_step(self) -> int | None:
        return int(self.steps[0]) if self.steps.size else None

    @property
    def last_step(self) -> int | None:
        return int(self.steps[-1]) if self.steps.size else None

    @property
    def nbytes(self) -> int:
        held = self.records.nbytes if self.resident_bytes is None else self.resident_bytes
        windows = sum(a.nbytes for a in (self.window_steps, self.window_last) if a is not None)
        return int(held + self.steps.nbytes + windows)

    def present(self) -> np.ndarray:
        """``[S, L]`` bool: where a layer has a record (absent rows are all-NaN; a record's size is never NaN)."""
        return ~np.isnan(self.records[..., record.INDEX["size"]])

    def summary(self) -> dict[str, Any]:
        """The run's entry in the ``runs`` route."""
        return {
            "run": self.run,
            "tags": list(self.tags),
            "layers": list(self.layers),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "num_steps": self.num_steps,
            "sample_limit": self.sample_limit,
            "maybe_downsampled": self.maybe_downsampled,
            "problems": list(self.problems),
            "notes": list(self.notes),
        }


@dataclass
class TagData:
    """What a source found for one tag: its metadata content and its points ``(step, wall_time, tensor)``."""

    tag: str
    content: bytes
    points: list[tuple[int, float, Any]] = field(default_factory=list)


# --- assembly (shared by both sources) ----------------------------------------------------------------------------


def _merge_order(orders: Iterable[Sequence[str]]) -> list[str]:
    """Union of layer lists keeping each list's order: a new name goes right after its nearest known predecessor
    in its own list (or before its nearest known successor), so layers stay in network order across tags."""
    merged: list[str] = []
    for order in orders:
        for k, name in enumerate(order):
            if name in merged:
                continue
            pos = None
            for prev in reversed(order[:k]):
                if prev in merged:
                    pos = merged.index(prev) + 1
                    break
            if pos is None:
                for nxt in order[k + 1 :]:
                    if nxt in merged:
                        pos = merged.index(nxt)
                        break
            merged.insert(len(merged) if pos is None else pos, name)
    return merged


PRIMARY_STREAM = "gradients"


def stream_of(tag: str) -> str:
    """The record stream of a tag: ``<name>`` of ``gradhealth/<name>/<hash8>`` (the writers' ``name=``)."""
    body = tag[len(metadata.TAG_PREFIX) :] if tag.startswith(metadata.TAG_PREFIX) else tag
    name, sep, _digest = body.rpartition("/")
    return name if sep and name else body


def split_streams(run: str, tags: Iterable[str]) -> dict[str, list[str]]:
    """``{series name: [tags]}`` for one run directory.

    Tags of one stream (same writer ``name``, different layer sets) are one series, merged by layer name. Different
    streams are different measurements (e.g. Keras' training ``gradients`` and its ``probe_gradients`` on a fixed
    batch) and must not be mixed: a run with one stream keeps its name; with several, the ``gradients`` stream (else
    the first by name) keeps it and every other stream is its own series named ``"<run> [<stream>]"``.
    """
    by_stream: dict[str, list[str]] = {}
    for tag in sorted(tags):
        by_stream.setdefault(stream_of(tag), []).append(tag)
    if not by_stream:
        return {}
    if len(by_stream) == 1:
        return {run: next(iter(by_stream.values()))}
    primary = PRIMARY_STREAM if PRIMARY_STREAM in by_stream else min(by_stream)
    return {(run if name == primary else f"{run} [{name}]"): tags for name, tags in sorted(by_stream.items())}


def _check_tensor(value: Any, n_layers: int) -> np.ndarray:
    """The disk tensor as float32 ``[L, C]``, or ValueError saying what is wrong with it as a whole (its rows are
    checked one by one by :func:`record.decode_disk`).

    A source passes a string instead of an array for a tensor it could not decode at all."""
    if isinstance(value, str):
        raise ValueError(value)
    t = np.asarray(value)
    if t.dtype != np.float32:
        if t.dtype.kind not in "fiu":
            raise ValueError(f"tensor of dtype {t.dtype}, expected float32")
        t = t.astype(np.float32)
    record.tensor_or_raise(t)
    if t.shape[0] != n_layers:
        raise ValueError(f"tensor has {t.shape[0]} rows for {n_layers} layers in the tag's metadata")
    return t


def supersede(points: Sequence[tuple[int, float, Any]]) -> tuple[list[tuple[int, float, Any]], list[int]]:
    """TensorBoard's rule for steps that go back (a job restarted from a checkpoint), applied to one tag's points in
    the order they were written: a point at step ``s`` drops every earlier point of the tag at a step ``>= s``.
    Returns the kept points (steps strictly increasing) and the steps where a restart dropped points.

    This is what TensorBoard's default data server does for every time series; its Python loader
    (``--load_fast=false``) keeps both and the plugin applies the rule to what it returns, so the tab and the CLI
    show one history whatever the loader.
    """
    kept: list[tuple[int, float, Any]] = []
    restarts: list[int] = []
    for p in points:
        if kept and kept[-1][0] >= p[0]:
            restarts.append(int(p[0]))
            while kept and kept[-1][0] >= p[0]:
                kept.pop()
        kept.append(p)
    return kept, restarts


#: Events checked together (stacked) by :func:`_check_points`: one vectorised check per chunk, bounded memory.
CHECK_CHUNK = 256


def _check_points(td: TagData, n_layers: int, problems: list[str]
                  ) -> list[tuple[float, int, np.ndarray, np.ndarray]]:
    """``(wall_time, step, tensor, good rows)`` of each readable point of a tag (checked, not yet decoded: the disk
    form is several times smaller); a damaged tensor or row is skipped and counted in one problem line per tag."""
    out = []
    bad_tensors, first_tensor = 0, None
    for step, wall_time, value in td.points:
        try:
            t = _check_tensor(value, n_layers)
        except (ValueError, TypeError) as e:
            bad_tensors += 1
            first_tensor = first_tensor or f"step {step}: {e}"
            continue
        out.append((float(wall_time), int(step), t, np.ones(n_layers, dtype=bool)))
    if bad_tensors:
        problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: {bad_tensors} unreadable record tensor(s) skipped, "
                                              f"first at {first_tensor}"))
    # Row checks, stacked per histogram width (events of one width share a column layout).
    by_width: dict[int, list[int]] = {}
    for i, (_, _, t, _) in enumerate(out):
        by_width.setdefault(t.shape[1], []).append(i)
    damaged: list[tuple[int, int, str]] = []  # (event index, row, reason)
    for idx in by_width.values():
        for start in range(0, len(idx), CHECK_CHUNK):
            chunk = idx[start : start + CHECK_CHUNK]
            stacked = out[chunk[0]][2] if len(chunk) == 1 else np.concatenate([out[i][2] for i in chunk])
            for flat, why in record.check_disk(stacked, n_layers)[1].items():
                damaged.append((chunk[flat // n_layers], flat % n_layers, why))
    for i, row, _ in damaged:
        out[i][3][row] = False
    if damaged:
        i, row, why = min(damaged)
        problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: {len(damaged)} damaged record row(s) skipped, first "
                                              f"at step {out[i][1]} row {row}: {why}"))
    return out


def _join_blocks(good: list[tuple[TagData, tuple[str, ...]]]) -> list[tuple[TagData, tuple[str, ...]]]:
    """The step-block tags of one layer list (:func:`metadata.tag_for`) as one tag, their points in write order
    (wall time), so that the restart rule (:func:`supersede`) applies across blocks as to a tag of every step: a
    job restarted at step 50 replaces the earlier records from step 50 on, in whichever block they are."""
    joined: dict[tuple[str, tuple[str, ...]], list[TagData]] = {}
    for td, lay in good:
        base = td.tag if metadata.tag_block(td.tag) is None else td.tag.rpartition(".")[0]
        joined.setdefault((base, lay), []).append(td)
    out = []
    for (base, lay), tds in joined.items():
        if len(tds) == 1:
            out.append((tds[0], lay))
            continue
        points = sorted((p for td in tds for p in td.points), key=lambda p: float(p[1]))
        out.append((TagData(base, tds[0].content, points), lay))
    return out


def new_records(n_steps: int, n_layers: int) -> np.ndarray:
    """Zeroed memory-form records ``[S, L, NUM_FIELDS]`` stored field by field (``[F, S, L]`` in memory).

    Each field is one contiguous ``[S, L]`` plane: the diagnosis reads a few fields of every step and layer, which
    are then contiguous, and the planes of histogram bins that no record of the run uses are never written, so the
    operating system never allocates them (a large ``np.zeros`` is lazily zeroed memory). A run's gradients
    usually span a few decades, so most of the 77 bin planes stay untouched: 1,000 layers x 10,000 steps hold
    about 2 GB instead of 7.5 GB.
    """
    return np.zeros((record.NUM_FIELDS, n_steps, n_layers)).transpose(1, 2, 0)


def assemble(
    run: str,
    tags: Sequence[TagData],
    *,
    sample_limit: int | None = None,
    problems: Sequence[str] = (),
    consume: bool = False,
) -> RunSeries:
    """Merge the tags of one run by layer name into a :class:`RunSeries`.

    ``consume``: empty the tags' point lists and let each disk tensor go once it is decoded, so that a large run
    never holds both all its disk tensors and all its decoded records (the readers pass True for data they read).

    A tag whose metadata is unreadable or of a future version is skipped with a problem; a tensor that does not
    decode, or a damaged row of one, is skipped with a problem (one line per tag, counting them) and the rest of the
    tag is read. Within a tag, steps that go back follow TensorBoard's restart rule (:func:`supersede`). When two
    records of a layer share a step in different tags, the one written last (wall time) wins.
    """
    problems = list(problems)
    notes: list[str] = []
    good, info = _readable_tags(tags, problems)
    tag_names = tuple(td.tag for td, _ in good)
    good = _join_blocks(good)
    # The tag with the most layers is the backbone of the order; the others' new layers go in around it.
    layers = _merge_order([lay for _, lay in sorted(good, key=lambda g: (-len(g[1]), g[0].tag))])
    valid, downsampled = _checked_points(good, layers, problems, notes, sample_limit)
    if consume:  # from here on only ``valid`` holds the tensors
        for td in [*tags, *(td for td, _ in good)]:
            td.points.clear()
    steps = np.unique(np.array([v.step for v in valid], dtype=np.int64))
    records, bins = _decode(valid, steps, len(layers))
    return RunSeries(
        run=run,
        layers=tuple(layers),
        steps=steps,
        records=records,
        problems=tuple(problems),
        notes=tuple(notes),
        tags=tag_names,
        sample_limit=sample_limit,
        maybe_downsampled=downsampled,
        resident_bytes=(record.HIST_START + max(0, bins[1] - bins[0])) * steps.size * len(layers) * 8,
        layer_info=info,
    )


def _readable_tags(tags: Sequence[TagData], problems: list[str]
                   ) -> tuple[list[tuple[TagData, tuple[str, ...]]], dict[str, tuple[str, str]]]:
    """``(tag, its layers)`` of each tag whose metadata decodes, by name (the others are problems), and the layers'
    kinds and activations where a tag's metadata has them."""
    good, info = [], {}
    for td in sorted(tags, key=lambda t: t.tag):
        try:
            content = metadata.decode_content(td.content)
        except ValueError as e:  # including metadata.UnsupportedVersion (a future format version)
            problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: skipped: {e}"))
            continue
        good.append((td, content.layers))
        info.update(zip(content.layers, content.layer_info, strict=False))  # () without info
    return good, info


class _Point(NamedTuple):
    """A checked record tensor of a tag, not yet decoded."""

    wall_time: float
    order: int  # read order: the tie-break between equal wall times
    step: int
    cols: np.ndarray  # the run's column of each of the tag's layers
    tensor: np.ndarray
    ok: np.ndarray  # [rows] bool: rows that passed the checks


def _checked_points(good: list[tuple[TagData, tuple[str, ...]]], layers: list[str], problems: list[str],
                    notes: list[str], sample_limit: int | None) -> tuple[list[_Point], bool]:
    """Pass 1: every tensor checked row by row, after the restart rule; and whether a tag reached the loader's
    sample limit (older steps may have been dropped)."""
    col = {name: i for i, name in enumerate(layers)}
    valid: list[_Point] = []
    downsampled = False
    for td, tag_layers in good:
        cols = np.array([col[name] for name in tag_layers], dtype=np.int64)
        points, restarts = supersede(td.points)
        if restarts:
            notes.append(f"tag {td.tag}: steps went back {len(restarts)} time(s) (a restart), first to step "
                         f"{restarts[0]}: the earlier records from that step on are replaced, as TensorBoard does")
        for wall_time, step, t, ok in _check_points(TagData(td.tag, td.content, points), len(tag_layers), problems):
            if ok.any():
                valid.append(_Point(wall_time, len(valid), step, cols, t, ok))
        if sample_limit is not None and len(td.points) >= sample_limit:
            downsampled = True
    return valid, downsampled


def _decode(valid: list[_Point], steps: np.ndarray, n_layers: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Pass 2: the records (:func:`new_records`, all-NaN where a layer has none) and the union of the histogram
    windows written. Decoded in write order (wall time, then read order) so the last written record of a step wins;
    taken from the end of ``valid`` (emptied), so that each tensor can go as soon as it is decoded."""
    records = new_records(steps.size, n_layers)
    filled = np.zeros((steps.size, n_layers), dtype=bool)
    valid.sort(key=lambda v: (v.wall_time, v.order), reverse=True)
    bins = (record.HIST_BINS, 0)
    while valid:
        _, _, step, cols, t, ok = valid.pop()
        s = int(np.searchsorted(steps, step))
        rows = cols if ok.all() else cols[ok]
        again = rows[filled[s, rows]]
        if again.size:  # a later record of the same step replaces the earlier one whole: clear its histogram
            records[s, again, record.HIST_START :] = 0.0
        if rows.size and rows.size == rows[-1] - rows[0] + 1 and np.all(np.diff(rows) == 1):
            rows = slice(int(rows[0]), int(rows[-1]) + 1)  # the usual case: a plain slice, no gather
        record.from_disk_into(t if ok.all() else t[ok], records[s], rows)
        filled[s, cols[ok]] = True
        if t.shape[1] > record.DISK_HIST_START:
            lo = int(t[0, record.DISK_HIST_LO])
            bins = (min(bins[0], lo), max(bins[1], lo + t.shape[1] - record.DISK_HIST_START))
    if not filled.all():
        records[~filled] = np.nan
    return records, bins


# --- source 1: a TensorBoard data provider (the plugin) -----------------------------------------------------------


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
    name = type(data_provider).__name__
    if name == "GrpcDataProvider":
        return SAMPLE_ALL, RUST_LOADER_DEFAULT
    if name == "MultiplexerDataProvider":
        return SAMPLE_ALL, PYTHON_LOADER_DEFAULT
    return SAMPLE_ALL, None


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
    """Whether a read failed because its answer exceeded the transport's message limit."""
    code = getattr(e, "code", None)
    if callable(code) and "grpc" in globals() and code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return True
    return "larger than max" in str(e)


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
                     ) -> tuple[dict[str, list[tuple[int, float, Any]]], list[str], bool, BaseException | None]:
        """``(points, problems, sampled, failure)``: each tag's ``(step, wall_time, tensor)`` points, read group by
        group as :meth:`_read` says; whether a tag was read with evenly spaced steps; and the provider's error when
        it could not read the run at all (then nothing else counts)."""
        points: dict[str, list[tuple[int, float, Any]]] = {}
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
                points.setdefault(tag, []).extend((d.step, d.wall_time, d.numpy) for d in answer.get(tag, ()))
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


# --- source 2: event files in a logdir (the CLI) ------------------------------------------------------------------


@dataclass
class LogdirData:
    runs: list[RunSeries]
    problems: list[str]


def is_event_file(name: str) -> bool:
    """TensorBoard's rule (``io_wrapper.IsTensorFlowEventsFile``): ``tfevents`` in the file name."""
    return "tfevents" in name


def add_event(payload: bytes, tags: dict[str, TagData], orphans: dict[str, int]) -> bool:
    """Add the gradient-health values of one serialized event to ``tags`` (False: it does not parse).

    A tag's metadata comes with its first value; records of a ``gradhealth/`` tag seen before it are counted in
    ``orphans`` (the event carrying the metadata is lost). A tensor that does not decode becomes a string, which
    :func:`assemble` reports."""
    try:
        event = event_pb2.Event.FromString(payload)
    except DecodeError:
        return False
    if not event.HasField("summary"):
        return True
    for value in event.summary.value:
        td = tags.get(value.tag)
        if td is None:
            if value.metadata.plugin_data.plugin_name != metadata.PLUGIN_NAME:
                if value.tag.startswith(metadata.TAG_PREFIX) and not value.metadata.plugin_data.plugin_name:
                    orphans[value.tag] = orphans.get(value.tag, 0) + 1
                continue
            td = tags[value.tag] = TagData(value.tag, value.metadata.plugin_data.content)
        if not value.HasField("tensor"):
            continue
        try:
            arr = tensor_util.make_ndarray(value.tensor)
        except (ValueError, TypeError) as e:
            arr = f"undecodable tensor proto: {e}"  # reported by assemble's validation
        td.points.append((event.step, event.wall_time, arr))
    return True


def orphan_problems(orphans: Mapping[str, int]) -> list[str]:
    return [Problem(Kind.RECORDS, f"tag {tag}: {n} record(s) without the tag's metadata skipped (the event that "
                                  f"carried it is damaged or missing)") for tag, n in sorted(orphans.items())]


def read_run_dir(paths: Sequence[str], problems: list[str],
                 storage_options: Mapping[str, Any] | None = None) -> list[TagData]:
    """Gradient-health tags of one run from its event files (in name order = creation order).

    Damage becomes a line in ``problems`` naming the file and byte offset: a record failing its data checksum, an
    event that does not parse, records of a ``gradhealth/`` tag seen before the tag's metadata (the event carrying
    it is lost), as well as what :func:`iter_framed` reports."""
    tags: dict[str, TagData] = {}
    orphans: dict[str, int] = {}
    for path in paths:
        bad_events, first_bad = 0, None
        for offset, payload in iter_framed(path, problems, storage_options):
            if not add_event(payload, tags, orphans):
                bad_events += 1
                first_bad = first_bad if first_bad is not None else offset
        if bad_events:
            problems.append(Problem(Kind.FILE, f"{path}: {bad_events} corrupt event(s) skipped (they do not parse), "
                                               f"first at byte {first_bad}"))
    problems.extend(orphan_problems(orphans))
    return list(tags.values())


def find_runs(logdir: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, list[str]]:
    """``{run: [event file paths]}``; runs are directories relative to ``logdir`` (``.`` for the logdir itself),
    named as TensorBoard names them. ``logdir`` may be a URL (:mod:`tb_gradhealth._storage`)."""
    runs: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in _storage.walk(logdir, storage_options):
        dirnames.sort()
        files = sorted(f for f in filenames if is_event_file(f))
        if not files:
            continue
        runs[_storage.relpath(dirpath, logdir)] = [_storage.join(dirpath, f) for f in files]
    return runs


def read_logdir(logdir: str, runs: Sequence[str] | None = None,
                storage_options: Mapping[str, Any] | None = None) -> LogdirData:
    """Every run of ``logdir`` that holds gradient-health data (or only ``runs``), read without a server.

    ``logdir`` is a local path or a ``gs://``, ``s3://`` or other fsspec URL (``storage_options`` go to fsspec).
    Raises FileNotFoundError / NotADirectoryError when ``logdir`` is not a readable directory, and an OSError
    (:class:`~tb_gradhealth._storage.StorageError`) for a URL that cannot be used (no fsspec or backend installed).
    """
    logdir = _storage.check(logdir)
    if not _storage.isdir(logdir, storage_options):
        if not _storage.exists(logdir, storage_options):
            raise FileNotFoundError(f"logdir {logdir!r} does not exist")
        raise NotADirectoryError(f"logdir {logdir!r} is not a directory")
    problems: list[str] = []
    out = []
    for run, paths in sorted(find_runs(logdir, storage_options).items()):
        if runs is not None and run not in runs and not any(r.startswith(run + " [") for r in runs):
            continue
        run_problems: list[str] = []
        tags = {td.tag: td for td in read_run_dir(paths, run_problems, storage_options)}
        if not tags:
            if any_of_kind(run_problems, Kind.RECORDS):  # gradhealth records, but none readable
                out.append(assemble(run, [], problems=run_problems))
            else:
                problems.extend(run_problems)
            continue
        for name, stream_tags in split_streams(run, tags).items():
            if runs is None or name in runs:
                out.append(assemble(name, [tags[t] for t in stream_tags], problems=run_problems, consume=True))
    out.sort(key=lambda s: s.run)
    return LogdirData(out, problems)
