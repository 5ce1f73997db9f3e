"""What a chat framework's messages carry beyond text, written as the model reads it, and back.

Tool calls take one of three layouts (:data:`ToolLayout`, chosen per model by
:func:`~kvshift_memory.engine.prompt.tool_layout`). A chat template that renders tools itself
renders them, their calls and their results (``tools=`` and ``tool_calls`` given to it, as
transformers passes them), and the model's calls are read in the format that template teaches:
``"hermes"`` (Qwen 2.5 and 3, Hermes: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``)
or ``"llama-json"`` (Llama 3.1 and later: the answer is ``{"name": ..., "parameters": {...}}``).
Every other template gets ``"kvshift"``, our own layout written into the conversation's text
(:func:`as_text_turns`): the tools' JSON schemas in the system message, each call in the Hermes
tags in the assistant's turn, each result as ``<tool_response>\\n...\\n</tool_response>`` in a user
turn. Either way a call the model made comes back into the next prompt as it was generated, so
the next turn's prompt starts with the previous one and its K/V is reused, and the call itself is
decoded under a grammar built from the tools' schemas (:class:`~kvshift_memory.Grammar`): names
and arguments always parse and validate.

Structured answers: the schema told in the system message, the answer decoded under it.

Reply token ids: what the model generated, carried by a framework's message as a hint; the engine
reads a reply as those ids when they read back as its text, so the next turn reuses all of it.

The LangChain and LlamaIndex adapters build on these (through :mod:`kvshift_memory.adapters`);
calls are plain ``{"name": str, "arguments": dict, "id": str}`` dicts (``id`` optional), each
framework adds its own ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast

from .exceptions import InvalidInputError
from .messages import Message

if TYPE_CHECKING:
    from .engine.grammar import Grammar

__all__ = [
    "CONSTRAINED_REPETITION_PENALTY",
    "TOOL_LAYOUTS",
    "ToolLayout",
    "as_text_turns",
    "closed_schema",
    "format_tool_calls",
    "parse_tool_calls",
    "plausible_reply_ids",
    "schema_instructions",
    "tool_call_grammar",
    "tool_response",
    "tools_instructions",
    "with_system_text",
]

#: the repetition penalty under a grammar: there a greedy loop cannot end by itself (inside a JSON
#: string the closing quote loses to the loop, and a cut answer does not parse)
CONSTRAINED_REPETITION_PENALTY = 1.1
_OPEN, _CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)

#: how tools, calls and results reach the model (the module's docstring): ``"kvshift"`` as text
#: in our own layout, ``"hermes"`` and ``"llama-json"`` rendered by the model's chat template
ToolLayout = Literal["kvshift", "hermes", "llama-json"]
TOOL_LAYOUTS: tuple[ToolLayout, ...] = ("kvshift", "hermes", "llama-json")
# the key a layout's call keeps its arguments under
_ARGUMENTS_KEY = {"kvshift": "arguments", "hermes": "arguments", "llama-json": "parameters"}


def tools_instructions(tools: Sequence[Mapping[str, Any]]) -> str:
    """What the system message says about ``tools`` (OpenAI-format tool dicts)."""
    described = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        "You can call these tools. To call one, answer with only\n"
        f'{_OPEN}{{"name": <tool name>, "arguments": <its arguments as a JSON object>}}{_CLOSE}\n'
        "A tool's result comes back in <tool_response></tool_response>.\n"
        f"Tools:\n{described}"
    )


def schema_instructions(schema: Mapping[str, Any]) -> str:
    """What the system message says when the answer is one JSON object following ``schema``."""
    return f"Answer with one JSON object that follows this JSON schema:\n{json.dumps(schema, ensure_ascii=False)}"


def with_system_text(messages: Sequence[Mapping[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` with ``text`` after the system message's (a system message of its own when none)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *map(dict, messages[1:])]
    return [{"role": "system", "content": text}, *map(dict, messages)]


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


def _call_schema(function: Mapping[str, Any], closed: bool, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call to ``function``. Its parameters' definitions (``$defs``, as
    Pydantic writes nested models) move to the call schema's root, where their ``#/$defs/...``
    references point once the parameters sit under ``arguments_key``."""
    parameters = dict(function.get("parameters") or {"type": "object", "properties": {}})
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    if closed:
        parameters = closed_schema(parameters)
        definitions = {key: closed_schema(value) for key, value in definitions.items()}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **definitions,
    }


