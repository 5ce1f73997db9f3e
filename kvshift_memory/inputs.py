"""Checking what callers pass in, so bad input fails with a clear error before any tensor work."""

from __future__ import annotations

import itertools
import json
import math
import unicodedata
from collections.abc import Sequence
from typing import Any, Literal

from .exceptions import InvalidInputError
from .messages import Message, ToolCall

__all__ = [
    "REUSE_MODES",
    "MAX_TEXT_CHARS",
    "check_continuation",
    "check_identifier",
    "check_memories",
    "check_messages",
    "check_tenant",
    "check_number",
    "check_positive_int",
    "check_ratio",
    "check_reuse",
    "check_sampling",
    "check_stop",
    "check_text",
    "check_tools",
    "check_ttl",
    "is_call_name",
]

REUSE_MODES = ("auto", "none", "prefix", "blend")
ROLES = ("system", "user", "assistant", "tool")
#: bounds on what a conversation's tool calls carry (each is JSON the prompt holds whole)
MAX_TOOLS = 128
MAX_TOOL_CALLS = 64
MAX_NAME_CHARS = 256

#: No single text is tokenised past this many characters: longer text cannot fit any context
#: window we support (~4 characters a token), and tokenising it would only waste time.
MAX_TEXT_CHARS = 1_000_000


