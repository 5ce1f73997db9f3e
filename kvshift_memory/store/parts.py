"""What gc, check, stats and the item layer work on: a memory store's parts, as a typing protocol.

:class:`~kvshift_memory.store.MemoryStore` satisfies it. :mod:`.maintenance` and :mod:`.items` are
typed against this protocol, not the class, so neither imports the module that imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..embedding import Embedder
    from .index import MemoryIndex
    from .qdrant_index import QdrantIndex
    from .records import MemoryRecord
    from .tiers import HotTier, KVTier
    from .versions import Versions

__all__ = ["StoreParts"]


class StoreParts(Protocol):
    """A memory store's tier, index and embedder, its clock, and the calls that change memories."""

    @property
    def tier(self) -> KVTier: ...
    @property
    def hot(self) -> HotTier: ...
    @property
    def versions(self) -> Versions: ...
    @property
    def index(self) -> MemoryIndex | QdrantIndex: ...
    @property
    def embedder(self) -> Embedder: ...
    @property
    def codec(self) -> str: ...
    @property
    def group_size(self) -> int: ...
    @property
    def corrupt_fragments(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def chunk_ttl_s(self) -> float: ...

    def now(self) -> float: ...

    def get(self, memory_id: str, *, tenant: str) -> MemoryRecord | None: ...

    def delete(self, memory_id: str, *, tenant: str) -> bool: ...

    def add_owned(
        self,
        text: str,
        *,
        tenant: str,
        session_id: str | None,
        importance_score: float,
        semantic_keywords: Sequence[str],
        ttl_s: float | None,
        index: bool,
        item: str | None,
        document: tuple[str, int, str | None] | None = None,
    ) -> MemoryRecord: ...
