"""Each layer's kind and activation (where its writer knew the model) in the reasons and the fixes.

The records cannot tell a sigmoid Dense layer from a ReLU convolution; where the tag's metadata says what a variable's
layer is (:mod:`tb_gradhealth.layerinfo`), a flagged layer's reasons name it and its fixes are worded for that
kind: vanishing through a saturating activation, vanishing although the activation does not saturate, dead ReLUs,
dead (saturated) tanh/sigmoid units. A saturating layer never reads rectifier advice, nor a rectifier saturation
advice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tb_gradhealth.health.result import LayerHealth
from tb_gradhealth.health.thresholds import DEAD, VANISHING, Status

#: Activations whose derivative goes to zero at both ends: a deep stack of them shrinks the gradient.
SATURATING = frozenset({"sigmoid", "tanh", "hard_sigmoid", "softsign", "softmax", "hard_tanh", "log_sigmoid"})
#: Activations whose units die (zero output and gradient for every input of the batch).
RECTIFIERS = frozenset({"relu", "relu6"})


def kind_fix(status: Status, kind: str, act: str) -> str | None:
    """The fix for ``status`` on a layer of this kind and activation, None where they do not decide it (unknown)."""
    what = f"this {kind or 'layer'}"
    act = act.lower()
    if status == VANISHING and act in SATURATING:
        return (f"{what} uses {act}, which saturates: use ReLU/GELU with He initialisation, add normalisation "
                f"(BatchNorm/LayerNorm) or residual connections")
    if status == VANISHING and act:
        return (f"{what}'s activation ({act}) does not saturate: look at the initialisation scale, normalisation, "
                f"or what scales the gradient down before it (a small multiplier, a stop_gradient, a saturating "
                f"layer deeper in the network)")
    if status == DEAD and act in RECTIFIERS:
        return (f"{what}'s {act} units are dead: lower the learning rate, use LeakyReLU/GELU, or initialise its "
                f"bias at or above zero")
    if status == DEAD and act in SATURATING:
        return (f"{what}'s {act} units are saturated: their inputs are so large that {act}' is exactly 0 in floating "
                f"point; lower the learning rate, use smaller initial weights (Glorot) or normalise the inputs "
                f"(BatchNorm/LayerNorm)")
    if status == DEAD and act:
        return (f"{what}'s activation ({act}) does not die or saturate: the gradient is cut before it (a "
                f"stop_gradient, a zero multiplier, a layer deeper in the network whose units are dead)")
    return None


def explain_kinds(out: list[LayerHealth], info: Mapping[str, tuple[str, str]]) -> list[LayerHealth]:
    """The layers, each flagged one with its kind and activation named in its reasons (its fixes are worded for
    them already)."""
    return [_with_kind(lh, *info.get(lh.layer, ("", ""))) for lh in out]


def _with_kind(lh: LayerHealth, kind: str, act: str) -> LayerHealth:
    if not lh.code.is_flag or not (kind or act):
        return lh
    return dataclasses.replace(lh, reasons=[*lh.reasons, f"layer: {kind or 'unknown kind'}"
                                            + (f", activation {act}" if act else "")])
