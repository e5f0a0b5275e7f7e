"""Plugin name, tag layout and the versioned ``SummaryMetadata`` of gradient-health summaries.

TensorBoard keeps only the first ``SummaryMetadata`` of a tag, so the layer names of a tag (the rows of its
record tensors) live in the metadata ``content`` and a tag's layer list never changes: a writer that logs a
different set of layers uses another tag (:func:`tag_for`). TF's summary writer repeats the metadata in every
event, so the content is zlib-compressed JSON (layer paths share long prefixes: ~5 bytes a layer).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tensorboard.compat.proto import summary_pb2

from tb_gradhealth import record

PLUGIN_NAME = "gradhealth"
#: Tags are ``gradhealth/<name>/<8 hex digits of the layer list>``.
TAG_PREFIX = PLUGIN_NAME + "/"


@dataclass(frozen=True)
class Content:
    """What the metadata of one tag says: format version, layer names (rows), and how the records were made."""

    version: int
    layers: tuple[str, ...]
    kind: str = "gradients"
    hist_sample: int = record.DEFAULT_HIST_SAMPLE
    #: Per row, what the writer knows of the variable's layer: ``(layer kind, activation)`` (``""``: not known),
    #: e.g. ``("Dense", "sigmoid")``; empty when the writer does not know the model (and in logs written before it).
    layer_info: tuple[tuple[str, str], ...] = ()
    #: What the writer knows of the training loop (:data:`SOURCE_KEYS`), e.g. ``{"loop": "keras.fit", "optimizer":
    #: "SGD", "momentum": "0.9"}``; empty where the writer said nothing (and in logs written before it).
    source: Mapping[str, str] = field(default_factory=dict)


#: Version of the optional ``info`` entry of the content (the layer kind and activation per row). Additive: a reader
#: that does not know it ignores it, and content without it reads as ``layer_info=()``.
LAYER_INFO_VERSION = 1
#: Version of the optional ``source`` entry of the content (what the writer knows of the training loop). Additive as
#: ``info``: content without it, or with a newer version of it, reads as ``source={}``.
SOURCE_VERSION = 1
#: The keys of ``source``: the loop that wrote the records (one of :data:`LOOPS`), the optimizer's class name, its
#: momentum where it has one (as text, e.g. ``"0.9"``), and the global norm the loop clips the gradients to where it
#: clips them (``"1"``: Hugging Face ``Trainer``'s ``max_grad_norm``, Lightning's ``gradient_clip_val``, Keras'
#: ``global_clipnorm``). A key added later reads in older readers as absent.
SOURCE_KEYS = ("loop", "optimizer", "momentum", "clip_norm")
#: The loops the package's writers name: ``model.fit`` through the Keras callback, a custom TensorFlow loop (the
#: ``summary`` op, TPU and ``tf.distribute`` helpers), PyTorch's ``StepRecorder``, Lightning, Hugging Face
#: ``Trainer``, JAX/optax, and the numpy ``Writer`` called by the user's own code.
LOOPS = ("keras.fit", "tf", "torch", "lightning", "transformers", "jax", "numpy")


class UnsupportedVersion(ValueError):
    """A record written by a newer tb_gradhealth than this one can read."""


#: Layer-steps a step-block tag holds at most: at the record's largest size (18 + 77 float32 a row, ~380 bytes) a
#: tag stays near 100 MB, well under the 256 MB that TensorBoard's data server answers in one read.
BLOCK_LAYER_STEPS = 1 << 18


def block_steps(n_layers: int) -> int:
    """Steps per step-block tag for a tag of ``n_layers`` rows: the largest power of two with
    ``n_layers * block_steps <= BLOCK_LAYER_STEPS`` (at least 1)."""
    n = max(1, BLOCK_LAYER_STEPS // max(1, int(n_layers)))
    return 1 << (n.bit_length() - 1)


def tag_for(layers: tuple[str, ...] | list[str], name: str = "gradients", step: int | None = None, *,
            kind: str = record.GRADIENTS) -> str:
    """The tag of a record tensor whose rows are ``layers`` (stable across processes and runs).

    Without ``step``: ``gradhealth/<name>/<hash8>``, one tag for every step (what the TF summary op writes). With
    ``step``: ``gradhealth/<name>/<hash8>.<block>``, ``block = step // block_steps(len(layers))``: a run's records
    split over tags of at most :data:`BLOCK_LAYER_STEPS` layer-steps each, so that a reader can fetch a run of any
    length in answers of bounded size (readers merge a run's tags by layer name, old ones included).

    Forward records (``kind="activations"``) of the stream ``name`` go under ``gradhealth/<name>/activations/...``:
    the same stream (one series with its gradients, :func:`tb_gradhealth._streams.stream_of`), a tag of their own.
    """
    digest = hashlib.sha1("\n".join(layers).encode("utf-8")).hexdigest()[:8]
    base = f"{TAG_PREFIX}{name}/{kind}/{digest}" if kind == record.ACTIVATIONS else f"{TAG_PREFIX}{name}/{digest}"
    return base if step is None else f"{base}.{int(step) // block_steps(len(layers))}"


def tag_block(tag: str) -> int | None:
    """The step block of a step-block tag (see :func:`tag_for`), None for a tag of every step."""
    _, _, last = tag.rpartition("/")
    _, dot, block = last.partition(".")
    return int(block) if dot and block.isdigit() else None


def encode_content(content: Content) -> bytes:
    payload = {
        "v": content.version,
        "kind": content.kind,
        "layers": list(content.layers),
        "hist_sample": content.hist_sample,
    }
    if content.layer_info:
        payload["info"] = {"v": LAYER_INFO_VERSION, "rows": [list(x) for x in content.layer_info]}
    if content.source:
        payload["source"] = {"v": SOURCE_VERSION, **check_source(content.source)}
    return zlib.compress(json.dumps(payload, separators=(",", ":")).encode("utf-8"), 9)


def decode_content(data: bytes) -> Content:
    """Parse a tag's plugin content; raise :class:`UnsupportedVersion` for a future format, ValueError if corrupt."""
    try:
        payload = json.loads(zlib.decompress(data).decode("utf-8"))
        version = int(payload["v"])
    except (zlib.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable gradhealth metadata: {e}") from e
    if version > record.FORMAT_VERSION:
        raise UnsupportedVersion(
            f"record format v{version} is newer than this tb_gradhealth (reads v{record.FORMAT_VERSION}): upgrade"
        )
    layers = payload.get("layers")
    if not isinstance(layers, list) or not all(isinstance(x, str) for x in layers):
        raise ValueError("unreadable gradhealth metadata: 'layers' is not a list of names")
    return Content(
        version=version,
        layers=tuple(layers),
        kind=str(payload.get("kind", "gradients")),
        hist_sample=int(payload.get("hist_sample", record.DEFAULT_HIST_SAMPLE)),
        layer_info=_layer_info(payload.get("info"), len(layers)),
        source=_source(payload.get("source")),
    )


def _layer_info(info: object, n: int) -> tuple[tuple[str, str], ...]:
    """The ``info`` entry's rows, or ``()`` when absent, of a newer version, or malformed: it is an explanation,
    never a reason to lose the records."""
    if not isinstance(info, dict) or info.get("v") != LAYER_INFO_VERSION:
        return ()
    rows = info.get("rows")
    if not isinstance(rows, list) or len(rows) != n:
        return ()
    if not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, str) for x in r) for r in rows):
        return ()
    return tuple((r[0], r[1]) for r in rows)


