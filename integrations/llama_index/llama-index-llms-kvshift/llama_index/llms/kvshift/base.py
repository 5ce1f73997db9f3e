"""``KVShiftLLM``: a LlamaIndex ``FunctionCallingLLM`` over a :class:`kvshift_memory.KVShiftEngine`.

Chat keeps the roles instead of flattening the messages into one prompt, so a chat engine's turn
starts with the previous turn's prompt and reply token for token, and the engine reuses their K/V
exactly; only the new message is prefilled. Given the user's store, memories that a
``llama_index.memory.kvshift.KVShiftMemory`` recalled into span markers (``docs/how-it-works.md``) are placed
from their stored fragments instead of being read again.

Tools (``FunctionAgent``, ``chat_with_tools``, ``predict_and_call``) and structured output
(``structured_predict``, ``as_structured_llm``, which LlamaIndex runs as one forced tool call) are
decoded under a grammar built from the tools' JSON schemas, so a call always parses and
validates; calls and their results are written in one layout for every model
(:mod:`kvshift_memory.chat_turns`), a call rendered back as it was generated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import uuid
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
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools.types import BaseTool
from pydantic import ConfigDict, Field, PrivateAttr

from kvshift_memory import GenerationResult, GenerationStream, Grammar, InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.adapters import (
    CONSTRAINED_REPETITION_PENALTY,
    is_call_name,
    marked_user_message,
    parse_tool_calls,
    strip_markers,
    tool_call_grammar,
)

__all__ = ["KVShiftLLM"]


_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.TOOL: "tool",
}


def to_engine_messages(
    messages: Sequence[ChatMessage], store: Any = None, *, user_id: str | None = None, session_id: str | None = None
) -> list[dict[str, Any]]:
    """LlamaIndex chat messages as the engine's; system messages joined into one leading message.

    An assistant message's tool calls (its ``ToolCallBlock`` blocks) go along as ``tool_calls``
    and tool results as ``"tool"`` messages: the engine writes them as the model's layout has them
    (``KVShiftEngine.tool_layout``). With
    ``store`` and ``user_id``, a user message's markers that name this user's memories bring their
    fragments along (:func:`~kvshift_memory.adapters.marked_user_message`); every other marker is
    removed.

    :raises InvalidInputError: a function, chatbot or other role the engine has no place for.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = _ROLES.get(message.role)
        if role is None:
            raise InvalidInputError(
                f"messages[{index}] has role {message.role.value!r}; KVShiftLLM reads {sorted(r.value for r in _ROLES)}"
            )
        text = message.content or ""
        if role == "system":
            system.append(strip_markers(text))
        elif role == "user":
            turns.append(marked_user_message(text, store, tenant=user_id, session_id=session_id))
        elif role == "tool":
            result: dict[str, Any] = {"role": "tool", "content": strip_markers(text)}
            for key in ("tool_call_id", "name"):
                if is_call_name(message.additional_kwargs.get(key)):
                    result[key] = message.additional_kwargs[key]
            turns.append(result)
        else:
            turn: dict[str, Any] = {"role": role, "content": strip_markers(text)}
            calls = [_call_of(block) for block in message.blocks if isinstance(block, ToolCallBlock)]
            if calls:
                turn["tool_calls"] = calls
            turns.append(turn)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


def _call_of(block: ToolCallBlock) -> dict[str, Any]:
    """A tool call block as the core's ``{"name", "arguments", "id"}`` (arguments that are no JSON
    object: ``{}``)."""
    arguments = block.tool_kwargs
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    call = {"name": block.tool_name, "arguments": arguments if isinstance(arguments, dict) else {}}
    return call | ({"id": block.tool_call_id} if is_call_name(block.tool_call_id) else {})


def _tool_choice(choice: Any, required: bool) -> str | None:
    """LlamaIndex's and OpenAI's ways of choosing a tool as :func:`~kvshift_memory.adapters.tool_call_grammar`'s.

    :raises InvalidInputError: anything but a tool's name, ``"auto"``, ``"required"``, ``"any"``,
        ``"none"`` or ``{"type": "function", "function": {"name": ...}}``.
    """
    named = choice
    if isinstance(choice, dict):
        function = choice.get("function")
        named = (function.get("name") if isinstance(function, dict) else None) or choice.get("name")
    if choice is not None and not isinstance(named, str):
        raise InvalidInputError(f"tool_choice is a tool's name, 'auto', 'required' or 'none', not {choice!r}")
    if required and named in (None, "auto"):
        return "required"
    return named


