"""The record's per-tensor statistics of float32 values on the CPU in one read (``_cpustats.c``), compiled at first
use with the machine's C compiler and loaded with ``ctypes``.

Why: on a CPU each framework op is a pass over memory, and the record needs the extremes, the sum, the sum of
squares and the count of normal values: five or six passes as framework ops, one as a loop (docs/PERFORMANCE.md,
*One read on the CPU*). The library is built once per source, compiler and CPU into the user's cache
(``$XDG_CACHE_HOME/tb_gradhealth``, else ``~/.cache/tb_gradhealth``) and reused by every later process. Where no
compiler works, or ``TB_GRADHEALTH_CPU_STATS=0`` is set, :func:`library` is ``None`` and the callers keep their
framework ops: the numbers agree either way within the record's documented float32 tolerance.

Beside them, each tensor's histogram of a sample read in place (:func:`bins`). :func:`stats` takes runs of values
(a pointer and a length each), pairs of runs whose difference it reads (an update: the weights before minus after,
never written), or runs it copies as it reads them (the weights' snapshot before a step), and splits them among
threads (``ctypes`` releases the GIL), as many as the caller allows.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

#: The fields of each run's row in :func:`stats`' answer, in order.
FIELDS = ("min", "max", "sum", "squares", "normal")
#: Values of one run at most: a tensor is cut into runs of this size so that threads can share it.
RUN = 1 << 18
#: Below this many values in all, one thread does the work (a thread's start costs more than it saves).
_THREADED_FROM = 1 << 20
ENV = "TB_GRADHEALTH_CPU_STATS"
_SOURCE = Path(__file__).with_name("_cpustats.c")
_log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # empty: not tried yet
_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}


def enabled() -> bool:
    """Whether the compiled statistics may be used (``TB_GRADHEALTH_CPU_STATS=0`` turns them off)."""
    return os.environ.get(ENV, "1") != "0"


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; ``None`` where it is turned off or cannot be built here."""
    if not enabled():
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_load())
    return _loaded[0]


def _load() -> ctypes.CDLL | None:
    try:
        path = _build()
        if path is None:
            return None
        lib = ctypes.CDLL(str(path))
        lib.gh_stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.gh_stats.restype = None
        lib.gh_difference_stats.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
        lib.gh_difference_stats.restype = None
        lib.gh_copy_stats.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p]
        lib.gh_copy_stats.restype = None
        lib.gh_bins.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 2 + [
            ctypes.c_int64, ctypes.c_void_p]
        lib.gh_bins.restype = None
        return lib
    except OSError as e:  # a library that does not load here: the framework ops stay
        _log.info("tb_gradhealth: the compiled CPU statistics are not used (%s)", e)
        return None


def _compiler() -> str | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return cc if cc and os.name == "posix" else None


def _cpu() -> str:
    """What sets the instructions ``-march=native`` chooses: the CPU's feature flags where Linux lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cache_dir() -> Path:
    """Where built libraries are kept."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tb_gradhealth"


