"""The keyword options of :meth:`KVShiftEngine.generate <.engine.KVShiftEngine.generate>` as a
typed dictionary, so its two signatures (a result, or a stream) are written once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from ..protocols import ChunkStore
    from .grammar import Grammar

__all__ = ["GenerateOptions"]


class GenerateOptions(TypedDict, total=False):
    """What ``generate`` takes besides messages, memories and ``stream`` (documented there)."""

    reuse: str | None
    recompute_ratio: float | None
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    repetition_penalty: float
    stop: str | Sequence[str] | None
    fragments_after: str | None
    encode_context: str | None
    tenant: str | None
    grammar: Grammar | None
    kv_store: ChunkStore | None
    tools: Sequence[dict[str, Any]] | None
