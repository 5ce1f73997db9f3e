"""Recall into span markers, and write-back: what KVShiftMemory and KVShiftMiddleware both do."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvshift_memory.agent.writeback import WriteBackModel
from kvshift_memory.markers import render_marker
from kvshift_memory.store.memory_store import MAX_SEARCH_K


def recall_marked(
    store: Any, query: str, *, user_id: str, shown: Collection[str], k: int, min_score: float, header: str
) -> tuple[str, list[str]]:
    """The ``k`` memories of ``user_id`` that ``query`` recalls, skipping ids already ``shown``,
    rendered under ``header`` in span markers, most relevant last.

    :returns: (the block, ``""`` when nothing was recalled; the recalled memory ids).
    :raises StoreError: the store cannot be searched.
    """
    if not query.strip():
        return "", []
    # memories the conversation shows already are skipped: ask for enough to find new ones
    hits = store.search(query, tenant=user_id, k=min(k + len(shown), MAX_SEARCH_K))
    recalled = [hit for hit in hits if hit.score >= min_score and hit.id not in shown][:k]
    if not recalled:
        return "", []
    marked = "\n".join(render_marker(record) for record in recalled[::-1])
    return f"{header}\n{marked}", [record.id for record in recalled]


def write_back(rule: WriteBackModel, store: Any, text: str, previous: str, *, user_id: str, session_id: str) -> Any:
    """Archive ``text`` (a human's message, answering ``previous``) when ``rule`` keeps it.

    :returns: the stored record, or ``None``.
    :raises StoreError: the store cannot be written.
    """
    importance = rule.importance(text, previous)
    if not text.strip() or rule.decide(importance) != "archive":
        return None
    return store.add(text, tenant=user_id, session_id=session_id, importance_score=importance)
