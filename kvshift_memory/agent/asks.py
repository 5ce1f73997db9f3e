"""What a user's message asks of the memory, and doing it: remember, forget, correct, or nothing.

One place decides, for every door (:class:`~kvshift_memory.AgentMemory`, LangChain's middleware
and chain memory, LlamaIndex's memory and block), what one message changes:

- a request to forget ("forget what I said about the plumber") deletes the one memory it clearly
  names, and takes it out of the core block at once (:func:`forget_closest`, :func:`forget_memory`);
- a correction ("the budget is not 50k, it is 70k") supersedes the one memory it clearly corrects,
  and a core line of it gets the new version appended (:func:`find_correction`, :func:`supersede`);
- anything else is written back as the fitted rule decides (:func:`archive`): "remember …"
  always; small talk, bare questions and tasks for the assistant never; a stored statement the
  user made about themselves joins the core block (:func:`joins_core`).

When unsure, nothing changes: an ambiguous forget deletes nothing, an ambiguous correction is
stored as a statement of its own, and another speaker's words (a transcript) change no memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..exceptions import VersionConflictError
from ..protocols import Store
from ..store.records import MemoryRecord, text_hash
from .core import change_block
from .corrections import corrects, is_correction_cue
from .recall import archived_text, similarity
from .writeback import (
    Decision,
    WriteBackModel,
    explicit_request,
    first_person,
    forget_subject,
    is_question_only,
    is_task_request,
)

__all__ = [
    "Asked",
    "FORGET_MARGIN",
    "FORGET_MIN_SCORE",
    "MAX_ARCHIVED_CHARS",
    "MAX_CORE_CHARS",
    "archive",
    "carry_out",
    "find_correction",
    "forget_closest",
    "forget_memory",
    "joins_core",
    "store_once",
    "supersede",
]

# a turn longer than this is a document pasted in, not something said: the application stores
# documents itself (chunked to fit the model), write-back leaves it in the window
MAX_ARCHIVED_CHARS = 4000
# a statement longer than this is a story, not a fact about the user: it is recalled by search
MAX_CORE_CHARS = 400
# a request to forget removes the closest memory only when it is this similar to what it names...
FORGET_MIN_SCORE = 0.35
# ...and this much closer than the next one ("forget the door code" with two door codes stored
# removes neither: the user is told, and names one more precisely)
FORGET_MARGIN = 0.05

# stored memories a correction is checked against (the nearest ones; it supersedes one only when
# exactly one of them is about the same subject and holds the value it negates)
_CORRECTION_CANDIDATES = 4


@dataclass(frozen=True)
class Asked:
    """What a user's chat message asked of the memory before its answer, and what was done.

    :param forget: for a request to forget: ``"forget"`` and the memory deleted, or
        ``"forget_ambiguous"`` and ``None`` (nothing deleted).
    :param corrected: the memory version a correction superseded; ``correction``: its new version.
    :param ambiguous_correction: worded as a correction, it matched no single memory (nothing changed).
    """

    forget: tuple[Decision, MemoryRecord | None] | None = None
    corrected: MemoryRecord | None = None
    correction: MemoryRecord | None = None
    ambiguous_correction: bool = False


def carry_out(store: Store, text: str, *, user_id: str, session_id: str, min_score: float) -> Asked:
    """Do what the user's chat message ``text`` asks of the memory before it is answered: a
    request to forget deletes what it names (:func:`forget_closest`); a correction supersedes the
    memory it corrects (:func:`find_correction`, at least ``min_score`` similar), a core line of it
    getting the new version from the next session of ``session_id`` on; anything else changes
    nothing here (it is written back after the answer, :func:`archive`).

    :raises StoreError: the store cannot be searched or written.
    """
    if explicit_request(text) == "forget":
        return Asked(forget=forget_closest(store, text, user_id=user_id))
    decision, corrected = find_correction(store, text, user_id=user_id, min_score=min_score)
    if corrected is None:
        return Asked(ambiguous_correction=decision == "correction_ambiguous")
    new = supersede(store, corrected, text, user_id=user_id, session_id=session_id)
    return Asked(corrected=corrected, correction=new)


def joins_core(text: str, request: str | None = None) -> bool:
    """Whether the user's own stored message ``text`` joins their core block: a "remember …"
    request, or a statement about themselves (in the first person, not a question) short enough
    to be one fact. Documents, other speakers' words and deferred turns never join on their own
    (a user pins them)."""
    if request == "remember":
        return len(text) <= MAX_CORE_CHARS
    return len(text) <= MAX_CORE_CHARS and first_person(text) and not text.rstrip().endswith("?")


def forget_memory(store: Store, record: MemoryRecord, *, user_id: str) -> bool:
    """Delete ``record`` (tombstoned: :meth:`~kvshift_memory.MemoryStore.history` shows it
    deleted, search never returns it again, :meth:`~kvshift_memory.MemoryStore.gc` erases its
    data) and take it out of the user's core block at once.

    :returns: whether it was live (and is deleted now).
    :raises VersionConflictError: another writer changed it meanwhile.
    :raises StoreError: the store cannot be written.
    """
    deleted = store.delete(record.id, tenant=user_id)
    # out of the block even when it was gone already: its text never stays in a prompt
    change_block(store, user_id, lambda block: block.without(record.id))
    return deleted


def supersede(store: Store, target: MemoryRecord, text: str, *, user_id: str, session_id: str = "") -> MemoryRecord:
    """Store ``text`` as the new version of ``target``; a core line of it gets the new version
    appended (placed from the next session of ``session_id`` on, at once for ``""``).

    :raises VersionConflictError: ``target`` changed meanwhile (a text changed since is never overwritten).
    :raises StoreError: the store cannot be written.
    """
    new = store.supersede(target.id, text, tenant=user_id, expected_version=target.version)
    change_block(store, user_id, lambda block: block.updated(new.id, new.version, new.text, session_id))
    return new


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

    The memory is tombstoned (:func:`forget_memory`).

    :returns: ``("forget", the record deleted)``, or ``("forget_ambiguous", None)`` when no memory
        scores ``min_score`` or the two closest are within ``margin`` of each other (nothing deleted).
    :raises StoreError: the store cannot be searched or written.
    """
    subject = forget_subject(request) or request
    hits = [hit for hit in store.search(subject, tenant=user_id, k=2) if similarity(hit) >= min_score]
    if not hits or (len(hits) > 1 and similarity(hits[0]) - similarity(hits[1]) < margin):
        return "forget_ambiguous", None
    try:
        deleted = forget_memory(store, hits[0], user_id=user_id)
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
    core_facts: bool = True,
) -> tuple[float, Decision, Any]:
    """Write back ``text``, a user's turn answering ``previous``, as ``rule`` decides.

    "Remember …" always archives (importance 1). "Forget …" deletes the closest memory
    (:func:`forget_closest`) and archives nothing, once: the same message, seen again (by
    another adapter instance, process or replay), deletes nothing more, while the same words
    sent again later (another ``message_key``) are a request of their own. A
    question that states nothing is never stored. Any other turn is archived unless the rule
    finds it content-free, or it only asks a question or gives the assistant a task ("Convert 50
    euros to dollars."); a turn the rule defers is stored now unless ``window`` says the
    caller keeps a working window that stores it when it leaves. A text the user's memory
    already holds word for word is not stored twice (:func:`store_once`).

    :param previous: what the turn answers: :func:`last_sentence` of the assistant's reply, or
        the other participant's turn.
    :param requests: honour "remember …" and "forget …" (the user's own words); ``False`` for a
        transcript, where another participant's "forget about it" must delete nothing.
    :param message_key: what tells this message from the same words sent at another point of
        the session: the framework's message id, or else the text of the reply it follows.

    With ``core_facts``, a stored turn that :func:`joins_core` (the user's own "remember …" or
    statement about themselves) is appended to the user's core block, placed from the next
    session on.
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
    if request is None and (is_question_only(text) or is_task_request(text)):
        decision = "window"  # a question or a task for this turn says nothing to remember
    if decision == "window" or (decision == "defer" and window):
        return importance, decision, None
    record = store_once(
        store, archived_text(text, previous), user_id=user_id, session_id=session_id, importance_score=importance
    )
    if core_facts and requests and joins_core(text, request):
        change_block(store, user_id, lambda block: block.joined(record.id, record.version, record.text, session_id))
    return importance, "archive", record
