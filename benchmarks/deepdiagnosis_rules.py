"""A per-tensor baseline for the zoo: DeepDiagnosis' (ICSE 2022) checks on gradients and weights, applied to the
same records.

Its public callback (``mapFaluireToFix`` in the authors' ``callback/callbacks.py``) checks, per Dense layer at each
check: a *numerical error in the weights' gradient* when the mean gradient is NaN, Inf or exactly 0; a *vanishing
gradient* when the mean absolute gradient is below ``1e-7``; a *numerical error in the weights* when their mean is
NaN, Inf or 0 (here Inf only: its zero check reads Dense kernels, which the records cannot tell from zero-initialised
biases). Its other checks read the forward activations (dead ReLU: >= 70% of outputs <= 0; saturation: > 50%
of pre-activations beyond +-5) or quantities the records do not hold, and its "unchanged tensor / loss not
decreasing" checks need five exactly equal values in a row; they are left out. The records hold the exact RMS, not
the mean |g|: RMS >= mean |g|, so judging the RMS flags a tensor no more often than the check itself would. Every
variable is checked (the records do not say which are Dense kernels). One word per model: ``nonfinite`` for a NaN/Inf
gradient or weight at any logged step, else ``dead`` for an exactly zero gradient, else ``vanishing``, else None.
"""

from __future__ import annotations

import numpy as np

from tb_gradhealth import record

VANISHING_THRESHOLD = 1e-7


def verdict(records: np.ndarray) -> str | None:
    """The model-level answer of the checks over a run's ``[S, L, NUM_FIELDS]`` records."""
    d = record.derived(records)
    with np.errstate(invalid="ignore"):
        # its zero-weights check reads Dense kernels, which the records cannot tell from zero-initialised biases
        if np.any(np.nan_to_num(d["nan"] + d["inf"]) > 0) or np.any(np.isinf(d["weight_norm"])):
            return "nonfinite"
        if np.any((d["zero_fraction"] == 1.0) & (d["missing"] == 0)):
            return "dead"
        if np.any(d["rms"] < VANISHING_THRESHOLD):
            return "vanishing"
    return None