def check_text(text: Any, what: str, allow_empty: bool = False) -> str:
    if not isinstance(text, str):
        raise InvalidInputError(f"{what} must be a str, got {type(text).__name__}")
    if not allow_empty and not text.strip():
        raise InvalidInputError(f"{what} is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInputError(f"{what} has {len(text)} characters; at most {MAX_TEXT_CHARS} are accepted")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInputError(f"{what} is not valid Unicode text (lone surrogate at {exc.start})") from None
    return text


def check_identifier(value: Any, name: str) -> str:
    """A tenant, session or memory id: 1-256 printable characters, in Unicode's NFC form.

    NFC is what makes ``"José"`` typed on two keyboards (composed ``é`` or ``e`` plus an accent)
    one tenant, not two; leading or trailing whitespace is refused rather than stripped, so
    ``"alice "`` never silently becomes someone's tenant.

    :returns: the id in NFC form.
    :raises InvalidInputError: not a str, empty, too long, blank at either end, or holding
        control characters or lone surrogates.
    """
    if not isinstance(value, str):
        raise InvalidInputError(f"{name} must be a str, got {type(value).__name__}")
    if not 0 < len(value) <= 256:
        raise InvalidInputError(f"{name} must hold 1 to 256 characters, got {len(value)}")
    if not value.isprintable():  # also refuses lone surrogates
        raise InvalidInputError(f"{name} may only hold printable characters, got {value!r}")
    if value != value.strip():
        raise InvalidInputError(f"{name} may not begin or end with whitespace, got {value!r}")
    value = unicodedata.normalize("NFC", value)
    if len(value) > 256:
        raise InvalidInputError(f"{name} must hold 1 to 256 characters, got {len(value)}")
    return value


def check_tenant(value: Any) -> str:
    """A caller's reuse tenant (an id, as :func:`check_identifier`); ``None`` is the shared default ``""``."""
    return "" if value is None else check_identifier(value, "tenant")


def check_messages(messages: Any) -> list[Message]:
    """Accept a string (one user message) or a non-empty list of ``{"role", "content"}`` dicts.

    A user message may also carry ``"memories"`` (texts or records, placed inside that message,
    before its content, or, without a header, at ``"memories_at"``: a character offset of the
    content, or one ascending offset per memory, where a framework's flat prompt had them); an
    assistant message may carry ``"token_ids"``, the ids it was generated
    as (used when they decode to its content, so that a reply is read back as the very tokens
    whose K/V are cached), and ``"tool_calls"``: ``{"name", "arguments", "id"}`` dicts (``id``
    optional). A ``"tool"`` message is a tool's result, with the ``"tool_call_id"`` and
    ``"name"`` of the call it answers when known.

    :raises InvalidInputError: empty list, unknown role or key, a system message after the first,
        a content that is not a non-empty string, bad memories or token ids.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, Sequence) or isinstance(messages, (bytes, bytearray)):
        raise InvalidInputError(
            f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise InvalidInputError("messages is empty: give at least one message")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidInputError(f"messages[{index}] must be a dict with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise InvalidInputError(f"messages[{index}] has role {role!r}; expected one of {ROLES}")
        if role == "system" and index != 0:
            raise InvalidInputError(f"messages[{index}]: a system message may only come first")
        allowed = _MESSAGE_KEYS[role]
        unknown = set(message) - allowed
        if unknown:
            raise InvalidInputError(
                f"messages[{index}] has keys {sorted(map(str, unknown))}; a {role} message takes {sorted(allowed)}"
            )
        content = check_text(message["content"], f"messages[{index}]['content']", allow_empty=role != "user")
        entry: Message = {"role": role, "content": content}
        if message.get("memories"):
            check_memories(message["memories"])
            entry["memories"] = list(message["memories"])
            at = message.get("memories_at")
            if at is not None:
                entry["memories_at"] = _check_offsets(
                    at, len(entry["memories"]), len(content), f"messages[{index}]['memories_at']"
                )
        if message.get("token_ids") is not None:
            entry["token_ids"] = _check_token_ids(message["token_ids"], f"messages[{index}]['token_ids']")
        if message.get("tool_calls"):
            entry["tool_calls"] = _check_tool_calls(message["tool_calls"], f"messages[{index}]['tool_calls']")
        for key in ("tool_call_id", "name"):
            if message.get(key) is not None:
                entry[key] = _check_name(message[key], f"messages[{index}][{key!r}]")
        checked.append(entry)
    return checked


_MESSAGE_KEYS = {
    "system": {"role", "content"},
    "user": {"role", "content", "memories", "memories_at"},
    "assistant": {"role", "content", "token_ids", "tool_calls"},
    "tool": {"role", "content", "tool_call_id", "name"},
}


def is_call_name(value: Any) -> bool:
    """Whether ``value`` can name a tool or a call (a tool call's ``name`` or ``id``, a result's
    ``tool_call_id``): a non-blank string of at most :data:`MAX_NAME_CHARS`, without NUL."""
    return isinstance(value, str) and bool(value.strip()) and len(value) <= MAX_NAME_CHARS and "\x00" not in value


def _check_name(value: Any, what: str) -> str:
    if not is_call_name(value):
        raise InvalidInputError(f"{what} is a non-empty string of at most {MAX_NAME_CHARS} characters, got {value!r}")
    return value


def _check_json_object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidInputError(f"{what} is a JSON object (a dict), got {type(value).__name__}")
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"{what} must be JSON (str keys; no NaN, no objects): {exc}") from None
    except RecursionError:
        raise InvalidInputError(f"{what} is nested too deeply") from None
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidInputError(f"{what} is {len(text):,} characters as JSON, over {MAX_TEXT_CHARS:,}")
    return value


def _check_tool_calls(calls: Any, what: str) -> list[ToolCall]:
    if isinstance(calls, (str, bytes)) or not isinstance(calls, Sequence) or len(calls) > MAX_TOOL_CALLS:
        raise InvalidInputError(f"{what} is a list of at most {MAX_TOOL_CALLS} calls")
    checked = []
    for number, call in enumerate(calls):
        where = f"{what}[{number}]"
        if (
            not isinstance(call, dict)
            or not {"name", "arguments"} <= set(call)
            or set(call) - {"name", "arguments", "id"}
        ):
            raise InvalidInputError(f"{where} is a dict with 'name', 'arguments' and optionally 'id'")
        entry: ToolCall = {
            "name": _check_name(call["name"], f"{where}['name']"),
            "arguments": _check_json_object(call["arguments"], f"{where}['arguments']"),
        }
        if call.get("id") is not None:
            entry["id"] = _check_name(call["id"], f"{where}['id']")
        checked.append(entry)
    return checked


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Accept ``None`` or a list of OpenAI-format tools: ``{"type": "function", "function":
    {"name", "description", "parameters"}}`` (description and parameters optional).

    :raises InvalidInputError: not a list, too many, or a tool of another shape.
    """
    if tools is None:
        return []
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence) or len(tools) > MAX_TOOLS:
        raise InvalidInputError(f"tools is a list of at most {MAX_TOOLS} OpenAI-format tool dicts")
    checked = []
    for number, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise InvalidInputError(f"tools[{number}] is {{'type': 'function', 'function': {{'name', ...}}}}")
        _check_name(function.get("name"), f"tools[{number}]['function']['name']")
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise InvalidInputError(f"tools[{number}]['function']['description'] is a string")
        if function.get("parameters") is not None:
            _check_json_object(function["parameters"], f"tools[{number}]['function']['parameters']")
        checked.append(_check_json_object(dict(tool), f"tools[{number}]"))
    return checked


