"""How numbers are printed, once for every view: the CLI's table, the headline, the reasons (the tab's frontend
mirrors these rules in JavaScript; docs/API.md, *Printing numbers*).

* counts (NaN/Inf counts, sizes, layer counts) are exact integers with thousands separators: ``1,024``;
* a severity is rounded to an integer with thousands separators: ``6,052`` (the JSON keeps the float);
* magnitudes (RMS, max |g|, norms) have 3 significant figures: ``1.23e-05``, ``0.0123``, ``456``;
* a relative change (the loss's trend) is a signed percentage up to 10x either way, ``+38%``, ``-62%``, and a
  factor beyond it, ``x7.1e19``, ``x0.0012``: a percentage of many digits reads as noise.

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


#: Beyond this factor either way a change prints as a factor, not a percentage.
FACTOR_BEYOND = 10.0


def format_change(change: Any) -> str:
    """A relative change ``new / old - 1``: ``+38%``, ``-62%``, ``0%``; beyond ``FACTOR_BEYOND`` times either way
    the factor with 2 significant figures: ``x12``, ``x7.1e19``, ``x0.0012``."""
    v = _finite(change)
    if v is None:
        return MISSING
    ratio = 1.0 + v
    if ratio > FACTOR_BEYOND or 0 < ratio < 1.0 / FACTOR_BEYOND:
        return format_ratio(ratio)
    pct = f"{100.0 * v:+,.0f}%"
    return "0%" if pct in ("+0%", "-0%") else pct


def format_ratio(ratio: Any) -> str:
    """A ratio of a quantity to its earlier level: ``x1.03``, ``x2.41``, ``x0.51`` (3 significant figures below 10),
    ``x12``, ``x340``, and in powers of ten from 10,000 (and below 0.001): ``x7.1e19``, ``x1.2e-5``."""
    v = _finite(ratio)
    if v is None:
        return MISSING
    if 1e-3 <= abs(v) < 1e4:
        return f"x{float(f'{v:.3g}' if abs(v) < 10 else f'{v:.2g}'):g}"
    mantissa, _, exp = f"{v:.1e}".partition("e")
    return f"x{mantissa.rstrip('0').rstrip('.')}e{int(exp)}"
