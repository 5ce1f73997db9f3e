"""``KVShiftLLM``: a LlamaIndex ``CustomLLM`` over a :class:`kvshift_memory.KVShiftEngine`.

Chat keeps the roles instead of flattening the messages into one prompt, so a chat engine's turn
starts with the previous turn's prompt and reply token for token, and the engine reuses their K/V
exactly; only the new message is prefilled.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from pydantic import Field, PrivateAttr

from kvshift_memory import GenerationResult, GenerationStream, InvalidInputError, KVShiftEngine

__all__ = ["KVShiftLLM"]

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


def to_engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages as the engine's; system messages joined into one leading message.

    :raises InvalidInputError: a tool, function or other role the engine has no place for.
    """
    system, turns = [], []
    for index, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidInputError(f"messages[{index}] has role {message.role.value!r}; KVShiftLLM has no tool calling")
        text = message.content or ""
        if role == "system":
            system.append(text)
        else:
            turns.append({"role": role, "content": text})
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


class KVShiftLLM(CustomLLM):
    """A local transformers model that prefills only what it has not read before.

    :param model: a Hugging Face id (from the local cache) or folder; ``None`` for the bundled
        SmolLM2-135M-Instruct. The process shares one engine per model, loaded on first use.
    :param max_tokens: most tokens generated per call; ``temperature`` 0 decodes greedily.
    :param reuse: ``"none"``, ``"prefix"``, ``"blend"`` or ``None`` (the engine's choice).
    """

    model: str | None = Field(default=None, description="HF id or folder; None for the bundled model")
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    reuse: str | None = None
    _engine: KVShiftEngine | None = PrivateAttr(default=None)

    def __init__(self, *, engine: KVShiftEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVShiftLLM"

    @property
    def engine(self) -> KVShiftEngine:
        if self._engine is None:
            self._engine = KVShiftEngine.shared(self.model)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.max_positions,
            num_output=self.max_tokens,
            is_chat_model=True,
            model_name=self.model or "SmolLM2-135M-Instruct",
        )

    def _run(self, messages: list[dict[str, str]], stream: bool, kwargs: dict[str, Any]) -> GenerationResult | GenerationStream:
        return self.engine.generate(
            messages,
            reuse=kwargs.get("reuse", self.reuse),
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            stop=kwargs.get("stop"),
            stream=stream,
        )

    @staticmethod
    def _raw(result: GenerationResult) -> dict[str, Any]:
        return {"reuse_stats": dataclasses.asdict(result.stats), "finish_reason": result.finish_reason}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        result = self._run([{"role": "user", "content": prompt}], False, kwargs)
        return CompletionResponse(text=result.text, raw=self._raw(result))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self._run([{"role": "user", "content": prompt}], True, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", raw=self._raw(pieces.result))

        return gen()

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        result = self._run(to_engine_messages(messages), False, kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text), raw=self._raw(result))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        pieces = self._run(to_engine_messages(messages), True, kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            final = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=final, delta="", raw=self._raw(pieces.result))

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """:meth:`chat` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.chat, messages, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """:meth:`complete` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self.complete, prompt, formatted, **kwargs)
