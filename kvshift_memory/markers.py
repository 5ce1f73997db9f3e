"""Span markers: how a memory travels through a framework's flat prompt text (``docs/how-it-works.md``).

``⟦mem:ID@VERSION⟧text⟦/mem⟧`` says "this text is memory ID at VERSION; use its stored KV". The
rules, which make markers safe to accept from any text (including a user's message):

- a marker resolves only to a live memory of the caller's tenant (and session, when given) at
  exactly that version, and only if the enclosed text hashes to that version's text hash;
- everything else (another tenant's id, a wrong hash, nested, unterminated or malformed markers)
  degrades to plain text, never to an error that loses the turn;
- the model never sees a marker: every marker-shaped sequence is removed from the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import inputs
from .exceptions import InvalidInputError
from .store.records import MemoryRecord, text_hash

__all__ = [
    "MarkedSpan",
    "marked_user_message",
    "parse_markers",
    "render_marker",
    "render_memories",
    "resolve_markers",
    "strip_markers",
]

_OPEN = re.compile(r"⟦mem:([^⟦⟧@\s]{1,256})@([1-9][0-9]{0,8})⟧")
# anything marker-shaped, well-formed or not: none of it may reach the model
_ANY_MARKER = re.compile(r"⟦/?mem\b[^⟦⟧]{0,300}⟧|⟦/?mem\b")
_CLOSE = "⟦/mem⟧"
#: markers past this many in one text are read as plain text: no prompt holds more memories
#: usefully, and each marker costs a store lookup
MAX_RESOLVED_MARKERS = 256


@dataclass(frozen=True, slots=True)
class MarkedSpan:
    """A piece of text, and the memory it claims to be (``None`` for plain text)."""

    text: str
    memory_id: str | None = None
    version: int | None = None


def render_marker(record: MemoryRecord) -> str:
    """``record``'s text wrapped in its marker."""
    return f"⟦mem:{record.id}@{record.version}⟧{record.text}⟦/mem⟧"


def render_memories(records: Sequence[MemoryRecord], header: str) -> str:
    """``records`` under ``header``, one marked memory a line, in the order given; ``""`` for none."""
    if not records:
        return ""
    return header + "\n" + "\n".join(render_marker(record) for record in records)


def strip_markers(text: str) -> str:
    """``text`` with every marker-shaped sequence removed."""
    return _ANY_MARKER.sub("", text)


def parse_markers(text: str) -> list[MarkedSpan]:
    """Split ``text`` into plain pieces and well-formed, non-nested marked spans.

    A marked span's text holds no marker; plain pieces have theirs stripped. Runs in time linear
    in ``len(text)`` whatever the text holds (a hostile message of openings without closes too):
    each opening looks only as far as the next marker-shaped sequence.
    """
    text = inputs.check_text(text, "text", allow_empty=True)
    spans: list[MarkedSpan] = []
    plain_start = 0
    position = 0
    while True:
        opening = _OPEN.search(text, position)
        if opening is None:
            break
        start, position = opening.span()
        following = _ANY_MARKER.search(text, position)
        # a span is an opening whose next marker-shaped sequence is its close: anything else
        # (unterminated, nested, another opening first) leaves the opening as plain text
        if following is None or following.group() != _CLOSE:
            continue
        if plain_start < start:
            plain = strip_markers(text[plain_start:start])
            if plain:
                spans.append(MarkedSpan(plain))
        spans.append(MarkedSpan(text[position : following.start()], opening.group(1), int(opening.group(2))))
        plain_start = position = following.end()
    rest = strip_markers(text[plain_start:])
    if rest:
        spans.append(MarkedSpan(rest))
    return spans


def resolve_markers(text: str, store: Any, *, tenant: str, session_id: str | None = None) -> list[str | MemoryRecord]:
    """Plain text pieces and the memory records the markers in ``text`` rightly name.

    :param store: a :class:`MemoryStore`; ids are looked up with ``store.get(id, tenant=tenant)``,
        so only the caller's own memories can ever resolve; markers past the first
        :data:`MAX_RESOLVED_MARKERS` are plain text.
    :returns: strings (plain text, markers removed) and records, in order.
    :raises InvalidInputError: ``text`` or ``tenant`` is not valid text.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    out: list[str | MemoryRecord] = []
    plain: list[str] = []  # the plain text since the last record, joined once (repeated += is quadratic)
    looked_up = 0
    for span in parse_markers(text):
        record = None
        if span.memory_id is not None and looked_up < MAX_RESOLVED_MARKERS:
            looked_up += 1
            try:
                record = store.get(span.memory_id, tenant=tenant)
            except InvalidInputError:  # an id no memory could have
                record = None
            if not (
                isinstance(record, MemoryRecord)
                and record.tenant == tenant
                and (session_id is None or record.session_id == session_id)
                and record.version == span.version
                and record.source_text_hash == text_hash(span.text)
            ):
                record = None
        if record is None:
            plain.append(span.text)
            continue
        if "".join(plain):
            out.append("".join(plain))
        plain = []
        out.append(record)
    if "".join(plain):
        out.append("".join(plain))
    return out


def marked_user_message(
    text: str, store: Any = None, *, tenant: str | None = None, session_id: str | None = None
) -> dict[str, Any]:
    """A user message for :meth:`KVShiftEngine.generate` whose marked memories bring their K/V.

    Each marker that resolves (:func:`resolve_markers`, in ``tenant`` and ``session_id``) becomes
    a memory placed where the marker stood (``"memories"`` with ``"memories_at"``): the engine
    shifts its stored fragment in instead of reading its text. A memory's fragment ends its line,
    so the newline after its marker goes. Without a ``store`` and ``tenant``, or for markers that
    do not resolve, the text is read as plain text. No marker is ever left in the content.

    :raises InvalidInputError: ``text`` or ``tenant`` is not valid text.
    """
    if store is None or tenant is None or "⟦" not in text:
        return {"role": "user", "content": strip_markers(text)}
    pieces: list[str] = []
    records: list[MemoryRecord] = []
    offsets: list[int] = []
    length = 0
    for piece in resolve_markers(text, store, tenant=tenant, session_id=session_id):
        if isinstance(piece, str):
            if records and offsets[-1] == length and piece.startswith("\n"):
                piece = piece[1:]
            pieces.append(piece)
            length += len(piece)
        else:
            records.append(piece)
            offsets.append(length)
    content = "".join(pieces)
    if not records:
        return {"role": "user", "content": content}
    return {"role": "user", "content": content, "memories": records, "memories_at": offsets}
