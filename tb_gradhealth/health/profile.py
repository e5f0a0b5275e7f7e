"""The depth profile: per-layer magnitudes and statuses at one step, with the healthy band's lines."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health.result import json_float
from tb_gradhealth.health.rules import evaluate
from tb_gradhealth.health.thresholds import ABSENT, MISSING, STATUSES, Thresholds


def profile(
    layers: Sequence[str],
    records_at_step: np.ndarray,
    thresholds: Thresholds = Thresholds(),  # noqa: B008 - frozen, immutable default
    statuses: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Per-layer norm/rms/max_abs/status at one step, in network order, plus the healthy band's lines.

    Cheap (one step, no history): the status is the *instantaneous* one of that step's rules (no trend, no
    sustain). Pass ``statuses`` (network order, e.g. ``RunHealth.statuses()``) to show the full diagnosis instead.
    A layer without a record at the step is ``missing``. Bands (JSON, None when unknown): ``reference_rms`` (the
    layers nearest the loss), ``median_rms``; ``vanishing_below`` = the larger of the relative and absolute
    vanishing lines; ``exploding_above`` = the smaller of the relative and absolute exploding lines; always
    ``vanishing_below < exploding_above`` (:func:`_band_lines`).
    """
    rows = np.asarray(records_at_step, dtype=np.float64)
    if rows.ndim != 2 or rows.shape != (len(layers), record.NUM_FIELDS):
        raise ValueError(f"records_at_step must have shape [{len(layers)}, {record.NUM_FIELDS}], got {rows.shape}")
    if statuses is not None and len(statuses) != len(layers):
        raise ValueError(f"{len(statuses)} statuses for {len(layers)} layers")
    t = thresholds
    ev = evaluate(rows[None], layers, t)
    d = record.derived(rows)
    ref_log = float(ev.ref[0])
    live = ev.log_rms[0][np.isfinite(ev.log_rms[0])]
    median = 10.0 ** float(np.median(live)) if live.size else None
    ref = 10.0 ** ref_log if math.isfinite(ref_log) else None
    vanish, explode = _band_lines(ref, t)
    out_layers = []
    for i, name in enumerate(layers):
        code = int(ev.raw[0, i])
        st = statuses[i] if statuses is not None else STATUSES[MISSING if code == ABSENT else code]
        known = bool(ev.present[0, i]) and d["finite"][i] > 0
        out_layers.append({"layer": name, "index": i, "norm": json_float(d["norm"][i]) if known else None,
                           "rms": json_float(d["rms"][i]) if known else None,
                           "max_abs": json_float(d["max_abs"][i]) if known else None, "status": st})
    return {"layers": out_layers,
            "bands": {"reference_rms": ref, "median_rms": median,
                      "vanishing_below": json_float(vanish) if vanish > 0 else None,
                      "exploding_above": json_float(explode)}}


def _band_lines(ref: float | None, t: Thresholds) -> tuple[float, float]:
    """``(vanishing_below, exploding_above)``. The relative lines follow the reference; a reference that is itself
    beyond the absolute lines (a run blowing up: 1e22 near the loss) would put the relative vanishing line above the
    absolute exploding one, and a layer there is exploding, not vanishing (exploding outranks it). The chart then
    draws the absolute lines, the only ones that still separate the two (none for vanishing where the thresholds
    themselves cross)."""
    vanish = max(ref * 10.0 ** -t.vanish_decades, t.vanish_rms_below) if ref else t.vanish_rms_below
    explode = min(ref * 10.0 ** t.explode_decades, t.explode_rms_above) if ref else t.explode_rms_above
    if not vanish < explode:
        vanish, explode = t.vanish_rms_below, t.explode_rms_above
    return (vanish if vanish < explode else 0.0), explode  # 0: no vanishing line (thresholds that cross)
