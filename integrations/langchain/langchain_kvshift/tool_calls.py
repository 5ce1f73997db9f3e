"""Tool calls as text the model writes under a grammar, and back.

Every chat template gets the same layout (the one Hermes and Qwen 2.5 templates use), written by
us into the conversation's text: the tools' JSON schemas in the system message, each call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` in the assistant's turn, each
result as ``<tool_response>\\n...\\n</tool_response>`` in a user turn. A call the model made is
rendered back exactly as it was generated, so the next turn's prompt starts with the previous one
and its K/V is reused. The call itself is decoded under a grammar built from the tools' schemas
(:class:`kvshift_memory.Grammar`): names and arguments always parse and validate.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import ToolCall
from langchain_core.messages.tool import tool_call

from kvshift_memory import Grammar, InvalidInputError

__all__ = [
    "closed_schema",
    "format_tool_calls",
    "parse_tool_calls",
    "tool_call_grammar",
    "tool_response",
    "tools_instructions",
]

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def tools_instructions(tools: Sequence[dict[str, Any]]) -> str:
    """What the system message says about ``tools`` (OpenAI-format tool dicts)."""
    described = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call these tools. To call one, answer with only\n"
        f'{OPEN}{{"name": <tool name>, "arguments": <its arguments as a JSON object>}}{CLOSE}\n'
        "A tool's result comes back in <tool_response></tool_response>.\n"
        f"Tools:\n{described}"
    )


def closed_schema(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object that does not say otherwise.

    JSON Schema lets an object hold keys it does not list, and a small model under a grammar will
    use that room (a call's arguments gained a ``"type"`` key); a tool's arguments and a structured
    answer hold the listed keys only, as OpenAI's strict mode has it.
    """
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: closed_schema(value) for key, value in schema.items()}
    if "properties" in schema:  # a map of names: the names are not schemas, their values are
        closed["properties"] = {name: closed_schema(value) for name, value in schema["properties"].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _call_schema(function: dict[str, Any], closed: bool) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if closed:
        parameters = closed_schema(parameters)
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(tools: Sequence[dict[str, Any]], choice: str | None, closed: bool = True) -> Grammar | None:
    """The grammar an answer follows with ``tools`` bound.

    :param choice: ``None``/``"auto"`` (text, or one call), ``"any"``/``"required"`` (one call to
        any tool), a tool's name (one call to it), ``"none"`` (no grammar: text only).
    :param closed: arguments hold their schema's listed keys only (:func:`closed_schema`).
    :raises InvalidInputError: a ``choice`` naming no bound tool.
    """
    if choice == "none" or not tools:
        return None
    functions = [tool["function"] for tool in tools]
    if choice not in (None, "auto", "any", "required"):
        functions = [function for function in functions if function["name"] == choice]
        if not functions:
            names = [tool["function"]["name"] for tool in tools]
            raise InvalidInputError(f"tool_choice {choice!r} names none of the bound tools {names}")
    schema = json.dumps({"anyOf": [_call_schema(function, closed) for function in functions]}, ensure_ascii=False)
    call = f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}\nbody: %json {schema}\n"
    if choice in (None, "auto"):
        # a text answer may not start a call's tag halfway: it starts with anything but "<"
        return Grammar.lark(f"start: call | TEXT\nTEXT: /[^<](.|\\n)*/\n{call}")
    return Grammar.lark(f"start: call\n{call}")


def format_tool_calls(calls: Sequence[ToolCall]) -> str:
    """``calls`` as the model writes them (the inverse of :func:`parse_tool_calls`)."""
    return "\n".join(
        OPEN + json.dumps({"name": call["name"], "arguments": call["args"]}, ensure_ascii=False) + CLOSE
        for call in calls
    )


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The text of an answer without its tool calls, and the calls (each with a fresh id).

    A block that does not parse as a call stays in the text.
    """
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for found in _CALL.finditer(text):
        try:
            body = json.loads(found.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments")
        calls.append(
            tool_call(
                name=body["name"],
                args=arguments if isinstance(arguments, dict) else {},
                id=f"call_{uuid.uuid4().hex[:24]}",
            )
        )
        kept.append(text[last : found.start()])
        last = found.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def tool_response(content: str) -> str:
    """A tool's result as the user turn that brings it back."""
    return f"<tool_response>\n{content}\n</tool_response>"
