"""Framed binary files: magic, u32 version, u32 header length, a UTF-8 JSON header, then the payload.

Slot snapshots (BSLT) and prefix cache files (BPXC) share this frame; each checks its own payload.
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

FRAME = struct.Struct("<4sII")
MAX_HEADER = 1 << 20


def write_frame(out: BinaryIO, magic: bytes, version: int, header: dict) -> None:
    """The frame's prefix and JSON header; the caller writes the payload after it."""
    encoded = json.dumps(header).encode()
    out.write(FRAME.pack(magic, version, len(encoded)))
    out.write(encoded)


def read_frame(data: bytes, magic: bytes, version: int, what: str, error: type[Exception]) -> tuple[dict, int]:
    """The JSON header of a frame and the payload's offset; `error(message)` for anything unusable."""
    if len(data) < FRAME.size:
        raise error(f"{what} is truncated ({len(data)} bytes)")
    found_magic, found_version, header_len = FRAME.unpack_from(data)
    if found_magic != magic:
        raise error(f"not a {what} (bad magic)")
    if found_version != version:
        raise error(f"{what} version {found_version} is not supported (only {version})")
    if header_len > MAX_HEADER or FRAME.size + header_len > len(data):
        raise error(f"{what} header runs past the end of the file")
    try:
        header = json.loads(data[FRAME.size: FRAME.size + header_len])
    except ValueError as exc:
        raise error(f"{what} header is invalid: {exc}") from exc
    if not isinstance(header, dict):
        raise error(f"{what} header is invalid: not an object")
    return header, FRAME.size + header_len