def check_source(source: Mapping[str, object]) -> dict[str, str]:
    """``source`` as the content stores it: the keys of :data:`SOURCE_KEYS` that are given, each value a non-empty
    string; ValueError naming a key that is none of them (a typo would be lost silently)."""
    unknown = sorted(str(k) for k in source if k not in SOURCE_KEYS)
    if unknown:
        raise ValueError(f"source: unknown key(s) {', '.join(unknown)} (known: {', '.join(SOURCE_KEYS)})")
    return {k: str(source[k]) for k in SOURCE_KEYS if k in source and source[k] is not None and str(source[k])}


def loop_source(loop: str, optimizer: Any = None) -> dict[str, str]:
    """The ``source`` a writer of ``loop`` (one of :data:`LOOPS`) states: the class name of ``optimizer`` (the one
    that applies the updates; ``None``: not known) and its momentum where it has one other than zero (an attribute
    ``momentum``, as Keras' ``SGD`` and ``RMSprop``, or the first parameter group's, as PyTorch's ``SGD``), and
    its ``global_clipnorm`` where it has one (Keras): :func:`with_clip`."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {LOOPS}, got {loop!r}")
    if optimizer is None:
        return {"loop": loop}
    momentum = getattr(optimizer, "momentum", None)
    groups = getattr(optimizer, "param_groups", None)
    if momentum is None and isinstance(groups, list) and groups and isinstance(groups[0], dict):
        momentum = groups[0].get("momentum")
    try:
        momentum = float(momentum) if momentum is not None else None
    except (TypeError, ValueError):  # a schedule or a tensor: not a number the loop states
        momentum = None
    source = {"loop": loop, "optimizer": type(optimizer).__name__}
    if momentum:
        source["momentum"] = f"{momentum:g}"
    return with_clip(source, getattr(optimizer, "global_clipnorm", None))  # Keras' optimizers clip by it


def with_clip(source: dict[str, str], clip_norm: Any) -> dict[str, str]:
    """``source`` stating ``clip_norm``, the global norm the loop clips every step's gradients to, where it is a
    positive number (a step whose gradients' global norm reaches it was clipped, whether the records hold the
    gradient before the clip or after it)."""
    try:
        clip = float(clip_norm) if clip_norm is not None else None
    except (TypeError, ValueError):  # a schedule or a tensor: not a number the loop states
        clip = None
    if clip is not None and clip > 0 and math.isfinite(clip):
        source["clip_norm"] = f"{clip:g}"
    return source


def _source(entry: object) -> dict[str, str]:
    """The ``source`` entry, or ``{}`` when absent, of a newer version, or malformed (as :func:`_layer_info`)."""
    if not isinstance(entry, dict) or entry.get("v") != SOURCE_VERSION:
        return {}
    return {k: entry[k] for k in SOURCE_KEYS if isinstance(entry.get(k), str) and entry[k]}


def create_summary_metadata(
    layers: tuple[str, ...] | list[str],
    *,
    kind: str = "gradients",
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    description: str = "",
    layer_info: tuple[tuple[str, str], ...] = (),
    source: Mapping[str, str] | None = None,
) -> summary_pb2.SummaryMetadata:
    """The ``SummaryMetadata`` for a record tensor of ``kind`` (forward records for ``"activations"``, gradient
    records for any other, each written with :func:`record.version_of` its kind); ``DATA_CLASS_TENSOR`` so the data
    provider serves it.
    ``layer_info``: per row, ``(layer kind, activation)`` where the writer knows the model; ``source``: what the
    writer knows of the training loop (:attr:`Content.source`)."""
    content = Content(record.version_of(kind), tuple(layers), kind, hist_sample, tuple(layer_info),
                      check_source(source or {}))
    return summary_pb2.SummaryMetadata(
        summary_description=description,
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=encode_content(content)
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )
