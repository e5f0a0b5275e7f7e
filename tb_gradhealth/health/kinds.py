"""Each layer's kind and activation (where its writer knew the model) in the reasons and the fixes.

The records cannot tell a sigmoid Dense layer from a ReLU convolution; where the tag's metadata says what a variable's
layer is (:mod:`tb_gradhealth.layerinfo`), a flagged layer's reasons name it and its first fix is the one for that
kind: vanishing through a saturating activation, vanishing although the activation does not saturate, dead ReLUs.
"""

from __future__ import annotations

from collections.abc import Mapping

from tb_gradhealth.health.result import LayerHealth
from tb_gradhealth.health.thresholds import FLAGS

#: Activations whose derivative goes to zero at both ends: a deep stack of them shrinks the gradient.
SATURATING = frozenset({"sigmoid", "tanh", "hard_sigmoid", "softsign", "softmax", "hard_tanh", "log_sigmoid"})
#: Activations whose units die (zero output and gradient for every input of the batch).
RECTIFIERS = frozenset({"relu", "relu6"})


def _fix(status: str, kind: str, act: str) -> str | None:
    what = f"this {kind or 'layer'}"
    if status == "vanishing" and act in SATURATING:
        return (f"{what} uses {act}, which saturates: use ReLU/GELU with He initialisation, add normalisation "
                f"(BatchNorm/LayerNorm) or residual connections")
    if status == "vanishing" and act:
        return (f"{what}'s activation ({act}) does not saturate: look at the initialisation scale, normalisation, "
                f"or what scales the gradient down before it (a small multiplier, a stop_gradient, a saturating "
                f"layer deeper in the network)")
    if status == "dead" and act in RECTIFIERS:
        return (f"{what}'s {act} units are dead: lower the learning rate, use LeakyReLU/GELU, or initialise its "
                f"bias at or above zero")
    return None


def explain_kinds(out: list[LayerHealth], info: Mapping[str, tuple[str, str]]) -> None:
    """Name each flagged layer's kind and activation in its reasons, and put the fix for that kind first."""
    for lh in out:
        kind, act = info.get(lh.layer, ("", ""))
        if lh.status not in FLAGS or not (kind or act):
            continue
        lh.reasons.append(f"layer: {kind or 'unknown kind'}" + (f", activation {act}" if act else ""))
        fix = _fix(lh.status, kind, act)
        if fix is not None:
            lh.fixes = [fix, *(f for f in lh.fixes if not f.startswith(("if the activations saturate",
                                                                        "an all-zero gradient behind ReLUs")))]