class KVShiftLLM(FunctionCallingLLM):
    """A local transformers model that prefills only what it has not read before.

    :param model: a shipped model's name (``"gemma-3-270m"``), a Hugging Face id (downloaded as
        transformers does unless ``HF_HUB_OFFLINE`` is set) or folder; ``None`` for the bundled
        SmolLM2-135M-Instruct.
    :param device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``; ``None``: the CPU.
    :param dtype: ``"auto"`` (the checkpoint's own), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    :param model_kwargs: more of :meth:`KVShiftEngine.from_pretrained`'s options (engine settings
        by name, transformers' loading options), as plain values. The process shares one engine
        per model, device, dtype and options, loaded on first use.
    :param max_tokens: most tokens generated per call; ``temperature`` 0 decodes greedily,
        ``top_k`` (0: off) limits sampling above it.
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
        earlier calls (and reports only that reuse). Models without one share the default tenant.
    :param fragments_after: the system message memories' fragments are encoded after; default the
        engine's system prompt, which is also what ``KVShiftMemory`` encodes archived memories
        after. Fixed rather than each prompt's own, because a chat engine may rewrite its system
        message every turn (``CondensePlusContextChatEngine`` writes the retrieved documents into
        it), and a fragment conditioned on that would serve one turn only.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str | None = Field(default=None, description="HF id or folder; None for the bundled model")
    device: str | None = None
    dtype: str = "auto"
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)
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
            self._engine = KVShiftEngine.shared(self.model, device=self.device, dtype=self.dtype, **self.model_kwargs)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.engine.max_positions,
            num_output=self.max_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model or "SmolLM2-135M-Instruct",
        )

    def _prompt(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], Grammar | None, list[dict[str, Any]]]:
        """The engine's messages, the grammar the answer follows, and the tools bound
        (``tools``, ``tool_choice`` and ``strict`` taken out of ``kwargs``).

        :raises InvalidInputError: a tool choice without tools, or naming no bound tool.
        """
        prompt = to_engine_messages(messages, self.store, user_id=self.user_id, session_id=self.session_id)
        tools = kwargs.pop("tools", None) or []
        choice = _tool_choice(kwargs.pop("tool_choice", None), required=False)
        strict = kwargs.pop("strict", None)
        if not tools:
            if choice not in (None, "auto", "none"):
                raise InvalidInputError(f"tool_choice {choice!r} without tools")
            return prompt, None, []
        return prompt, tool_call_grammar(tools, choice, strict is not False, self.engine.tool_layout), tools

    def _options(
        self, kwargs: dict[str, Any], grammar: Grammar | None = None, tools: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        return {
            "tools": tools,
            "reuse": kwargs.get("reuse", self.reuse),
            "recompute_ratio": kwargs.get("recompute_ratio", self.recompute_ratio),
            "fragments_after": self.fragments_after or self.engine.settings.system_prompt,
            "max_new_tokens": kwargs.get("max_tokens", self.max_tokens),
            "temperature": kwargs.get("temperature", self.temperature),
            "top_k": kwargs.get("top_k", self.top_k),
            "stop": kwargs.get("stop"),
            "grammar": grammar,
            "repetition_penalty": CONSTRAINED_REPETITION_PENALTY if grammar is not None else 1.0,
            "tenant": self.user_id,
            "kv_store": self.store,  # the conversation's K/V kept there: another process continues from it
        }

    @staticmethod
    def _raw(result: GenerationResult | None) -> dict[str, Any]:
        """The engine's statistics of a finished generation (a stream's, once exhausted)."""
        if result is None:
            return {}
        return {"reuse_stats": dataclasses.asdict(result.stats), "finish_reason": result.finish_reason}

    def _reply(self, text: str, calls_read: bool) -> ChatMessage:
        """The assistant message of an answer: its text, and when a call may have been made its calls as blocks."""
        if not calls_read:
            return ChatMessage(role=MessageRole.ASSISTANT, content=text)
        text, calls = parse_tool_calls(text, self.engine.tool_layout)
        blocks: list[Any] = [TextBlock(text=text)] if text else []
        blocks += [
            ToolCallBlock(
                tool_call_id=f"call_{uuid.uuid4().hex[:24]}", tool_name=call["name"], tool_kwargs=call["arguments"]
            )
            for call in calls
        ]
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)

    # The public methods carry LlamaIndex's callback decorators; the async ones call the undecorated
    # bodies below, so a call fires its callback events once.

    def _complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponse:
        messages, grammar, _ = self._prompt([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        result = self.engine.generate(messages, **self._options(kwargs, grammar))
        return CompletionResponse(text=result.text, raw=self._raw(result))

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> CompletionResponseGen:
        messages, grammar, _ = self._prompt([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        pieces = self.engine.generate(messages, stream=True, **self._options(kwargs, grammar))

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", raw=self._raw(pieces.result))

        return gen()

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        prompt, grammar, tools = self._prompt(messages, kwargs)
        result = self.engine.generate(prompt, **self._options(kwargs, grammar, tools))
        # tool_choice="none": the tools are described, no call is read
        return ChatResponse(
            message=self._reply(result.text, bool(tools) and grammar is not None), raw=self._raw(result)
        )

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponseGen:
        prompt, grammar, tools = self._prompt(messages, kwargs)
        pieces: GenerationStream = self.engine.generate(prompt, stream=True, **self._options(kwargs, grammar, tools))
        calls_read = bool(tools) and grammar is not None

        def gen() -> ChatResponseGen:
            text = ""
            for piece in pieces:
                text += piece
                if not calls_read:  # a call's text is no answer: then the whole reply comes at the end
                    yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=piece)
            final = self._reply(text, calls_read)
            yield ChatResponse(
                message=final, delta=(final.content or "") if calls_read else "", raw=self._raw(pieces.result)
            )

        return gen()

    # Tools: FunctionCallingLLM's chat_with_tools, predict_and_call, FunctionAgent and structured output

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The chat call's arguments: the messages, the tools as OpenAI-format dicts, the choice
        (``tool_required`` makes it one call to any tool). One call per answer: the grammar admits
        one, whatever ``allow_parallel_tool_calls`` says."""
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg
            )
        return {
            "messages": messages,
            "tools": [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools],
            "tool_choice": _tool_choice(tool_choice, required=tool_required),
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The tool calls of an answer.

        :raises ValueError: none, with ``error_on_no_tool_call`` (LlamaIndex's contract).
        """
        calls = [
            ToolSelection(
                tool_id=block.tool_call_id or "", tool_name=block.tool_name, tool_kwargs=_call_of(block)["arguments"]
            )
            for block in response.message.blocks
            if isinstance(block, ToolCallBlock)
        ]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"Expected at least one tool call, but got 0 tool calls: {response.message.content!r}")
        return calls

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
