"""Paths and URLs for the readers and writers: local paths, ``gs://``, ``s3://`` and any other fsspec URL.

A local path (or ``file://`` URL) goes through ``os`` and ``open``; any ``scheme://`` URL goes through `fsspec
<https://filesystem-spec.readthedocs.io>`_ and its backends (``gcsfs`` for ``gs://``, ``s3fs`` for ``s3://``), imported
only when such a URL is used: ``pip install 'tb-gradhealth[gcs]'`` or ``'tb-gradhealth[s3]'``. Never TensorFlow.

Credentials and endpoints are the backends' own: environment variables (``AWS_*``, ``AWS_ENDPOINT_URL``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``STORAGE_EMULATOR_HOST``), fsspec's ``FSSPEC_<PROTOCOL>_<OPTION>`` variables
(e.g. ``FSSPEC_GCS_TOKEN=anon``) or ``storage_options`` passed to :class:`tb_gradhealth.Writer` and
:func:`tb_gradhealth.reader.read_logdir`.

A string that starts like a URL but is not one (``s3:bucket``, ``gs:/bucket``) is an error, never a local directory
of that name.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from typing import Any

#: ``scheme://`` (two or more letters, so that a Windows drive ``C:\\`` stays a path).
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)://")
_ALMOST_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)")
#: The extra that installs each common backend.
EXTRAS = {"gs": "gcs", "gcs": "gcs", "s3": "s3", "s3a": "s3"}


class StorageError(OSError):
    """A URL that cannot be used: no fsspec or backend installed, or a malformed URL (the message says which)."""


class StrictWriteError(OSError):
    """A write that failed in a writer made with ``strict=True`` (the message names the logdir and the cause);
    without ``strict`` the same fault is a warning and the events wait in memory."""


def check_writable(logdir: str) -> None:
    """Raise, naming ``logdir``, when a local logdir can never be written: it or the nearest of its parents that
    exists is not a directory (``NotADirectoryError``), or this process may not create or write files there
    (``PermissionError``). What may clear by itself passes: a full disk, a file system mounted read-only (it can be
    remounted), an object store that is down (URLs are not checked here: their writes retry).

    Why at construction: a writer that cannot ever write would warn, keep its events in memory and let a training
    job finish with nothing on disk; every writer and callback of the package calls this before anything else."""
    if is_url(logdir):
        return
    path = os.path.abspath(check(os.fspath(logdir)))
    nearest = path
    while not os.path.lexists(nearest) and os.path.dirname(nearest) != nearest:
        nearest = os.path.dirname(nearest)
    if not os.path.isdir(nearest):
        what = "the log directory itself" if nearest == path else f"its parent {nearest!r}"
        raise NotADirectoryError(errno.ENOTDIR, f"cannot write to log directory {os.fspath(logdir)!r}: {what} "
                                 f"is not a directory", os.fspath(logdir))
    if not _may_write(nearest) and not _read_only_mount(nearest):
        what = "it" if nearest == path else f"its parent {nearest!r}"
        raise PermissionError(errno.EACCES, f"cannot write to log directory {os.fspath(logdir)!r}: permission "
                              f"denied ({what} is not writable by this user)", os.fspath(logdir))


def _may_write(directory: str) -> bool:
    """Whether this process (its effective user: root may write anywhere) may create files in ``directory``."""
    effective = os.access in os.supports_effective_ids
    return os.access(directory, os.W_OK | os.X_OK, effective_ids=effective)


def _read_only_mount(directory: str) -> bool:
    """Whether ``directory`` is on a file system mounted read-only (a fault that a remount clears)."""
    try:
        return bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def scheme(path: str) -> str | None:
    """``"gs"`` for ``gs://b/x``; None for a local path (``file://`` URLs count as local)."""
    m = _URL_RE.match(str(path))
    if m is None or m.group(1).lower() == "file":
        return None
    return m.group(1).lower()


def is_url(path: str) -> bool:
    return scheme(path) is not None


