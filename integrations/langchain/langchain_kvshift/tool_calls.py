"""Tool calls between LangChain's ``ToolCall`` and the engine's plain calls.

The layouts, the grammar and the schema rules are the core's (:mod:`kvshift_memory.chat_turns`,
through :mod:`kvshift_memory.adapters`; the LlamaIndex adapter shares them): the engine writes
tools, calls and results as the model's layout has them (``KVShiftEngine.tool_layout``); this
module only turns LangChain's calls into the engine's and the model's answer back into LangChain's
(each with a fresh id).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import ToolCall
from langchain_core.messages.tool import tool_call

from kvshift_memory import adapters
from kvshift_memory.adapters import ToolLayout, closed_schema, is_call_name, tool_call_grammar

__all__ = ["closed_schema", "engine_calls", "parse_tool_calls", "tool_call_grammar"]


def engine_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """LangChain's calls as the engine's ``{"name", "arguments", "id"}``."""
    converted = []
    for call in calls:
        entry: dict[str, Any] = {"name": call["name"], "arguments": call["args"]}
        if is_call_name(call.get("id")):
            entry["id"] = call["id"]
        converted.append(entry)
    return converted


def parse_tool_calls(text: str, layout: ToolLayout = "kvshift") -> tuple[str, list[ToolCall]]:
    """The text of an answer without its tool calls, and the calls (each with a fresh id).

    :param layout: the model's (``KVShiftEngine.tool_layout``).
    A block that does not parse as a call stays in the text.
    """
    text, calls = adapters.parse_tool_calls(text, layout)
    return text, [
        tool_call(name=call["name"], args=call["arguments"], id=f"call_{uuid.uuid4().hex[:24]}") for call in calls
    ]
