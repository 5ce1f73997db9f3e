"""Reading a memory's versions from the tier: its head, its records, the writers that published them.

What the tier holds is untrusted: a row the tier refuses (a checksum that fails) reads as absent
and is logged, a record that does not parse or names another memory is refused. The memory store
and its maintenance (gc, check) read through this one class.
"""

from __future__ import annotations

import logging

from ..exceptions import CorruptRecordError, StoreError
from .layout import WRITER, Head, parse_head, tier_key
from .records import MemoryRecord
from .tiers import KVTier

__all__ = ["Versions"]

logger = logging.getLogger("kvshift_memory.store")


class Versions:
    """The version rows of one tier, read defensively.

    :param tier: where the rows are.
    """

    def __init__(self, tier: KVTier) -> None:
        self.tier = tier

    def get_row(self, key: str) -> bytes | None:
        """A row's value; ``None`` for a row the tier refuses (logged; ``check()`` reports it)."""
        try:
            return self.tier.get(key)
        except CorruptRecordError as exc:
            logger.warning("refusing %r: %s", key, exc)
            return None

    def read_record(self, tenant: str, memory_id: str, version: int, writer: str) -> MemoryRecord | None:
        """Version ``version`` of a memory as ``writer`` wrote it, or ``None`` when absent or refused."""
        raw = self.get_row(tier_key("r", tenant, memory_id, version, writer))
        if raw is None:
            return None
        try:
            record = MemoryRecord.from_json(raw)
        except StoreError as exc:
            logger.warning("unreadable record %s@%s of %r: %s", memory_id, version, tenant, exc)
            return None
        if (record.tenant, record.id, record.version) != (tenant, memory_id, version):
            logger.warning("record under %s@%s of %r names another memory", memory_id, version, tenant)
            return None
        return record

    def published_writer(self, tenant: str, memory_id: str, version: int) -> str | None:
        """The writer whose version ``version`` (below the head's) was published."""
        raw = self.get_row(tier_key("p", tenant, memory_id, version))
        writer = raw.decode("ascii", "replace") if raw else ""
        return writer if WRITER.fullmatch(writer) else None

    def read_head(self, tenant: str, memory_id: str) -> tuple[bytes | None, Head | None]:
        """A memory's head row as read (for a compare-and-set) and as parsed (``None``: absent or malformed)."""
        raw = self.get_row(tier_key("h", tenant, memory_id))
        return raw, parse_head(raw)
