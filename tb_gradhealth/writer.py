"""A TensorFlow-free writer of gradient-health summaries (for PyTorch, JAX or numpy training loops).

It computes records with :func:`tb_gradhealth.record.compute` (the float64 reference, so it agrees with the TF
path field for field) and writes them with TensorBoard's protos, so the event files hold what
``tf.summary.write`` would produce: one event per (tag, step) holding the float32 disk tensor of all
layers of that call (see docs/FORMAT.md for why one packed tag rather than one tag per layer).

It imports numpy and tensorboard's protos only, and writes the files itself (:mod:`tb_gradhealth._eventfile`):
TensorBoard's ``EventFileWriter`` would import TensorFlow whenever it is installed.

TensorBoard keeps the first ``SummaryMetadata`` it sees for a tag and ignores the rest, so the (layer-list)
metadata is attached only to the first event of each tag in each event file, which saves ~5 bytes a layer on
every later event.

Example (PyTorch)::

    with Writer("logs/run1") as w:
        for step, batch in enumerate(loader):
            loss = model(batch); loss.backward()
            w.add_gradients(step, {n: p.grad.detach().cpu().numpy() if p.grad is not None else None
                                   for n, p in model.named_parameters()},
                            weights={n: p.detach().cpu().numpy() for n, p in model.named_parameters()})
            w.add_scalars(step, {"loss": loss.item()})
            opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

from tb_gradhealth import metadata, progress, record
from tb_gradhealth._eventfile import EventFile

__all__ = ["Writer", "make_event"]

_log = logging.getLogger("tb_gradhealth")


def make_event(
    step: int,
    tag: str,
    tensor: np.ndarray,
    summary_metadata: summary_pb2.SummaryMetadata | None,
    wall_time: float | None = None,
) -> event_pb2.Event:
    """One ``Event`` holding one tensor summary value (what ``tf.summary.write`` emits)."""
    event = event_pb2.Event(wall_time=time.time() if wall_time is None else wall_time, step=int(step))
    value = event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(tensor))
    if summary_metadata is not None:
        value.metadata.CopyFrom(summary_metadata)
    return event


def check_step(step: Any, last: int | None = None, what: str = "step") -> int:
    """``step`` as an int: an integer (Python or numpy, not bool) ``>= 0`` and ``>= last``; TypeError/ValueError
    naming ``what`` otherwise (a float step would be truncated, a decreasing one read as a restart)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {type(step).__name__} {step!r}")
    step = int(step)
    if step < 0:
        raise ValueError(f"{what} must be >= 0, got {step}")
    if last is not None and step < last:
        raise ValueError(f"{what} {step} is below the step {last} this writer already wrote for the same tag: steps "
                         f"that go back read as a restart that replaces the later ones (use a new Writer after a "
                         f"restart)")
    return step


