"""Where the first NaN/Inf of a run was made: the result of a replay, and how it is stored and read back.

The writers detect the first non-finite gradient exactly, on the device; only then is the step replayed op by op
(:mod:`tb_gradhealth.tf_origin`, :mod:`tb_gradhealth.torch_origin`) to find the first operation whose output is not
finite. The answer is a :class:`NanOrigin`, written as one small tensor summary (a JSON string) under its own tag
and plugin name, so readers without it (and logs without it) are unaffected. This module imports neither
TensorFlow nor torch: the reader, the plugin and the CLI use it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.util import tensor_util

from tb_gradhealth._core import NONFINITE_COLUMNS
from tb_gradhealth._eventfile import EventFile, iter_framed

__all__ = ["NanOrigin", "OriginSearch", "PLUGIN_NAME", "write", "read_event_files", "read_provider",
           "UnsupportedVersion"]

PLUGIN_NAME = "gradhealth_origin"
#: Tags are ``gradhealth_origin/<name>``: outside the ``gradhealth/`` prefix that record readers claim.
_log = logging.getLogger("tb_gradhealth")
TAG_PREFIX = PLUGIN_NAME + "/"
FORMAT_VERSION = 1
#: The end of the name of the event files that hold origins (see :func:`write`).
FILE_SUFFIX = ".nanorigin"
DIRECTIONS = ("forward", "backward")


class UnsupportedVersion(ValueError):
    """An origin written by a newer tb_gradhealth than this one can read."""


@dataclass(frozen=True)
class NanOrigin:
    """The first operation that produced a NaN/Inf in the replay of one training step, or why none was named.

    ``found`` is False when the step could not be replayed or the replay met no non-finite value (``reason`` says
    which). ``op`` is the operation type (``Log``, ``aten::exp``), ``op_name`` its graph or module-qualified name
    when there is one; ``layer`` the Keras layer path or ``nn.Module`` path it ran in (``None``: outside every
    layer, e.g. in the loss); ``direction`` ``forward`` or ``backward`` (its gradient made the value);
    ``input_nonfinite`` the batch inputs that already held NaN/Inf (then ``op`` is the first op that read them);
    ``file``/``line``/``function``/``code`` the first frame of user code that created the operation.
    """

    step: int
    found: bool
    framework: str = ""
    op: str = ""
    op_name: str = ""
    layer: str | None = None
    direction: str = ""
    input_shapes: tuple[tuple[int, ...] | None, ...] = ()
    output_shapes: tuple[tuple[int, ...] | None, ...] = ()
    file: str = ""
    line: int = 0
    function: str = ""
    code: str = ""
    input_nonfinite: tuple[str, ...] = ()
    nonfinite: str = ""
    reason: str = ""
    seconds: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """``file:line`` (base name) of the user code, or ``""``."""
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else ""

    def message(self) -> str:
        """One line for logs, CI output and the tab's headline."""
        if not self.found:
            return f"non-finite gradient at step {self.step}: origin not found ({self.reason})"
        place = f"layer {self.layer!r}" if self.layer else "code outside any layer"
        what = f"{self.op}, {self.direction}"
        if self.input_nonfinite:
            what += f", non-finite input: {', '.join(self.input_nonfinite)}"
        at = f" - {self.where}" if self.where else ""
        code = f" `{self.code}`" if self.code else ""
        return f"NaN/Inf made at step {self.step} in {place} ({what}){at}{code}"

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["input_shapes"] = [None if s is None else list(s) for s in self.input_shapes]
        body["output_shapes"] = [None if s is None else list(s) for s in self.output_shapes]
        body["input_nonfinite"] = list(self.input_nonfinite)
        body["extra"] = dict(self.extra)
        body["where"] = self.where
        body["message"] = self.message()
        return body

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> NanOrigin:
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in body.items() if k in known}
        for key in ("input_shapes", "output_shapes"):
            kw[key] = tuple(None if s is None else tuple(int(d) for d in s) for s in kw.get(key, ()))
        kw["input_nonfinite"] = tuple(str(s) for s in kw.get("input_nonfinite", ()))
        kw["step"], kw["found"] = int(kw["step"]), bool(kw["found"])
        kw["line"] = int(kw.get("line", 0))
        return cls(**kw)


