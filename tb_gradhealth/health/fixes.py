"""What to do about a layer's status: short suggestions chosen from the evidence that flagged it.

A chain is fixed at its cause: a layer that exploded and then died gets the explosion's fixes first. The records do
not know a layer's activation or kind, so where the fix depends on it and the writer did not record them, the
suggestion names the condition ("if the activations saturate"); where it did, :func:`kinds.kind_fix` words the
fix for that kind (a tanh layer never reads ReLU advice, a ReLU layer reads the dead-unit one).
"""

from __future__ import annotations

from tb_gradhealth.health.episodes import Track
from tb_gradhealth.health.kinds import kind_fix
from tb_gradhealth.health.rules import Steps
from tb_gradhealth.health.thresholds import DEAD, EXPLODING, INERT, MISSING, NONFINITE, VANISHING

_LOWER_LR = "lower the learning rate (or warm it up over the first steps)"
_LEARNING_RATE = _LOWER_LR + "; clip the gradient norm (clipnorm / global_clipnorm) as a guard"
_DEPTH_GROWTH = ("the gradient grows through depth: use an initialisation that keeps it level (He for ReLU, "
                 "Glorot for tanh), normalisation (BatchNorm/LayerNorm), or scale down residual branches")
FORWARD_GROWTH = ("the activations grow on their way forward: keep each layer's gain at or below 1 (orthogonal or "
                   "identity recurrent weights at gain 1 for a ReLU recurrence, He/Glorot elsewhere), normalise "
                   "(LayerNorm), or use a bounded activation (tanh) in the recurrence")
_VANISHING = ("if the activations saturate (sigmoid/tanh), use ReLU/GELU with He initialisation; add normalisation "
              "or residual connections so the gradient reaches the early layers")
_ADAPTIVE = "an adaptive optimizer (Adam) rescales small gradients; plain SGD passes them on as they are"
_DEAD = ("an all-zero gradient: the units feeding this variable give no gradient (rectifiers that died: LeakyReLU/GELU "
         "or a lower learning rate; saturated tanh/sigmoid: smaller initial weights or inputs, normalisation), or a "
         "path is cut on purpose (stop_gradient, a zero multiplier)")
_NONFINITE_HERE = ("NaN/Inf appears first here: check this layer's numerics (log or division of 0, sqrt of negatives, "
                   "exp overflow); with float16, use dynamic loss scaling")
_MISSING = "the variable is not connected to the loss: remove it or set trainable=False"
_INERT = "the parameter is unused (e.g. a bias before BatchNormalization): use_bias=False removes it"


def learning_rate_fix(clip_norm: float | None, clip_reached: bool) -> str:
    """The learning-rate fix for the loop the writer recorded: a clip of the global norm is advised only to a loop
    that does not state one; a loop whose stated clip the gradients reached is told the clip did not hold, one
    whose clip they never reached that a lower clip would guard."""
    if clip_norm is None:
        return _LEARNING_RATE
    if clip_reached:
        return (f"{_LOWER_LR}: the loop already clips the global gradient norm at {clip_norm:g}, its gradients reached "
                "that clip, and it did not hold them")
    return (f"{_LOWER_LR}; the loop clips the global gradient norm at {clip_norm:g}, which these gradients never "
            "reached: a lower clip would guard")


def fixes(code: int, ev: Steps, track: Track, i: int, nan_here: bool,
          info: tuple[str, str] = ("", "")) -> list[str]:
    """Suggestions for a layer whose confirmed status is ``code``, in the order of its chain (the cause's fix first:
    a layer that exploded and then died gets the explosion's fix before the dead one's), each worded for the layer's
    kind and activation ``info`` where the writer recorded them (:func:`kinds.kind_fix`)."""
    if code == INERT:
        return [_INERT]
    if code == MISSING:
        return [_MISSING]
    chain = [c for c, a, _ in track.runs if a >= track.chain_start()]
    rows = track.rows[track.chain_start():]
    learning_rate = learning_rate_fix(ev.clip_norm, bool(ev.global_clipped[rows].any()))
    out: list[str] = []
    for c in dict.fromkeys(chain):
        if c == EXPLODING:
            lr = (ev.exp_feedback[rows, i] | ev.exp_update[rows, i] | ev.exp_trend[rows, i]
                  | ev.exp_capped[rows, i]).any()
            depth = ev.exp_rel[rows, i].any()
            forward = ev.exp_inputs[rows, i].any()
            out += (([FORWARD_GROWTH] if forward else []) + ([learning_rate] if lr or not (depth or forward) else [])
                    + ([_DEPTH_GROWTH] if depth else []))
        elif c == VANISHING:
            out.append(kind_fix(VANISHING, *info) or _VANISHING)
            if not ev.learns[rows, i].any():
                out.append(_ADAPTIVE)
        elif c == DEAD:
            out.append(kind_fix(DEAD, *info) or _DEAD)
        elif c == NONFINITE:
            out.append(_NONFINITE_HERE if nan_here else learning_rate)
    return list(dict.fromkeys(out))
