"""Plugin name, tag layout and the versioned ``SummaryMetadata`` of gradient-health summaries.

TensorBoard keeps only the first ``SummaryMetadata`` of a tag, so the layer names of a tag (the rows of its
record tensors) live in the metadata ``content`` and a tag's layer list never changes: a writer that logs a
different set of layers uses another tag (:func:`tag_for`). TF's summary writer repeats the metadata in every
event, so the content is zlib-compressed JSON (layer paths share long prefixes: ~5 bytes a layer).
"""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass

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


class UnsupportedVersion(ValueError):
    """A record written by a newer tb_gradhealth than this one can read."""


def tag_for(layers: tuple[str, ...] | list[str], name: str = "gradients") -> str:
    """The tag of a record tensor whose rows are ``layers`` (stable across processes and runs)."""
    digest = hashlib.sha1("\n".join(layers).encode("utf-8")).hexdigest()[:8]
    return f"{TAG_PREFIX}{name}/{digest}"


def encode_content(content: Content) -> bytes:
    payload = {
        "v": content.version,
        "kind": content.kind,
        "layers": list(content.layers),
        "hist_sample": content.hist_sample,
    }
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
    )


def create_summary_metadata(
    layers: tuple[str, ...] | list[str],
    *,
    kind: str = "gradients",
    hist_sample: int = record.DEFAULT_HIST_SAMPLE,
    description: str = "",
) -> summary_pb2.SummaryMetadata:
    """The ``SummaryMetadata`` for a record tensor; ``DATA_CLASS_TENSOR`` so the data provider serves it."""
    content = Content(record.FORMAT_VERSION, tuple(layers), kind, hist_sample)
    return summary_pb2.SummaryMetadata(
        summary_description=description,
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=PLUGIN_NAME, content=encode_content(content)
        ),
        data_class=summary_pb2.DATA_CLASS_TENSOR,
    )
