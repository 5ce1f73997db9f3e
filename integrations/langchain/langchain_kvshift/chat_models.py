"""``ChatKVShift``: a LangChain chat model over a :class:`kvshift_memory.KVShiftEngine`.

Each call hands the conversation to the engine, which reuses the K/V of the longest prefix it has
already read (the previous turn's prompt and reply, exactly) and prefills only the rest. What was
reused is reported the way LangChain reports provider-side prompt caching:
``usage_metadata["input_token_details"]["cache_read"]`` (tokens served from reused K/V) and
``["cache_creation"]`` (tokens computed in this call and kept for reuse by later calls).

Tool calls and structured output are decoded under a grammar (:class:`kvshift_memory.Grammar`), so
even a small model's calls and JSON always parse and follow their schema (:mod:`.tool_calls`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
    UsageMetadata,
)
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field

from kvshift_memory import GenerationResult, Grammar, InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.adapters import (
    CONSTRAINED_REPETITION_PENALTY,
    context_window,
    is_call_name,
    marked_user_message,
    plausible_reply_ids,
    schema_instructions,
    strip_markers,
    with_system_text,
)
from langchain_kvshift.tool_calls import closed_schema, engine_calls, parse_tool_calls, tool_call_grammar

__all__ = ["ChatKVShift"]

BUNDLED_MODEL = "SmolLM2-135M-Instruct"

_ROLES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}
# per-call keyword arguments a call may override, and the engine's names for them
_CALL_OPTIONS = {
    "max_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "reuse": "reuse",
    "recompute_ratio": "recompute_ratio",
    "repetition_penalty": "repetition_penalty",
}
# content blocks of an AI message that repeat its tool_calls (Anthropic's and LangChain's own)
_CALL_BLOCKS = ("tool_use", "tool_call")
# per-call keyword arguments that shape the prompt and the grammar (bind_tools, with_structured_output)
_TOOL_OPTIONS = ("tools", "tool_choice", "strict", "response_format")
# per-call keyword arguments that say whose call it is (KVShiftMiddleware sets them from the run's context)
_TENANT_OPTIONS = ("store", "user_id", "session_id")


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
        elif isinstance(message, AIMessage) and isinstance(block, dict) and block.get("type") in _CALL_BLOCKS:
            continue  # the message's tool_calls say the same, and are written from there
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
    An AI message's ``response_metadata["token_ids"]`` (what ChatKVShift generated) go along: the
    engine reads the reply as those ids when they read back as its text, so the next turn reuses
    all of it. An AI message's tool calls go along as ``tool_calls`` and tool results as ``"tool"``
    messages: the engine writes them as the model's layout has them (``KVShiftEngine.tool_layout``).
    With ``store`` and ``user_id``, a human message's markers that name this user's memories
    bring their fragments along (:func:`~kvshift_memory.adapters.marked_user_message`); every
    other marker is removed.

    :raises InvalidInputError: a function message, an unknown role, a non-text block.
    """
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = message.role if isinstance(message, ChatMessage) else message.type
        if role not in _ROLES:
            raise InvalidInputError(f"messages[{index}] is a {role!r} message; ChatKVShift reads {sorted(_ROLES)}")
        text = _text(message, index)
        if _ROLES[role] == "system":
            system.append(strip_markers(text))
        elif _ROLES[role] == "user":
            turns.append(marked_user_message(text, store, tenant=user_id, session_id=session_id))
        elif _ROLES[role] == "tool":
            result: dict[str, Any] = {"role": "tool", "content": strip_markers(text)}
            if isinstance(message, ToolMessage) and is_call_name(message.tool_call_id):
                result["tool_call_id"] = message.tool_call_id
            if is_call_name(message.name):
                result["name"] = message.name
            turns.append(result)
        else:
            calls = message.tool_calls if isinstance(message, AIMessage) else []
            content = strip_markers(text)
            turn: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                turn["tool_calls"] = engine_calls(calls)
            reply_ids = message.response_metadata.get("token_ids") if isinstance(message, AIMessage) else None
            if not calls and plausible_reply_ids(reply_ids, content):
                # the ids the model generated: the engine takes them when they read back as the text
                # (a reply the tokenizer would split differently is then still this prompt's prefix);
                # anything else there is ignored, never an error that loses the turn
                turn["token_ids"] = reply_ids
            turns.append(turn)
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + turns


