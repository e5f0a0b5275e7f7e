"""Problem lines that carry their kind as a value: what a reader tells the user, and what code may branch on.

A :class:`Problem` is the line a user reads (it is a ``str``: JSON answers, the CLI and the tab show it as before)
with a :class:`Kind` beside it, so that no code recovers a fact from a message's wording.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

__all__ = ["Kind", "Problem", "any_of_kind"]


class Kind(enum.Enum):
    """What a problem is about."""

    #: an event file's damage: unreadable, a failed checksum, a corrupt header, events that do not parse
    FILE = "file"
    #: an event file ends in a partial record: truncated, or still being written (the next read may complete it)
    PARTIAL = "partial"
    #: a gradient-health tag's records, some or all of them unreadable or damaged
    RECORDS = "records"
    #: the data provider could not read the run at all
    PROVIDER = "provider"
    #: anything else a reader notes
    OTHER = "other"


class Problem(str):
    """A problem line (a ``str``) with its :attr:`kind`."""

    kind: Kind

    def __new__(cls, kind: Kind, text: str) -> Problem:
        line = super().__new__(cls, text)
        line.kind = kind
        return line

    def __reduce__(self) -> tuple:
        return Problem, (self.kind, str(self))


def any_of_kind(problems: Iterable[str], kind: Kind) -> bool:
    """Whether any of ``problems`` is a :class:`Problem` of ``kind`` (a plain ``str`` is of no kind)."""
    return any(getattr(p, "kind", None) is kind for p in problems)
