"""The assembly of gradient-health records into one :class:`RunSeries` per run, shared by every source (a
TensorBoard data provider, a logdir's event files, the plugin's incremental file reader): the tags' points checked
(damage becomes a problem line, never an exception), TensorBoard's restart rule applied, the layers of all tags
merged in network order and the records decoded into memory form.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tb_gradhealth import metadata, record
from tb_gradhealth.problems import Kind, Problem

_GENERATIONS = itertools.count(1)


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
    #: What the writer knew of the training loop (:attr:`tb_gradhealth.metadata.Content.source`), else empty.
    source: Mapping[str, str] = field(default_factory=dict)
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


class TagPoint(NamedTuple):
    """One value of a tag as a source read it: the step, the event's wall time, the disk tensor (or the string
    saying why it could not be decoded, reported by :func:`assemble`)."""

    step: int
    wall_time: float
    tensor: Any


@dataclass
class TagData:
    """What a source found for one tag: its metadata content and its points (:class:`TagPoint`)."""

    tag: str
    content: bytes
    points: list[TagPoint] = field(default_factory=list)


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


def supersede(points: Sequence[Sequence[Any]]) -> tuple[list[TagPoint], list[int]]:
    """TensorBoard's rule for steps that go back (a job restarted from a checkpoint), applied to one tag's points in
    the order they were written: a point at step ``s`` drops every earlier point of the tag at a step ``>= s``.
    Returns the kept points (steps strictly increasing) and the steps where a restart dropped points. The points
    are :class:`TagPoint` values, or plain ``(step, wall_time, tensor)`` sequences.

    This is what TensorBoard's default data server does for every time series; its Python loader
    (``--load_fast=false``) keeps both and the plugin applies the rule to what it returns, so the tab and the CLI
    show one history whatever the loader.
    """
    kept: list[TagPoint] = []
    restarts: list[int] = []
    for p in map(_as_point, points):
        if kept and kept[-1].step >= p.step:
            restarts.append(int(p.step))
            while kept and kept[-1].step >= p.step:
                kept.pop()
        kept.append(p)
    return kept, restarts


def _as_point(p: Sequence[Any]) -> TagPoint:
    """A :class:`TagPoint` of a point given as one, or as a plain ``(step, wall_time, tensor)`` sequence."""
    return p if isinstance(p, TagPoint) else TagPoint(*p)


#: Events checked together (stacked) by :func:`_check_points`: one vectorised check per chunk, bounded memory.
CHECK_CHUNK = 256


class _Checked(NamedTuple):
    """A point of a tag whose tensor passed the checks as a whole, and which of its rows did."""

    step: int
    wall_time: float
    tensor: np.ndarray  # float32 [L, C], still in disk form (several times smaller than decoded)
    ok: np.ndarray  # [L] bool: rows that passed the row checks


def _check_points(td: TagData, n_layers: int, problems: list[str]) -> list[_Checked]:
    """Each readable point of a tag, checked, not yet decoded; a damaged tensor or row is skipped and counted in
    one problem line per tag."""
    out = []
    bad_tensors, first_tensor = 0, None
    for p in td.points:
        try:
            t = _check_tensor(p.tensor, n_layers)
        except (ValueError, TypeError) as e:
            bad_tensors += 1
            first_tensor = first_tensor or f"step {p.step}: {e}"
            continue
        out.append(_Checked(int(p.step), float(p.wall_time), t, np.ones(n_layers, dtype=bool)))
    if bad_tensors:
        problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: {bad_tensors} unreadable record tensor(s) skipped, "
                                              f"first at {first_tensor}"))
    damaged = _damaged_rows(out, n_layers)
    for i, row, _ in damaged:
        out[i].ok[row] = False
    if damaged:
        i, row, why = min(damaged)
        problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: {len(damaged)} damaged record row(s) skipped, first "
                                              f"at step {out[i].step} row {row}: {why}"))
    return out


def _damaged_rows(points: list[_Checked], n_layers: int) -> list[tuple[int, int, str]]:
    """``(point index, row, reason)`` of every row that fails :func:`record.check_disk`, checked stacked per
    histogram width (points of one width share a column layout) in chunks of :data:`CHECK_CHUNK`."""
    by_width: dict[int, list[int]] = {}
    for i, p in enumerate(points):
        by_width.setdefault(p.tensor.shape[1], []).append(i)
    damaged: list[tuple[int, int, str]] = []
    for idx in by_width.values():
        for start in range(0, len(idx), CHECK_CHUNK):
            chunk = idx[start : start + CHECK_CHUNK]
            stacked = points[chunk[0]].tensor if len(chunk) == 1 else np.concatenate([points[i].tensor
                                                                                        for i in chunk])
            for flat, why in record.check_disk(stacked, n_layers)[1].items():
                damaged.append((chunk[flat // n_layers], flat % n_layers, why))
    return damaged


class _Tag(NamedTuple):
    """A tag whose metadata decodes, and the layers it names."""

    data: TagData
    layers: tuple[str, ...]


def _block_base(tag: str) -> str:
    """The tag of every step that a step-block tag (:func:`metadata.tag_for`) is a block of; any other tag itself."""
    return tag if metadata.tag_block(tag) is None else tag.rpartition(".")[0]


def _joined(tag_layers: Iterable[tuple[str, tuple[str, ...]]]) -> dict[tuple[str, tuple[str, ...]], list[str]]:
    """``{(base tag, layers): [tags]}``: the step-block tags of one layer list, grouped."""
    joined: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for tag, lay in tag_layers:
        joined.setdefault((_block_base(tag), lay), []).append(tag)
    return joined


def layer_order(tag_layers: Mapping[str, Sequence[str]]) -> list[str]:
    """A run's layers in network order from its tags' layer lists ``{tag: layers}``, as :func:`assemble` orders
    them: the step-block tags of one layer list count as one tag, the tag with the most layers is the backbone of
    the order and the others' new layers go in around it (:func:`_merge_order`)."""
    named = [(tags[0] if len(tags) == 1 else base, lay)
             for (base, lay), tags in _joined((t, tuple(lay)) for t, lay in tag_layers.items()).items()]
    return _merge_order([lay for _, lay in sorted(named, key=lambda t: (-len(t[1]), t[0]))])