class ChatKVShift(BaseChatModel):
    """A local transformers chat model that prefills only what it has not read before.

    Constructing one loads nothing: the engine loads on the first call (or is given).

    :param model: a shipped model's name (``"gemma-3-270m"``), a Hugging Face id (downloaded as
        transformers does unless ``HF_HUB_OFFLINE`` is set) or folder; ``None`` for the bundled
        SmolLM2-135M-Instruct.
    :param device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``; ``None``: the CPU.
    :param dtype: ``"auto"`` (the checkpoint's own), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    :param model_kwargs: more of :meth:`KVShiftEngine.from_pretrained`'s options (engine settings
        by name, transformers' loading options), as plain values. The process shares one engine
        per model, device, dtype and options (:meth:`KVShiftEngine.shared`), loaded on first use.
    :param engine: an engine to use instead of the process's shared one for ``model``.
    :param max_tokens: most tokens generated per call.
    :param temperature: 0 for greedy decoding; ``top_p``, ``top_k`` (0: off) and ``seed`` shape
        sampling above it.
    :param stop: strings that end a reply (not included).
    :param reuse: ``"auto"``, ``"none"``, ``"prefix"``, ``"blend"`` or ``None`` (the engine's default, ``"auto"``).
    :param repetition_penalty: above 1, tokens the answer already holds are made less likely;
        ``None``: 1.1 for structured output and tool calls (a loop would never close the JSON), 1 otherwise.
    :param recompute_ratio: the blend's share of memory tokens recomputed; ``None`` (default) the
        engine's blend, which recomputes short memories next to the question whole (answers as
        full recompute's where the recalled memories sit in front of the latest message, as the
        memories and the middleware put them); 0 shifts memories in without repair: the fastest,
        and it changes some answers (docs/benchmarks/writeback.md).
    :param store: the conversation's K/V is kept there (``kv_store``): a LangGraph thread continued
        after a restart or on another worker restores it instead of prefilling it again. With
        ``user_id`` (and ``session_id``), memory markers in human messages that
        name this user's memories resolve to them and bring their stored K/V (``docs/how-it-works.md``); without
        a store every marker is plain text. Markers are never shown to the model.
    :param user_id: the tenant, also without a store: the engine reuses K/V only from this user's
        earlier calls, and ``cache_read`` counts only those, so one user can never learn from
        speed or usage what another typed. Models without one share the default tenant.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model: str | None = None
    device: str | None = None
    dtype: str = "auto"
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    engine: KVShiftEngine | None = Field(default=None, exclude=True)
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    reuse: str | None = None
    recompute_ratio: float | None = None
    repetition_penalty: float | None = None
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
        # everything that changes an answer, and the tenant: an LLM cache keyed by these never
        # hands one user's answer to another or a call with other settings
        return {
            "model_name": self.model_name,
            "device": self.device,
            "dtype": self.dtype,
            "model_kwargs": self.model_kwargs,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "stop": self.stop,
            "reuse": self.reuse,
            "recompute_ratio": self.recompute_ratio,
            "repetition_penalty": self.repetition_penalty,
            "user_id": self.user_id,
            "session_id": self.session_id,
        }

    @classmethod
    def is_lc_serializable(cls) -> bool:
        """Settings serialise (``dumpd``/``load``); an engine or store given is left out and rebuilt or re-given."""
        return True

    @classmethod
    def get_lc_namespace(cls) -> list[str]:
        return ["langchain_kvshift", "chat_models"]

    def _resolve_model_profile(self) -> ModelProfile | None:
        # constructing loads no weights: the context window comes from a loaded engine or the config
        window = self.engine.max_positions if self.engine is not None else context_window(self.model)
        if window is None:
            return None
        return ModelProfile(
            max_input_tokens=window,
            text_inputs=True,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            structured_output=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
        )

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s tokens under the model's own tokenizer (as message content; no special tokens).

        :raises InvalidInputError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidInputError(f"text is a string, not {type(text).__name__}")
        return list(self.loaded_engine().tokenizer.encode(text, add_special_tokens=False))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage], tools: Sequence[Any] | None = None) -> int:
        """The tokens of the whole prompt these messages make: chat template, tool descriptions and all."""
        bound = [convert_to_openai_tool(tool) for tool in tools or ()]
        prompt = self._engine_messages(messages)
        return self.loaded_engine().planner.plan(prompt, reuse="none", tenant=self.user_id, tools=bound).layout.length

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        return LangSmithParams(
            ls_provider="kvshift",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
            ls_stop=stop or self.stop,
        )

    def _engine_messages(
        self, messages: Sequence[BaseMessage], kwargs: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        who = {name: (kwargs or {}).get(name, getattr(self, name)) for name in _TENANT_OPTIONS}
        return to_engine_messages(messages, who["store"], user_id=who["user_id"], session_id=who["session_id"])

    def loaded_engine(self) -> KVShiftEngine:
        """The engine this chat model answers with: the one it was given, else the process's
        shared engine for its model and options (loaded on the first call)."""
        if self.engine is not None:
            return self.engine
        return KVShiftEngine.shared(self.model, device=self.device, dtype=self.dtype, **self.model_kwargs)

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any], constrained: bool = False) -> dict[str, Any]:
        model = kwargs.pop("model", None)
        if model is not None and model != self.model_name and model != self.model:
            raise InvalidInputError(
                f"ChatKVShift serves {self.model_name!r}; a per-call model ({model!r}) would load other weights: "
                "build another ChatKVShift"
            )
        unknown = set(kwargs) - set(_CALL_OPTIONS) - set(_TOOL_OPTIONS) - set(_TENANT_OPTIONS)
        if unknown:
            known = sorted([*_CALL_OPTIONS, *_TOOL_OPTIONS, *_TENANT_OPTIONS])
            raise InvalidInputError(f"ChatKVShift takes no {sorted(unknown)}; per-call options are {known}")
        options = {engine_name: getattr(self, name) for name, engine_name in _CALL_OPTIONS.items()}
        options.update({_CALL_OPTIONS[name]: value for name, value in kwargs.items() if name in _CALL_OPTIONS})
        options["stop"] = list(self.stop or []) + list(stop or [])
        options["tenant"] = kwargs.get("user_id", self.user_id)
        options["kv_store"] = self.store  # the thread's K/V kept there: another worker or process continues from it
        if options["repetition_penalty"] is None:
            options["repetition_penalty"] = CONSTRAINED_REPETITION_PENALTY if constrained else 1.0
        return options

    def _prompt(
        self, messages: Sequence[BaseMessage], kwargs: dict[str, Any]
    ) -> tuple[list[dict[str, Any]], Grammar | None, list[dict[str, Any]]]:
        """The engine's messages, the grammar the answer follows, and the tools bound.

        :raises InvalidInputError: a tool, tool choice or response format that cannot be honoured.
        """
        prompt = self._engine_messages(messages, kwargs)
        tools = kwargs.pop("tools", None) or []
        choice = kwargs.pop("tool_choice", None)
        strict = kwargs.pop("strict", None)
        response_format = kwargs.pop("response_format", None)
        if response_format is not None:
            if tools:
                raise InvalidInputError("give tools or a response_format, not both")
            return _response_format(prompt, response_format)
        if choice is not None and not tools:
            raise InvalidInputError("tool_choice without tools: bind_tools(tools, tool_choice=...)")
        if not tools:
            return prompt, None, []
        if choice in ("any", "required", True):
            choice = "any"
        elif isinstance(choice, dict):  # OpenAI's {"type": "function", "function": {"name": ...}}
            choice = choice.get("function", {}).get("name") or choice.get("name")
        if choice is not None and not isinstance(choice, str):
            raise InvalidInputError(f"tool_choice is a tool's name, 'auto', 'any' or 'none', not {choice!r}")
        grammar = tool_call_grammar(tools, choice, closed=strict is not False, layout=self.loaded_engine().tool_layout)
        return prompt, grammar, tools

    def _message(self, result: GenerationResult | None, tools: bool = False) -> AIMessage:
        assert result is not None  # a generation, or a stream once exhausted, has its result
        stats = result.stats
        engine = self.loaded_engine()
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
        text, calls = parse_tool_calls(result.text, engine.tool_layout) if tools else (result.text, [])
        metadata = {
            "model_name": self.model_name,
            "finish_reason": "tool_calls" if calls else result.finish_reason,
            "reuse_stats": dataclasses.asdict(stats),
            "token_ids": list(result.token_ids),
        }
        return AIMessage(content=text, tool_calls=calls, usage_metadata=usage, response_metadata=metadata)

    def _last_chunk(self, result: GenerationResult | None, tools: bool = False) -> AIMessageChunk:
        """The chunk that ends a stream: usage and metadata, and with tools the whole answer and its calls."""
        message = self._message(result, tools)
        return AIMessageChunk(
            content=message.content if tools else "",
            tool_call_chunks=[
                tool_call_chunk(name=call["name"], args=json.dumps(call["args"]), id=call["id"], index=index)
                for index, call in enumerate(message.tool_calls)
            ],
            usage_metadata=message.usage_metadata,
            response_metadata=message.response_metadata,
            chunk_position="last",
        )

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt, grammar, tools = self._prompt(messages, kwargs)
        options = self._options(stop, kwargs, constrained=grammar is not None)
        result = self.loaded_engine().generate(prompt, grammar=grammar, tools=tools, **options)
        calls = bool(tools) and grammar is not None  # tool_choice="none": tools described, no call read
        return ChatResult(generations=[ChatGeneration(message=self._message(result, tools=calls))])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        prompt, grammar, tools = self._prompt(messages, kwargs)
        options = self._options(stop, kwargs, constrained=grammar is not None)
        if tools and grammar is not None:  # a call is parsed whole: one chunk holds the answer's text and calls
            result = self.loaded_engine().generate(prompt, grammar=grammar, tools=tools, **options)
            last = self._last_chunk(result, tools=True)
            if run_manager is not None and last.text:
                run_manager.on_llm_new_token(last.text)
            yield ChatGenerationChunk(message=last)
            return
        pieces = self.loaded_engine().generate(prompt, stream=True, grammar=grammar, tools=tools, **options)
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
        yield ChatGenerationChunk(message=self._last_chunk(pieces.result))

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model with ``tools`` it may call; each call is decoded under the tools' JSON schemas.

        :param tool_choice: ``"auto"``/``None`` (the model answers or calls), ``"any"``,
            ``"required"`` or ``True`` (it calls one), a tool's name (it calls that one), ``"none"``.
        :param strict: arguments always follow the tool's schema; by default (and with ``True``)
            they hold its listed keys only, with ``False`` they may hold others.
        :raises InvalidInputError: a tool that does not convert to a JSON schema, or a
            ``tool_choice`` naming none of them.
        """
        try:
            converted = [convert_to_openai_tool(tool) for tool in tools]
        except (ValueError, TypeError) as exc:
            raise InvalidInputError(f"a tool cannot be described as a JSON schema: {exc}") from None
        names = [tool["function"]["name"] for tool in converted]
        if isinstance(tool_choice, str) and tool_choice not in ("auto", "any", "required", "none", *names):
            raise InvalidInputError(f"tool_choice {tool_choice!r} names none of the bound tools {names}")
        return super().bind(tools=converted, tool_choice=tool_choice, strict=strict, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """This model answering with an instance of ``schema`` (a Pydantic model, a TypedDict or a JSON schema).

        :param method: ``"json_schema"`` (the answer is decoded under the schema), ``"function_calling"``
            (a forced call of a tool with the schema's arguments), ``"json_mode"`` (any JSON object;
            the prompt says what it should hold).
        :param include_raw: return ``{"raw", "parsed", "parsing_error"}`` instead of raising on a parse error.
        :param strict: the answer always follows the schema; by default (and with ``True``) its
            objects hold their listed keys only (:func:`~langchain_kvshift.tool_calls.closed_schema`),
            with ``False`` they may hold others, as JSON Schema allows.
        :raises InvalidInputError: an unknown method, or keyword arguments this model does not take.
        """
        if kwargs:
            raise InvalidInputError(f"with_structured_output takes no {sorted(kwargs)}")
        pydantic = is_basemodel_subclass(schema) if isinstance(schema, type) else False
        parser: Runnable[Any, Any]
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=name,
                strict=strict,
                ls_structured_output_format={"kwargs": {"method": method}, "schema": tool},
            )
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            json_schema = convert_to_json_schema(schema)
            response_format: dict[str, Any] = (
                {"type": "json_schema", "schema": json_schema, "strict": strict is not False}
                if method == "json_schema"
                else {"type": "json_object"}
            )
            llm = self.bind(
                response_format=response_format,
                ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema},
            )
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()  # type: ignore[arg-type]
        else:
            raise InvalidInputError(f"method is 'json_schema', 'function_calling' or 'json_mode', not {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")


def _response_format(
    prompt: list[dict[str, Any]], response_format: Any
) -> tuple[list[dict[str, Any]], Grammar | None, list[dict[str, Any]]]:
    """The prompt and grammar of a ``response_format``: ``{"type": "json_schema", "schema": {...}}``
    (OpenAI's nesting under ``"json_schema"`` is read too; ``"strict": false`` leaves objects open)
    or ``{"type": "json_object"}``.

    :raises InvalidInputError: any other value.
    """
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return prompt, Grammar.json_schema({"type": "object"}), []
    if kind == "json_schema":
        schema = response_format.get("schema") or response_format.get("json_schema", {}).get("schema")
        if isinstance(schema, dict):
            grammar = Grammar.json_schema(schema if response_format.get("strict") is False else closed_schema(schema))
            return with_system_text(prompt, schema_instructions(schema)), grammar, []
    raise InvalidInputError(
        "response_format is {'type': 'json_schema', 'schema': {...}} or {'type': 'json_object'}, "
        f"not {response_format!r}"
    )
