"""``gcp-storage-emulator`` with multipart uploads taken byte for byte; run as the emulator's own command line.

The emulator parses a multipart upload (gcsfs's upload of a small object) with Python's ``email`` parser, which
drops a last ``b"\\r"`` of the object: an event-file object ends in that byte whenever its last record's checksum
does (1 object in 256), and the reader then rightly reports a partial record. Google Cloud Storage keeps every byte,
so the tests run the emulator with this one parse replaced.
"""

from __future__ import annotations

import json
import sys
from email.parser import BytesHeaderParser
from typing import Any

from gcp_storage_emulator import server
from gcp_storage_emulator.__main__ import main

_read_data = server._read_data


def split_related(raw: bytes, content_type: str) -> dict[str, Any]:
    """A ``multipart/related`` upload's JSON metadata, content bytes and content type, as the emulator expects.

    Lines break as the first delimiter's line does (gcsfs writes ``\\n``, others ``\\r\\n``); the break before each
    delimiter belongs to it, so a body ending in ``\\r`` keeps it."""
    boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip().strip('"').encode()
    parts = raw.split(b"--" + boundary)[1:-1]  # before the first delimiter: nothing; after the last: "--"
    nl = b"\r\n" if parts[0].startswith(b"\r\n") else b"\n"
    bodies = []
    for part in parts:
        head, _, body = part.removeprefix(nl).partition(nl + nl)
        bodies.append((BytesHeaderParser().parsebytes(head.replace(nl, b"\r\n") + b"\r\n\r\n"),
                       body.removesuffix(nl)))
    (_, meta), (headers, content) = bodies
    return {"meta": json.loads(meta), "content": content,
            "content-type": headers.get_content_type() if headers["Content-Type"] else "application/octet-stream"}


def exact_read_data(request_handler: Any, query: dict) -> Any:
    content_type = request_handler.headers.get("Content-Type") or ""
    if not content_type.startswith("multipart/related"):
        return _read_data(request_handler, query)
    raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
    return split_related(raw, content_type) if raw else None


server._read_data = exact_read_data

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
