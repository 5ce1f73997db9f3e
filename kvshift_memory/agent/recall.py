"""Recall and write-back of one conversation turn, framework-free.

:class:`~kvshift_memory.AgentMemory` and every framework adapter (LangChain's chain memory and
agent middleware, LlamaIndex's memory) recall and archive with these, so a memory ranks and is
archived the same way whichever door it came in by.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..exceptions import VersionConflictError
from ..protocols import Store
from ..store.memory_store import MAX_SEARCH_K
from ..store.records import MemoryRecord, text_hash
from .corrections import corrects, is_correction_cue
from .writeback import Decision, WriteBackModel, explicit_request, forget_subject, is_question_only

__all__ = [
    "RECALL",
    "FORGET_MARGIN",
    "FORGET_MIN_SCORE",
    "MAX_ARCHIVED_CHARS",
    "archive",
    "archived_text",
    "find_correction",
    "forget_closest",
    "last_sentence",
    "RecallSettings",
    "recall",
    "similarity",
    "store_once",
]

# a turn longer than this is a document pasted in, not something said: the application stores
# documents itself (chunked to fit the model), write-back leaves it in the window
MAX_ARCHIVED_CHARS = 4000
# a request to forget removes the closest memory only when it is this similar to what it names...
FORGET_MIN_SCORE = 0.35
# ...and this much closer than the next one ("forget the door code" with two door codes stored
# removes neither: the user is told, and names one more precisely)
FORGET_MARGIN = 0.05

# stored memories a correction is checked against (the nearest ones; it supersedes one only when
# exactly one of them is about the same subject and holds the value it negates)
_CORRECTION_CANDIDATES = 4
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


def forget_closest(
    store: Store,
    request: str,
    *,
    user_id: str,
    min_score: float = FORGET_MIN_SCORE,
    margin: float = FORGET_MARGIN,
) -> tuple[Decision, Any]:
    """Delete the memory of ``user_id`` closest to what ``request`` names, when one is clearly the closest.

    ``request`` is a request to forget ("delete what I said about the plumber": its subject is
    searched, :func:`~kvshift_memory.agent.writeback.forget_subject`) or the subject itself.

    The memory is tombstoned (:meth:`~kvshift_memory.MemoryStore.history` shows it deleted, search
    never returns it again, :meth:`~kvshift_memory.MemoryStore.gc` erases its data).

    :returns: ``("forget", the record deleted)``, or ``("forget_ambiguous", None)`` when no memory
        scores ``min_score`` or the two closest are within ``margin`` of each other (nothing deleted).
    :raises StoreError: the store cannot be searched or written.
    """
    subject = forget_subject(request) or request
    hits = [hit for hit in store.search(subject, tenant=user_id, k=2) if similarity(hit) >= min_score]
    if not hits or (len(hits) > 1 and similarity(hits[0]) - similarity(hits[1]) < margin):
        return "forget_ambiguous", None
    try:
        deleted = store.delete(hits[0].id, tenant=user_id)
    except VersionConflictError:  # changed by another writer meanwhile: what the user named may be gone
        return "forget_ambiguous", None
    return ("forget", hits[0]) if deleted else ("forget_ambiguous", None)


def find_correction(
    store: Store, message: str, *, user_id: str, min_score: float
) -> tuple[Decision | None, MemoryRecord | None]:
    """The memory of ``user_id`` that ``message`` corrects, when it is one.

    A message worded as a correction (:func:`~kvshift_memory.agent.corrections.is_correction_cue`)
    corrects a stored memory only when exactly one of the nearest ones (similarity at least
    ``min_score``) is about the same person, attribute and time and holds the value it negates
    (:func:`~kvshift_memory.agent.corrections.corrects`).

    :returns: ``(None, None)`` for a message that is no correction; ``("archive", the memory)``
        for the one it corrects; ``("correction_ambiguous", None)`` when none or several qualify
        (nothing is to change: the message is stored as a statement of its own).
    :raises StoreError: the store cannot be searched.
    """
    if not is_correction_cue(message):
        return None, None
    hits = store.search(message, tenant=user_id, k=_CORRECTION_CANDIDATES)
    matching = [hit for hit in hits if similarity(hit) >= min_score and corrects(message, hit.text)]
    return ("archive", matching[0]) if len(matching) == 1 else ("correction_ambiguous", None)


def store_once(
    store: Store, text: str, *, user_id: str, session_id: str | None, importance_score: float
) -> MemoryRecord:
    """``text`` as a memory of ``user_id``: the live memory that already holds exactly this text
    (read again, so its last access is now), else a new one. A fact restated in another session
    stays one memory.

    :raises StoreError: the store cannot be read or written.
    """
    existing = store.find_by_hash(text_hash(text), tenant=user_id)
    # an item's memory belongs to its item (a delete of the item would take this statement with it)
    if existing is not None and existing.item is None:
        refreshed = store.get(existing.id, tenant=user_id)
        if refreshed is not None:
            return refreshed
    return store.add(text, tenant=user_id, session_id=session_id, importance_score=importance_score)


def archive(
    rule: WriteBackModel,
    store: Store,
    text: str,
    previous: str,
    *,
    user_id: str,
    session_id: str,
    window: bool = False,
    requests: bool = True,
    message_key: str = "",
) -> tuple[float, Decision, Any]:
    """Write back ``text``, a user's turn answering ``previous``, as ``rule`` decides.

    "Remember …" always archives (importance 1). "Forget …" deletes the closest memory
    (:func:`forget_closest`) and archives nothing, once: the same message, seen again (by
    another adapter instance, process or replay), deletes nothing more, while the same words
    sent again later (another ``message_key``) are a request of their own. A
    question that states nothing is never stored. Any other turn is archived unless the rule
    finds it content-free; a turn the rule defers is stored now unless ``window`` says the
    caller keeps a working window that stores it when it leaves. A text the user's memory
    already holds word for word is not stored twice (:func:`store_once`).

    :param previous: what the turn answers: :func:`last_sentence` of the assistant's reply, or
        the other participant's turn.
    :param requests: honour "remember …" and "forget …" (the user's own words); ``False`` for a
        transcript, where another participant's "forget about it" must delete nothing.
    :param message_key: what tells this message from the same words sent at another point of
        the session: the framework's message id, or else the text of the reply it follows.
    :returns: (importance, decision, the record stored or forgotten, else ``None``). A blank turn,
        or one longer than :data:`MAX_ARCHIVED_CHARS`, is ``"window"``.
    :raises StoreError: the store cannot be searched or written.
    """
    if not text.strip() or len(text) > MAX_ARCHIVED_CHARS:
        return 0.0, "window", None
    request = explicit_request(text) if requests else None
    if request == "forget":
        # carried out once, whichever process or adapter instance sees the message (again) first
        if not store.claim_once(f"forget\0{session_id}\0{message_key}\0{text}", tenant=user_id):
            return 0.0, "forget_ambiguous", None
        decision, forgotten = forget_closest(store, text, user_id=user_id)
        return 0.0, decision, forgotten
    importance = 1.0 if request == "remember" else rule.importance(text, previous)
    decision = "archive" if request == "remember" else rule.decide(importance)
    if request is None and is_question_only(text):
        decision = "window"
    if decision == "window" or (decision == "defer" and window):
        return importance, decision, None
    record = store_once(
        store, archived_text(text, previous), user_id=user_id, session_id=session_id, importance_score=importance
    )
    return importance, "archive", record
