"""What the records say about the optimizer, for the reasons: gradient clipping and layer-wise adaptive updates.

Both change what a gradient's size means. A clipped gradient's recorded norm sits at the clip; under LAMB or LARS
every layer's update is the same fraction of its weights whatever its gradient. The diagnosis states them beside the
verdict instead of guessing a different one.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth import record
from tb_gradhealth.health.levels import CLIP_STEPS, layerwise_common
from tb_gradhealth.health.rules import Steps


def clipped_norm(ev: Steps, i: int) -> float | None:
    """The norm a variable's gradient is clipped to, when it sits there at ``CLIP_STEPS`` or more of its logged
    steps (:func:`~tb_gradhealth.health.levels.pinned_at_clip`), else None."""
    pinned = ev.clipped[:, i]
    return float(ev.norm[pinned, i].max()) if pinned.any() else None


def layerwise_adaptive(ev: Steps, s: int) -> float | None:
    """The common update/weight ratio at step row ``s`` under a layer-wise adaptive optimizer, else None (see
    :func:`~tb_gradhealth.health.rules.layerwise_common`)."""
    common = layerwise_common(ev.upd_ratio[s:s + 1], ev.weight_norm[s:s + 1], ev.size[s:s + 1])[0]
    return float(common) if np.isfinite(common) else None


def optimizer_notes(ev: Steps, s: int, i: int) -> list[str]:
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


#: Spread (decades) under which every variable's update/gradient ratio at a step is one factor.
_COMMON_FACTOR = 0.01
#: Spread (decades) under which factor x global gradient norm is one number: the clip, times the learning rate.
_SAME_PRODUCT = 0.005
#: The factor must change by this much (decades) over the clipped steps, else it is a constant learning rate.
_FACTOR_MOVES = 0.05


def global_clip(records: np.ndarray) -> tuple[float, int] | None:
    """``(lr x clip, clipped logged steps)`` when the updates show global gradient clipping, else None.

    Under SGD with ``global_clipnorm`` every variable's update is its gradient times one factor, ``lr x clip / G``
    (``G`` the norm of the whole gradient) at the steps where ``G`` exceeds the clip: the factor is common to all
    variables, it changes from step to step, and factor x ``G`` is the same number. Needs the updates recorded and
    the gradient recorded before clipping (a loop that records the gradient it passes to the optimizer; the Keras
    callback records the clipped gradient the optimizer applies)."""
    d = record.derived(records)
    with np.errstate(invalid="ignore", divide="ignore"):
        factor = np.log10(d["update_norm"] / d["norm"])
        factor = np.where(np.isfinite(factor), factor, np.nan)
        n = np.isfinite(factor).sum(axis=1)
        spread = np.where(n >= 2, np.nanmax(np.where(n[:, None] > 0, factor, 0.0), axis=1)
                          - np.nanmin(np.where(n[:, None] > 0, factor, 0.0), axis=1), np.inf)
        common = np.nanmedian(np.where(n[:, None] > 0, factor, 0.0), axis=1)
        product = common + 0.5 * np.log10(np.nansum(np.where(np.isfinite(d["norm"]), d["norm"], 0.0) ** 2, axis=1))
    rows = np.flatnonzero((n >= 2) & (spread <= _COMMON_FACTOR) & np.isfinite(product))
    if rows.size < CLIP_STEPS:
        return None
    top = float(product[rows].max())
    clipped = rows[product[rows] >= top - _SAME_PRODUCT]
    if clipped.size < CLIP_STEPS or float(np.ptp(common[clipped])) < _FACTOR_MOVES:
        return None
    return 10.0 ** top, int(clipped.size)


def global_clip_note(records: np.ndarray) -> str | None:
    found = global_clip(records)
    if found is None:
        return None
    product, steps = found
    return (f"note: at {steps} logged steps every variable's update is its gradient times one factor that shrinks as "
            f"the whole gradient's norm grows (factor x global norm = {product:.3g}): global gradient clipping "
            f"(global_clipnorm); the gradient recorded is the one before clipping, so an explosion still shows in it")