def tool_call_grammar(
    tools: Sequence[Mapping[str, Any]], choice: str | None, closed: bool = True, layout: ToolLayout = "kvshift"
) -> Grammar | None:
    """The grammar an answer follows with ``tools`` (OpenAI-format tool dicts) bound.

    :param choice: ``None``/``"auto"`` (text, or one call), ``"any"``/``"required"`` (one call to
        any tool), a tool's name (one call to it), ``"none"`` (no grammar: text only).
    :param closed: arguments hold their schema's listed keys only (:func:`closed_schema`).
    :param layout: the model's tool layout (``KVShiftEngine.tool_layout``): a call is written as
        that layout's model writes it.
    :raises InvalidInputError: a ``choice`` naming no bound tool, or an unknown layout.
    """
    # imported here: the engine package brings torch and transformers, which a process that only
    # uses the store through the adapters (a worker writing memories) must not wait for
    from .engine.grammar import COMPACT_JSON, Grammar

    if layout not in TOOL_LAYOUTS:
        raise InvalidInputError(f"layout is one of {TOOL_LAYOUTS}, got {layout!r}")
    if choice == "none" or not tools:
        return None
    functions = [tool["function"] for tool in tools]
    if choice not in (None, "auto", "any", "required"):
        functions = [function for function in functions if function["name"] == choice]
        if not functions:
            names = [tool["function"]["name"] for tool in tools]
            raise InvalidInputError(f"tool_choice {choice!r} names none of the bound tools {names}")
    # one JSON rule per tool: each call schema keeps its own definitions at its root
    schemas = [_call_schema(function, closed, _ARGUMENTS_KEY[layout]) for function in functions]
    if layout != "kvshift":
        # the template writes the call back with tojson: the model writes it so, and the next turn reuses it
        schemas = [schema | {"x-guidance": COMPACT_JSON} for schema in schemas]
    bodies = [f"body{index}: %json {json.dumps(schema, ensure_ascii=False)}\n" for index, schema in enumerate(schemas)]
    alternatives = " | ".join(f"body{index}" for index in range(len(functions)))
    if layout == "llama-json":  # the answer is the call's JSON itself
        call, first = f"call: {alternatives}\n{''.join(bodies)}", "{"
    else:
        call, first = f"call: {json.dumps(_OPEN)} ({alternatives}) {json.dumps(_CLOSE)}\n{''.join(bodies)}", "<"
    if choice in (None, "auto"):
        # a text answer may not start a call halfway: it starts with anything but a call's first character
        return Grammar.lark(f"start: call | TEXT\nTEXT: /[^{re.escape(first)}](.|\\n)*/\n{call}")
    return Grammar.lark(f"start: call\n{call}")


def format_tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """``calls`` (``{"name", "arguments"}``) as the model writes them (the inverse of :func:`parse_tool_calls`)."""
    return "\n".join(
        _OPEN + json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False) + _CLOSE
        for call in calls
    )


def parse_tool_calls(text: str, layout: ToolLayout = "kvshift") -> tuple[str, list[dict[str, Any]]]:
    """The text of an answer without its tool calls, and the calls as ``{"name", "arguments"}``.

    :param layout: the model's tool layout (``KVShiftEngine.tool_layout``). For ``"llama-json"``
        an answer that is one JSON object with a ``name`` and ``parameters`` is a call.
    A block that does not parse as a call stays in the text; arguments that are not an object
    become ``{}``.
    """
    if layout == "llama-json":
        try:
            body = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            return text.strip(), []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text.strip(), []
        arguments = body.get("parameters", body.get("arguments"))
        return "", [{"name": body["name"], "arguments": arguments if isinstance(arguments, dict) else {}}]
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for found in _CALL.finditer(text):
        try:
            body = json.loads(found.group(1))
        except (json.JSONDecodeError, RecursionError):
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        arguments = body.get("arguments")
        calls.append({"name": body["name"], "arguments": arguments if isinstance(arguments, dict) else {}})
        kept.append(text[last : found.start()])
        last = found.end()
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def tool_response(content: str) -> str:
    """A tool's result as the user turn that brings it back."""
    return f"<tool_response>\n{content}\n</tool_response>"


def as_text_turns(messages: Sequence[Message], tools: Sequence[Mapping[str, Any]]) -> list[Message]:
    """``messages`` (the engine's, checked: calls in ``tool_calls``, results as ``"tool"``
    messages) in our own layout, as text: ``tools`` described after the system message's text,
    each call written after its message's text as the model writes it, each run of results one
    user turn. What a template that renders no tools is given."""
    turns: list[Message] = []
    after_result = False
    for message in messages:
        if message["role"] == "tool":
            response = tool_response(message["content"])
            if after_result:
                turns[-1]["content"] += "\n" + response
            else:
                turns.append({"role": "user", "content": response})
        elif message.get("tool_calls"):
            turn = message.copy()
            calls = turn.pop("tool_calls")
            turn["content"] = "\n".join(part for part in (message["content"], format_tool_calls(calls)) if part)
            turns.append(turn)
        else:
            turns.append(message.copy())
        after_result = message["role"] == "tool"
    # with_system_text keeps every key of every message: only the system message's content grows
    return cast("list[Message]", with_system_text(turns, tools_instructions(tools))) if tools else turns


def plausible_reply_ids(ids: Any, content: str) -> bool:
    """Whether ``ids`` could be a reply's token ids: non-negative ints, no more than its text could hold.

    A framework's message is untrusted: anything else is ignored by the adapters (never an error
    that loses the turn); ids that pass are still checked by the engine against the text.
    """
    return (
        isinstance(ids, list) and 0 < len(ids) <= 4 * len(content) + 16 and all(type(i) is int and i >= 0 for i in ids)
    )
