"""Host-side recording work run so that no exception reaches the training loop: a warning and a count instead.

Why: a monitoring tool must never end the training it watches. The writers already keep what they record from
raising (an inconsistent record is written and reported by the readers; a logdir that cannot be written queues
and retries); this is the last line for the rest, a bug of ours included: the Keras callback, the PyTorch
``StepRecorder`` and the JAX callback run each piece of host-side work through :meth:`Failsafe.run`, which logs
the first failure of each kind with its traceback, counts the records it cost, and lets training go on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from tb_gradhealth._storage import StrictWriteError

__all__ = ["Failsafe"]

_log = logging.getLogger("tb_gradhealth")
T = TypeVar("T")


class Failsafe:
    """Runs host-side recording work; a failure costs a warning (once per kind) and a count, never an exception."""

    def __init__(self) -> None:
        #: Records (one step's records of all layers count as one) that failures kept from being written.
        self.dropped_records = 0
        #: Failures caught so far.
        self.failures = 0
        self._warned: set[tuple[str, type]] = set()

    def run(self, what: str, fn: Callable[..., T], *args: Any, records: int = 0, **kwargs: Any) -> T | None:
        """``fn(*args, **kwargs)``; on an exception, ``None`` after logging it (first time for ``what`` and that
        exception type, with the traceback) and adding ``records`` to :attr:`dropped_records`."""
        try:
            return fn(*args, **kwargs)
        except StrictWriteError:  # the user asked for write failures to raise (a writer made with strict=True)
            raise
        except Exception as e:  # noqa: BLE001 - whatever it is, training goes on
            self.failures += 1
            self.dropped_records += records
            key = (what, type(e))
            if key not in self._warned:
                self._warned.add(key)
                _log.warning("tb_gradhealth: %s failed (%s: %s); training goes on without it (later failures of "
                             "this kind are counted, not logged)", what, type(e).__name__, e, exc_info=True)
            return None
