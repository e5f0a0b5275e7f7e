"""TFRecord framing of TensorBoard event files, read and written without TensorFlow.

TensorBoard's own ``EventFileWriter`` and ``event_file_loader`` reach the file system through
``tensorboard.compat.tf``, which imports TensorFlow whenever it is installed (2+ s, and a TF dependency the
numpy/PyTorch writer and the CLI must not have). The framing is small, so both directions live here:

    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

CRC32C comes from ``google_crc32c`` (C, a dependency of the package), else TensorBoard's pure-Python version (slow:
the reader checks every record's data checksum).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2

from tb_gradhealth import _storage
from tb_gradhealth.problems import Kind, Problem

try:  # C implementation (a dependency; the fallback keeps a broken install readable)
    import google_crc32c

    def _crc32c(data: bytes) -> int:
        return google_crc32c.value(data)

except ImportError:  # pragma: no cover - depends on the environment
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as _tb_crc32c

    def _crc32c(data: bytes) -> int:
        return _tb_crc32c(data)

_MASK_DELTA = 0xA282EAD8
_log = logging.getLogger("tb_gradhealth")


def masked_crc32c(data: bytes) -> int:
    """The TFRecord checksum: CRC32C rotated right by 15 bits plus a constant."""
    x = _crc32c(data)
    return (((x >> 15) | (x << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """One TFRecord around ``data``."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def iter_records(path: str, problems: list[str], storage_options: Mapping[str, Any] | None = None
                 ) -> Iterable[bytes]:
    """The TFRecord payloads of an event file whose data checksums match (see :func:`iter_framed`)."""
    for _, payload in iter_framed(path, problems, storage_options):
        yield payload


@dataclass
class ScanEnd:
    """Where :func:`scan_framed` stopped: ``end``, the byte offset just past the last whole record, and ``stop``:
    None at a record boundary, ``"partial"`` in a partial record (truncated, or still being written), ``"corrupt"``
    at a record header whose length checksum fails (the framing cannot be trusted past it)."""

    end: int = 0
    stop: str | None = None