def nonfinite_samples(name: str, values: Any) -> str:
    """``"x (samples 3, 17)"``: which samples (rows of the first axis) of a batch input hold a NaN/Inf."""
    arr = np.asarray(values)
    if arr.ndim == 0:
        return name
    bad = np.flatnonzero(~np.all(np.isfinite(arr.reshape(arr.shape[0], -1)), axis=1))
    shown = ", ".join(str(int(i)) for i in bad[:8]) + (", ..." if bad.size > 8 else "")
    return f"{name} (sample{'s' if bad.size > 1 else ''} {shown})"


def _metadata() -> summary_pb2.SummaryMetadata:
    return summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=json.dumps({"v": FORMAT_VERSION}).encode("utf-8")
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )


def encode(origin: NanOrigin) -> bytes:
    return json.dumps({"v": FORMAT_VERSION, **origin.to_json()}, allow_nan=False, default=str).encode("utf-8")


def decode(data: bytes | str) -> NanOrigin:
    """An origin from its stored JSON; :class:`UnsupportedVersion` for a newer format, ValueError if unreadable."""
    try:
        body = json.loads(data)
        version = int(body["v"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"unreadable NaN origin: {e}") from e
    if version > FORMAT_VERSION:
        raise UnsupportedVersion(f"NaN origin format v{version} is newer than this tb_gradhealth reads "
                                 f"(v{FORMAT_VERSION}): upgrade")
    try:
        return NanOrigin.from_json(body)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"unreadable NaN origin: {e}") from e


def write(logdir: str, origin: NanOrigin, name: str = "gradients") -> str:
    """Append ``origin`` to ``logdir`` as one event (its own small event file); returns the tag."""
    tag = TAG_PREFIX + name
    event = event_pb2.Event(wall_time=time.time(), step=int(origin.step))
    value = event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(np.array(encode(origin),
                                                                                           dtype=object)))
    value.metadata.CopyFrom(_metadata())
    out = EventFile(logdir, filename_suffix=FILE_SUFFIX)
    try:
        out.add_event(event)
    finally:
        out.close()
    return tag


def announce(found: NanOrigin, logdir: str | None, name: str = "gradients") -> NanOrigin:
    """Store ``found`` in ``logdir`` (if given) and log its message: what every finder does with its answer. A
    failure to store costs a warning, never an exception in the training loop."""
    if logdir is not None:
        try:
            write(logdir, found, name)
        except Exception as e:  # noqa: BLE001 - never raise from the training loop because of the record
            _log.warning("tb_gradhealth: could not store the NaN origin: %s", e)
    _log.warning("tb_gradhealth: %s", found.message())
    return found


class OriginSearch:
    """The one NaN-origin protocol: each framework's finder is an ``OriginSearch`` and answers
    :meth:`find` the same way; only :meth:`replay` (how the step is replayed) is its own.

    ``log_dir`` (optional) is the run directory where the answer is stored for TensorBoard and
    ``tb-gradhealth report``; ``name`` the record stream it belongs to.
    """

    def __init__(self, log_dir: str | None = None, name: str = "gradients") -> None:
        self.log_dir = None if log_dir is None else str(log_dir)
        self.name = name
        #: The answer (a :class:`NanOrigin`) once a record held a NaN/Inf; None before.
        self.origin: NanOrigin | None = None

    def find(self, step: int, counts: Any, *, log_dir: str | None = None, **inputs: Any) -> NanOrigin | None:
        """After step ``step``, whose record's counts are ``counts`` (memory-form rows, or device counts
        ``[L, 5]``: the count columns are the same): the first time they hold a NaN/Inf, the step is replayed
        (:meth:`replay` with ``inputs``, what the framework's replay needs) and the answer kept in
        :attr:`origin`, stored in the finder's ``log_dir`` (else the ``log_dir`` given here) and returned;
        otherwise None."""
        if self.origin is not None:
            return None
        if not np.any(np.asarray(counts)[:, NONFINITE_COLUMNS] > 0):
            self.finite(step)
            return None
        found = self.replay(int(step), **inputs)
        self.origin = found
        announce(found, self.log_dir or log_dir, self.name)
        return found

    def replay(self, step: int, **inputs: Any) -> NanOrigin:
        """The answer for step ``step``, whose record holds a NaN/Inf (found or not, with the reason)."""
        raise NotImplementedError

    def finite(self, step: int) -> None:
        """What a finder does with a record of step ``step`` that holds no NaN/Inf (by default nothing)."""


