"""A per-model baseline for the zoo: AutoTrainer's gradient rules applied to the same records.

AutoTrainer (IEEE TDSC 2024; ``AutoTrainer/utils/monitor.py`` of the public repository ``shiningrain/AUTOTRAINER``)
judges a whole model from one batch's gradients: with ``rate = ||g(first kernel)|| / ||g(last kernel)||``,

* vanishing when ``rate < beta_1 = 1e-3`` and ``||g(first kernel)|| < beta_2 = 1e-4``;
* exploding when ``rate > beta_3 = 70``, or when any gradient has NaN/Inf;
* dying ReLU when at least ``gamma = 0.7`` of all gradient elements are exactly zero;

and reports a gradient symptom as a problem only while training does not progress (accuracy below ``Theta = 0.7``,
or no epoch improved it by ``delta = 0.01``); NaN is reported whatever the progress. The zoo logs the raw loss, not
the accuracy, so progress is approximated here: a run progresses when the mean loss of its last quarter of logged
steps is at least 10% below that of its first quarter. The same rule is also printed without the progress gate.

The records carry every number these rules read (exact norms and zero counts), so the baseline is computed from
the same event files the diagnosis reads. ``verdict`` answers one word per model at the last logged step, as this
baseline first did; ``verdict_every_check`` is the fairer reading: AutoTrainer checks at every monitored batch and
accumulates its symptoms, and also stops on a NaN loss (or a loss of ``LOSS_HUGE`` or more) and on NaN weights, so
there the symptom seen at any logged step counts (the first one, NaN first), gated by progress as above.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from tb_gradhealth import _eventfile, reader, record

BETA_1, BETA_2, BETA_3, GAMMA = 1e-3, 1e-4, 70.0, 0.7
#: Loss improvement (first quarter -> last quarter of the logged steps) that counts as progress.
PROGRESS = 0.10
#: AutoTrainer's loss check: a NaN loss, or a loss at least this large, is an explosion.
LOSS_HUGE = 1e5


def symptom(layers: Sequence[str], rows: np.ndarray) -> str | None:
    """AutoTrainer's gradient symptom of one step's records (``[L, NUM_FIELDS]``), or None."""
    d = record.derived(rows)
    if np.any(d["nan"] + d["inf"] > 0):
        return "nonfinite"
    kernels = [i for i, name in enumerate(layers) if name.rsplit("/", 1)[-1] in ("kernel", "depthwise_kernel")
               and np.isfinite(d["norm"][i])]
    if np.nansum(d["zero"]) >= GAMMA * np.nansum(d["size"]):
        return "dead"
    if len(kernels) < 2 or not d["norm"][kernels[-1]] > 0:
        return None
    first, rate = float(d["norm"][kernels[0]]), float(d["norm"][kernels[0]] / d["norm"][kernels[-1]])
    if rate > BETA_3:
        return "exploding"
    if rate < BETA_1 and first < BETA_2:
        return "vanishing"
    return None


def losses(run_dir: str) -> np.ndarray:
    """The scalar ``loss`` values of a run directory's event files, in step order."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.util import tensor_util

    found: dict[int, float] = {}
    for name in sorted(os.listdir(run_dir)):
        if not reader.is_event_file(name):
            continue
        for payload in _eventfile.iter_records(os.path.join(run_dir, name), []):
            event = event_pb2.Event.FromString(payload)
            for value in event.summary.value:
                if value.tag == "loss":
                    v = value.simple_value if value.HasField("simple_value") else tensor_util.make_ndarray(
                        value.tensor).item()
                    found[int(event.step)] = float(v)
    return np.array([found[k] for k in sorted(found)])


def progresses(loss: np.ndarray) -> bool | None:
    """Whether the loss improved by ``PROGRESS`` from the first to the last quarter (None: no finite loss)."""
    loss = loss[np.isfinite(loss)]
    if loss.size < 4:
        return None
    q = max(1, loss.size // 4)
    return bool(loss[-q:].mean() <= (1.0 - PROGRESS) * loss[:q].mean())


def verdict(layers: Sequence[str], records: np.ndarray, loss: np.ndarray) -> tuple[str | None, str | None]:
    """(gated, ungated) AutoTrainer answer for a run at its last logged step."""
    raw = symptom(layers, records[-1])
    if raw in (None, "nonfinite"):
        return raw, raw
    return (None if progresses(loss) else raw), raw


def verdict_every_check(layers: Sequence[str], records: np.ndarray, loss: np.ndarray) -> str | None:
    """AutoTrainer at every logged step: NaN/Inf gradients, weights or loss (or a loss >= ``LOSS_HUGE``) at any
    step answer at once; otherwise the first gradient symptom of any step, reported unless training progresses."""
    weight_bad = ~np.isfinite(records[..., record.INDEX["weight_max_abs"]])
    weight_bad &= ~np.isnan(records[..., record.INDEX["weight_ssq_rel"]])  # NaN there: weights not recorded
    if (~np.isfinite(loss)).any() or weight_bad.any():
        return "nonfinite"
    if (loss >= LOSS_HUGE).any():
        return "exploding"
    seen = [symptom(layers, rows) for rows in records]
    if "nonfinite" in seen:
        return "nonfinite"
    first = next((s for s in seen if s is not None), None)
    return None if first is None or progresses(loss) else first