def scan_framed(data: bytes, base: int, path: str, problems: list[str], where: ScanEnd
                ) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, payload)`` of each whole TFRecord in ``data`` (the file's bytes from offset ``base``) whose
    data checksum matches; a record failing it is skipped with a problem naming the file and offset. ``where``
    is updated as records are read, so a reader can resume at ``where.end`` when more bytes arrive."""
    pos, n = 0, len(data)
    where.end, where.stop = base, None
    while pos < n:
        if n - pos < 12:
            where.stop = "partial"
            return
        (length,) = struct.unpack_from("<Q", data, pos)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        if masked_crc32c(data[pos : pos + 8]) != length_crc:
            where.stop = "corrupt"
            return
        end = pos + 12 + length + 4
        if end > n:
            where.stop = "partial"
            return
        payload = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, end - 4)
        pos = end
        where.end = base + end
        if masked_crc32c(payload) != data_crc:
            problems.append(Problem(Kind.FILE, f"{path}: record at byte {base + end - 16 - length} fails its data "
                                             f"checksum (damaged); skipped"))
        else:
            yield base + end - 16 - length, payload


def stop_problem(path: str, where: ScanEnd) -> Problem | None:
    """The problem line for where a scan stopped early (None when it read to a record boundary)."""
    if where.stop == "partial":
        return Problem(Kind.PARTIAL, f"{path}: ends in a partial record at byte {where.end} (truncated, or still "
                                     f"being written)")
    if where.stop == "corrupt":
        return Problem(Kind.FILE, f"{path}: corrupt record header at byte {where.end}; the rest of the file is skipped")
    return None


def iter_framed(path: str, problems: list[str], storage_options: Mapping[str, Any] | None = None
                ) -> Iterable[tuple[int, bytes]]:
    """``(byte offset, payload)`` of each TFRecord of an event file whose data checksum matches.

    A record whose data checksum does not match is skipped with a problem naming the file and its byte offset, and
    reading goes on with the next record (its length was checked, so the framing still holds). A bad length checksum
    or a partial last record ends the file with a problem: the framing cannot be trusted past it. (TensorBoard's
    loaders verify data checksums only of records that fail to parse, so a flipped byte that still parses reaches
    the tab; the reader's row checks, :func:`tb_gradhealth.record.check_disk`, catch most of those.)"""
    try:
        data = _storage.read_bytes(path, storage_options)
    except OSError as e:
        problems.append(Problem(Kind.FILE, f"{path}: unreadable: {e}"))
        return
    where = ScanEnd()
    yield from scan_framed(data, 0, path, problems, where)
    line = stop_problem(path, where)
    if line:
        problems.append(line)


#: While writing fails, events wait in memory up to this many bytes; beyond it the oldest are dropped (counted).
MAX_PENDING_BYTES = 64 << 20
#: After a failed write, the next try waits this long, doubling up to ``flush_secs`` (an object store that is down
#: must not cost a timeout per training step).
FIRST_RETRY_SECS = 1.0


class _Outage:
    """The state of a write fault: since when, how many tries failed, when to try again, events dropped so far.

    One warning when writing starts to fail and one when it resumes (with what was lost), not one per try.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.failing = False
        self.failures = 0
        self.dropped = 0
        self._wait = FIRST_RETRY_SECS
        self._next_try = 0.0

    def may_try(self) -> bool:
        return not self.failing or time.monotonic() >= self._next_try

    def failed(self, error: BaseException, max_wait: float) -> None:
        self.failures += 1
        if not self.failing:
            self.failing = True
            self._wait = FIRST_RETRY_SECS
            _log.warning("tb_gradhealth: cannot write to %s (%s: %s); events are kept in memory (up to %d MB) and "
                         "written when it works again; training goes on", self.where, type(error).__name__, error,
                         MAX_PENDING_BYTES >> 20)
        else:
            self._wait = min(self._wait * 2, max(max_wait, FIRST_RETRY_SECS))
        self._next_try = time.monotonic() + self._wait

    def succeeded(self) -> None:
        if self.failing:
            lost = f"; {self.dropped} events dropped while it failed" if self.dropped else ""
            _log.warning("tb_gradhealth: writing to %s works again after %d failed tries%s", self.where,
                         self.failures, lost)
        self.failing = False


class EventFile:
    """An append-only event file named as TensorFlow names them, so TensorBoard orders and reads it as usual.

    Events are buffered and written on :meth:`flush` (also when ``max_queue`` events are pending, and by a
    background thread every ``flush_secs`` while events are pending), so a reader sees whole records only, at most
    ``flush_secs`` after they were added.

    On object storage (``gs://``, ``s3://``, any fsspec URL: :mod:`tb_gradhealth._storage`) nothing can be appended
    to an object, so each flush writes one new object ``<file name>.<8-digit sequence number>``: an object is
    written whole or not at all, so everything flushed survives a killed process, and the names sort in write
    order, as TensorBoard reads a run's event files.

    Writing never raises for where it writes (a full disk, a directory that cannot be made, an object store that
    is down): the events stay queued (up to :data:`MAX_PENDING_BYTES`, then the oldest are dropped and counted in
    :attr:`dropped_events`), one warning says so, and writing resumes by itself when the fault clears. A local
    write that fails halfway is cut back to the last whole record, so the file never holds a torn one. Only a path
    that is not a path (a malformed URL, a missing fsspec backend) raises, at construction, as does a local logdir
    that can never be written (:func:`tb_gradhealth._storage.check_writable`: a parent that is a file, permission
    denied). With ``strict=True`` any failed write raises :class:`~tb_gradhealth._storage.StrictWriteError` (from
    the call that wrote, or, for a write of the background flush, from the next call), the events staying queued.
    """

    def __init__(self, logdir: str, *, max_queue: int = 32, flush_secs: float = 120, filename_suffix: str = "",
                 storage_options: Mapping[str, Any] | None = None, strict: bool = False):
        logdir = _storage.check(logdir)
        _storage.check_writable(logdir)
        self._strict = bool(strict)
        self._error: BaseException | None = None  # strict: the failed write not raised yet
        self._remote = _storage.is_url(logdir)
        self._storage_options = dict(storage_options or {})
        if self._remote:
            _storage.makedirs(logdir, self._storage_options)  # StorageError now: no fsspec, no backend, a bad URL
        self.logdir = logdir
        self._name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}{filename_suffix}"
        self.path = _storage.join(logdir, self._name) if self._remote else os.path.join(logdir, self._name)
        self._fd: int | None = None
        self._objects = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._started = False  # the file-version record is written
        self._outage = _Outage(logdir)
        self._max_queue = max_queue
        self._flush_secs = flush_secs
        self._last_flush = time.monotonic()
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self.add_event(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()
        self._flusher = threading.Thread(target=self._flush_periodically, name="tb_gradhealth-flush", daemon=True)
        self._flusher.start()

    @property
    def dropped_events(self) -> int:
        """Events dropped because writing failed for longer than the queue could hold them."""
        return self._outage.dropped

    @property
    def failing(self) -> bool:
        """Whether the last try to write failed (events are waiting for the fault to clear)."""
        return self._outage.failing

    @property
    def objects(self) -> list[str]:
        """On object storage, the objects written so far (in order); locally, the one file."""
        if not self._remote:
            return [self.path]
        return [f"{self.path}.{k:08d}" for k in range(self._objects)]

    def add_event(self, event: event_pb2.Event) -> None:
        with self._lock:
            data = frame(event.SerializeToString())
            self._pending.append(data)
            self._pending_bytes += len(data)
            self._drop_oldest_beyond(MAX_PENDING_BYTES)
            if len(self._pending) >= self._max_queue or time.monotonic() - self._last_flush >= self._flush_secs:
                self._flush(now=False)
            self._raise_strict()  # a strict writer's failure in the background flush, now in the caller's thread

    def _drop_oldest_beyond(self, limit: int) -> None:
        """Drop the oldest queued events while more than ``limit`` bytes wait (the file-version record of a file
        not yet started stays first)."""
        keep_first = int(not self._started)
        while self._pending_bytes > limit and len(self._pending) > keep_first + 1:
            self._pending_bytes -= len(self._pending.pop(keep_first))
            self._outage.dropped += 1

    def flush(self) -> bool:
        """Write the queued events now; whether everything queued is written (a failure keeps them queued for a
        later try, with a warning, and is not raised unless ``strict``)."""
        return self._flush(now=True)

    def _flush(self, now: bool, raising: bool = True) -> bool:
        """Write the queued events, unless a failed write's back-off says to wait (``now``: try anyway).
        ``raising=False`` (the background flush) keeps a strict writer's failure for the next caller."""
        with self._lock:
            if self._pending and (now or self._outage.may_try()):
                data = b"".join(self._pending)
                try:
                    self._write(data)
                except Exception as e:  # noqa: BLE001 - OSError, or a storage backend's own error types
                    self._outage.failed(e, self._flush_secs)
                    if self._strict:
                        self._error = e
                else:
                    self._started = True
                    self._outage.succeeded()
                    self._pending.clear()
                    self._pending_bytes = 0
            self._last_flush = time.monotonic()
            if raising:
                self._raise_strict()
            return not self._pending

    def _raise_strict(self) -> None:
        """A strict writer's failed write, raised once, naming the logdir and the cause."""
        error, self._error = self._error, None
        if error is not None:
            raise _storage.StrictWriteError(
                getattr(error, "errno", None) or errno.EIO,
                f"cannot write to {self.logdir} ({type(error).__name__}: {error}) (strict=True: a failed write "
                f"raises)") from error

    def _write(self, data: bytes) -> None:
        if self._remote:
            _storage.write_object(f"{self.path}.{self._objects:08d}", data, self._storage_options)
            self._objects += 1
            return
        if self._fd is None:
            self._fd = self._open_local()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            try:  # never leave a torn record: cut back to the last whole one
                os.ftruncate(self._fd, start)
            except OSError:  # cannot even cut: start a new file at the next try
                os.close(self._fd)
                self._fd = None
            raise

    def _open_local(self) -> int:
        """Make the directory and open a new file (a name taken in this process within the same microsecond, or
        a file abandoned after a failed write, gets a counter)."""
        os.makedirs(self.logdir, exist_ok=True)
        path, k = self.path, 0
        while os.path.exists(path):
            k += 1
            path = os.path.join(self.logdir, f"{self._name}.{k}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.path = path
        return fd

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self._flush_secs):
            self._flush(now=False, raising=False)

    def close(self) -> None:
        """Flush and close; events that still cannot be written are dropped (counted) with a warning."""
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            try:
                self._flush(now=True, raising=False)  # one last try, whatever the back-off says
            finally:
                self._close_after_flush()
            self._raise_strict()

    def _close_after_flush(self) -> None:
        """Drop (and count, with a warning) what still could not be written; close the file."""
        with self._lock:
            if self._pending:
                self._outage.dropped += len(self._pending)
                _log.warning("tb_gradhealth: %d events could not be written to %s before closing",
                             len(self._pending), self.logdir)
                self._pending.clear()
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def iter_summary_values(paths: Iterable[str], storage_options: Mapping[str, Any] | None = None
                        ) -> Iterable[tuple[Any, Any]]:
    """``(event, summary value)`` of every summary value in ``paths``, in file order; damaged records and events
    that do not parse are skipped silently (for side readers: the record reader reports damage)."""
    for path in paths:
        for _, payload in iter_framed(path, [], storage_options):
            try:
                event = event_pb2.Event.FromString(payload)
            except DecodeError:
                continue
            for value in event.summary.value:
                yield event, value
