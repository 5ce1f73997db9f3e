"""Recall of one conversation turn, framework-free, and the text a turn is archived as.

:class:`~kvshift_memory.AgentMemory` and every framework adapter (LangChain's chain memory and
agent middleware, LlamaIndex's memory) recall with these, so a memory ranks the same way
whichever door it came in by; what a message asks of the memory (remember, forget, correct) is
decided in :mod:`.asks`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..protocols import Store
from ..store.memory_store import MAX_SEARCH_K
from ..store.records import MemoryRecord

__all__ = [
    "RECALL",
    "RecallSettings",
    "archived_text",
    "last_sentence",
    "message_key",
    "recall",
    "similarity",
]

# candidates fetched beyond k: some are shown already, some rank up with session and importance
_RECALL_SPARE = 8
# a question longer than this is not a short question a short answer needs to make sense
_QUESTION_CONTEXT_CHARS = 400
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True)
class RecallSettings:
    """How a turn recalls a user's memories, whichever door it comes through (the agent, the
    LangChain middleware and chain memory, the LlamaIndex memory and block take their defaults
    from :data:`RECALL`, so a memory ranks the same way in each).

    :param k: memories recalled per message at most.
    :param min_score: a memory less similar than this to the message is not recalled.
    :param importance_weight: how much a memory's importance adds to its similarity when ranking.
    :param session_weight: how much being from the current session adds to it.
    """

    k: int = 4
    min_score: float = 0.3
    importance_weight: float = 0.1
    session_weight: float = 0.05


#: the recall policy every door shares by default
RECALL = RecallSettings()


def similarity(hit: MemoryRecord) -> float:
    """A search hit's score (a record that came from no search ranks below every hit)."""
    return hit.score if hit.score is not None else float("-inf")


def recall(
    store: Store,
    query: str,
    *,
    user_id: str,
    session_id: str | None = None,
    exclude: Collection[tuple[str, int]] = (),
    k: int = RECALL.k,
    min_score: float = RECALL.min_score,
    importance_weight: float = RECALL.importance_weight,
    session_weight: float = RECALL.session_weight,
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
    candidates = [hit for hit in hits if similarity(hit) >= min_score and (hit.id, hit.version) not in exclude]

    def rank(record: MemoryRecord) -> float:
        same_session = session_weight if session_id is not None and record.session_id == session_id else 0.0
        return similarity(record) + importance_weight * record.importance_score + same_session

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


def message_key(reply: str) -> str:
    """What tells a user's message from the same words at another point of a conversation, for
    a framework whose messages carry no id: a digest of the whole reply it follows."""
    return hashlib.sha256(reply.encode("utf-8", "surrogatepass")).hexdigest()
