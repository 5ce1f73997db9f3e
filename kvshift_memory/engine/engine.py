"""The engine: a local transformers model that reuses the K/V it has already computed.

Its parts: :mod:`.settings` (what can be tuned), :mod:`.planning` (prompt layout and reuse mode),
:mod:`.prefix_cache` (earlier prompts' K/V), :mod:`.fragments` (memories' K/V: pool, store, encode),
:mod:`.blend` (placing and repairing fragments), :mod:`.decoding` (the token loop and scoring).
This module runs the model and holds them together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from .. import inputs
from ..chat_turns import ToolLayout
from ..exceptions import ContextOverflowError, InvalidInputError
from ..kv.cache import ForwardStep, ShiftCache
from ..kv.fragment import Fragment
from ..kv.rope import rotate_
from ..protocols import ChunkStore
from ..shipped import DEFAULT_MODEL, SHIPPED_MODELS
from .allocator import keep_freed_memory
from .attention import ATTENTION_NAME
from .blend import last_adjacent_run, lead_possible, prefill_blend
from .chunks import StoredChunks
from .costs import CostModel
from .decoding import GenerationStream, eos_ids, generate_steps, score_continuation
from .families import PositionScheme, position_scheme, text_decoder
from .fingerprint import model_fingerprint
from .fragments import FragmentCache
from .grammar import Grammar, GrammarMatcher, grammar_tokenizer
from .loading import load_model, resolve_device, resolve_dtype
from .packing import pack_linear_layers, sharing
from .planning import Planner, PreparedPrompt, PromptPlan
from .prefix_cache import PrefixCache
from .prompt import FragmentSpan, PromptLayout, TokenMemo, common_prefix
from .results import GenerationResult, ReuseStats, ScoreResult
from .settings import EngineSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["EngineSettings", "GenerationStream", "KVShiftEngine"]

#: what a forward pass returns: the last position's logits, every position's, or none (decoder only)
Logits = Literal["last", "all", "none"]

_SHARED: dict[str, KVShiftEngine] = {}
_SHARED_LOCK = threading.Lock()


class KVShiftEngine:
    """A causal LM that prefills only what it has not read before.

    ``reuse="none"`` recomputes the whole prompt (the honest baseline); ``"prefix"`` reuses the
    K/V of the longest prompt prefix it has seen, exactly; ``"blend"`` also places each memory's
    cached fragment at its position in the prompt (RoPE-shifted) and recomputes a chosen share of
    the fragment tokens so that fragments and question see each other. Left to the engine
    (``reuse=None``), memories get ``"blend"`` and prompts without them ``"prefix"``.

    The engine installs its own attention function in the model
    (``model.set_attn_implementation("kvshift")``) and, with ``settings.pack_weights``, replaces
    its linear layers by packed ones in place; a model given to one engine should not be used
    elsewhere at the same time.

    :param model: a transformers causal LM (batch size 1 is what the engine runs).
    :param tokenizer: its tokenizer; its chat template, when it has one, formats the prompt.
    :param fingerprint: identifies model + tokenizer in fragment keys; computed when omitted.
    :param settings: behaviour knobs (:class:`EngineSettings`); keyword arguments override fields.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        *,
        fingerprint: str | None = None,
        settings: EngineSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = replace(settings or EngineSettings(), **overrides)
        if self.settings.auto_shifts is None:  # a model nobody measured: the blend's default
            self.settings = replace(self.settings, auto_shifts=True)
        if self.settings.keep_freed_memory:
            keep_freed_memory()
        self.model = model.eval()
        self.model.set_attn_implementation(ATTENTION_NAME)
        #: where the model runs (its input embeddings' device): every tensor it is given goes there
        embeddings = model.get_input_embeddings()
        assert isinstance(embeddings.weight, torch.Tensor)
        self.device: torch.device = embeddings.weight.device
        self.tokenizer = tokenizer
        #: the tokenisation memo (per namespace), which also reads this engine's replies back as their ids
        self.tokens = TokenMemo(tokenizer)
        self.fingerprint = fingerprint or model_fingerprint(model, tokenizer)
        #: how many linear layers were packed for oneDNN (0: left as loaded)
        self.packed_layers = pack_linear_layers(self.model) if self.settings.pack_weights else 0
        self.position_scheme: PositionScheme = position_scheme(model)
        self._decoder = text_decoder(model)  # the decoder alone, for passes that need no logits
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = int(config.max_position_embeddings)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.eos_token_ids = eos_ids(model, tokenizer)
        #: what a forward pass and a fragment fetch cost here, learned from this engine's own calls
        self.costs = CostModel()
        #: the K/V of earlier prompts, per namespace
        self.prefix_cache = PrefixCache(self.settings.prefix_cache_bytes)
        #: memories' fragments held in this process, and what each memory's store holds
        self.fragments = FragmentCache(
            self.settings.fragment_cache_bytes,
            self.fingerprint,
            (self.num_layers, self.kv_heads, self.head_dim),
            self.model.dtype,
            self.costs,
        )
        #: this engine's K/V kept in stores past the process (calls given a ``kv_store``)
        self.chunks = StoredChunks(
            self.fingerprint,
            (self.num_layers, self.kv_heads, self.head_dim),
            self.model.dtype,
            self.settings.chunk_tokens,
            self.costs,
        )
        self._planner = Planner(self.tokens, self.settings, self.max_positions, self.position_scheme)
        self._grammar_tokenizer: Any = None
        self._grammar_lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike | None = None,
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "auto",
        settings: EngineSettings | None = None,
        revision: str | None = None,
        attn_implementation: str | None = None,
        device_map: Any = None,
        **kwargs: Any,
    ) -> KVShiftEngine:
        """Load a model and wrap it.

        :param name_or_path: a shipped model's name (``"smollm2-135m-instruct"``, the default, or
            ``"gemma-3-270m"``; converted once from its package's GGUF file into ``$KVSHIFT_HOME``,
            default ``~/.cache/kvshift``), a local folder, or a hub id: read from the local hub
            cache, downloaded into it as transformers does when ``HF_HUB_OFFLINE`` is unset.
        :param device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``; or give ``device_map`` instead
            (the engine then runs on the device of the model's input embeddings).
        :param dtype: ``"auto"`` (the checkpoint's own), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        :param revision: the hub revision (branch, tag or commit) of a hub id.
        :param attn_implementation: how transformers loads attention; the engine installs its own
            attention function after loading either way, so this only matters for loading.
        :param kwargs: :class:`EngineSettings` fields by name; the rest go to transformers'
            ``from_pretrained`` (``trust_remote_code``, ``low_cpu_mem_usage``…).
        :raises InvalidInputError: an unknown dtype or device, a device this machine lacks, or both
            ``device`` and ``device_map``.
        :raises ModelNotFoundError: no model there; for a shipped model, the message gives the
            install command; for a hub id not cached while offline, how to get its weights.
        :raises ModelLoadError: files found but not loadable.
        """
        if device is not None and device_map is not None:
            raise InvalidInputError("give device or device_map, not both")
        fields = {field.name for field in dataclasses.fields(EngineSettings)}
        overrides = {key: value for key, value in kwargs.items() if key in fields}
        passed = {key: value for key, value in kwargs.items() if key not in fields}
        for key, value in (("revision", revision), ("attn_implementation", attn_implementation)):
            if value is not None:
                passed[key] = value
        if device_map is not None:
            passed["device_map"] = device_map
        shipped = SHIPPED_MODELS.get(DEFAULT_MODEL if name_or_path is None else str(name_or_path))
        if (
            shipped is not None
            and overrides.get("auto_shifts") is None
            and (settings or EngineSettings()).auto_shifts is None
        ):
            overrides["auto_shifts"] = shipped.auto_shifts  # what was measured on this model
        loaded = load_model(name_or_path, resolve_dtype(dtype), resolve_device(device), **passed)
        with sharing(loaded.weights):
            return cls(loaded.model, loaded.tokenizer, fingerprint=loaded.fingerprint, settings=settings, **overrides)

    @classmethod
    def shared(
        cls,
        name_or_path: str | os.PathLike | None = None,
        *,
        device: str | None = None,
        dtype: str = "auto",
        **kwargs: Any,
    ) -> KVShiftEngine:
        """The process's engine for a model, device, dtype and loading options, loaded by the first call.

        Framework adapters build many model objects; they must share one engine per model and
        device, which holds the weights and the K/V worth reusing.

        :param kwargs: as :meth:`from_pretrained` takes them (settings by name, transformers'
            options); plain values, since they name the engine.
        :raises InvalidInputError: options that cannot name an engine (not JSON values), and as
            :meth:`from_pretrained`.
        :raises ModelNotFoundError: ``ModelLoadError``: as :meth:`from_pretrained`.
        """
        try:
            key = json.dumps(
                [None if name_or_path is None else str(name_or_path), device, dtype, kwargs], sort_keys=True
            )
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"a shared engine's options are plain JSON values: {exc}") from exc
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.from_pretrained(name_or_path, device=device, dtype=dtype, **kwargs)
            return _SHARED[key]

    # ------------------------------------------------------------------ public API

    @overload
    def generate(
        self,
        messages: Sequence[dict[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: Literal[False] = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        grammar: Grammar | None = None,
        kv_store: ChunkStore | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        messages: Sequence[dict[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: Literal[True],
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        grammar: Grammar | None = None,
        kv_store: ChunkStore | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> GenerationStream: ...

    def generate(
        self,
        messages: Sequence[dict[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        repetition_penalty: float = 1.0,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        grammar: Grammar | None = None,
        kv_store: ChunkStore | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> GenerationResult | GenerationStream:
        """Answer ``messages`` with ``memories`` in the system message.

        :param messages: a user message, or a list of ``{"role", "content"}`` dicts (a system message
            may come first; without one, ``settings.system_prompt`` is used).
        :param memories: texts, or records with a ``text`` attribute; placed one per line after
            ``settings.memory_header``. Records from a :class:`MemoryStore` bring their stored
            fragment along (and a fragment encoded here is stored for them).
        :param reuse: ``"auto"`` (or ``None``, the default): exact prefix reuse, and the memories'
            fragments shifted in and repaired where that pays: a memory shorter than
            ``settings.min_recompute_tokens``, or one whose fragment is not cached, is computed
            with the question (a missed fragment is encoded after the answer, for the next call);
            ``"blend"``: every cached fragment shifted in; ``"prefix"``: exact prefix reuse only;
            ``"none"``: full recompute. A fragment is looked up after this prompt's system
            message, then after the engine's own (where :meth:`warm` without messages put it).
        :param recompute_ratio: share of the shifted fragment tokens the blend recomputes
            (default ``settings.recompute_ratio``).
        :param temperature: 0 for greedy decoding, else sampling with ``top_p``/``top_k``/``seed``.
        :param repetition_penalty: above 1, tokens this answer already holds are made less likely
            (a small model's greedy loops end; the prompt's tokens are not penalised).
        :param stop: strings that end the answer (not included in it).
        :param stream: return a :class:`GenerationStream` of text pieces instead of waiting.
        :param fragments_after: the system message memories' fragments are encoded after (and
            looked up under first); default: this prompt's own. A caller whose system message
            changes every call (a chat engine that writes retrieved documents into it) may pass a
            fixed one, the same it gives :meth:`warm`, so fragments encoded once match exactly.
        :param encode_context: the text the memories' fragments are encoded after (and looked up
            under), between the system message and the memory; default
            ``settings.encode_context``. Text about the same people as the memories works best (a
            sample of the user's own earlier conversation: ``docs/how-it-works.md``); with
            ``settings.match_speakers`` its speakers that a memory lacks take that memory's names.
            Give :meth:`warm` the same, or every fragment is encoded again here.
        :param namespace: whose call this is (the tenant): K/V is reused only from earlier calls of
            the same namespace, so neither the answer's speed nor ``stats`` tells one tenant what
            another has sent. Calls without one share the default namespace; a server for several
            users passes each user's id (:class:`AgentMemory` and the framework adapters do).
        :param grammar: what the answer must match (:class:`Grammar`: a JSON schema, a regular
            expression, a Lark grammar); tokens it forbids are never picked, and the answer ends
            where the grammar does. Give ``max_new_tokens`` room to finish: an answer cut by it
            (``finish_reason == "length"``) may be incomplete.
        :param kv_store: a store (a :class:`MemoryStore`) that keeps this conversation's K/V past the
            process: on a prefix-cache miss the prompt's stored chunks are read from it
            (``stats.restored_tokens``), and after the answer the prompt's and answer's K/V are
            written to it in the background (:meth:`flush_chunks` waits for that), under
            ``namespace``. Another process or worker given the same store continues from there.
        :param tools: OpenAI-format tools (``{"type": "function", "function": {"name",
            "description", "parameters"}}``) the model may call, written as its
            :attr:`tool_layout` writes them, with the calls (``tool_calls`` of an assistant
            message) and results (``"tool"`` messages) in ``messages``. The answer is text: read
            its calls with ``adapters.parse_tool_calls(text, engine.tool_layout)``, and constrain
            it with ``adapters.tool_call_grammar(tools, choice, layout=engine.tool_layout)``.
        :returns: a :class:`GenerationResult` (text, token ids, stats, finish reason).
        :raises InvalidInputError: bad messages, memories or parameters.
        :raises ContextOverflowError: the prompt plus ``max_new_tokens`` exceeds the context window.
            (A memory that does not fit after the system message and the encode context is not an
            error: the call falls back to exact prefix reuse and ``stats.fallback_reason`` says so.)
        """
        started = time.perf_counter()  # TTFT counts from here: validation and tokenising are the user's wait too
        max_new_tokens = inputs.check_positive_int(max_new_tokens, "max_new_tokens")
        inputs.check_sampling(temperature, top_p, top_k, seed, repetition_penalty)
        stops = inputs.check_stop(stop)
        if grammar is not None and not isinstance(grammar, Grammar):
            raise InvalidInputError(f"grammar is a kvshift_memory.Grammar, not {type(grammar).__name__}")
        matcher = None if grammar is None else GrammarMatcher(grammar, self.grammar_tokenizer())
        plan = self._with_store(
            self._planner.plan(
                messages,
                memories,
                reuse,
                recompute_ratio,
                max_new_tokens,
                fragments_after,
                encode_context,
                namespace,
                tools,
            ),
            kv_store,
        )
        sampling = (float(temperature), float(top_p), int(top_k), seed, float(repetition_penalty))
        steps = GenerationStream(generate_steps(self, plan, sampling, stops, started, matcher))
        if stream:
            return steps
        for _ in steps:
            pass
        assert steps.result is not None  # the steps end with the result
        return steps.result

    def score(
        self,
        messages: Sequence[dict[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        continuation: str | Sequence[int] = "",
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        return_distributions: bool = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        kv_store: ChunkStore | None = None,
    ) -> ScoreResult:
        """Log-probabilities of ``continuation`` as the start of the assistant's answer.

        The prompt is built exactly as :meth:`generate` builds it, with the same reuse, so a
        fidelity figure is the difference between ``score(..., reuse="none")`` and a reuse mode.
        Scoring leaves no prompt in the prefix cache (one measurement cannot warm the next).

        :param continuation: text (tokenised as content) or token ids.
        :param return_distributions: also return the full log-softmax at each position.
        :param fragments_after: as in :meth:`generate`.
        :param encode_context: as in :meth:`generate`.
        :param namespace: as in :meth:`generate`.
        :param kv_store: as in :meth:`generate`, read only (scoring stores nothing).
        :raises InvalidInputError: bad input, or token ids outside the vocabulary.
        :raises ContextOverflowError: prompt plus continuation exceeds the context window.
        """
        started = time.perf_counter()
        continuation = inputs.check_continuation(continuation)
        if isinstance(continuation, str):
            cont_ids = list(self.tokens.encode(continuation, namespace=inputs.check_namespace(namespace)))
        else:
            cont_ids = continuation
            if max(cont_ids) >= self.vocab_size:
                raise InvalidInputError(
                    f"continuation holds token id {max(cont_ids)} >= vocabulary size {self.vocab_size}"
                )
        plan = self._with_store(
            self._planner.plan(
                messages, memories, reuse, recompute_ratio, len(cont_ids), fragments_after, encode_context, namespace
            ),
            kv_store,
        )
        return score_continuation(self, plan, cont_ids, return_distributions, started)

    def warm(
        self,
        memories: Sequence[Any],
        messages: Sequence[dict[str, str]] | str | None = None,
        *,
        fragments_after: str | None = None,
        lead_fragments: bool | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        from_turn: Sequence[dict[str, Any]] | None = None,
    ) -> int:
        """Encode the memories' fragments now, ahead of any question, and cache the shared prefix.

        An agent calls this when it stores memories, so that a question later pays only for
        itself. Fragments are encoded after a system message: leave ``messages`` out when the
        system message of later questions is not known (the engine's own is used, and a fragment
        encoded after it serves a prompt under any system message, shifted and repaired), or pass
        the ``messages`` whose system message will be used (or the ``fragments_after`` that
        :meth:`generate` will be given) for the closest match.
        Does nothing for models whose positions cannot be shifted.

        :param lead_fragments: also encode each memory's lead fragment (see
            :attr:`EngineSettings.lead_fragments`), read when it opens the system message's memory
            block; default: the setting. Pass ``False`` when the memories will only be placed in
            user messages (as the agent and the framework adapters place them), where it is never read.
        :param encode_context: as in :meth:`generate`; pass there the same.
        :param namespace: as in :meth:`generate`: what is warmed here serves only that namespace.
        :param from_turn: the messages of a call just made in ``namespace`` (a chat turn): a
            memory whose text that prompt holds (the user's own message) takes its fragment from
            the turn's cached K/V, computed in the conversation it was said in, instead of
            being encoded after the encode context. It skips the encode context's prefill for a
            namespace that has none cached yet, but the blend then strays further from full
            recompute (``docs/benchmarks/fidelity.md``), so the agent does not use it. Memories
            the turn does not hold, and a turn no longer cached, are encoded as without it.
        :returns: how many of the memories had a fragment encoded or cut from the turn (those
            already cached are skipped).
        :raises InvalidInputError: bad messages, memories or turn.
        :raises ContextOverflowError: the system message, encode context and a memory exceed the
            context window.
        """
        if messages is None:
            messages = [{"role": "user", "content": "?"}]  # only the system message matters here
        if lead_fragments is not None and not isinstance(lead_fragments, bool):
            raise InvalidInputError(f"lead_fragments must be True, False or None, not {lead_fragments!r}")
        plan = self._planner.plan(messages, memories, "blend", 0.0, 1, fragments_after, encode_context, namespace)
        turn = None
        if from_turn is not None:
            turn = self._planner.plan(from_turn, None, "prefix", 0.0, 0, None, None, namespace).layout.token_ids
        no_room = self._planner.no_room_to_encode(plan.layout)
        if no_room is not None:
            raise ContextOverflowError(no_room)
        if plan.reuse != "blend" or not plan.layout.fragments:
            return 0
        lead = self.settings.lead_fragments if lead_fragments is None else lead_fragments
        return self._warm(plan.layout, lead, turn)

    def clear_cache(self, *, prefixes: bool = True, fragments: bool = True) -> None:
        """Forget cached prompt prefixes and/or fragments (measurements start cold with this).

        Stored chunks stay in their stores; the engine forgets which it wrote, and checks again.
        """
        if prefixes:
            self.prefix_cache.clear()
            self.chunks.forget_known()
        if fragments:
            self.fragments.clear()

    def flush_chunks(self, timeout_s: float | None = None) -> bool:
        """Wait until the K/V chunks of finished calls are written to their stores (see ``kv_store``).

        :returns: ``False`` when ``timeout_s`` ran out first (the writing goes on).
        """
        return self.chunks.writer.flush(timeout_s)

    @staticmethod
    def _with_store(plan: PromptPlan, kv_store: Any) -> PromptPlan:
        if kv_store is None:
            return plan
        if not isinstance(kv_store, ChunkStore):
            raise InvalidInputError(
                f"kv_store must be a MemoryStore (load_chunk, save_chunk, codec), not {type(kv_store).__name__}"
            )
        return replace(plan, kv_store=kv_store)

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of this engine's vocabulary, built on first use (constrained decoding).

        :raises InvalidInputError: the tokenizer is not a fast (tokenizers) one.
        """
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_tokenizer

    @property
    def tool_layout(self) -> ToolLayout:
        """How tools, calls and results reach this model: ``"hermes"`` or ``"llama-json"`` when
        its chat template renders them (Qwen 2.5 and 3; Llama 3.1 and later), else
        ``"kvshift"``, our own layout as text (``kvshift_memory.chat_turns``)."""
        return self.tokens.tool_layout

    def count_tokens(self, text: str, *, namespace: str | None = None) -> int:
        """Tokens ``text`` takes as message content (``namespace``: as in :meth:`generate`)."""
        text = inputs.check_text(text, "text", allow_empty=True)
        return len(self.tokens.encode(text, namespace=inputs.check_namespace(namespace)))

    # ------------------------------------------------------------------ planning API (tests, benchmarks)

    def plan(
        self,
        messages: Sequence[dict[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        extra_tokens: int = 1,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> PromptPlan:
        """The :class:`PromptPlan` :meth:`generate` would run, with ``extra_tokens`` slots after the prompt.

        Arguments as in :meth:`generate`. Nothing is computed or cached.

        :raises InvalidInputError: ``ContextOverflowError``: as :meth:`generate`.
        """
        extra_tokens = inputs.check_positive_int(extra_tokens, "extra_tokens")
        return self._planner.plan(
            messages, memories, reuse, recompute_ratio, extra_tokens, fragments_after, encode_context, namespace, tools
        )

    @torch.inference_mode()
    def prefill(self, plan: PromptPlan) -> PreparedPrompt:
        """Compute the K/V of ``plan``'s prompt, reusing what ``plan.reuse`` allows.

        The prompt's K/V is not remembered for later prefix reuse (:meth:`generate` does that once
        it has decoded); fragments encoded on the way are cached and stored as in :meth:`generate`.
        """
        layout, mode, ratio = plan.layout, plan.reuse, plan.recompute_ratio
        ids, n = layout.token_ids, layout.length
        cache = ShiftCache(self.num_layers, n + plan.extra_tokens, self.device)
        stats = ReuseStats(
            reuse=mode,
            requested_reuse=plan.requested_reuse,
            prompt_tokens=n,
            recompute_ratio=ratio if mode == "blend" else 0.0,
            fallback_reason=plan.fallback_reason,
        )
        reused, exact_until, shifted = (
            (0, n, 0)
            if mode == "none"
            # "auto" keeps the conversation exact: no window shifted in from behind a cut
            else self.prefix_cache.reuse(cache, layout, mode, self.rotate, shift_cuts=plan.requested_reuse != "auto")
        )
        if plan.kv_store is not None and mode != "none" and shifted == 0 and reused < n - 1:
            restored = self.chunks.restore(plan.kv_store, cache, layout, reused, mode == "blend")
            stats.restored_tokens = restored.end - reused
            stats.chunks_rejected = restored.rejected
            exact_until = min(exact_until, restored.exact_until)
            reused = restored.end
        stats.reused_tokens = reused
        stats.shifted_tokens = shifted
        stats.fragments_hit = sum(1 for span in layout.fragments if span.end <= reused)
        stats.memory_reuse = ["prefix" if span.end <= reused else "text" for span in layout.fragments]
        # Only the last run of memories (at most separators apart) is placed; earlier ones not yet
        # cached (a conversation whose earlier turns fell out of the prefix cache) are read as text.
        new_spans = (
            last_adjacent_run([span for span in layout.fragments if span.start >= reused]) if mode == "blend" else []
        )
        if not new_spans:
            logits = self.prefill_exact(cache, ids, reused, n)
            stats.prefilled_tokens = n - reused
            return PreparedPrompt(cache, logits[-1], stats, exact_until)
        auto = plan.requested_reuse == "auto"
        return prefill_blend(self, cache, layout, ratio, stats, reused, exact_until, new_spans, auto)

    def encode_missed(self, layout: PromptLayout, spans: list[FragmentSpan]) -> int:
        """Encode the fragments of memories a prompt found none for (after its conditioning), so
        the next call shifts them in: a generation does this after its answer.

        :returns: the fragment tokens encoded.
        """
        if not spans:
            return 0
        _, origins = self.fragments.fetch(layout, spans, self.encode_fragments)
        opening = [
            span
            for span in spans
            if span.start == layout.conditioning.numel() and lead_possible(self.settings, layout, span)
        ]
        if opening:
            self.fragments.fetch(layout, opening, self.encode_fragments, lead=True)
        return sum(len(span.token_ids) for span, origin in zip(spans, origins, strict=True) if "encoded" in origin)

    # ------------------------------------------------------------------ forward passes

    @overload
    def forward(
        self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Literal["last", "all"] = "last"
    ) -> torch.Tensor: ...

    @overload
    def forward(self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Literal["none"]) -> None: ...

    @torch.inference_mode()
    def forward(
        self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Logits = "last"
    ) -> torch.Tensor | None:
        """Run ``ids`` at ``step.slots`` over ``cache``; ``logits``: ``"last"``, ``"all"`` or ``"none"``.

        Every pass goes through here: the cost model learns from it.
        """
        started = time.perf_counter()
        try:
            return self._forward_pass(cache, ids, step, logits)
        finally:
            self.costs.observe_pass(int(ids.numel()), time.perf_counter() - started)

    def _forward_pass(
        self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Logits
    ) -> torch.Tensor | None:
        ids, positions = ids.to(self.device)[None], step.slots_on(self.device)[None]
        with cache.stepping(step):
            if logits == "none":  # the decoder alone: the LM head would read the whole vocabulary matrix
                self._decoder(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
                return None
            out = self.model(
                input_ids=ids,
                position_ids=positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if logits == "all" else 1,
            )
        return out.logits[0].float()

    @torch.inference_mode()
    def _prefilled(self, namespace: str, ids: torch.Tensor, room: int) -> ShiftCache:
        """A cache holding the exact K/V of ``ids``, with ``room`` slots after.

        ``namespace``'s cached prefixes are reused, and ``ids`` is remembered as one.
        """
        n = ids.numel()
        cache = ShiftCache(self.num_layers, n + room, self.device)
        reused, _, _ = self.prefix_cache.reuse(cache, PromptLayout(ids, (), ids, namespace), "prefix", self.rotate)
        self.prefill_exact(cache, ids, reused, n, logits="none")
        self.prefix_cache.remember(namespace, cache, ids, n, n)
        return cache

    @torch.inference_mode()
    def encode_fragments(self, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False) -> list[Fragment]:
        """Encode each span after the layout's prefix and its encode context (after the prefix alone when ``lead``)."""
        by_context: dict[str, list[int]] = {}
        for index, span in enumerate(spans):
            by_context.setdefault(layout.context_digest(span, lead), []).append(index)
        fragments: dict[int, Fragment] = {}
        for context_digest, indices in by_context.items():
            conditioning = layout.encoded_after(spans[indices[0]], lead)
            start = conditioning.numel()
            scratch = self._prefilled(layout.namespace, conditioning, max(len(spans[i].token_ids) for i in indices))
            for index in indices:
                span = spans[index]
                end = start + len(span.token_ids)
                self.forward(
                    scratch, torch.tensor(span.token_ids, device="cpu"), ForwardStep.span(start, end), logits="none"
                )
                kv = scratch.view(start, end)
                fragments[index] = Fragment(
                    token_ids=span.token_ids,
                    keys=tuple(k.clone() for k, _ in kv),
                    values=tuple(v.clone() for _, v in kv),
                    base_position=start,
                    context_digest=context_digest,
                )
        return [fragments[index] for index in range(len(spans))]

    def _cut_or_encode(
        self, turn: torch.Tensor, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False
    ) -> list[Fragment]:
        """Each span's fragment cut from the cached K/V of the prompt ``turn`` where it holds the
        span's tokens; encoded (:meth:`encode_fragments`) where it does not, and always when ``lead``."""
        cut = [None if lead else self._cut_from_turn(turn, layout, span) for span in spans]
        missing = [index for index, fragment in enumerate(cut) if fragment is None]
        encoded = iter(self.encode_fragments(layout, [spans[i] for i in missing], lead) if missing else ())
        return [fragment if fragment is not None else next(encoded) for fragment in cut]

    def _cut_from_turn(self, turn: torch.Tensor, layout: PromptLayout, span: FragmentSpan) -> Fragment | None:
        """``span``'s fragment from the K/V of the last place the cached prompt ``turn`` holds its text.

        A span ends with the separator that follows a memory in a prompt, which the message that
        said the text lacks: the separator's K/V is computed after the text's, in the turn's
        context. The keys stay rotated at the positions they had in the turn (``base_position``):
        placing the fragment rotates them once, to where it lands.
        """
        entry, cached = self.prefix_cache.lookup(layout.namespace, turn)
        said = common_prefix(
            torch.tensor(span.token_ids), torch.tensor(self.tokens.encode(span.text, namespace=layout.namespace))
        )
        if entry is None or said == 0 or cached < said:
            return None
        windows = turn[:cached].unfold(0, said, 1)
        found = (windows == torch.tensor(span.token_ids[:said], dtype=turn.dtype)).all(dim=1).nonzero()
        if not found.numel():
            return None
        start, n = int(found[-1]), len(span.token_ids)
        cache = ShiftCache(self.num_layers, start + n, self.device)
        with torch.inference_mode():
            for layer, (keys, values) in enumerate(entry.kv):
                cache.write(layer, 0, keys[..., : start + said, :], values[..., : start + said, :])
        if said < n:
            tail = torch.tensor(span.token_ids[said:], device="cpu")
            self.forward(cache, tail, ForwardStep.span(start + said, start + n), logits="none")
        kv = cache.view(start, start + n)
        return Fragment(
            token_ids=span.token_ids,
            keys=tuple(k.clone() for k, _ in kv),
            values=tuple(v.clone() for _, v in kv),
            base_position=start,
            context_digest=layout.context_digest(span),
        )

    @torch.inference_mode()
    def place(self, cache: ShiftCache, spans: list[FragmentSpan], fragments: list[Fragment]) -> None:
        """Copy the fragments into their spans, then rotate each run of adjacent spans at once."""
        for layer in range(self.num_layers):
            cache.reserve(layer, fragments[0].keys[layer], fragments[0].values[layer])
            keys, values = cache.buffer(layer)
            for span, fragment in zip(spans, fragments, strict=True):
                keys[..., span.start : span.end, :].copy_(fragment.keys[layer])
                values[..., span.start : span.end, :].copy_(fragment.values[layer])
        run_start, deltas = spans[0].start, []
        for index, (span, fragment) in enumerate(zip(spans, fragments, strict=True)):
            deltas.append(torch.full((span.end - span.start,), span.start - fragment.base_position, device="cpu"))
            if index + 1 == len(spans) or spans[index + 1].start != span.end:
                self.rotate(cache, run_start, torch.cat(deltas))
                if index + 1 < len(spans):
                    run_start, deltas = spans[index + 1].start, []

    def rotate(self, cache: ShiftCache, start: int, deltas: torch.Tensor) -> None:
        """Move the keys in slots ``[start, start + len(deltas))`` by ``deltas`` positions (RoPE re-encoding)."""
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, rotary in enumerate(self.position_scheme.layers):
            keys, _ = cache.buffer(layer)
            if id(rotary) not in tables:
                tables[id(rotary)] = rotary.cos_sin(deltas, keys.dtype, keys.device)
            rotate_(keys[..., start : start + deltas.numel(), :], *tables[id(rotary)], rotary.rotary_dim)
        cache.mark_filled(start + deltas.numel())

    @overload
    def prefill_exact(
        self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: Literal["last", "all"] = "last"
    ) -> torch.Tensor: ...

    @overload
    def prefill_exact(
        self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: Literal["none"]
    ) -> None: ...

    @torch.inference_mode()
    def prefill_exact(
        self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: Logits = "last"
    ) -> torch.Tensor | None:
        """Run ``ids[start:end]`` at their own slots (nothing when the range is empty, which only a
        ``logits="none"`` call may ask: the others' callers always leave the last token to run)."""
        if end <= start:
            if logits != "none":
                raise ValueError(f"no token in [{start}, {end}) to compute logits for")
            return None
        return self.forward(cache, ids[start:end], ForwardStep.span(start, end), logits=logits)

    def _warm(self, layout: PromptLayout, lead_fragments: bool, turn: torch.Tensor | None = None) -> int:
        spans = list(layout.fragments)
        encode = self.encode_fragments if turn is None else functools.partial(self._cut_or_encode, turn)
        _, origins = self.fragments.fetch(layout, spans, encode)
        encoded = [origin not in ("pool", "store") for origin in origins]
        leading = [
            index for index, span in enumerate(spans) if lead_fragments and lead_possible(self.settings, layout, span)
        ]
        if leading:
            _, lead_origins = self.fragments.fetch(
                layout, [spans[i] for i in leading], self.encode_fragments, lead=True
            )
            for index, origin in zip(leading, lead_origins, strict=True):
                encoded[index] = encoded[index] or origin not in ("pool", "store")
        if not any(encoded):  # nothing was encoded, so the shared prefix may not be cached yet
            self._prefilled(layout.namespace, layout.conditioning, 0)
        return sum(encoded)
