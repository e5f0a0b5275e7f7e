"""TFRecord framing of TensorBoard event files, read and written without TensorFlow.

TensorBoard's own ``EventFileWriter`` and ``event_file_loader`` reach the file system through
``tensorboard.compat.tf``, which imports TensorFlow whenever it is installed (2+ s, and a TF dependency the
numpy/PyTorch writer and the CLI must not have). The framing is small, so both directions live here:

    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

CRC32C comes from ``google_crc32c`` (C, a dependency of the package), else TensorBoard's pure-Python version (slow:
the reader checks every record's data checksum).
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from tensorboard.compat.proto import event_pb2

from tb_gradhealth import storage

try:  # C implementation (a dependency; the fallback keeps a broken install readable)
    import google_crc32c

    def _crc32c(data: bytes) -> int:
        return google_crc32c.value(data)

except ImportError:  # pragma: no cover - depends on the environment
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as _tb_crc32c

    def _crc32c(data: bytes) -> int:
        return _tb_crc32c(data)

_MASK_DELTA = 0xA282EAD8


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


def iter_framed(path: str, problems: list[str], storage_options: Mapping[str, Any] | None = None
                ) -> Iterable[tuple[int, bytes]]:
    """``(byte offset, payload)`` of each TFRecord of an event file whose data checksum matches.

    A record whose data checksum does not match is skipped with a problem naming the file and its byte offset, and
    reading goes on with the next record (its length was checked, so the framing still holds). A bad length checksum
    or a partial last record ends the file with a problem: the framing cannot be trusted past it. (TensorBoard's
    loaders verify data checksums only of records that fail to parse, so a flipped byte that still parses reaches
    the tab; the reader's row checks, :func:`tb_gradhealth.record.check_disk`, catch most of those.)"""
    try:
        data = storage.read_bytes(path, storage_options)
    except OSError as e:
        problems.append(f"{path}: unreadable: {e}")
        return
    pos, n = 0, len(data)
    while pos < n:
        if n - pos < 12:
            problems.append(f"{path}: ends in a partial record at byte {pos} (truncated, or still being written)")
            return
        (length,) = struct.unpack_from("<Q", data, pos)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        if masked_crc32c(data[pos : pos + 8]) != length_crc:
            problems.append(f"{path}: corrupt record header at byte {pos}; the rest of the file is skipped")
            return
        end = pos + 12 + length + 4
        if end > n:
            problems.append(f"{path}: ends in a partial record at byte {pos} (truncated, or still being written)")
            return
        payload = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, end - 4)
        if masked_crc32c(payload) != data_crc:
            problems.append(f"{path}: record at byte {pos} fails its data checksum (damaged); skipped")
        else:
            yield pos, payload
        pos = end


class EventFile:
    """An append-only event file named as TensorFlow names them, so TensorBoard orders and reads it as usual.

    Events are buffered and written on :meth:`flush` (also when ``max_queue`` events are pending, and by a
    background thread every ``flush_secs`` while events are pending), so a reader sees whole records only, at most
    ``flush_secs`` after they were added.

    On object storage (``gs://``, ``s3://``, any fsspec URL: :mod:`tb_gradhealth.storage`) nothing can be appended
    to an object, so each flush writes one new object ``<file name>.<8-digit sequence number>``: an object is
    written whole or not at all, so everything flushed survives a killed process, and the names sort in write
    order, as TensorBoard reads a run's event files.
    """

    def __init__(self, logdir: str, *, max_queue: int = 32, flush_secs: float = 120, filename_suffix: str = "",
                 storage_options: Mapping[str, Any] | None = None):
        logdir = storage.check(logdir)
        self._remote = storage.is_url(logdir)
        self._storage_options = dict(storage_options or {})
        storage.makedirs(logdir, self._storage_options)  # StorageError now, before any record is accepted
        self.logdir = logdir
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}{filename_suffix}"
        self._file = None
        self._objects = 0
        if self._remote:
            self.path = storage.join(logdir, name)
        else:
            # The same name twice in one process within a microsecond would clobber: add a counter if it exists.
            path, k = os.path.join(logdir, name), 0
            while os.path.exists(path):
                k += 1
                path = os.path.join(logdir, f"{name}.{k}")
            self.path = path
            self._file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._pending: list[bytes] = []
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
    def objects(self) -> list[str]:
        """On object storage, the objects written so far (in order); locally, the one file."""
        if not self._remote:
            return [self.path]
        return [f"{self.path}.{k:08d}" for k in range(self._objects)]

    def add_event(self, event: event_pb2.Event) -> None:
        with self._lock:
            self._pending.append(frame(event.SerializeToString()))
            if len(self._pending) >= self._max_queue or time.monotonic() - self._last_flush >= self._flush_secs:
                self.flush()

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                data = b"".join(self._pending)
                if self._remote:
                    storage.write_object(f"{self.path}.{self._objects:08d}", data, self._storage_options)
                    self._objects += 1
                else:
                    self._file.write(data)
                self._pending.clear()
            if self._file is not None:
                self._file.flush()
            self._last_flush = time.monotonic()

    def _flush_periodically(self) -> None:
        while not self._closed.wait(self._flush_secs):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - a failed background write is retried; flush()/close() raise it
                pass

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self.flush()
            if self._file is not None:
                self._file.close()
