"""The engine: a local transformers model that reuses the K/V it has already computed.

This module is the public front. Its parts: :mod:`.settings` (what can be tuned), :mod:`.planning`
(prompt layout and reuse mode), :mod:`.runner` (forward passes, prefill with reuse, the caches),
:mod:`.prefix_cache` (earlier prompts' K/V), :mod:`.fragments` (memories' K/V: pool, store,
encode), :mod:`.blend` (placing and repairing fragments), :mod:`.decoding` (the token loop and scoring).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from .. import inputs
from ..chat_turns import ToolLayout
from ..deprecation import renamed_keyword
from ..exceptions import InvalidInputError
from ..protocols import ChunkStore
from .decoding import Sampling, generate_steps, score_continuation
from .fingerprint import format_fingerprint, model_fingerprint
from .grammar import Grammar, GrammarMatcher
from .loading import load_model, resolve_device, resolve_dtype, shared_key, split_options
from .native import native_status
from .options import GenerateOptions
from .packing import sharing
from .planning import Planner
from .results import GenerationResult, GenerationStream, ScoreResult
from .runner import ModelRunner
from .settings import EngineSettings
from .weights import check_weight_format, resident_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from typing_extensions import Unpack

__all__ = ["KVShiftEngine"]

_SHARED: dict[str, KVShiftEngine] = {}
_SHARED_LOCK = threading.Lock()


class KVShiftEngine:
    """A causal LM that prefills only what it has not read before (the reuse modes: :meth:`generate`).

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
        self.fingerprint = format_fingerprint(fingerprint or model_fingerprint(model, tokenizer), self.settings.weights)
        #: runs the model and holds the K/V it computed (:class:`~.runner.ModelRunner`)
        self.runner = runner = ModelRunner(model, tokenizer, self.fingerprint, self.settings)
        self.model, self.device, self.tokenizer = runner.model, runner.device, tokenizer
        #: the model's context window, in tokens
        self.max_positions = runner.max_positions
        #: how many linear layers were packed for oneDNN (0: left as loaded)
        self.packed_layers = runner.packed_layers
        #: what a forward pass and a fragment fetch cost here, learned from this engine's own calls
        self.costs = runner.costs
        #: lays prompts out: ``planner.plan(...)`` is the :class:`PromptPlan` :meth:`generate` would run
        self.planner = Planner(runner.tokens, self.settings, runner.max_positions, runner.position_scheme)

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
        overrides, passed = split_options(
            name_or_path, settings, kwargs, device, dtype, device_map, revision, attn_implementation
        )
        weights = check_weight_format(overrides.get("weights", (settings or EngineSettings()).weights))
        loaded = load_model(name_or_path, resolve_dtype(dtype), resolve_device(device), weights, **passed)
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
        :raises ModelNotFoundError: as :meth:`from_pretrained`.
        :raises ModelLoadError: as :meth:`from_pretrained`.
        """
        key = shared_key(name_or_path, device, dtype, kwargs)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.from_pretrained(name_or_path, device=device, dtype=dtype, **kwargs)
            return _SHARED[key]

    @overload
    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        stream: Literal[True],
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream: ...

    @renamed_keyword("namespace", "tenant")
    def generate(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
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
        tenant: str | None = None,
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
        :param tenant: whose call this is: K/V is reused only from earlier calls of the same
            tenant, so neither the answer's speed nor ``stats`` tells one tenant what another has
            sent. Calls without one share the default tenant; a server for several users passes
            each user's id (:class:`AgentMemory` and the framework adapters pass their
            ``user_id``). Formerly ``namespace=``, still accepted with a ``DeprecationWarning``.
        :param grammar: what the answer must match (:class:`Grammar`: a JSON schema, a regular
            expression, a Lark grammar); tokens it forbids are never picked, and the answer ends
            where the grammar does. Give ``max_new_tokens`` room to finish: an answer cut by it
            (``finish_reason == "length"``) may be incomplete.
        :param kv_store: a store (a :class:`MemoryStore`) that keeps this conversation's K/V past the
            process: on a prefix-cache miss the prompt's stored chunks are read from it
            (``stats.restored_tokens``), and after the answer the prompt's and answer's K/V are
            written to it in the background (:meth:`flush_chunks` waits for that), under
            ``tenant``. Another process or worker given the same store continues from there.
        :param tools: OpenAI-format tools (``{"type": "function", "function": {"name", "description",
            "parameters"}}``) the model may call, written as its :attr:`tool_layout` writes them, with
            the calls (``tool_calls`` of an assistant message) and results (``"tool"`` messages) in
            ``messages``. The answer is text: read its calls with ``adapters.parse_tool_calls(text,
            engine.tool_layout)``; constrain it with ``adapters.tool_call_grammar(tools, choice, layout=...)``.
        :returns: a :class:`GenerationResult` (text, token ids, stats, finish reason).
        :raises InvalidInputError: bad messages, memories or parameters.
        :raises ContextOverflowError: the prompt plus ``max_new_tokens`` exceeds the context window.
            (A memory that does not fit after the system message and the encode context is not an
            error: the call falls back to exact prefix reuse and ``stats.fallback_reason`` says so.)
        """
        started = time.perf_counter()  # TTFT counts from here: validation and tokenising are the user's wait too
        max_new_tokens = inputs.check_positive_int(max_new_tokens, "max_new_tokens")
        sampling = Sampling.checked(temperature, top_p, top_k, seed, repetition_penalty)
        stops = inputs.check_stop(stop)
        if grammar is not None and not isinstance(grammar, Grammar):
            raise InvalidInputError(f"grammar is a kvshift_memory.Grammar, not {type(grammar).__name__}")
        matcher = None if grammar is None else GrammarMatcher(grammar, self.grammar_tokenizer())
        plan = self.planner.plan(
            messages,
            memories,
            reuse=reuse,
            recompute_ratio=recompute_ratio,
            extra_tokens=max_new_tokens,
            fragments_after=fragments_after,
            encode_context=encode_context,
            tenant=tenant,
            tools=tools,
            kv_store=kv_store,
        )
        steps = GenerationStream(generate_steps(self.runner, plan, sampling, stops, started, matcher))
        if stream:
            return steps
        for _ in steps:
            pass
        assert steps.result is not None  # the steps end with the result
        return steps.result

    @renamed_keyword("namespace", "tenant")
    def score(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        continuation: str | Sequence[int] = "",
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        return_distributions: bool = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        tenant: str | None = None,
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
        :param tenant: as in :meth:`generate`.
        :param kv_store: as in :meth:`generate`, read only (scoring stores nothing).
        :raises InvalidInputError: bad input, or token ids outside the vocabulary.
        :raises ContextOverflowError: prompt plus continuation exceeds the context window.
        """
        started = time.perf_counter()
        cont_ids = self.planner.continuation_ids(continuation, tenant, self.runner.vocab_size)
        plan = self.planner.plan(
            messages,
            memories,
            reuse=reuse,
            recompute_ratio=recompute_ratio,
            extra_tokens=len(cont_ids),
            fragments_after=fragments_after,
            encode_context=encode_context,
            tenant=tenant,
            kv_store=kv_store,
        )
        return score_continuation(self.runner, plan, cont_ids, return_distributions, started)

    @renamed_keyword("namespace", "tenant")
    def warm(
        self,
        memories: Sequence[Any],
        messages: Sequence[Mapping[str, Any]] | str | None = None,
        *,
        fragments_after: str | None = None,
        lead_fragments: bool | None = None,
        encode_context: str | None = None,
        tenant: str | None = None,
        from_turn: Sequence[Mapping[str, Any]] | None = None,
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
        :param tenant: as in :meth:`generate`: what is warmed here serves only that tenant.
        :param from_turn: the messages of a call just made for ``tenant`` (a chat turn): a memory
            whose text that prompt holds takes its fragment from the turn's cached K/V instead of
            being encoded after the encode context (no encode-context prefill, but the blend strays
            further from full recompute: ``docs/benchmarks/fidelity.md``; the agent does not use it).
            Memories the turn does not hold, or a turn no longer cached, are encoded as without it.
        :returns: how many of the memories had a fragment encoded or cut from the turn (those
            already cached are skipped).
        :raises InvalidInputError: bad messages, memories or turn.
        :raises ContextOverflowError: the system message, encode context and a memory exceed the
            context window.
        """
        lead = inputs.check_optional_bool(lead_fragments, "lead_fragments")
        layout, turn = self.planner.warm_layout(memories, messages, fragments_after, encode_context, tenant, from_turn)
        if layout is None:
            return 0
        return self.runner.warm(layout, self.settings.lead_fragments if lead is None else lead, turn)

    def clear_cache(self, *, prefixes: bool = True, fragments: bool = True) -> None:
        """Forget cached prompt prefixes and/or fragments (measurements start cold with this).

        Stored chunks stay in their stores; the engine forgets which it wrote, and checks again.
        """
        self.runner.clear(prefixes=prefixes, fragments=fragments)

    def flush_chunks(self, timeout_s: float | None = None) -> bool:
        """Wait until the K/V chunks of finished calls are written to their stores (see ``kv_store``).

        :returns: ``False`` when ``timeout_s`` ran out first (the writing goes on).
        """
        return self.runner.chunks.writer.flush(timeout_s)

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of this engine's vocabulary, built on first use (constrained decoding).

        :raises InvalidInputError: the tokenizer is not a fast (tokenizers) one.
        """
        return self.runner.grammar_tokenizer()

    def describe(self) -> dict[str, Any]:
        """What this engine runs, as plain values: its model (``config.name_or_path``), weight format,
        K/V dtype, what decodes (``"native"``: the one-token step in the engine's kernels;
        ``"torch"``: that step in PyTorch's operators; ``"transformers"``: its forward), the kernels'
        build, the weights' bytes in memory, device, threads and fingerprint. ``kvshift inspect
        --engine`` prints it."""
        runner = self.runner
        return {
            "model": str(getattr(self.model.config, "name_or_path", "") or type(self.model).__name__),
            "weights": runner.weights,
            "kv_dtype": runner.kv_dtype,
            "decode": runner.decode_path,
            "decode_fallback_reason": runner.step_reason,
            "kernels": native_status(),
            "weights_bytes": resident_bytes(self.model),
            "device": str(self.device),
            "threads": torch.get_num_threads(),
            "fingerprint": self.fingerprint,
        }

    @property
    def tool_layout(self) -> ToolLayout:
        """How tools, calls and results reach this model: ``"hermes"`` or ``"llama-json"`` when
        its chat template renders them (Qwen 2.5 and 3; Llama 3.1 and later), else
        ``"kvshift"``, our own layout as text (``kvshift_memory.chat_turns``)."""
        return self.runner.tokens.tool_layout

    def stored_prefix(
        self, messages: Sequence[Mapping[str, Any]] | str, *, kv_store: ChunkStore, tenant: str | None = None
    ) -> tuple[int, int]:
        """How much of ``messages``' prompt a new process would read from ``kv_store``'s chunks
        instead of computing: (tokens stored from the prompt's start, the prompt's tokens).

        :raises InvalidInputError: bad messages or tenant.
        """
        layout = self.planner.plan(messages, tenant=tenant).layout
        return self.runner.chunks.stored_length(kv_store, layout), layout.length

    @renamed_keyword("namespace", "tenant")
    def count_tokens(self, text: str, *, tenant: str | None = None) -> int:
        """Tokens ``text`` takes as message content (``tenant``: as in :meth:`generate`)."""
        text = inputs.check_text(text, "text", allow_empty=True)
        return len(self.runner.tokens.encode(text, tenant=inputs.check_tenant(tenant)))
