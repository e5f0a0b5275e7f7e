"""Diagnosis: from a run's per-layer records, decide which layers are sick, since when and how badly.

Pure numpy on top of :mod:`tb_gradhealth.record` (no TensorFlow, no TensorBoard), so the plugin, the CLI and any
script share one diagnosis. The rules and the reasons behind every default are in ``docs/DIAGNOSIS.md``.

Every rule is evaluated for every (logged step, layer) at once on ``[S, L]`` arrays, which gives each layer a raw
status per step. Vanishing and exploding are properties of the gradient's flow through depth, so they are judged
against the *reference*: the layers nearest the loss (where backprop starts), never a statistic that sinks with the
disease. The per-step statuses become *episodes* (runs of one status, slow diseases confirmed over several logged
steps); a layer's status is that of its last record, and ``first_step`` is the onset of its current chain of
episodes. ``layers`` are in network (forward) order: backprop computes gradients deepest layer first.

The package's modules follow that design: ``thresholds`` (status words, knobs), ``levels`` (what the rules read),
``rules`` (per-step rules), ``episodes`` (runs of one status, onset, timeline), ``reasons`` (text, severity, the
cause), ``answer`` (the run's answer: the cause layer, since when, its story, fixes and headline, defined once
for every view, with the ranks and the tie-breaks the timeline shares), ``fixes`` (what to do), ``optimizer``
(clipping and layer-wise updates read from the records), ``progress`` (the loss as evidence), ``kinds`` (layer kind
and activation in reasons and fixes), ``forward`` (the layers' outputs read as
evidence) and ``outputs`` (their words in the reasons), ``result`` (the public result), ``diagnose``
(``diagnose_run``) and ``profile`` (one step).
"""

from __future__ import annotations

from tb_gradhealth.health.diagnose import diagnose_run
from tb_gradhealth.health.episodes import BLOWN_UP, CHAIN_GAP
from tb_gradhealth.health.forward import Forward, depth_profile, output_history
from tb_gradhealth.health.levels import REFERENCE_FRACTION, REFERENCE_MIN, layer_groups
from tb_gradhealth.health.profile import profile
from tb_gradhealth.health.result import LayerHealth, RunHealth
from tb_gradhealth.health.rules import TREND_MIN_SIZE
from tb_gradhealth.health.thresholds import (
    DEAD,
    EXPLODING,
    FLAG_CODES,
    FLAGS,
    FROZEN,
    HEALTHY,
    INERT,
    MISSING,
    NONFINITE,
    STATUSES,
    VANISHING,
    Status,
    ThresholdError,
    Thresholds,
)

__all__ = [
    "BLOWN_UP", "CHAIN_GAP", "DEAD", "EXPLODING", "FLAGS", "FLAG_CODES", "FROZEN", "HEALTHY", "INERT", "MISSING",
    "NONFINITE",
    "REFERENCE_FRACTION", "REFERENCE_MIN", "STATUSES", "TREND_MIN_SIZE", "VANISHING", "Forward", "LayerHealth",
    "RunHealth", "Status", "ThresholdError", "Thresholds", "depth_profile", "diagnose_run", "layer_groups",
    "output_history", "profile",
]
