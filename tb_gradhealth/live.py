"""A run diagnosed while it trains, as ``tb-gradhealth report --step S`` diagnoses it once written; ``stop_on``.

:class:`LiveRun` is handed every event a :class:`tb_gradhealth.writer.Writer` writes (:meth:`Writer.observe`) and
reads them back as the readers read the event file: each event by the logdir reader's code, each record tensor
checked and decoded by the assembly's (in its float32 disk form, so the values are the reader's bit for bit), the
layers in the readers' network order, the loss and the skipped steps as :mod:`tb_gradhealth.progress` reads them,
the layers' kinds and the training loop from the tags' metadata. :meth:`LiveRun.diagnose` calls the one function
behind the CLI and the tab (:func:`tb_gradhealth._payloads.diagnose`), so at a logged step ``S`` it answers what
``report --step S`` answers on the finished logdir, as long as everything at or before ``S`` was written before
the call (each writer calls it once a step's loss and skip flag are in).

:class:`StopCheck` is ``stop_on`` for every writer (the Keras callback, PyTorch's ``StepRecorder``, the Lightning
and Hugging Face callbacks, :class:`tb_gradhealth.jax.StepWatch`): at each logged step, that diagnosis; the first
step where a layer's current status is watched gives a :class:`StopEvent`. A check reads the whole history, as the
report does, so it costs O(logged steps so far): the first :data:`DENSE_CHECKS` logged steps are each checked, later
ones ever more sparsely (every ``k // DENSE_CHECKS``-th at the ``k``-th), which keeps the cost per logged step
bounded over any length of run; a step whose records or loss hold a NaN/Inf after one that held none is always
checked. docs/PERFORMANCE.md
has the figures. No framework is imported here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2

from tb_gradhealth import health, metadata, progress, record
from tb_gradhealth._assembly import RunSeries, TagData, assemble, layer_order
from tb_gradhealth._logdirreader import add_summary
from tb_gradhealth._payloads import diagnose
from tb_gradhealth._streams import PRIMARY_STREAM, stream_of

__all__ = ["DENSE_CHECKS", "LiveRun", "StopCheck", "StopEvent", "StopTraining", "Stoppable", "check_stop_on",
           "make_thresholds"]


#: Logged steps that :class:`StopCheck` checks one by one; from the ``k``-th logged step on it checks every
#: ``k // DENSE_CHECKS``-th (a check costs O(k): the cost per logged step stays about that of a check at this many).
DENSE_CHECKS = 256


@dataclass(frozen=True)
class StopEvent:
    """Why ``stop_on`` stopped training: the first logged step whose diagnosis shows a watched status.

    ``layer`` is the run's answer (its cause, rank 1) when its current status is watched, else the highest-ranked
    layer whose status is; ``status`` is that layer's status; ``layers`` lists every layer with a watched status at
    that step, in network order.
    """

    step: int
    layer: str
    status: str
    layers: tuple[str, ...]
    #: Where the first NaN/Inf was made (a :class:`tb_gradhealth.origin.NanOrigin`), when it was looked for.
    origin: Any = None

    def message(self) -> str:
        others = f" (bad layers at that step: {', '.join(self.layers)})" if len(self.layers) > 1 else ""
        made = f"; {self.origin.message()}" if self.origin is not None else ""
        return f"tb_gradhealth: {self.status} gradient in layer {self.layer!r} at step {self.step}{others}{made}"


class StopTraining(RuntimeError):
    """Raised by a writer asked to (``raise_on_stop=True``) when ``stop_on`` stops training; holds the
    :class:`StopEvent`."""

    def __init__(self, event: StopEvent) -> None:
        super().__init__(event.message())
        self.event = event


def check_stop_on(stop_on: str | Iterable[str]) -> tuple[str, ...]:
    """``stop_on`` as a tuple of statuses (a string is one status); ValueError naming the choices for a status that
    is no flag of the diagnosis (:data:`tb_gradhealth.health.FLAGS`)."""
    watched = (stop_on,) if isinstance(stop_on, str) else tuple(stop_on)
    unknown = [s for s in watched if s not in health.FLAGS]
    if unknown:
        raise ValueError(f"stop_on accepts statuses of {health.FLAGS}, got {unknown}")
    return watched


def make_thresholds(thresholds: health.Thresholds | Mapping[str, Any] | None) -> health.Thresholds:
    """:class:`tb_gradhealth.health.Thresholds` from ``None`` (the defaults), a mapping of its fields (checked as
    the CLI's flags are: ValueError naming the key) or an instance."""
    if thresholds is None:
        return health.Thresholds()
    if isinstance(thresholds, Mapping):
        return health.Thresholds.from_mapping({str(k): str(v) for k, v in thresholds.items()})
    return thresholds


class _Rows:
    """One series' records as :func:`tb_gradhealth.reader.new_records` lays them out (``[F, capacity, L]``: each
    field a plane, so the diagnosis reads the arrays it reads from a reader), grown by doubling; a layer's row is
    all-NaN at a step where it has no record. Planes no record set stay untouched (lazily zeroed memory)."""

    def __init__(self) -> None:
        self.layers: tuple[str, ...] = ()
        self.where: dict[str, int] = {}
        self.buf = np.zeros((record.NUM_FIELDS, 0, 0))
        self.steps = np.zeros(0, np.int64)
        self.n = 0
        self.touched = np.zeros(record.NUM_FIELDS, dtype=bool)

    def relayout(self, layers: Sequence[str]) -> None:
        """The columns in a new order ``layers`` (a new tag's layers joined the run); new columns are NaN."""
        layers = tuple(layers)
        if layers == self.layers:
            return
        where = {name: j for j, name in enumerate(layers)}
        buf = np.zeros((record.NUM_FIELDS, self.buf.shape[1], len(layers)))
        cols = np.array([where[name] for name in self.layers], dtype=np.int64)
        new = np.setdiff1d(np.arange(len(layers)), cols)
        for f in range(record.NUM_FIELDS):
            plane = buf[f]
            if self.touched[f]:
                plane[: self.n, cols] = self.buf[f, : self.n]
            if self.n and new.size:
                plane[: self.n, new] = np.nan
        if self.n and new.size:
            self.touched[:] = True
        self.layers, self.where, self.buf = layers, where, buf

    def _row(self, step: int) -> tuple[int, bool]:
        """``(row of step, whether it is new)``: the existing row, or a new zero row at its place in step order."""
        k = int(np.searchsorted(self.steps[: self.n], step))
        if k < self.n and self.steps[k] == step:
            return k, False
        if self.n == self.buf.shape[1]:
            self._grow(max(16, 2 * self.n))
        touched = np.flatnonzero(self.touched)
        if k < self.n:  # a step between earlier ones (another tag's): the later rows move down
            self.buf[touched, k + 1 : self.n + 1] = self.buf[touched, k : self.n]
            self.steps[k + 1 : self.n + 1] = self.steps[k : self.n]
            self.buf[touched, k] = 0.0
        self.steps[k] = step
        self.n += 1
        return k, True

    def _grow(self, capacity: int) -> None:
        buf = np.zeros((record.NUM_FIELDS, capacity, len(self.layers)))
        for f in np.flatnonzero(self.touched):
            buf[f, : self.n] = self.buf[f, : self.n]
        steps = np.zeros(capacity, np.int64)
        steps[: self.n] = self.steps[: self.n]
        self.buf, self.steps = buf, steps

    def put(self, part: RunSeries) -> None:
        """The records of ``part`` (decoded points of one tag) at their steps, replacing what its tag's layers held
        there: a tag written again at a step replaces its earlier record there whole, as the readers' restart rule
        does (:func:`tb_gradhealth.reader.supersede`). The other layers of a new step have no record there."""
        cols = np.array([self.where[name] for name in part.layers], dtype=np.int64)
        others = np.setdiff1d(np.arange(len(self.layers)), cols)
        for s, rows in zip(part.steps, part.records, strict=True):
            k, new = self._row(int(s))
            if new and others.size:
                self.buf[:, k, others] = np.nan
                self.touched[:] = True
            planes = rows.T  # [F, l]
            write = self.touched | np.any(planes != 0, axis=1)  # a plane no record set stays untouched
            fields = np.flatnonzero(write)
            self.buf[fields[:, None], k, cols[None, :]] = planes[fields]
            self.touched |= write


class LiveRun:
    """The record stream ``name`` of one run, built from the events its writer writes, as the readers read it back.

    Feed it with :meth:`watch` (a :class:`tb_gradhealth.writer.Writer`) or :meth:`add_event`; :meth:`series` is
    the :class:`tb_gradhealth.reader.RunSeries` a reader of the logdir gives for the events so far, :meth:`progress`
    the loss and skipped steps, :meth:`diagnose` the diagnosis at a step. ``run``: the series' name.
    """

    def __init__(self, *, name: str = PRIMARY_STREAM, run: str = ".") -> None:
        self.name, self.run = name, run
        self._tags: dict[str, TagData] = {}
        self._orphans: dict[str, int] = {}
        self._contents: dict[str, metadata.Content] = {}
        self._rows = _Rows()
        self._scalars: dict[str, dict[int, float]] = {tag: {} for tag in progress.TAGS}
        self._about: tuple[dict[str, tuple[str, str]], dict[str, str]] = ({}, {})

    def watch(self, writer: Any) -> None:
        """Read every event ``writer`` writes from now on (:meth:`tb_gradhealth.writer.Writer.observe`)."""
        writer.observe(self.add_event)

    def add_event(self, event: event_pb2.Event) -> None:
        """One event as written: its records of this stream (decoded as :func:`tb_gradhealth.reader.assemble`
        decodes them) and its progress scalars (:data:`tb_gradhealth.progress.TAGS`)."""
        for value in event.summary.value:
            if value.tag in self._scalars and (x := progress.scalar_value(value)) is not None:
                self._scalars[value.tag][int(event.step)] = x
        add_summary(event, self._tags, self._orphans)
        for td in self._tags.values():
            if td.points:
                self._add_points(td)

    def _add_points(self, td: TagData) -> None:
        if stream_of(td.tag) != self.name:
            td.points.clear()
            return
        if td.tag not in self._contents:
            try:
                self._contents[td.tag] = metadata.decode_content(td.content)
            except ValueError:  # a reader skips the tag (and says so): so does the live run
                td.points.clear()
                return
            self._rows.relayout(layer_order({t: c.layers for t, c in self._contents.items()}))
            self._about = self._tag_facts()
        part = assemble(self.run, [td], consume=True)
        self._rows.put(part)

    def _tag_facts(self) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
        """The layers' kinds and the loop, from the tags' metadata in the order the assembly reads them."""
        info: dict[str, tuple[str, str]] = {}
        source: dict[str, str] = {}
        for tag in sorted(self._contents):
            content = self._contents[tag]
            info.update(zip(content.layers, content.layer_info, strict=False))
            source.update(content.source)
        return info, source

    @property
    def steps(self) -> np.ndarray:
        """The logged steps so far, ascending."""
        return self._rows.steps[: self._rows.n]

    def series(self) -> RunSeries:
        """The run as a reader of its logdir would assemble it now (a view of the records: valid until the next
        event)."""
        rows = self._rows
        info, source = self._about
        return RunSeries(run=self.run, layers=rows.layers, steps=rows.steps[: rows.n],
                         records=rows.buf[:, : rows.n, :].transpose(1, 2, 0), tags=tuple(sorted(self._contents)),
                         layer_info=info, source=source)

    def progress(self) -> progress.Progress:
        """The loss and skipped steps as :func:`tb_gradhealth.progress.read_progress` reads them."""
        return progress.progress_of(self._scalars)

    def diagnose(self, thresholds: health.Thresholds, step: int | None = None, origin: Any = None
                 ) -> health.RunHealth:
        """The diagnosis at the latest logged step at or before ``step`` (default: the last), by the CLI's and the
        tab's function; ``origin``: where the writer's replay found the first NaN/Inf made, which it stores beside
        the records."""
        return diagnose(self.series(), thresholds, step, self.progress().with_origin(origin))


class StopCheck:
    """``stop_on``: the live diagnosis of each logged step, and the first one where a watched status shows.

    ``stop_on``: statuses of :data:`tb_gradhealth.health.FLAGS` (``"nonfinite"``, ``"exploding"``, ...);
    ``thresholds`` as for :func:`make_thresholds`; ``name``: the record stream; ``dense``: the logged steps checked
    one by one before the checks thin out (:data:`DENSE_CHECKS`; ``None``: every logged step is checked). A writer
    calls :meth:`watch` with its :class:`tb_gradhealth.writer.Writer`, then :meth:`check` with each logged step
    once everything of that step (its records, loss and skip flag) is written.
    """

    def __init__(self, stop_on: str | Iterable[str], *, thresholds: Any = None, name: str = PRIMARY_STREAM,
                 dense: int | None = DENSE_CHECKS) -> None:
        if dense is not None and (isinstance(dense, bool) or not isinstance(dense, int) or dense < 1):
            raise ValueError(f"dense must be a positive integer or None, got {dense!r}")
        self.stop_on = check_stop_on(stop_on)
        self.thresholds = make_thresholds(thresholds)
        self.dense = dense
        self.live = LiveRun(name=name)
        #: The index (among the logged steps) of the next one checked whatever it holds.
        self.next_check = 0
        #: The first stop event (``None`` until a check shows a watched status).
        self.event: StopEvent | None = None
        #: The diagnosis of the last step checked.
        self.last: health.RunHealth | None = None
        #: Checks made and the seconds (process time) they took: the cost docs/PERFORMANCE.md states.
        self.checks = 0
        self.seconds = 0.0

    def watch(self, writer: Any) -> None:
        """Read what ``writer`` writes from now on (:meth:`LiveRun.watch`)."""
        self.live.watch(writer)

    def rearm(self) -> None:
        """Watch for a stop again (a new ``fit`` of a callback that stopped one): the history stays, as in the
        logdir, so a status still watched stops at the next check."""
        self.event = None

    def check(self, step: int, origin: Any = None) -> StopEvent | None:
        """Diagnose at the logged step ``step`` when it is due (see :data:`DENSE_CHECKS`; nothing when it has no
        record, or once an event was found); the :class:`StopEvent` when a layer's current status is watched (kept
        in :attr:`event`, with ``origin``: where the first NaN/Inf was made, if known), else ``None``."""
        k = int(np.searchsorted(self.live.steps, step))
        if self.event is not None or k == self.live.steps.size or self.live.steps[k] != step:
            return None
        if self.dense is not None and k < self.next_check and not (self._nonfinite(k) and not self._nonfinite(k - 1)):
            return None
        self.next_check = k + 1 if self.dense is None else k + max(1, k // self.dense)
        start = time.process_time()
        try:
            self.last = self.live.diagnose(self.thresholds, step, origin)
        finally:
            self.checks += 1
            self.seconds += time.process_time() - start
        self.event = stop_event(self.last, self.stop_on, origin)
        return self.event

    def _nonfinite(self, k: int) -> bool:
        """Whether the ``k``-th logged step's records or loss hold a NaN/Inf (the first of a run of such steps is
        checked whenever it comes)."""
        if k < 0:
            return False
        series = self.live.series()
        with np.errstate(invalid="ignore"):
            if np.nansum(record.nonfinite_count(series.records[k])) > 0:
                return True
        loss = self.live.progress().loss
        step = int(series.steps[k])
        return loss is not None and bool(np.any((loss[0] == step) & ~np.isfinite(loss[1])))


class Stoppable:
    """What a writer with ``stop_on`` tells its loop, read from its :class:`StopCheck` (``_stop``: None without
    ``stop_on``): :attr:`stop_event` and :attr:`should_stop`."""

    _stop: StopCheck | None

    @property
    def stop_event(self) -> StopEvent | None:
        """Why ``stop_on`` asks training to stop (None until it does)."""
        return self._stop.event if self._stop is not None else None

    @property
    def should_stop(self) -> bool:
        """Whether ``stop_on`` asks training to stop: the loop reads it after each step."""
        return self.stop_event is not None


def stop_event(h: health.RunHealth, stop_on: Sequence[str], origin: Any = None) -> StopEvent | None:
    """The :class:`StopEvent` of the diagnosis ``h`` (at its step) for the watched statuses ``stop_on``, or ``None``
    when no layer's current status is watched."""
    watched = [lh for lh in h.layers if lh.status in stop_on]  # ranked: the answer first
    if not watched or h.step is None:
        return None
    answer = h.answer
    top = next((lh for lh in watched if answer is not None and lh.layer == answer["layer"]), watched[0])
    return StopEvent(step=int(h.step), layer=top.layer, status=top.status,
                     layers=tuple(lh.layer for lh in sorted(watched, key=lambda lh: lh.index)), origin=origin)
