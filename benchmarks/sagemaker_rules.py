"""A per-tensor baseline for the zoo: Amazon SageMaker Debugger's built-in ``VanishingGradient`` and
``ExplodingTensor`` rules applied to the same records.

``VanishingGradient`` fires when the mean absolute value of a gradient tensor is below ``threshold`` (default
``1e-7``); ``ExplodingTensor`` fires when a tensor holds NaN or Inf (its defaults: ``only_nan=False``). Both are
evaluated at every saved step, per tensor, with no reference to the other layers. The records hold the exact RMS,
not the mean |g|: RMS >= mean |g|, so judging the RMS flags a tensor no more often than the rule itself would
(the figure is a lower bound of the rule's alarms). One word per model: ``nonfinite`` when ExplodingTensor fired at
any step, else ``vanishing`` when VanishingGradient did, else None.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth import record

VANISHING_THRESHOLD = 1e-7


def verdict(records: np.ndarray) -> str | None:
    """The model-level answer of the two rules over a run's ``[S, L, NUM_FIELDS]`` records."""
    d = record.derived(records)
    if np.any(np.nan_to_num(d["nan"] + d["inf"]) > 0):
        return "nonfinite"
    with np.errstate(invalid="ignore"):
        if np.any(d["rms"] < VANISHING_THRESHOLD):
            return "vanishing"
    return None
