"""``ChatKVShift``: a LangChain chat model over a :class:`kvshift_memory.KVShiftEngine`.

Each call hands the conversation to the engine, which reuses the K/V of the longest prefix it has
already read (the previous turn's prompt and reply, exactly) and prefills only the rest. What was
reused is reported the way LangChain reports provider-side prompt caching:
``usage_metadata["input_token_details"]["cache_read"]`` (tokens served from reused K/V) and
``["cache_creation"]`` (tokens computed in this call and kept for reuse by later calls).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    UsageMetadata,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from kvshift_memory import GenerationResult, InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.adapters import marked_user_message, strip_markers

__all__ = ["ChatKVShift"]

BUNDLED_MODEL = "SmolLM2-135M-Instruct"

_ROLES = {"human": "user", "user": "user", "ai": "assistant", "assistant": "assistant", "system": "system"}
# per-call keyword arguments a call may override, and the engine's names for them
_CALL_OPTIONS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "reuse": "reuse",
    "recompute_ratio": "recompute_ratio",
}


def _text(message: BaseMessage, index: int) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidInputError(f"messages[{index}] holds a {kind!r} content block; ChatKVShift reads text only")
    return "".join(parts)


def to_engine_messages(
    messages: Sequence[BaseMessage], store: Any = None, *, user_id: str | None = None, session_id: str | None = None
) -> list[dict[str, Any]]:
    """LangChain messages as the engine's ``{"role", "content"}`` dicts.

    System messages are joined into one leading system message (the engine's chat template has
    one place for it), in order; human, AI and chat messages with those roles keep their order.
    With ``store`` and ``user_id``, a human message's markers that name this user's memories
    bring their fragments along (:func:`~kvshift_memory.adapters.marked_user_message`); every
    other marker is removed.

    :raises InvalidInputError: a tool or function message, an unknown role, a non-text block.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.role if isinstance(message, ChatMessage) else message.type
        if role not in _ROLES:
            raise InvalidInputError(f"messages[{index}] is a {role!r} message; ChatKVShift has no tool calling")
        text = _text(message, index)
        if _ROLES[role] == "system":
            system.append(strip_markers(text))
        elif _ROLES[role] == "user":
            turns.append(marked_user_message(text, store, tenant=user_id, session_id=session_id))
        else:
            turns.append({"role": "assistant", "content": strip_markers(text)})
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


class ChatKVShift(BaseChatModel):
    """A local transformers chat model that prefills only what it has not read before.

    Constructing one loads nothing: the engine loads on the first call (or is given).

    :param model: a Hugging Face id (from the local cache) or folder; ``None`` for the bundled
        SmolLM2-135M-Instruct.
    :param engine: an engine to use instead of the process's shared one for ``model``.
    :param max_tokens: most tokens generated per call.
    :param temperature: 0 for greedy decoding.
    :param stop: strings that end a reply (not included).
    :param reuse: ``"none"``, ``"prefix"``, ``"blend"`` or ``None`` (the engine's choice).
    :param recompute_ratio: the blend's share of memory tokens recomputed; 0 (shift only, the
        fastest, and it changes some answers: docs/benchmarks/writeback.md), ``None`` for the
        engine's default. ``reuse="prefix"`` answers as full recompute does, as ``AgentMemory`` does.
    :param store: with ``user_id`` (and ``session_id``), memory markers in human messages that
        name this user's memories resolve to them and bring their stored K/V (``docs/how-it-works.md``); without
        a store every marker is plain text. Markers are never shown to the model.
    :param user_id: the tenant, also without a store: the engine reuses K/V only from this user's
        earlier calls, and ``cache_read`` counts only those, so one user can never learn from
        speed or usage what another typed. Models without one share the default namespace.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str | None = None
    engine: KVShiftEngine | None = Field(default=None, exclude=True)
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] | None = None
    reuse: str | None = None
    recompute_ratio: float | None = 0.0
    streaming: bool = False
    store: MemoryStore | None = Field(default=None, exclude=True)
    user_id: str | None = None
    session_id: str | None = None

    @property
    def _llm_type(self) -> str:
        return "kvshift"

    @property
    def model_name(self) -> str:
        return self.model or BUNDLED_MODEL

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "reuse": self.reuse,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(
            ls_provider="kvshift",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
            ls_stop=stop or self.stop,
        )

    def _engine_messages(self, messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
        return to_engine_messages(messages, self.store, user_id=self.user_id, session_id=self.session_id)

    def _engine(self) -> KVShiftEngine:
        return self.engine if self.engine is not None else KVShiftEngine.shared(self.model)

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_name and model != self.model:
            raise InvalidInputError(
                f"ChatKVShift serves {self.model_name!r}; a per-call model ({model!r}) would load other weights: "
                "build another ChatKVShift"
            )
        unknown = set(kwargs) - set(_CALL_OPTIONS)
        if unknown:
            raise InvalidInputError(
                f"ChatKVShift takes no {sorted(unknown)}; per-call options are {sorted(_CALL_OPTIONS)}"
            )
        options = {engine_name: getattr(self, name) for name, engine_name in _CALL_OPTIONS.items()}
        options.update({_CALL_OPTIONS[name]: value for name, value in kwargs.items()})
        options["stop"] = list(self.stop or []) + list(stop or [])
        options["namespace"] = self.user_id
        return options

    def _message(self, result: GenerationResult | None, chunk: bool = False) -> AIMessage | AIMessageChunk:
        assert result is not None  # a generation, or a stream once exhausted, has its result
        stats = result.stats
        engine = self._engine()
        # everything this call computed is kept as a prefix for the next calls, when prefixes are cached
        created = (
            stats.prompt_tokens - stats.reused_tokens if engine.settings.prefix_cache_bytes else stats.encoded_tokens
        )
        usage: UsageMetadata = {
            "input_tokens": stats.prompt_tokens,
            "output_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "input_token_details": {"cache_read": stats.reused_tokens, "cache_creation": created},
        }
        metadata = {
            "model_name": self.model_name,
            "finish_reason": result.finish_reason,
            "reuse_stats": dataclasses.asdict(stats),
        }
        if chunk:
            return AIMessageChunk(content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last")
        return AIMessage(content=result.text, usage_metadata=usage, response_metadata=metadata)

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        options = self._options(stop, kwargs)
        result = self._engine().generate(self._engine_messages(messages), **options)
        return ChatResult(generations=[ChatGeneration(message=self._message(result))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        options = self._options(stop, kwargs)
        pieces = self._engine().generate(self._engine_messages(messages), stream=True, **options)
        finished = False
        try:
            for piece in pieces:
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
                if run_manager is not None:
                    run_manager.on_llm_new_token(piece, chunk=chunk)
                yield chunk
            finished = True
        finally:
            if not finished:
                pieces.close()  # a consumer that stopped early ends the generation; the cache stays valid
        last = self._message(pieces.result, chunk=True)
        assert isinstance(last, AIMessageChunk)
        yield ChatGenerationChunk(message=last)
