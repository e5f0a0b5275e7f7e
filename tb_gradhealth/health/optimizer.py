"""What the records say about the optimizer, for the reasons: gradient clipping and layer-wise adaptive updates.

Both change what a gradient's size means. A clipped gradient's recorded norm sits at the clip; under LAMB or LARS
every layer's update is the same fraction of its weights whatever its gradient. The diagnosis states them beside the
verdict instead of guessing a different one.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth.health.rules import _log10, _Steps

#: Logged steps at which a variable's gradient norm must repeat (to float32 precision) to read as clipped.
CLIP_STEPS = 3
#: Relative difference under which two recorded norms are the same number (float32 rounding of the clip).
_SAME = 1e-5
#: Spread (decades) under which every layer's update/weight ratio is one number: a layer-wise adaptive optimizer.
_LAYERWISE_SPREAD = 0.05
#: ... while the variables' weight RMS spread over at least this many decades (else Adam would look the same).
_WEIGHT_SPREAD = 0.3


def clipped_norm(ev: _Steps, i: int) -> float | None:
    """The norm a variable's gradient is clipped to, when it is the same at ``CLIP_STEPS`` or more of its logged steps
    (the largest value it ever had, repeated), else None."""
    norm = ev.rms[:, i] * np.sqrt(np.where(ev.size[:, i] > 0, ev.size[:, i], np.nan))
    norm = norm[np.isfinite(norm) & (norm > 0)]
    if norm.size < CLIP_STEPS:
        return None
    top = float(norm.max())
    return top if int(np.sum(np.abs(norm - top) <= _SAME * top)) >= CLIP_STEPS else None


def layerwise_adaptive(ev: _Steps, s: int) -> float | None:
    """The common update/weight ratio at step row ``s`` when every variable with weights has the same one although
    their weights' scales differ (LAMB, LARS: update = lr x ||w|| x direction; under Adam or SGD layers of different
    weight scales move by different fractions), else None."""
    ratios = _log10(ev.upd_ratio[s])
    scale = _log10(ev.weight_norm[s] / np.sqrt(np.where(ev.size[s] > 0, ev.size[s], np.nan)))
    ok = np.isfinite(ratios) & np.isfinite(scale)
    ratios, scale = ratios[ok], scale[ok]
    if ratios.size < 3 or float(ratios.max() - ratios.min()) > 2 * _LAYERWISE_SPREAD \
            or float(scale.max() - scale.min()) < _WEIGHT_SPREAD:
        return None
    return float(10.0 ** np.median(ratios))


def optimizer_notes(ev: _Steps, s: int, i: int) -> list[str]:
    notes = []
    clip = clipped_norm(ev, i)
    if clip is not None:
        notes.append(f"note: its gradient norm is {clip:.3g} at several logged steps: the recorded gradient is "
                     f"clipped, so its size understates the gradient before clipping; the update/weight ratio is the "
                     f"evidence")
    common = layerwise_adaptive(ev, s)
    if common is not None:
        notes.append(f"note: every layer's update is {common:.2g} of its weights (a layer-wise adaptive optimizer "
                     f"such as LAMB or LARS): the gradient's size does not set how fast a layer learns")
    return notes