def check(path: str) -> str:
    """``path`` as the readers and writers use it: a ``file://`` URL becomes a local path; a string that looks like
    a URL without ``//`` (``s3:bucket/run``) raises StorageError instead of naming a local directory ``s3:``."""
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"a path or URL must be a string, got {type(path).__name__}")
    if path.lower().startswith("file://"):
        return path[len("file://") :]
    m = _ALMOST_URL_RE.match(path)
    if m and not _URL_RE.match(path):
        raise StorageError(f"{path!r} is neither a local path nor a URL: did you mean {m.group(1)}://...?")
    return path


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a URL; StorageError naming the extra to install if missing."""
    proto = scheme(url)
    try:
        import fsspec
    except ImportError as e:
        raise StorageError(_missing(proto, "fsspec")) from e
    try:
        fs, inner = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:  # fsspec knows the protocol but its backend (gcsfs, s3fs, ...) is not installed
        raise StorageError(_missing(proto, str(e))) from e
    except ValueError as e:  # an unknown protocol
        raise StorageError(f"{url!r}: {e}") from e
    return fs, inner


def _missing(proto: str | None, what: str) -> str:
    extra = EXTRAS.get(proto or "")
    hint = f"pip install 'tb-gradhealth[{extra}]'" if extra else "pip install fsspec and the backend of this scheme"
    return f"{proto}:// paths need fsspec and its {proto} backend ({what}): {hint}"


def join(base: str, *parts: str) -> str:
    if is_url(base):
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


def _ask(path: str, what: str, call: Any) -> Any:
    """``call()``, with a backend's own error types (credentials, HTTP) turned into StorageError naming ``path``."""
    try:
        return call()
    except (OSError, StorageError):
        raise
    except Exception as e:  # noqa: BLE001 - botocore, google-auth, aiohttp... each have their own
        raise StorageError(f"{path}: cannot {what}: {type(e).__name__}: {e}") from e


def _uncached(path: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """:func:`filesystem` with its listing cache of ``path`` dropped, so new objects show up."""
    fs, inner = filesystem(path, storage_options)
    fs.invalidate_cache(inner)
    return fs, inner


def isdir(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = _uncached(path, storage_options)
    return bool(_ask(path, "list", lambda: fs.isdir(inner)))


def exists(path: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path, storage_options)
    return bool(_ask(path, "list", lambda: fs.exists(inner)))


def walk(top: str, storage_options: Mapping[str, Any] | None = None) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` for paths and URLs: ``(dirpath, dirnames, filenames)``, top down; ``dirnames`` may be pruned or
    reordered in place. Listings are never served from a cache, so new objects show up at the next walk."""
    if not is_url(top):
        yield from os.walk(top)
        return
    fs, inner = _uncached(top, storage_options)
    base = inner.rstrip("/")
    for dirpath, dirnames, filenames in _ask(top, "list", lambda: list(fs.walk(base, topdown=True))):
        yield (top.rstrip("/") + dirpath[len(base):]), dirnames, filenames


def relpath(path: str, start: str) -> str:
    """``path`` relative to ``start`` with ``/`` separators (``.`` for ``start`` itself)."""
    if not is_url(path):
        return os.path.relpath(path, start).replace(os.sep, "/")
    rel = path.rstrip("/")[len(start.rstrip("/")) :].strip("/")
    return rel or "."


def read_bytes(path: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, inner = filesystem(path, storage_options)
    return _ask(path, "read", lambda: fs.cat_file(inner))


def size(path: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Bytes in the file or object (an object store answers from a fresh listing, never a cache)."""
    if not is_url(path):
        return os.path.getsize(path)
    fs, inner = _uncached(path, storage_options)
    return int(_ask(path, "list", lambda: fs.size(inner)))


def read_range(path: str, start: int, length: int, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """At most ``length`` bytes of the file or object from byte ``start`` (fewer at its end)."""
    if not is_url(path):
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(length)
    fs, inner = filesystem(path, storage_options)
    return _ask(path, "read", lambda: fs.cat_file(inner, start=start, end=start + length))


def write_object(path: str, data: bytes, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write ``data`` as one whole object (object stores make it visible all at once, or not at all)."""
    fs, inner = filesystem(path, storage_options)
    _ask(path, "write", lambda: fs.pipe_file(inner, data))


def makedirs(path: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Create a local directory; for URLs check that the filesystem can be used (object stores have no
    directories: a "directory" exists once an object is written under it)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)
        return
    filesystem(path, storage_options)
