"""The integrity envelope of a stored fragment blob, readable without torch.

A blob is a safetensors file whose JSON header carries string metadata. Its ``checksum`` entry
covers every tensor's name, dtype, shape and bytes and every other metadata entry, so a bit flip,
a truncation or an edited header is caught before any tensor is built. The store checks blobs with
this module alone (it never imports torch); the codec builds and opens them.

Parsing follows the safetensors format: 8 bytes of little-endian header length, the JSON header,
then the tensor data. Every offset is checked against the blob's length before use, because a
blob read from a shared store is untrusted input.
"""

from __future__ import annotations

import json
import struct
import zlib

from .exceptions import CorruptFragmentError, InvalidInputError

__all__ = ["CHECKSUM_KEY", "CODECS", "blob_checksum", "check_codec", "codec_label", "read_header", "verify_blob"]

CHECKSUM_KEY = "checksum"
#: fragment codecs, named here so the store can check a setting without importing the codec (torch)
CODECS = ("fp32", "fp16", "int8", "int4")
# crc32 catches bit flips and truncation (what a disk or a network does) at ~4 GB/s; a 4096-token
# fragment set is ~48 MB, and its check sits inside the time to first token.
_ALGORITHM = "crc32"
_MAX_HEADER_BYTES = 16 << 20


def check_codec(name: object, group_size: object) -> None:
    """A codec setting: one of :data:`CODECS`, and ``int4``'s group size an even int >= 2.

    :raises InvalidInputError: otherwise.
    """
    if name not in CODECS:
        raise InvalidInputError(f"codec must be one of {CODECS}, got {name!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2 or group_size % 2:
        raise InvalidInputError(f"group_size must be an even int >= 2, got {group_size!r}")


def codec_label(name: str, group_size: int) -> str:
    """How a codec setting is named in keys and reports (``int4-g32``: the group size matters)."""
    return f"int4-g{group_size}" if name == "int4" else name


def read_header(blob: bytes | memoryview) -> tuple[dict, dict[str, str], int]:
    """Parse a safetensors header.

    :returns: ``(tensors, metadata, data_start)``: each tensor's entry (dtype, shape, data offsets),
        the string metadata, and where the data section begins.
    :raises CorruptFragmentError: the blob is too short, the header is not valid JSON of the
        expected shape, or an offset falls outside the blob.
    """
    view = memoryview(blob)
    if len(view) < 8:
        raise CorruptFragmentError(f"blob of {len(view)} bytes is too short to be a fragment")
    (header_size,) = struct.unpack("<Q", view[:8])
    if header_size > min(_MAX_HEADER_BYTES, len(view) - 8):
        raise CorruptFragmentError(f"blob header claims {header_size} bytes; the blob holds {len(view) - 8}")
    try:
        header = json.loads(bytes(view[8 : 8 + header_size]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptFragmentError(f"blob header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptFragmentError("blob header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFragmentError("blob metadata is not a map of strings")
    data_start = 8 + header_size
    data_size = len(view) - data_start
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise CorruptFragmentError(f"tensor {name!r} has data offsets outside the blob")
    return header, metadata, data_start


def blob_checksum(blob: bytes | memoryview) -> str:
    """The checksum of a blob's tensors and metadata (its own ``checksum`` entry excluded).

    :raises CorruptFragmentError: the blob cannot be parsed.
    """
    view = memoryview(blob)
    tensors, metadata, data_start = read_header(view)
    crc = 0
    described = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    for name in sorted(tensors):
        entry = tensors[name]
        start, end = entry["data_offsets"]
        crc = zlib.crc32(json.dumps([name, entry.get("dtype"), entry.get("shape")]).encode(), crc)
        crc = zlib.crc32(view[data_start + start : data_start + end], crc)
    crc = zlib.crc32(json.dumps(described, sort_keys=True).encode(), crc)
    return f"{_ALGORITHM}:{crc:08x}"


def verify_blob(blob: bytes | memoryview) -> dict[str, str]:
    """Check a blob's checksum.

    :returns: its metadata.
    :raises CorruptFragmentError: unparseable, no checksum, or a checksum that does not match.
    """
    _, metadata, _ = read_header(blob)
    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is None:
        raise CorruptFragmentError("blob carries no checksum")
    actual = blob_checksum(blob)
    if recorded != actual:
        raise CorruptFragmentError(f"blob checksum mismatch: recorded {recorded}, computed {actual}")
    return metadata
