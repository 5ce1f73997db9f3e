"""The shape of one chat message as the engine reads it: OpenAI's, with the engine's extras."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypedDict

if TYPE_CHECKING:  # annotations are not evaluated here (PEP 563): Python 3.10 needs no typing_extensions
    from typing_extensions import NotRequired

__all__ = ["Message", "ToolCall"]


class ToolCall(TypedDict):
    """A call an assistant message made: the tool's ``name``, its ``arguments`` (a dict), its ``id``."""

    name: str
    arguments: dict[str, Any]
    id: NotRequired[str]


class Message(TypedDict):
    """One message of a prompt, as ``inputs.check_messages`` returns it (checked).

    ``role`` and ``content`` always; a user message may carry ``memories`` (texts or records) and
    ``memories_at`` (one character offset of its content per memory, where they go; a caller may
    give one offset for all), an assistant message ``token_ids`` (the ids it was generated as) and
    ``tool_calls``, a tool message the ``tool_call_id`` and ``name`` of the call it answers.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    memories: NotRequired[list[Any]]
    memories_at: NotRequired[list[int]]
    token_ids: NotRequired[list[int]]
    tool_calls: NotRequired[list[ToolCall]]
    tool_call_id: NotRequired[str]
    name: NotRequired[str]
