"""What a framework adapter builds on: recall, write-back and span markers, framework-free.

:class:`~kvshift_memory.AgentMemory` and the LangChain and LlamaIndex packages use these, so a
memory ranks, is archived and is forgotten the same way whichever door it came in by. An adapter
for another framework imports from here, not from the private modules behind it; this surface is
pinned by a test and changes only with a changelog entry.

Recall and archive:

- :func:`recall` ranks a user's memories for a message (two search paths, importance, session);
- :func:`archive` applies the write-back rule to one user turn (archive, defer, keep in the
  window, or honour "remember …" / "forget …");
- :func:`archived_text`, :func:`last_sentence`: what an archived turn is stored as;
- :func:`forget_closest`: delete the memory a "forget …" request names, or nothing when unsure;
- :class:`WriteBackModel`, :func:`turn_features`, :data:`FEATURES`: the write-back rule and the
  features it reads (fitted by ``benchmarks/writeback.py --fit``);
- :func:`explicit_request`: whether a turn asks to remember or to forget.
- :func:`context_window`: a model's context window, read without loading its weights.

Items (a key-value store's contract over the memory store, for LangGraph's ``BaseStore``):
:class:`Item`, :func:`put_item`, :func:`get_item`, :func:`delete_item`, :func:`item_of` (a
search hit's item), :func:`list_items`, :func:`item_tenants`.

Span markers (``⟦mem:ID@VERSION⟧text⟦/mem⟧``, how a memory travels through a framework's flat
prompt text; ``docs/how-it-works.md``): :func:`render_marker`, :func:`render_memories`, :func:`marked_user_message`,
:func:`parse_markers`, :func:`resolve_markers`, :func:`strip_markers`; :func:`in_document_order`
(a retriever's hits with a document's parts in order).

The engine and store an adapter is given are typed by :class:`~kvshift_memory.protocols.Engine`
and :class:`~kvshift_memory.protocols.Store`.
"""

from __future__ import annotations

from .agent.recall import archive, archived_text, forget_closest, last_sentence, recall
from .agent.writeback import FEATURES, Decision, WriteBackModel, explicit_request, turn_features
from .markers import (
    MarkedSpan,
    marked_user_message,
    parse_markers,
    render_marker,
    render_memories,
    resolve_markers,
    strip_markers,
)
from .protocols import Engine, Store
from .shipped import context_window
from .store.documents import in_document_order
from .store.items import Item, delete_item, get_item, item_of, item_tenants, list_items, put_item

__all__ = [
    "FEATURES",
    "Decision",
    "Engine",
    "Item",
    "MarkedSpan",
    "Store",
    "WriteBackModel",
    "archive",
    "archived_text",
    "context_window",
    "delete_item",
    "explicit_request",
    "forget_closest",
    "get_item",
    "in_document_order",
    "item_of",
    "item_tenants",
    "last_sentence",
    "list_items",
    "marked_user_message",
    "parse_markers",
    "put_item",
    "recall",
    "render_marker",
    "render_memories",
    "resolve_markers",
    "strip_markers",
    "turn_features",
]