def _check_array(value: Any, what: str) -> np.ndarray:
    """``value`` as a real numeric array, else TypeError naming ``what`` (complex values would lose their imaginary
    part, objects and strings would become NaN or fail later)."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{what}: expected a real float or integer array, got dtype {arr.dtype}")
    return arr


def _check_counts(layers: Sequence[str], rows: np.ndarray) -> None:
    """ValueError naming the first layer whose counts are not non-negative integers (they could not be encoded)."""
    counts = rows[:, : record.NUM_COUNTS]
    bad = ~np.all(np.isfinite(counts) & (counts >= 0) & (counts == np.round(counts)), axis=1)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"layer {layers[j]!r}: counts must be non-negative integers, got {counts[j].tolist()}")


def _names(keys: Any, what: str) -> list[str]:
    """Layer or tag names: strings only (``None`` or a number would be written as ``"None"``), TypeError naming
    ``what`` otherwise."""
    names = list(keys)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"{what}: names must be non-empty strings, got {bad[0]!r}")
    return names


class Writer:
    """Writes gradient-health records (and plain scalars) to an event file in ``logdir``, without TensorFlow.

    ``logdir`` is a local path or a ``gs://``, ``s3://`` or other fsspec URL (:mod:`tb_gradhealth._storage`;
    ``storage_options`` go to the fsspec filesystem). Records are visible to readers at most ``flush_secs`` after
    they were added (or at :meth:`flush` / :meth:`close`); on object storage each flush writes one new object, so
    nothing flushed is lost if the process is killed.

    ``hist_sample`` bounds the histogram work per tensor exactly as in the TF path (``None``/0: always exact);
    ``seed`` makes the sampling reproducible. Not thread-safe (like ``tf.summary`` writers).

    Input is checked before anything is written: layer names must be strings, gradients real numeric arrays (or
    ``None``), weights and updates keyed by known layers with their gradient's shape, steps integers that do not go
    below the last step written for the same tag; a wrong input is a TypeError or ValueError naming the layer or
    argument, and nothing of that call is written. What is recorded never raises: a record that fails the
    readers' checks is written with a warning (the readers report it as damaged), and a logdir that cannot be
    written for now (a full disk, an object store that is down) costs a warning and :attr:`dropped_records`, while
    writing resumes by itself when the fault clears. A local ``logdir`` that can never be written (a parent that
    is a file, permission denied) raises ``NotADirectoryError``/``PermissionError`` naming it, here, before any
    training; ``strict=True`` makes every failed write raise :class:`tb_gradhealth._storage.StrictWriteError`.

    ``source``: what the writer knows of the training loop, kept in the tags' metadata for the diagnosis
    (:attr:`tb_gradhealth.metadata.Content.source`: ``loop``, ``optimizer``, ``momentum``); by default
    ``{"loop": "numpy"}``, the user's own loop calling this writer. The package's writers name theirs.
    """

    def __init__(
        self,
        logdir: str,
        *,
        hist_sample: int | None = record.DEFAULT_HIST_SAMPLE,
        seed: int | None = None,
        max_queue: int = 32,
        flush_secs: float = 120,
        filename_suffix: str = "",
        storage_options: Mapping[str, Any] | None = None,
        strict: bool = False,
        source: Mapping[str, str] | None = None,
    ) -> None:
        self.source = metadata.check_source({"loop": "numpy", **(source or {})})
        self._observers: list[Callable[[event_pb2.Event], None]] = []
        self._writer = EventFile(
            os.fspath(logdir), max_queue=max_queue, flush_secs=flush_secs, filename_suffix=filename_suffix,
            storage_options=storage_options, strict=strict,
        )
        self.hist_sample = hist_sample
        self._rng = np.random.default_rng(seed)
        self._tags_with_metadata: set[str] = set()
        self._last_step: dict[str, int] = {}
        self._warned: set[tuple[str, str]] = set()
        self._closed = False

    @property
    def logdir(self) -> str:
        return self._writer.logdir

    @property
    def dropped_records(self) -> int:
        """Events (one step's records of one call each) dropped because the logdir could not be written for
        longer than the queue could hold them (see :class:`tb_gradhealth._eventfile.EventFile`)."""
        return self._writer.dropped_events

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("tb_gradhealth.Writer is closed")

    def observe(self, observer: Callable[[event_pb2.Event], None]) -> None:
        """Hand ``observer`` every event this writer writes from now on, as it goes to the event file (metadata on a
        tag's first event only, values in their disk form): what a reader of the file will read, known at once (a
        live run's diagnosis, :mod:`tb_gradhealth.live`). It must not change the event; what it raises reaches the
        caller of the write, after the event was queued."""
        self._observers.append(observer)

    def _emit(self, event: event_pb2.Event) -> None:
        self._writer.add_event(event)
        for observer in self._observers:
            observer(event)

    def add_gradients(
        self,
        step: int,
        grads: Mapping[str, np.ndarray | None],
        weights: Mapping[str, np.ndarray] | None = None,
        updates: Mapping[str, np.ndarray] | None = None,
        *,
        name: str = "gradients",
        wall_time: float | None = None,
    ) -> str:
        """Record ``{layer: gradient}`` (``None`` = no gradient reached it: recorded as missing) at ``step``.

        Layers are rows in the dict's order, which should be the network's forward order. ``weights`` and
        ``updates`` (same keys, any subset) add the optional weight / applied-update norms. Returns the tag.
        """
        self._check_open()
        layers = _names(grads, "grads")
        weights = dict(weights or {})
        updates = dict(updates or {})
        arrays: dict[str, np.ndarray | None] = {}
        for n in layers:
            arrays[n] = None if grads[n] is None else _check_array(grads[n], f"gradient of layer {n!r}")
        for what, extra in (("weights", weights), ("updates", updates)):
            unknown = [k for k in extra if k not in grads]
            if unknown:
                raise ValueError(f"{what}: no gradient given for {', '.join(map(repr, unknown))}")
            for n, v in extra.items():
                arr = _check_array(v, f"{what[:-1]} of layer {n!r}")
                g = arrays[n]
                if g is not None and arr.shape != g.shape:
                    raise ValueError(f"{what[:-1]} of layer {n!r}: shape {arr.shape} differs from its gradient's "
                                     f"{g.shape}")
                extra[n] = arr
        check_step(step, self._last_step.get(metadata.tag_for(layers, name)))
        rows = np.stack(
            [
                record.compute(arrays[n], weights.get(n), updates.get(n), hist_sample=self.hist_sample, rng=self._rng)
                for n in layers
            ]
        ) if layers else record.empty((0,))
        return self.add_records(step, layers, rows, name=name, wall_time=wall_time)

    def add_records(
        self,
        step: int,
        layers: Sequence[str],
        mem_rows: np.ndarray,
        *,
        name: str = "gradients",
        kind: str = "gradients",
        wall_time: float | None = None,
        layer_info: Sequence[tuple[str, str]] = (),
        source: Mapping[str, str] | None = None,
    ) -> str:
        """Write already-computed records (memory form ``[L, NUM_FIELDS]``, rows = ``layers``). Returns the tag.
        ``layer_info``: per row, ``(layer kind, activation)`` where known, kept in the tag's metadata; ``source``:
        what the caller knows of the training loop, kept there too (default: the writer's :attr:`source`)."""
        self._check_open()
        layers = _names(layers, "layers")
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty string, got {name!r}")
        rows = _check_array(mem_rows, "mem_rows").astype(np.float64)
        if rows.shape != (len(layers), record.NUM_FIELDS):
            raise ValueError(f"expected records of shape [{len(layers)}, {record.NUM_FIELDS}], got {rows.shape}")
        if len(set(layers)) != len(layers):
            raise ValueError("layer names must be unique")
        _check_counts(layers, rows)
        about = self.source if source is None else metadata.check_source(source)
        base = metadata.tag_for(layers, name)
        self._last_step[base] = step = check_step(step, self._last_step.get(base))
        disk = record.to_disk(rows)
        self._warn_inconsistent(base, layers, step, disk)
        tag = metadata.tag_for(layers, name, step)
        md = None
        if tag not in self._tags_with_metadata:
            info = tuple((str(k), str(a)) for k, a in layer_info) if len(layer_info) == len(layers) else ()
            md = metadata.create_summary_metadata(layers, kind=kind, hist_sample=self.hist_sample or 0,
                                                  layer_info=info, source=about)
            self._tags_with_metadata.add(tag)
        self._emit(make_event(step, tag, disk, md, wall_time))
        return tag

    def _warn_inconsistent(self, base: str, layers: Sequence[str], step: int, disk: np.ndarray) -> None:
        """Warn, once per layer, about rows that fail the readers' checks (:func:`record.check_disk`).

        Such a row is still written: the readers report it as damaged, with its reason, where the user looks, and
        the rows of the other layers and steps are kept. Raising here would end the training that produced it.
        """
        _, reasons = record.check_disk(disk)
        for j, why in sorted(reasons.items()):
            if (base, layers[j]) not in self._warned:
                self._warned.add((base, layers[j]))
                _log.warning("tb_gradhealth: the record of layer %r at step %d is not consistent (%s); it is written "
                             "and the readers will report it as damaged", layers[j], step, why)

    def add_scalars(self, step: int, scalars: Mapping[str, float], *, wall_time: float | None = None) -> None:
        """Standard TensorBoard scalars (loss, learning rate, ...) shown in the Scalars tab, one event per call."""
        self._check_open()
        checked = {tag: check_step(step, self._last_step.get(tag)) for tag in _names(scalars, "scalars")}
        values = {tag: float(v) for tag, v in scalars.items()}  # TypeError/ValueError before anything is written
        self._last_step.update(checked)
        event = event_pb2.Event(wall_time=time.time() if wall_time is None else wall_time, step=int(step))
        for tag, v in values.items():
            value = event.summary.value.add(
                tag=str(tag), tensor=tensor_util.make_tensor_proto(np.float32(v))
            )
            if tag not in self._tags_with_metadata:
                md = scalar_metadata.create_summary_metadata(display_name=str(tag), description="")
                md.data_class = summary_pb2.DATA_CLASS_SCALAR
                value.metadata.CopyFrom(md)
                self._tags_with_metadata.add(str(tag))
        self._emit(event)

    def add_loss(self, step: int, loss: Any, *, wall_time: float | None = None) -> None:
        """The training loss at ``step`` (a float, or anything ``float()`` reads: a numpy or one-element framework
        tensor, read here), as :data:`tb_gradhealth.progress.LOSS_TAG`: the diagnosis weighs it beside the
        gradients (a flat loss while layers barely learn is flagged; a falling one is evidence against a slow
        status). Every writer of this package records its loss through this method, often from inside a training
        step: a loss that is not a number (a string, ``None``, a tensor of many elements) is not written, with one
        warning per kind of value, rather than raised."""
        value, why = None, "a string"
        if not isinstance(loss, (str, bytes)):
            try:
                value = float(loss)
            except (TypeError, ValueError) as e:
                why = str(e)
        if value is None:
            kind = type(loss).__name__
            if ("loss", kind) not in self._warned:
                self._warned.add(("loss", kind))
                _log.warning("tb_gradhealth: a loss of type %s at step %s is not a number (%s); it is not written",
                             kind, step, why)
            return
        self.add_scalars(step, {progress.LOSS_TAG: value}, wall_time=wall_time)

    def flush(self) -> bool:
        """Write everything queued so far now; whether all of it is written (when the logdir cannot be written, the
        records stay queued and a warning says so: see the class docstring)."""
        self._check_open()
        return self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (idempotent)."""
        if not self._closed:
            self._writer.close()
            self._closed = True

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
