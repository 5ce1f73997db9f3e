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
  :func:`message_key`: what tells a message from the same words later, where messages have no id;
- :func:`forget_closest`: delete the memory a "forget …" request names, or nothing when unsure;
- :class:`WriteBackModel`, :func:`turn_features`, :data:`FEATURES`: the write-back rule and the
  features it reads (fitted by ``benchmarks/writeback.py --fit``);
- :func:`explicit_request`: whether a turn asks to remember or to forget; :func:`joins_core`:
  whether a stored turn joins the user's core block.
- :func:`context_window`: a model's context window, read without loading its weights.

The core block (what the agent always knows about a user, after the system prompt in every
session): :func:`placed_lines` (the lines a session's prompt shows), :func:`core_text` (as the
system message shows them), :func:`change_block` (pin, supersede or remove lines by
compare-and-set), :func:`read_block` (every line, superseded ones too), :class:`CoreLine`, :data:`CORE_TOKENS`.

Items (a key-value store's contract over the memory store, for LangGraph's ``BaseStore``):
:class:`Item`, :func:`put_item`, :func:`get_item`, :func:`delete_item`, :func:`item_of` (a
search hit's item), :func:`list_items`, :func:`item_tenants`, :func:`refresh_item` (restart an
item's time to live), :func:`sweep_items` (remove expired items).

Span markers (``⟦mem:ID@VERSION⟧text⟦/mem⟧``, how a memory travels through a framework's flat
prompt text; ``docs/how-it-works.md``): :func:`render_marker`, :func:`render_memories`, :func:`marked_user_message`,
:func:`parse_markers`, :func:`resolve_markers`, :func:`strip_markers`; :func:`in_document_order`
(a retriever's hits with a document's parts in order).

Chat turns beyond text (:mod:`kvshift_memory.chat_turns`): tool calls in the model's layout
(:data:`ToolLayout`: the engine writes tools, calls and results; the model's answer is decoded
under :func:`tool_call_grammar` and read by :func:`parse_tool_calls`; :func:`closed_schema`, and
our own layout's parts :func:`tools_instructions`, :func:`format_tool_calls`,
:func:`tool_response`), structured answers
(:func:`schema_instructions`, :func:`with_system_text`, :data:`CONSTRAINED_REPETITION_PENALTY`) and reply token ids
(:func:`plausible_reply_ids`); :func:`is_call_name`: a framework's call id or tool name the engine takes.

The engine and store an adapter is given are typed by :class:`~kvshift_memory.protocols.Engine`
and :class:`~kvshift_memory.protocols.Store`.
"""

from __future__ import annotations

from .agent.asks import archive, forget_closest, joins_core
from .agent.core import CORE_TOKENS, CoreLine, change_block, core_text, placed_lines, read_block
from .agent.recall import RECALL, RecallSettings, archived_text, last_sentence, message_key, recall
from .agent.writeback import FEATURES, Decision, WriteBackModel, explicit_request, turn_features
from .chat_turns import (
    CONSTRAINED_REPETITION_PENALTY,
    TOOL_LAYOUTS,
    ToolLayout,
    closed_schema,
    format_tool_calls,
    parse_tool_calls,
    plausible_reply_ids,
    schema_instructions,
    tool_call_grammar,
    tool_response,
    tools_instructions,
    with_system_text,
)
from .inputs import is_call_name
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
from .store.items import (
    Item,
    delete_item,
    get_item,
    item_of,
    item_tenants,
    list_items,
    put_item,
    refresh_item,
    sweep_items,
)

__all__ = [
    "CONSTRAINED_REPETITION_PENALTY",
    "CORE_TOKENS",
    "CoreLine",
    "FEATURES",
    "Decision",
    "Engine",
    "Item",
    "MarkedSpan",
    "RECALL",
    "RecallSettings",
    "Store",
    "TOOL_LAYOUTS",
    "ToolLayout",
    "WriteBackModel",
    "archive",
    "archived_text",
    "change_block",
    "closed_schema",
    "context_window",
    "core_text",
    "delete_item",
    "explicit_request",
    "forget_closest",
    "format_tool_calls",
    "get_item",
    "in_document_order",
    "is_call_name",
    "item_of",
    "item_tenants",
    "joins_core",
    "last_sentence",
    "list_items",
    "marked_user_message",
    "message_key",
    "parse_markers",
    "parse_tool_calls",
    "placed_lines",
    "read_block",
    "plausible_reply_ids",
    "put_item",
    "recall",
    "refresh_item",
    "render_marker",
    "render_memories",
    "resolve_markers",
    "schema_instructions",
    "strip_markers",
    "sweep_items",
    "tool_call_grammar",
    "tool_response",
    "tools_instructions",
    "turn_features",
    "with_system_text",
]
