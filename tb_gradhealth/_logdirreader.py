"""Runs read straight from a logdir's event files (the CLI's source: no server, no TensorFlow): the run
directories found as TensorBoard finds them, each event file's gradient-health values collected by tag (damage
becomes a problem line naming the file and byte offset), then assembled stream by stream.

TensorBoard's ``event_file_loader`` goes through ``tensorboard.compat.tf``, which imports TensorFlow whenever it is
installed, so the TFRecord framing is parsed by :mod:`tb_gradhealth._eventfile` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util

from tb_gradhealth import _storage, metadata
from tb_gradhealth._assembly import RunSeries, TagData, TagPoint, assemble
from tb_gradhealth._eventfile import iter_framed
from tb_gradhealth._streams import run_of, split_streams
from tb_gradhealth.problems import Kind, Problem, any_of_kind


@dataclass
class LogdirData:
    """The series of a logdir's runs (sorted by name) and what went wrong outside any run's records."""

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
    add_summary(event, tags, orphans)
    return True


def add_summary(event: event_pb2.Event, tags: dict[str, TagData], orphans: dict[str, int]) -> None:
    """Add the gradient-health values of one parsed event to ``tags`` (:func:`add_event`, whose rules it holds)."""
    if not event.HasField("summary"):
        return
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
        td.points.append(TagPoint(event.step, event.wall_time, arr))


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
        if runs is not None and run not in runs and not any(run_of(r) == run for r in runs):
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
