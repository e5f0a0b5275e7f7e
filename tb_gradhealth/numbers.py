"""How numbers are printed, once for every view: the CLI's table, the headline, the reasons (the tab's frontend
mirrors these rules in JavaScript; docs/API.md, *Printing numbers*).

* counts (NaN/Inf counts, sizes, layer counts) are exact integers with thousands separators: ``1,024``;
* a severity is rounded to an integer with thousands separators: ``6,052`` (the JSON keeps the float);
* magnitudes (RMS, max |g|, norms) have 3 significant figures: ``1.23e-05``, ``0.0123``, ``456``.

Missing and non-finite values print as ``-`` (the JSON holds them as null).
"""

from __future__ import annotations

import math
from typing import Any

#: What a missing, NaN or infinite value prints as.
MISSING = "-"


def _finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def format_count(n: Any) -> str:
    """An exact count with thousands separators: ``format_count(1024) == "1,024"``; never rounded to significant
    figures (a count of 1,000,001 NaN prints every digit). A non-integral value is a bug upstream: it prints
    rounded to the nearest integer."""
    v = _finite(n)
    return MISSING if v is None else f"{round(v):,d}"


def format_severity(x: Any) -> str:
    """A severity rounded to an integer with thousands separators: ``format_severity(6052.0) == "6,052"``."""
    v = _finite(x)
    return MISSING if v is None else f"{round(v):,d}"


def format_magnitude(x: Any) -> str:
    """A magnitude to 3 significant figures (``%.3g``): ``1.23e-05``, ``0.0123``, ``456``, ``1.23e+04``."""
    v = _finite(x)
    return MISSING if v is None else f"{v:.3g}"
