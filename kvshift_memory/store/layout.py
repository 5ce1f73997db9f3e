"""How a memory store lays its data out in the KV tier, and the small encodings of its values.

Layout (every key component percent-encoded; ``t`` tenant, ``m`` memory id):

===================  ====================================================================
``h/t/m``            the head: current version ``v``, its writer ``w``, whether deleted
``r/t/m/v/w``        version ``v``'s record as writer ``w`` wrote it (JSON; immutable)
``e/t/m/v/w``        its embedding (the text's SHA-256, then float32, little-endian)
``p/t/m/v``          the writer whose version ``v`` was published (for every ``v`` below the head's)
``f/t/m/v/variant``  a KV fragment blob of version ``v`` (one per model and codec: ``variant``)
``x/t/hash``         the memory id of a text hash (the design's second path: text -> fragment)
``ac/t/m``           access count; ``al/t/m``: last access time
``o/t/digest``       a token claimed once (:meth:`MemoryStore.claim_once`: a request carried out)
``s/t/session``      an agent's saved session (its working window, JSON), replaced by compare-and-set
``c/t/key``          a chunk of a conversation's K/V (kept apart by the tier, bounded; see :mod:`.tiers`)
``log``              the change log the index replays
``store_id``         the store's identity in a shared Qdrant collection (made once, by compare-and-set)
===================  ====================================================================

Everything read back here is untrusted: a head, embedding or blob that fails its checks parses to
``None``, never to a guess.
"""

from __future__ import annotations

import json
import math
import re
import struct
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from ..blobs import read_header
from ..exceptions import CorruptFragmentError

__all__ = [
    "Head",
    "LOG_KEY",
    "ORPHAN_GRACE_S",
    "STORE_ID_KEY",
    "VARIANT",
    "WRITER",
    "blob_fingerprint",
    "float_or_none",
    "head_bytes",
    "is_earlier_head",
    "log_entry",
    "pack_embedding",
    "parse_head",
    "split_key",
    "tier_key",
    "unpack_embedding",
]

LOG_KEY = "log"
STORE_ID_KEY = "store_id"
VARIANT = re.compile(r"[0-9a-f]{8,64}")
WRITER = re.compile(r"[0-9a-f]{32}")
# Data without a head younger than this may be an add in progress in another process.
ORPHAN_GRACE_S = 60.0


def tier_key(*parts: Any) -> str:
    return "/".join(quote(str(p), safe="") for p in parts)


def split_key(key: str) -> list[str]:
    return [unquote(p) for p in key.split("/")]


def head_bytes(
    version: int, writer: str, deleted: bool = False, erased: bool = False, fence: str | None = None
) -> bytes:
    """A head's bytes. ``fence`` (a nonce) changes them without changing what they say: gc writes
    it before it frees a write no head names, so that writer's compare-and-set, made against the
    head it read before, can never publish what was freed."""
    data: dict[str, Any] = {"v": version, "w": writer, "deleted": deleted}
    if erased:
        data["erased"] = True
    if fence is not None:
        data["fence"] = fence
    return json.dumps(data, sort_keys=True).encode()


@dataclass(frozen=True)
class Head:
    """A memory's head row, parsed: its live version, the writer that published it, and whether
    the memory is deleted (and, after gc, erased)."""

    version: int
    writer: str
    deleted: bool = False
    erased: bool = False

    def to_bytes(self, fence: str | None = None) -> bytes:
        """These fields as :func:`head_bytes` writes them."""
        return head_bytes(self.version, self.writer, self.deleted, self.erased, fence)


def parse_head(raw: bytes | None) -> Head | None:
    """The head ``raw`` holds, or ``None``: absent, or not a head this build wrote (malformed)."""
    if raw is None:
        return None
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(head, dict) or not isinstance(head.get("v"), int) or head["v"] < 1:
        return None
    if not isinstance(head.get("w"), str) or not WRITER.fullmatch(head["w"]):
        return None
    return Head(head["v"], head["w"], bool(head.get("deleted")), bool(head.get("erased")))


def is_earlier_head(raw: bytes | None) -> bool:
    """A head as builds before writer keys wrote it: a version and a deleted flag, no writer."""
    try:
        head = json.loads(raw) if raw is not None else None
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(head, dict) and "w" not in head and isinstance(head.get("v"), int) and head["v"] >= 1


def log_entry(tenant: str, memory_id: str) -> bytes:
    # the nonce makes every entry unique, so an index can tell a log that went backwards (a tier
    # restored from an older snapshot) from one that only grew
    return json.dumps({"tenant": tenant, "id": memory_id, "n": uuid.uuid4().hex}).encode()


def pack_embedding(source_text_hash: str, vector: Sequence[float]) -> bytes:
    """The text's hash, then the vector: an embedding names the text it was computed from."""
    return bytes.fromhex(source_text_hash) + struct.pack(f"<{len(vector)}f", *vector)


def unpack_embedding(raw: bytes | None, dimension: int) -> tuple[str, list[float]] | None:
    """(text hash, vector), or ``None`` for a missing or damaged embedding."""
    if raw is None or len(raw) != 32 + 4 * dimension:
        return None
    vector = list(struct.unpack(f"<{dimension}f", raw[32:]))
    return (raw[:32].hex(), vector) if all(math.isfinite(x) for x in vector) else None


def float_or_none(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def blob_fingerprint(raw: bytes) -> str | None:
    try:
        return read_header(raw)[1].get("model_fingerprint")
    except CorruptFragmentError:
        return None