def _join_blocks(good: list[_Tag]) -> list[_Tag]:
    """The step-block tags of one layer list (:func:`metadata.tag_for`) as one tag, their points in write order
    (wall time), so that the restart rule (:func:`supersede`) applies across blocks as to a tag of every step: a
    job restarted at step 50 replaces the earlier records from step 50 on, in whichever block they are."""
    by_tag = {t.data.tag: t.data for t in good}
    out = []
    for (base, lay), names in _joined((t.data.tag, t.layers) for t in good).items():
        tds = [by_tag[n] for n in names]
        if len(tds) == 1:
            out.append(_Tag(tds[0], lay))
            continue
        points = sorted((_as_point(p) for td in tds for p in td.points), key=lambda p: float(p.wall_time))
        out.append(_Tag(TagData(base, tds[0].content, points), lay))
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
    good, info, source = _readable_tags(tags, problems)
    tag_names = tuple(t.data.tag for t in good)
    layers = layer_order({t.data.tag: t.layers for t in good})
    good = _join_blocks(good)
    valid, downsampled = _checked_points(good, layers, problems, notes, sample_limit)
    if consume:  # from here on only ``valid`` holds the tensors
        for td in [*tags, *(t.data for t in good)]:
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
        source=source,
    )


def _readable_tags(tags: Sequence[TagData], problems: list[str]
                   ) -> tuple[list[_Tag], dict[str, tuple[str, str]], dict[str, str]]:
    """The :class:`_Tag` of each tag whose metadata decodes, by name (the others are problems), the layers'
    kinds and activations where a tag's metadata has them, and what the writers said of the training loop (the
    last tag by name that says it wins, key by key)."""
    good, info, source = [], {}, {}
    for td in sorted(tags, key=lambda t: t.tag):
        try:
            content = metadata.decode_content(td.content)
        except ValueError as e:  # including metadata.UnsupportedVersion (a future format version)
            problems.append(Problem(Kind.RECORDS, f"tag {td.tag}: skipped: {e}"))
            continue
        good.append(_Tag(td, content.layers))
        info.update(zip(content.layers, content.layer_info, strict=False))  # () without info
        source.update(content.source)
    return good, info, source


class _Point(NamedTuple):
    """A checked record tensor of a tag, not yet decoded."""

    wall_time: float
    order: int  # read order: the tie-break between equal wall times
    step: int
    cols: np.ndarray  # the run's column of each of the tag's layers
    tensor: np.ndarray
    ok: np.ndarray  # [rows] bool: rows that passed the checks


def _checked_points(good: list[_Tag], layers: list[str], problems: list[str],
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
        for c in _check_points(TagData(td.tag, td.content, points), len(tag_layers), problems):
            if c.ok.any():
                valid.append(_Point(c.wall_time, len(valid), c.step, cols, c.tensor, c.ok))
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
        v = valid.pop()
        cols, t, ok = v.cols, v.tensor, v.ok
        s = int(np.searchsorted(steps, v.step))
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