def _build() -> Path | None:
    """The library's path, compiled now unless a build for this source, compiler and CPU is in the cache."""
    cc = _compiler()
    if cc is None:
        return None
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu().encode()])).hexdigest()[:16]
    target = cache_dir() / f"cpustats-{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        where = target.parent
    except OSError:
        where = Path(tempfile.mkdtemp(prefix="tb_gradhealth-"))
        target = where / target.name
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=where)
    os.close(fd)
    for arch in (["-march=native"], []):  # a compiler that does not know -march=native still builds it
        cmd = [cc, "-O3", "-std=c99", "-shared", "-fPIC", *arch, "-o", tmp, str(_SOURCE)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as e:
            _log.info("tb_gradhealth: %s failed: %s", cc, e)
            break
        if done.returncode == 0:
            os.replace(tmp, target)  # atomic: a process beside this one sees the whole file or none
            return target
        _log.info("tb_gradhealth: %s failed: %s", " ".join(cmd), done.stderr.strip()[-2000:])
    os.unlink(tmp)
    return None


def stats(pointers: np.ndarray, sizes: np.ndarray, threads: int = 1, minus: np.ndarray | None = None,
          copy_to: np.ndarray | None = None) -> np.ndarray:
    """``[runs, len(FIELDS)]`` float64: :data:`FIELDS` of each run of contiguous float32 values (``pointers``:
    uint64 addresses, ``sizes``: int64 lengths; the memory must stay alive through the call); where ``minus`` is
    given (addresses of runs of the same sizes) of the differences ``values - minus`` (never written); where
    ``copy_to`` is, of the values while they are copied there. On up to ``threads`` threads. A run holding NaN or
    +-Inf has NaN extremes. Needs :func:`library`."""
    lib = library()
    assert lib is not None, "the compiled CPU statistics are not available"
    pointers = np.ascontiguousarray(pointers, np.uint64)
    sizes = np.ascontiguousarray(sizes, np.int64)
    seconds = next((np.ascontiguousarray(a, np.uint64) for a in (minus, copy_to) if a is not None), None)
    pair = lib.gh_difference_stats if copy_to is None else lib.gh_copy_stats
    out = np.empty((len(sizes), len(FIELDS)))
    n = len(sizes)
    parts = _parts(sizes, threads) if threads > 1 and n and int(sizes.sum()) >= _THREADED_FROM else [(0, n)]

    def run(part: tuple[int, int]) -> None:
        a, b = part
        if b <= a:
            return
        at = out.ctypes.data + 8 * len(FIELDS) * a
        if seconds is None:
            lib.gh_stats(pointers.ctypes.data + 8 * a, sizes.ctypes.data + 8 * a, b - a, at)
        else:
            pair(pointers.ctypes.data + 8 * a, seconds.ctypes.data + 8 * a, sizes.ctypes.data + 8 * a, b - a, at)

    if len(parts) == 1:
        run(parts[0])
    else:
        list(_pool(len(parts)).map(run, parts))
    return out


def bins(pointers: np.ndarray, sizes: np.ndarray, steps: np.ndarray, offsets: np.ndarray, samples: np.ndarray,
         base: np.ndarray, edge: np.ndarray, width: int) -> np.ndarray:
    """``[runs, width]`` int64: each run's histogram, its values read at ``(steps[t][j] + offsets[t]) % sizes[t]``
    for ``j < samples[t]`` (``steps``: uint64 addresses of int64 steps below the size, 0 for every value in order;
    ``offsets`` below the size), each binned by the exponent tables ``base`` and ``edge`` (int32 [256],
    :func:`tb_gradhealth._core.exponent_bins`). Needs :func:`library`."""
    lib = library()
    assert lib is not None, "the compiled CPU statistics are not available"
    args = [np.ascontiguousarray(a, t) for a, t in ((pointers, np.uint64), (sizes, np.int64), (steps, np.uint64),
                                                    (offsets, np.int64), (samples, np.int64))]
    tables = [np.ascontiguousarray(t, np.int32) for t in (base, edge)]
    out = np.zeros((len(args[1]), width), np.int64)
    lib.gh_bins(*(a.ctypes.data for a in args), len(args[1]), *(t.ctypes.data for t in tables), width,
                out.ctypes.data)
    return out


def _parts(sizes: np.ndarray, threads: int) -> list[tuple[int, int]]:
    """Consecutive ranges of runs, one a thread, of about equal values."""
    ends = np.cumsum(sizes)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, threads) / threads, side="right")
    bounds = [0, *sorted(set(int(c) for c in cuts)), len(sizes)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def _pool(threads: int) -> ThreadPoolExecutor:
    """A pool of ``threads`` threads of this process (a forked child makes its own: its parent's threads are not
    in it)."""
    key = (os.getpid(), threads)
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = ThreadPoolExecutor(threads, thread_name_prefix="tb_gradhealth-stats")
    return pool


def runs(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(owner, offset, size)`` of the runs that cut tensors of ``sizes`` values into pieces of at most
    :data:`RUN` (a tensor of zero values has none)."""
    sizes = np.asarray(sizes, np.int64)
    per = -(-sizes // RUN)
    owner = np.repeat(np.arange(len(sizes)), per)
    first = np.cumsum(per) - per
    index = np.arange(len(owner)) - np.repeat(first, per)
    offset = index * RUN
    return owner, offset, np.minimum(sizes[owner] - offset, RUN)
