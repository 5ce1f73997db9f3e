"""Recall and write-back of one conversation turn, framework-free.

:class:`~kvshift_memory.AgentMemory` and every framework adapter (LangChain's chain memory and
agent middleware, LlamaIndex's memory) recall and archive with these, so a memory ranks and is
archived the same way whichever door it came in by.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from ..store.memory_store import MAX_SEARCH_K
from .writeback import Decision, WriteBackModel

__all__ = ["archive", "archived_text", "last_sentence", "recall"]

# candidates fetched beyond k: some are shown already, some rank up with session and importance
_RECALL_SPARE = 8
# a question longer than this is not a short question a short answer needs to make sense
_QUESTION_CONTEXT_CHARS = 400
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def recall(
    store: Any,
    query: str,
    *,
    user_id: str,
    session_id: str | None = None,
    exclude: Collection[tuple[str, int]] = (),
    k: int = 4,
    min_score: float = 0.3,
    importance_weight: float = 0.1,
    session_weight: float = 0.05,
) -> list[Any]:
    """The memories of ``user_id`` to recall for ``query``, most relevant last (nearest the question).

    The store's two paths (embedding and keywords) search all of the user's sessions; a hit less
    similar than ``min_score`` or whose ``(id, version)`` is in ``exclude`` (the conversation shows
    it already) is skipped; the rest rank by similarity, plus ``importance_weight`` times the
    memory's importance, plus ``session_weight`` when it comes from ``session_id``.

    :returns: at most ``k`` records; none for a blank query.
    :raises InvalidInputError: a malformed ``user_id``; ``StoreError``: the store cannot be searched.
    """
    if not query.strip():
        return []
    hits = store.search(query, tenant=user_id, k=min(k + len(exclude) + _RECALL_SPARE, MAX_SEARCH_K))
    candidates = [hit for hit in hits if hit.score >= min_score and (hit.id, hit.version) not in exclude]

    def rank(record: Any) -> float:
        same_session = session_weight if session_id is not None and record.session_id == session_id else 0.0
        return record.score + importance_weight * record.importance_score + same_session

    return sorted(candidates, key=rank, reverse=True)[:k][::-1]


def archived_text(text: str, previous: str) -> str:
    """What a turn is archived as: the turn, after the question it answers when it answers one.

    "Lisbon." means nothing alone; "Where are you going in May?" + "Lisbon." is a memory.
    """
    previous = previous.strip()
    if previous.endswith("?") and len(previous) <= _QUESTION_CONTEXT_CHARS:
        return f"{previous}\n{text}"
    return text


def last_sentence(reply: str) -> str:
    """What a user's next message answers: the reply's last sentence.

    The write-back rule was fitted on conversations between people, where "the turn before" is the
    other person's; an assistant's whole reply is much longer than that and would lower every
    importance (the rule weighs a long turn before against a turn), while its last sentence is
    what the user responds to, and is the question when the reply asked one.
    """
    sentences = _SENTENCE_END.split(reply.strip())
    return sentences[-1] if sentences else ""


def archive(
    rule: WriteBackModel, store: Any, text: str, previous: str, *, user_id: str, session_id: str
) -> tuple[float, Decision, Any]:
    """Classify ``text`` (a user's turn, answering ``previous``) and store it when ``rule`` archives it.

    :param previous: what the turn answers: :func:`last_sentence` of the assistant's reply, or
        the other participant's turn.
    :returns: (importance, decision, the stored record or ``None``). A blank turn is dropped.
    :raises StoreError: the store cannot be written.
    """
    if not text.strip():
        return 0.0, "drop", None
    importance = rule.importance(text, previous)
    decision = rule.decide(importance)
    if decision != "archive":
        return importance, decision, None
    record = store.add(archived_text(text, previous), tenant=user_id, session_id=session_id, importance_score=importance)
    return importance, decision, record