def _check_offsets(at: Any, count: int, length: int, what: str) -> list[int]:
    """One character offset per memory, ascending, from one offset for all or a list."""
    offsets = [at] * count if isinstance(at, int) and not isinstance(at, bool) else at
    if (
        not isinstance(offsets, (list, tuple))
        or len(offsets) != count
        or not all(isinstance(o, int) and not isinstance(o, bool) and 0 <= o <= length for o in offsets)
        or any(a > b for a, b in itertools.pairwise(offsets))
    ):
        raise InvalidInputError(
            f"{what} must be a character offset into the content (0..{length}), "
            f"or one ascending offset per memory; got {at!r}"
        )
    return list(offsets)


def _check_token_ids(ids: Any, what: str) -> list[int]:
    if (
        isinstance(ids, Sequence)
        and not isinstance(ids, (str, bytes))
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
    ):
        return list(ids)
    raise InvalidInputError(f"{what} must be a list of token ids (ints >= 0)")


def check_memories(memories: Any) -> list[str]:
    """Accept ``None``, or a list of strings or of objects with a ``text`` string (memory records).

    :returns: the texts, stripped of surrounding whitespace.
    :raises InvalidInputError: not a list, or an item that is not text, or empty text.
    """
    if memories is None:
        return []
    if isinstance(memories, (str, bytes)) or not isinstance(memories, Sequence):
        raise InvalidInputError(f"memories must be a list of texts or memory records, got {type(memories).__name__}")
    texts = []
    for index, memory in enumerate(memories):
        text = memory if isinstance(memory, str) else getattr(memory, "text", memory)
        texts.append(check_text(text, f"memories[{index}]").strip())
    return texts


def check_reuse(reuse: Any) -> Literal["auto", "none", "prefix", "blend"] | None:
    """``None`` (let the engine choose, as ``"auto"``) or one of :data:`REUSE_MODES`."""
    if reuse is not None and reuse not in REUSE_MODES:
        raise InvalidInputError(f"reuse must be one of {REUSE_MODES} or None, got {reuse!r}")
    return reuse


def check_positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidInputError(f"{name} must be a positive int, got {value!r}")
    return value


def check_optional_bool(value: Any, name: str) -> bool | None:
    """``True``, ``False`` or ``None`` (left to a setting).

    :raises InvalidInputError: anything else, naming ``name``.
    """
    if value is not None and not isinstance(value, bool):
        raise InvalidInputError(f"{name} must be True, False or None, not {value!r}")
    return value


def check_non_negative_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInputError(f"{name} must be an int >= 0, got {value!r}")
    return value


def check_number(
    value: Any, name: str, low: float, high: float, *, low_open: bool = False, high_open: bool = False, unit: str = ""
) -> float:
    """``value`` as a float when it is a finite number (not a bool) between ``low`` and ``high``
    (included unless ``low_open`` / ``high_open``).

    :param unit: what the number counts, for the message (``"seconds"``).
    :raises InvalidInputError: anything else, naming ``name`` and the interval.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not (low < value if low_open else low <= value)
        or not (value < high if high_open else value <= high)
    ):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise InvalidInputError(f"{name} must be a number{f' of {unit}' if unit else ''} in {interval}, got {value!r}")
    return float(value)


def check_ttl(ttl_s: Any) -> float | None:
    """A time to live in seconds, or ``None`` (kept until deleted).

    :raises InvalidInputError: not a positive number (below 1e11).
    """
    return (
        None if ttl_s is None else check_number(ttl_s, "ttl_s", 0, 1e11, low_open=True, high_open=True, unit="seconds")
    )


def check_ratio(value: Any, name: str = "recompute_ratio") -> float:
    return check_number(value, name, 0, 1)


def check_sampling(temperature: Any, top_p: Any, top_k: Any, seed: Any, repetition_penalty: Any = 1.0) -> None:
    check_number(temperature, "temperature", 0, 100)
    check_number(top_p, "top_p", 0, 1, low_open=True)
    check_non_negative_int(top_k, "top_k (0: no limit)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidInputError(f"seed must be an int or None, got {seed!r}")
    check_number(repetition_penalty, "repetition_penalty", 1, 10)


def check_stop(stop: Any) -> list[str]:
    """``None``, one string, or a list of non-empty strings."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidInputError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    return list(stop)


def check_continuation(continuation: Any) -> str | list[int]:
    """A non-empty string, or a non-empty list of token ids."""
    if isinstance(continuation, str):
        return check_text(continuation, "continuation")
    if isinstance(continuation, Sequence) and continuation:
        try:
            return _check_token_ids(continuation, "continuation")
        except InvalidInputError:
            pass
    raise InvalidInputError("continuation must be a non-empty str or a non-empty list of token ids")
