"""What the agent and the adapters need of an engine and a store, as typing protocols.

:class:`~kvshift_memory.KVShiftEngine` and :class:`~kvshift_memory.MemoryStore` satisfy them; a
test double or another implementation may too (the type checker says whether it does).
"""

from __future__ import annotations

import builtins  # the classes below have a method named `list`, which hides the type in their bodies
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, overload, runtime_checkable

if TYPE_CHECKING:
    from .engine.results import GenerationResult, GenerationStream
    from .engine.settings import EngineSettings
    from .store.records import MemoryRecord

__all__ = ["ChunkStore", "Engine", "Store"]


class Engine(Protocol):
    """The engine calls :class:`~kvshift_memory.AgentMemory` makes (see :class:`~kvshift_memory.KVShiftEngine`)."""

    settings: EngineSettings
    #: the model's context window, in tokens
    max_positions: int

    @overload
    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        stream: Literal[False] = False,
        tenant: str | None = None,
        kv_store: Any = None,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        stream: Literal[True],
        tenant: str | None = None,
        kv_store: Any = None,
    ) -> GenerationStream: ...

    def warm(
        self,
        memories: Sequence[Any],
        messages: Sequence[Mapping[str, Any]] | str | None = None,
        *,
        lead_fragments: bool | None = None,
        tenant: str | None = None,
    ) -> int: ...

    def count_tokens(self, text: str, *, tenant: str | None = None) -> int: ...


class Store(Protocol):
    """The store calls recall, write-back and markers make (see :class:`~kvshift_memory.MemoryStore`)."""

    def add(
        self,
        text: str,
        *,
        tenant: str,
        session_id: str | None = None,
        importance_score: float = 0.5,
    ) -> MemoryRecord: ...

    def add_document(
        self,
        text: str,
        *,
        tenant: str,
        source: str | None = None,
        session_id: str | None = None,
        max_tokens: int = 200,
        count_tokens: Callable[[str], int] | None = None,
    ) -> builtins.list[MemoryRecord]: ...

    def get(self, memory_id: str, *, tenant: str) -> MemoryRecord | None: ...

    def list(
        self,
        tenant: str,
        *,
        session_id: str | None = None,
        include_superseded: bool = False,
        limit: int = 100,
        offset: int = 0,
    ) -> builtins.list[MemoryRecord]: ...

    def search(
        self, query: str, *, tenant: str, session_id: str | None = None, k: int = 4
    ) -> builtins.list[MemoryRecord]: ...

    def supersede(
        self, memory_id: str, new_text: str, *, tenant: str, expected_version: int | None = None
    ) -> MemoryRecord: ...

    def delete(self, memory_id: str, *, tenant: str) -> bool: ...

    def find_by_hash(self, source_text_hash: str, *, tenant: str) -> MemoryRecord | None: ...

    def claim_once(self, token: str, *, tenant: str) -> bool: ...

    def history(self, memory_id: str, *, tenant: str) -> builtins.list[MemoryRecord]: ...

    def load_session(self, session_id: str, *, tenant: str) -> bytes | None: ...

    def save_session(self, session_id: str, state: bytes, *, tenant: str, expected: bytes | None) -> bool: ...

    def load_core(self, *, tenant: str) -> bytes | None: ...

    def save_core(self, state: bytes, *, tenant: str, expected: bytes | None) -> bool: ...


@runtime_checkable
class ChunkStore(Protocol):
    """Where an engine keeps a conversation's K/V chunks (``kv_store``; a :class:`~kvshift_memory.MemoryStore` is one).

    Methods raise :class:`~kvshift_memory.StoreError` when the store cannot be reached.
    """

    codec: str
    group_size: int

    def load_chunk(self, key: str, *, tenant: str | None) -> bytes | None:
        """The blob stored under ``key`` for ``tenant`` (``None``: the default tenant), or ``None``."""
        ...

    def save_chunk(self, key: str, blob: bytes, *, tenant: str | None) -> None:
        """Keep a blob (the store may drop it later: chunks are bounded)."""
        ...
