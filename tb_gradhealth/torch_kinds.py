"""Each parameter's layer kind and activation from a PyTorch module tree, in the Keras writer's words.

The diagnosis names a flagged layer's kind and activation and picks its fix by them (:mod:`tb_gradhealth.health.kinds`),
from what the writer stores in the tag's metadata (:mod:`tb_gradhealth.layerinfo`). A parameter's kind is the class
of the module that owns it, mapped to the Keras class of the same layer (``Linear`` -> ``Dense``, ``Conv2d`` ->
``Conv2D``, ``LayerNorm`` -> ``LayerNormalization``; a class with no Keras twin keeps its own name), so a torch run
and a Keras run of one network read alike. Its activation is known where the order of the calls is: the next
activation module after its layer among the children of an ``nn.Sequential`` (Dropout, Identity and Flatten in
between change nothing); anywhere else it is ``""``. Nothing here runs the model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ACTIVATIONS", "KINDS", "layer_info_for", "module_layer_info"]

#: torch layer classes whose Keras twin has another name (any other class keeps its own name).
KINDS = {
    "Linear": "Dense", "LazyLinear": "Dense", "Bilinear": "Dense",
    "Conv1d": "Conv1D", "Conv2d": "Conv2D", "Conv3d": "Conv3D",
    "ConvTranspose1d": "Conv1DTranspose", "ConvTranspose2d": "Conv2DTranspose", "ConvTranspose3d": "Conv3DTranspose",
    "BatchNorm1d": "BatchNormalization", "BatchNorm2d": "BatchNormalization", "BatchNorm3d": "BatchNormalization",
    "LayerNorm": "LayerNormalization", "GroupNorm": "GroupNormalization", "RMSNorm": "RMSNormalization",
    "RNN": "SimpleRNN", "MultiheadAttention": "MultiHeadAttention", "EmbeddingBag": "Embedding",
}
#: torch activation modules, as Keras names the same function.
ACTIVATIONS = {
    "ReLU": "relu", "ReLU6": "relu6", "LeakyReLU": "leaky_relu", "PReLU": "prelu", "ELU": "elu", "SELU": "selu",
    "CELU": "celu", "GELU": "gelu", "SiLU": "silu", "Mish": "mish", "Sigmoid": "sigmoid", "Tanh": "tanh",
    "Hardsigmoid": "hard_sigmoid", "Hardtanh": "hard_tanh", "Hardswish": "hard_swish", "Softsign": "softsign",
    "Softplus": "softplus", "Softmax": "softmax", "LogSigmoid": "log_sigmoid", "LogSoftmax": "log_softmax",
    "Tanhshrink": "tanh_shrink",
}
#: Modules between a layer and its activation that leave the activation the layer's.
_PASS_THROUGH = frozenset({"Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "Identity", "Flatten",
                           "Unflatten"})


def _next_activation(children: Sequence[torch.nn.Module], i: int) -> str:
    for nxt in children[i + 1:]:
        name = type(nxt).__name__
        if name in ACTIVATIONS:
            return ACTIVATIONS[name]
        if name not in _PASS_THROUGH:
            return ""
    return ""


def module_layer_info(module: torch.nn.Module) -> dict[str, tuple[str, str]]:
    """``{parameter name: (layer kind, activation)}`` for every parameter of ``module``, named as
    ``module.named_parameters()`` names it, e.g. ``{"0.weight": ("Dense", "sigmoid")}`` for ``Sequential(Linear,
    Sigmoid)``; the activation is ``""`` where the module tree does not say it."""
    activation: dict[int, str] = {}
    for seq in module.modules():
        if isinstance(seq, torch.nn.Sequential):
            children = list(seq.children())
            for i, child in enumerate(children):
                activation.setdefault(id(child), _next_activation(children, i))
    out: dict[str, tuple[str, str]] = {}
    for prefix, owner in module.named_modules():
        name = type(owner).__name__
        for pname, _ in owner.named_parameters(recurse=False):
            full = f"{prefix}.{pname}" if prefix else pname
            out.setdefault(full, (KINDS.get(name, name), activation.get(id(owner), "")))
    return out


def layer_info_for(module: torch.nn.Module, names: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``(kind, activation)`` of each of ``names`` (rows of a record), ``("", "")`` for a name not in the module."""
    info = module_layer_info(module)
    return tuple(info.get(n, ("", "")) for n in names)
