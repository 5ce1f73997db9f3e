"""Tool calls as text the model writes under a grammar, and back, with LangChain's ``ToolCall``.

The layout, the grammar and the schema rules are the core's (:mod:`kvshift_memory.chat_turns`,
through :mod:`kvshift_memory.adapters`; the LlamaIndex adapter shares them): this module only turns
its plain calls into LangChain's (each with a fresh id) and back.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from langchain_core.messages import ToolCall
from langchain_core.messages.tool import tool_call

from kvshift_memory import adapters
from kvshift_memory.adapters import closed_schema, tool_call_grammar, tool_response, tools_instructions

__all__ = [
    "closed_schema",
    "format_tool_calls",
    "parse_tool_calls",
    "tool_call_grammar",
    "tool_response",
    "tools_instructions",
]


def format_tool_calls(calls: Sequence[ToolCall]) -> str:
    """``calls`` as the model writes them (the inverse of :func:`parse_tool_calls`)."""
    return adapters.format_tool_calls([{"name": call["name"], "arguments": call["args"]} for call in calls])


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text of an answer without its tool calls, and the calls (each with a fresh id).

    A block that does not parse as a call stays in the text.
    """
    text, calls = adapters.parse_tool_calls(text)
    return text, [
        tool_call(name=call["name"], args=call["arguments"], id=f"call_{uuid.uuid4().hex[:24]}") for call in calls
    ]
