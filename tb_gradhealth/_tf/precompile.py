"""Compile a ``jit_compile`` function's XLA program on a background thread while the caller's graph is still built.

Why: a ``tf.function`` (no ``jit_compile``) that calls the statistics' compiled function
(:mod:`tb_gradhealth._tf.packed`) compiles that XLA program when the call first *runs*: after the whole train step
has been traced and optimised and its forward and backward pass have run, all on the training thread. XLA caches a
program by function and argument signature (programs of calls from graphs apart from those of eager calls), so the
same concrete function called from a small graph on zeros of the same shapes on another thread, as soon as the
caller's trace reaches it, compiles the very program the caller's call will run (one program, so one result), while
the training thread goes on tracing, optimising and running the step. A call that runs before that compile has
ended waits for it (XLA compiles a signature once) instead of compiling it again.

The zeros are one tensor per distinct shape and dtype, freed when the call returns; a signature with an unknown
dimension (e.g. a batch-dependent ``IndexedSlices``) is left to compile where it runs.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Any

import tensorflow as tf

_log = logging.getLogger("tb_gradhealth")

_started: set[str] = set()
_lock = threading.Lock()
_threads: list[threading.Thread] = []


def _zeros_like_specs(args: Any) -> Any | None:
    """``args`` with every tensor (and each part of a composite one) replaced by zeros of its static shape and
    dtype, one tensor per distinct ``(shape, dtype)``; ``None`` when a shape is not fully known."""
    cache: dict[tuple[tuple[int, ...], tf.DType], tf.Tensor] = {}

    def zeros(t: Any) -> Any:
        if not isinstance(t, (tf.Tensor, tf.Variable)):
            return t
        known = tf.get_static_value(t) if t.dtype.is_integer and t.shape.num_elements() in range(1, 9) else None
        if known is not None:  # e.g. an IndexedSlices' dense shape: part of its signature
            with tf.init_scope():
                return tf.constant(known, t.dtype)
        key = (tuple(t.shape.as_list()), t.dtype)
        if key not in cache:
            with tf.init_scope():
                cache[key] = tf.zeros(key[0], key[1])
        return cache[key]

    tensors = [t for t in tf.nest.flatten(args, expand_composites=True) if isinstance(t, (tf.Tensor, tf.Variable))]
    if not all(t.shape.is_fully_defined() for t in tensors):
        return None  # a shape with an unknown dimension: nothing to compile ahead
    return tf.nest.map_structure(zeros, args, expand_composites=True)


def compile_ahead(function: Any, args: tuple, kwargs: dict) -> bool:
    """Start compiling ``function(*args, **kwargs)``'s XLA program on a background thread, once per concrete
    function; call from the graph being traced that calls ``function`` with these symbolic ``args``. Returns
    whether a compile was started. Outside a graph (eager: the call compiles right away), under an enclosing
    XLA compile (the call is inlined there) or with more than one replica (each compiles on its own device), it
    does nothing."""
    if tf.executing_eagerly() or tf.distribute.get_strategy().num_replicas_in_sync > 1:
        return False
    concrete = function.get_concrete_function(*args, **kwargs)  # the one the caller's graph calls (cached trace)
    name = concrete.name.decode() if isinstance(concrete.name, bytes) else str(concrete.name)
    with _lock:
        if name in _started:
            return False
        dummy = _zeros_like_specs(args)
        if dummy is None:
            return False
        _started.add(name)

    def run() -> None:
        try:
            # Called from a graph, as the caller's graph calls it: XLA keeps the programs of calls from graphs
            # apart from those of eager calls.
            tf.function(lambda: concrete(*dummy, **kwargs), autograph=False)()
        except Exception:  # noqa: BLE001 - the graph's own call compiles (and reports) instead
            _log.debug("tb_gradhealth: compiling the statistics ahead failed", exc_info=True)
        _release_freed_memory()

    thread = threading.Thread(target=run, name="tb_gradhealth-xla-compile")
    with _lock:
        _threads[:] = [t for t in _threads if t.is_alive()]
        _threads.append(thread)
    thread.start()
    return True


def _release_freed_memory() -> None:
    """Give the memory the compiler freed back to the system (glibc's ``malloc_trim``): it stays resident in this
    thread's malloc arena otherwise, where the training thread's allocations do not reuse it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def wait() -> None:
    """Wait for the compiles started here (tests, and a process that wants them done before it measures)."""
    with _lock:
        threads = list(_threads)
    for t in threads:
        t.join()
