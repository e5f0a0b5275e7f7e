"""The record streams of a run directory and the series names they get: one place that writes a series name
``"<run> [<stream>]"`` and one that reads it back.

A writer's ``name=`` (``gradients`` by default) is the stream of its tags (``gradhealth/<name>/<hash8>``, and
``gradhealth/<name>/activations/<hash8>`` for its forward records). A run
directory with one stream is one series named as the directory; with several, the ``gradients`` stream (else the
first by name) keeps the directory's name and every other stream is a series of its own, ``"<run> [<stream>]"``
(e.g. Keras' ``probe_gradients`` on a fixed batch: another measurement, never mixed with the training's).
"""

from __future__ import annotations

from collections.abc import Iterable

from tb_gradhealth import metadata, record

PRIMARY_STREAM = "gradients"


def stream_of(tag: str) -> str:
    """The record stream of a tag: ``<name>`` of ``gradhealth/<name>/<hash8>`` (the writers' ``name=``), and of
    ``gradhealth/<name>/activations/<hash8>``, the same stream's forward records."""
    body = tag[len(metadata.TAG_PREFIX) :] if tag.startswith(metadata.TAG_PREFIX) else tag
    name, sep, _digest = body.rpartition("/")
    head, slash, last = name.rpartition("/")
    if slash and head and last == record.ACTIVATIONS:
        return head
    return name if sep and name else body


def series_name(run: str, stream: str | None) -> str:
    """The series name of ``stream`` of the run directory ``run`` (``None``: the run's primary stream)."""
    return run if stream is None else f"{run} [{stream}]"


def parse_series(name: str) -> tuple[str, str | None]:
    """``(run directory, stream)`` of a series name: ``"<run> [<stream>]"``, or a run's own name (stream
    ``None``). The last bracket is the stream's, so a directory whose name has brackets keeps them in a stream's
    name; the primary series of a directory whose own name ends in ``" [...]"`` reads as a stream of a shorter
    name (the names cannot tell), which is why a reader of run directories tries ``name`` itself first."""
    head, sep, tail = name.rpartition(" [")
    if sep and head and tail.endswith("]"):
        return head, tail[:-1]
    return name, None


def run_of(name: str) -> str:
    """The run directory of the series ``name`` (its other streams share it)."""
    return parse_series(name)[0]


def split_streams(run: str, tags: Iterable[str]) -> dict[str, list[str]]:
    """``{series name: [tags]}`` for one run directory.

    Tags of one stream (same writer ``name``, different layer sets) are one series, merged by layer name. Different
    streams are different measurements and must not be mixed: a run with one stream keeps its name; with several,
    the ``gradients`` stream (else the first by name) keeps it and every other stream is its own series named
    ``"<run> [<stream>]"`` (:func:`series_name`).
    """
    by_stream: dict[str, list[str]] = {}
    for tag in sorted(tags):
        by_stream.setdefault(stream_of(tag), []).append(tag)
    if not by_stream:
        return {}
    if len(by_stream) == 1:
        return {run: next(iter(by_stream.values()))}
    primary = PRIMARY_STREAM if PRIMARY_STREAM in by_stream else min(by_stream)
    return {series_name(run, None if name == primary else name): tags for name, tags in sorted(by_stream.items())}
