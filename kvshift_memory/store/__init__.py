"""Memory records, their versions and KV fragment blobs on a tier, and the index that finds them.

Nothing in this package imports torch or the engine: it moves bytes and metadata (``docs/store.md``).
"""

from .memory_store import CheckReport, GCReport, MemoryStore
from .records import MemoryRecord, text_hash
from .tiers import DiskTier, HotTier, KVTier, RedisTier, open_tier

__all__ = [
    "CheckReport",
    "DiskTier",
    "GCReport",
    "HotTier",
    "KVTier",
    "MemoryRecord",
    "MemoryStore",
    "RedisTier",
    "open_tier",
    "text_hash",
]
