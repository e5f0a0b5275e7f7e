"""What the records say about the optimizer, for the reasons: gradient clipping and layer-wise adaptive updates.

Both change what a gradient's size means. A clipped gradient's recorded norm sits at the clip; under LAMB or LARS
every layer's update is the same fraction of its weights whatever its gradient. The diagnosis states them beside the
verdict instead of guessing a different one.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth.health.rules import _Steps, layerwise_common

#: Logged steps at which a variable's gradient norm must repeat (to float32 precision) to read as clipped.
CLIP_STEPS = 3
#: Relative difference under which two recorded norms are the same number (float32 rounding of the clip).
_SAME = 1e-5
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
    """The common update/weight ratio at step row ``s`` under a layer-wise adaptive optimizer, else None (see
    :func:`~tb_gradhealth.health.rules.layerwise_common`)."""
    common = layerwise_common(ev.upd_ratio[s:s + 1], ev.weight_norm[s:s + 1], ev.size[s:s + 1])[0]
    return float(common) if np.isfinite(common) else None


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
