"""The layers' outputs in a diagnosis' words: the saturated fraction in a saturating layer's vanishing reason, a
forward blow-up named as the cause of the exploding layers after it, and each layer's latest output fields
(docs/DIAGNOSIS.md, "The layers' outputs"). Reads :mod:`tb_gradhealth.health.forward`; changes no status."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tb_gradhealth import record
from tb_gradhealth.health.fixes import FORWARD_GROWTH
from tb_gradhealth.health.forward import Blowup, Forward, Units, first_blowup, latest_at, layer_fields
from tb_gradhealth.health.kinds import SATURATING
from tb_gradhealth.health.result import LayerHealth
from tb_gradhealth.health.thresholds import EXPLODING, VANISHING, Thresholds


def explain_outputs(out: Sequence[LayerHealth], fw: Forward, units: Units, t: Thresholds, step: int
                    ) -> list[LayerHealth]:
    """The layers with their output's evidence: ``forward`` (the latest fields of the output that shows each
    layer's units, at or before ``step``) on every layer with one, and the reasons above on the flagged ones."""
    a = latest_at(fw, step)
    rows = {str(name): r for r, name in enumerate(fw.layers)}
    blowups: dict[int, Blowup | None] = {}
    healed = []
    for lh in out:
        shown = units.shown[lh.index]
        if a is None or not shown:
            healed.append(lh)
            continue
        reasons, fixes = list(lh.reasons), list(lh.fixes)
        if lh.code == VANISHING and units.activation[lh.index] in SATURATING:
            reasons.append(_saturated_reason(fw, rows[shown], units.activation[lh.index], lh.step or step))
        if lh.code == EXPLODING and lh.first_step is not None:
            if lh.first_step not in blowups:
                blowups[lh.first_step] = first_blowup(fw, units.position, lh.first_step, step, t.forward_growth)
            found = blowups[lh.first_step]
            if found is not None and units.position[lh.index] >= found.first:
                reasons.append(_blowup_reason(fw, found, units.position[lh.index] == found.first))
                fixes = [FORWARD_GROWTH, *(f for f in fixes if f != FORWARD_GROWTH)]
        healed.append(dataclasses.replace(lh, reasons=reasons, fixes=fixes,
                                          forward=layer_fields(fw, a, rows[shown])))
    return healed


def _saturated_reason(fw: Forward, r: int, act: str, step: int) -> str:
    """``62% of its tanh outputs within 1% of their range from a bound at step N``, or that none was recorded."""
    a = latest_at(fw, step)
    frac = float(record.act_derived(fw.records[a, r][None])["saturated_fraction"][0]) if a is not None else float("nan")
    if frac != frac:  # NaN: no finite output, or no record
        return f"forward: no saturated fraction of its {act} outputs recorded at or before step {step}"
    return (f"forward: {frac:.0%} of its {act} outputs ({fw.layers[r]}) within {record.SATURATION_MARGIN:.0%} of "
            f"their range from a bound at step {int(fw.steps[a])}, where {act}' is at most 4% of its largest")


def _blowup_reason(fw: Forward, b: Blowup, starts: bool) -> str:
    """The climb as the cause of an exploding layer's gradient: after the climb's first layer, through its inputs;
    at that layer (``starts``), whose inputs are the data, through the layers after it, whose weights multiply the
    gradient on its way back as they multiply the activations on their way forward."""
    how = ("the layers after it multiply its gradient on the way back as they multiply the activations on the way "
           "forward" if starts else "this layer's gradient is large because its inputs are")
    return (f"cause: the activations blow up on their way forward: output RMS {b.first_rms:.2g} at "
            f"{fw.layers[b.first]} -> {b.peak_rms:.2g} at {fw.layers[b.peak]} ({b.growth:,.0f}x over {b.layers} "
            f"layers) at step {b.step}; {how}")
