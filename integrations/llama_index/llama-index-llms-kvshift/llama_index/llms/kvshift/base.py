"""``KVShiftLLM``: a LlamaIndex ``CustomLLM`` over a :class:`kvshift_memory.KVShiftEngine`.

Chat keeps the roles instead of flattening the messages into one prompt, so a chat engine's turn
starts with the previous turn's prompt and reply token for token, and the engine reuses their K/V
exactly; only the new message is prefilled. Given the user's store, memories that a
``llama_index.memory.kvshift.KVShiftMemory`` recalled into span markers (``docs/how-it-works.md``) are placed
from their stored fragments instead of being read again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, TypeVar

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.llms import CustomLLM
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from pydantic import ConfigDict, Field, PrivateAttr

from kvshift_memory import GenerationResult, GenerationStream, InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.adapters import marked_user_message, strip_markers

__all__ = ["KVShiftLLM"]

_ROLES = {MessageRole.SYSTEM: "system", MessageRole.USER: "user", MessageRole.ASSISTANT: "assistant"}


def to_engine_messages(
    messages: Sequence[ChatMessage], store: Any = None, *, user_id: str | None = None, session_id: str | None = None
) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as the engine's; system messages joined into one leading message.

    With ``store`` and ``user_id``, a user message's markers that name this user's memories bring
    their fragments along (:func:`~kvshift_memory.adapters.marked_user_message`); every other
    marker is removed.

    :raises InvalidInputError: a tool, function or other role the engine has no place for.
    """
    system, turns = [], []
    for index, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidInputError(
                f"messages[{index}] has role {message.role.value!r}; KVShiftLLM has no tool calling"
            )
        text = message.content or ""
        if role == "system":
            system.append(strip_markers(text))
        elif role == "user":
            turns.append(marked_user_message(text, store, tenant=user_id, session_id=session_id))
        else:
            turns.append({"role": role, "content": strip_markers(text)})
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


class KVShiftLLM(CustomLLM):
    """A local transformers model that prefills only what it has not read before.

    :param model: a Hugging Face id (from the local cache) or folder; ``None`` for the bundled
        SmolLM2-135M-Instruct. The process shares one engine per model, loaded on first use.
    :param max_tokens: most tokens generated per call; ``temperature`` 0 decodes greedily.
    :param reuse: ``"auto"``, ``"none"``, ``"prefix"``, ``"blend"`` or ``None`` (the engine's default, ``"auto"``).
    :param recompute_ratio: the blend's share of memory tokens recomputed; ``None`` (default) the
        engine's blend, which recomputes short memories next to the question whole (answers as
        full recompute's where the recalled memories sit in front of the latest message, as the
        memories and the middleware put them); 0 shifts memories in without repair: the fastest,
        and it changes some answers (docs/benchmarks/writeback.md).
    :param store: the conversation's K/V is kept there (``kv_store``), so a chat continued in another
        process or worker restores it instead of prefilling it again; with ``user_id`` (and
        ``session_id``), memory markers in user messages that name
        this user's memories resolve to them and bring their stored K/V; without a store every
        marker is plain text. Markers are never shown to the model.
    :param user_id: the tenant, also without a store: the engine reuses K/V only from this user's
        earlier calls (and reports only that reuse). Models without one share the default namespace.
    :param fragments_after: the system message memories' fragments are encoded after; default the
        engine's system prompt, which is also what ``KVShiftMemory`` encodes archived memories
        after. Fixed rather than each prompt's own, because a chat engine may rewrite its system
        message every turn (``CondensePlusContextChatEngine`` writes the retrieved documents into
        it), and a fragment conditioned on that would serve one turn only.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str | None = Field(default=None, description="HF id or folder; None for the bundled model")
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    reuse: str | None = None
    recompute_ratio: float | None = None
    store: MemoryStore | None = Field(default=None, exclude=True)
    user_id: str | None = None
    session_id: str | None = None
    fragments_after: str | None = None
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

    def _messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        return to_engine_messages(messages, self.store, user_id=self.user_id, session_id=self.session_id)

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {
            "reuse": kwargs.get("reuse", self.reuse),
            "recompute_ratio": kwargs.get("recompute_ratio", self.recompute_ratio),
            "fragments_after": self.fragments_after or self.engine.settings.system_prompt,
            "max_new_tokens": kwargs.get("max_tokens", self.max_tokens),
            "temperature": kwargs.get("temperature", self.temperature),
            "stop": kwargs.get("stop"),
            "namespace": self.user_id,
            "kv_store": self.store,  # the conversation's K/V kept there: another process continues from it
        }

    def _generate(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> GenerationResult:
        return self.engine.generate(messages, **self._options(kwargs))

    def _stream(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> GenerationStream:
        return self.engine.generate(messages, stream=True, **self._options(kwargs))

    @staticmethod
    def _raw(result: GenerationResult | None) -> dict[str, Any]:
        """The engine's statistics of a finished generation (a stream's, once exhausted)."""
        if result is None:
            return {}
        return {"reuse_stats": dataclasses.asdict(result.stats), "finish_reason": result.finish_reason}

    # The public methods carry LlamaIndex's callback decorators; the async ones call the undecorated
    # bodies below, so a call fires its callback events once.

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        result = self._generate(self._messages([ChatMessage(role=MessageRole.USER, content=prompt)]), kwargs)
        return CompletionResponse(text=result.text, raw=self._raw(result))

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        pieces = self._stream(self._messages([ChatMessage(role=MessageRole.USER, content=prompt)]), kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", raw=self._raw(pieces.result))

        return gen()

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        result = self._generate(self._messages(messages), kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text), raw=self._raw(result))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        pieces = self._stream(self._messages(messages), kwargs)

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            final = ChatMessage(role=MessageRole.ASSISTANT, content=text)
            yield ChatResponse(message=final, delta="", raw=self._raw(pieces.result))

        return gen()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """:meth:`chat` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """:meth:`complete` in a worker thread, so the event loop keeps running."""
        return await asyncio.to_thread(self._complete, prompt, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        """:meth:`stream_chat` decoded in a worker thread: each piece reaches the loop as it is made."""
        return _in_worker_thread(lambda: self._stream_chat(messages, kwargs))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        """:meth:`stream_complete` decoded in a worker thread: each piece reaches the loop as it is made."""
        return _in_worker_thread(lambda: self._stream_complete(prompt, kwargs))


_Piece = TypeVar("_Piece")


async def _in_worker_thread(make: Callable[[], Iterator[_Piece]]) -> AsyncGenerator[_Piece, None]:
    """The items of the iterator ``make`` returns, produced in a worker thread and handed to the
    event loop one by one. A consumer that stops early stops the producer (the iterator is closed)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            iterator = make()
            try:
                for item in iterator:
                    if stop.is_set():
                        break
                    loop.call_soon_threadsafe(queue.put_nowait, (False, item))
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
            loop.call_soon_threadsafe(queue.put_nowait, (True, None))
        except BaseException as exc:  # handed to the consumer, raised where it awaits
            loop.call_soon_threadsafe(queue.put_nowait, (True, exc))

    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            finished, item = await queue.get()
            if finished:
                if item is not None:
                    raise item
                return
            yield item
    finally:
        stop.set()
        await worker