def _decode_value(value: Any, problems: list[str], where: str) -> NanOrigin | None:
    try:
        raw = value.item() if isinstance(value, np.ndarray) else value
        return decode(raw)
    except ValueError as e:
        problems.append(f"{where}: {e}")
        return None


def read_event_files(paths: Sequence[str], problems: list[str] | None = None,
                     storage_options: Mapping[str, Any] | None = None) -> list[NanOrigin]:
    """The origins stored in a run's event files, by step (damage and newer formats go to ``problems``)."""
    problems = [] if problems is None else problems
    out = []
    for path in paths:
        for _, payload in iter_framed(path, problems, storage_options):
            try:
                event = event_pb2.Event.FromString(payload)
            except Exception:  # noqa: BLE001 - damaged events are the record reader's to report
                continue
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name != PLUGIN_NAME and not value.tag.startswith(TAG_PREFIX):
                    continue
                found = _decode_value(tensor_util.make_ndarray(value.tensor), problems, f"{path}: {value.tag}")
                if found is not None:
                    out.append(found)
    return sorted(out, key=lambda o: o.step)


def read_provider(data_provider: Any, ctx: Any, experiment_id: str, run: str,
                  problems: list[str] | None = None) -> list[NanOrigin]:
    """The origins of ``run`` through TensorBoard's data provider, by step."""
    problems = [] if problems is None else problems
    listing = data_provider.list_tensors(ctx, experiment_id=experiment_id, plugin_name=PLUGIN_NAME,
                                         run_tag_filter=_run_filter(run))
    tags = sorted((listing or {}).get(run, {}))
    if not tags:
        return []
    data = data_provider.read_tensors(ctx, experiment_id=experiment_id, plugin_name=PLUGIN_NAME,
                                      run_tag_filter=_run_filter(run, tags), downsample=1000)
    out = []
    for tag, points in (data or {}).get(run, {}).items():
        for p in points:
            found = _decode_value(p.numpy, problems, f"run {run!r}: {tag}")
            if found is not None:
                out.append(found)
    return sorted(out, key=lambda o: o.step)


def _run_filter(run: str, tags: Iterable[str] | None = None) -> Any:
    from tensorboard.data import provider

    return provider.RunTagFilter(runs=[run], tags=None if tags is None else list(tags))


def read_logdir(logdir: str, runs: Iterable[str] | None = None, problems: list[str] | None = None,
                storage_options: Mapping[str, Any] | None = None) -> dict[str, NanOrigin]:
    """The earliest origin of each run directory of ``logdir`` that holds one (only ``runs`` when given). Only the
    event files :func:`write` makes (``*.nanorigin``, with a sequence number on object storage) are read, so a
    report does not read a run's records twice."""
    from tb_gradhealth import reader

    wanted = None if runs is None else set(runs)
    out = {}
    for run, paths in reader.find_runs(logdir, storage_options).items():
        if wanted is not None and run not in wanted:
            continue
        ours = [p for p in paths if FILE_SUFFIX in os.path.basename(p)]
        found = first(read_event_files(ours, problems, storage_options))
        if found is not None:
            out[run] = found
    return out


def first(origins: Sequence[NanOrigin]) -> NanOrigin | None:
    """The earliest origin (the one a run's headline names), or None."""
    return min(origins, key=lambda o: o.step) if origins else None
