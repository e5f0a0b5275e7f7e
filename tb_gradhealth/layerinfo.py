"""Each variable's layer kind and activation: taken from a Keras model by its writer, read back from a tag's metadata.

The diagnosis uses them to explain a status and to pick its fix (vanishing through sigmoid Dense layers: ReLU/GELU
with He init; dead behind ReLU: LeakyReLU, a lower learning rate). Records cannot tell a layer's kind; the model
can, so the writer that has the model stores ``(kind, activation)`` per row in the tag's metadata
(:attr:`tb_gradhealth.metadata.Content.layer_info`). Logs without it read as before. No framework is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tb_gradhealth import metadata
from tb_gradhealth._eventfile import iter_summary_values


def _activation_name(layer: Any) -> str:
    act = getattr(layer, "activation", None)
    if act is None:
        return ""
    name = getattr(act, "__name__", None) or getattr(act, "name", None) or type(act).__name__
    return str(name)


def model_layer_info(model: Any, variables: Sequence[Any]) -> tuple[tuple[str, str], ...]:
    """``(layer kind, activation)`` per variable of a Keras model (``""`` where not known): the innermost layer
    that owns the variable, e.g. ``("Dense", "sigmoid")``, ``("LayerNormalization", "")``."""
    owner: dict[int, tuple[str, str]] = {}
    layers = list(model._flatten_layers(include_self=False, recursive=True))  # outer layers first
    for layer in layers:
        for v in getattr(layer, "trainable_weights", ()):
            owner[id(v)] = (type(layer).__name__, _activation_name(layer))  # an inner layer overrides its parent
    return tuple(owner.get(id(v), ("", "")) for v in variables)


def read_layer_info(paths: Sequence[str], storage_options: Mapping[str, Any] | None = None
                    ) -> dict[str, tuple[str, str]]:
    """``{variable: (kind, activation)}`` from the gradient-health tags' metadata of a run's event files (empty
    for logs written without it). Damage is skipped silently: the gradient reader reports it."""
    out: dict[str, tuple[str, str]] = {}
    for _, value in iter_summary_values(paths, storage_options):
        data = value.metadata.plugin_data
        if data.plugin_name != metadata.PLUGIN_NAME or not data.content:
            continue
        try:
            content = metadata.decode_content(data.content)
        except ValueError:
            continue
        out.update(zip(content.layers, content.layer_info, strict=False))  # () without info
    return out
