"""The model runner: forward passes over a :class:`ShiftCache`, prefill with reuse, fragment
encoding and RoPE placement, and the caches they fill. :class:`~.engine.KVShiftEngine` is the
public front over one runner; :mod:`.blend` and :mod:`.decoding` see it as :class:`~.passes.ModelPasses`.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from ..kv.cache import ForwardStep, ShiftCache
from ..kv.fragment import Fragment
from ..kv.rope import rotate_
from .allocator import keep_freed_memory
from .attention import ATTENTION_NAME
from .blend import last_adjacent_run, lead_possible, prefill_blend
from .chunks import StoredChunks
from .costs import CostModel
from .decoding import eos_ids
from .families import PositionScheme, position_scheme, text_decoder
from .fragments import FragmentCache
from .grammar import grammar_tokenizer
from .native import kernels
from .packing import pack_linear_layers
from .passes import Logits
from .planning import PreparedPrompt, PromptPlan
from .prefix_cache import Exactness, PrefixCache
from .prompt import FragmentSpan, PromptLayout, TokenMemo, common_prefix
from .results import ReuseStats
from .settings import EngineSettings
from .stepping import OneTokenStep, one_token_step
from .weights import QuantizedEmbedding, QuantizedLinear, apply_weight_format, dtype_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["ModelRunner"]


def _device_of(embeddings: torch.nn.Module) -> torch.device:
    if isinstance(embeddings, QuantizedEmbedding):
        return embeddings.matrix.device
    weight = embeddings.weight
    assert isinstance(weight, torch.Tensor)
    return weight.device


def _rows_of(head: torch.nn.Module) -> int:
    """The output head's rows: the vocabulary it scores."""
    if isinstance(head, QuantizedLinear):
        return head.out_features
    weight = head.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0])


class ModelRunner:
    """Runs one model for one engine, and holds the K/V it computed (prefix cache, fragments, chunks).

    It installs the engine's attention function in the model and, with ``settings.pack_weights``,
    packs its linear layers in place.

    :param fingerprint: identifies model + tokenizer in fragment and chunk keys.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: Any, fingerprint: str, settings: EngineSettings) -> None:
        self.settings = settings
        if settings.keep_freed_memory:
            keep_freed_memory()
        self.model = model.eval()
        self.model.set_attn_implementation(ATTENTION_NAME)
        #: where the model runs (its input embeddings' device): every tensor it is given goes there
        self.device: torch.device = _device_of(model.get_input_embeddings())
        self.tokenizer = tokenizer
        #: the tokenisation memo (per tenant), which also reads this engine's replies back as their ids
        self.tokens = TokenMemo(tokenizer)
        self._decoder = text_decoder(model)  # the decoder alone, for passes that need no logits
        #: the weight format the model runs in (``settings.weights``, or its dtype's name when unset)
        self.weights: str = apply_weight_format(model, self._decoder, settings.weights)
        #: how many linear layers were packed for oneDNN (0: left as loaded)
        self.packed_layers = pack_linear_layers(self.model) if settings.pack_weights else 0
        step = one_token_step(model, self._decoder) if settings.one_token_step else "one_token_step=False"
        #: the one-token step decoding runs (``None``: transformers' forward, for :attr:`step_reason`)
        self.step: OneTokenStep | None = step if isinstance(step, OneTokenStep) else None
        self.step_reason: str | None = step if isinstance(step, str) else None
        self.position_scheme: PositionScheme = position_scheme(model)
        self._decoder = text_decoder(model)  # the decoder alone, for passes that need no logits
        config = model.config.get_text_config(decoder=True)
        self.num_layers: int = config.num_hidden_layers
        self.vocab_size: int = _rows_of(model.get_output_embeddings())
        self.max_positions = int(config.max_position_embeddings)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.eos_token_ids = eos_ids(model, tokenizer)
        self.costs = CostModel()
        #: the K/V of earlier prompts, per tenant
        self.prefix_cache = PrefixCache(settings.prefix_cache_bytes)
        shape = (self.num_layers, self.kv_heads, self.head_dim)
        self.fragments = FragmentCache(settings.fragment_cache_bytes, fingerprint, shape, model.dtype, self.costs)
        #: this engine's K/V kept in stores past the process (calls given a ``kv_store``)
        self.chunks = StoredChunks(fingerprint, shape, model.dtype, settings.chunk_tokens, self.costs)
        self._grammar_tokenizer: Any = None
        self._grammar_lock = threading.Lock()

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built on first use.

        :raises InvalidInputError: the tokenizer is not a fast (tokenizers) one.
        """
        with self._grammar_lock:
            if self._grammar_tokenizer is None:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_tokenizer

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
            weights=self.weights,
            kv_dtype=self.kv_dtype,
        )
        # only what the caller left to the engine may read K/V that went through a store's lossy codec
        lossy = plan.requested_reuse in ("auto", "blend")
        reused, exactness, shifted = (
            (0, Exactness.whole(n), 0)
            if mode == "none"
            # "auto" keeps the conversation exact: no window shifted in from behind a cut
            else self.prefix_cache.reuse(
                cache, layout, mode, self.rotate, shift_cuts=plan.requested_reuse != "auto", lossy=lossy
            )
        )
        if plan.kv_store is not None and mode != "none" and shifted == 0 and reused < n - 1:
            restored = self.chunks.restore(plan.kv_store, cache, layout, reused, mode == "blend", lossy)
            stats.restored_tokens = restored.end - reused
            stats.chunks_rejected = restored.rejected
            exactness = exactness.join(restored.exactness)
            reused = restored.end
        stats.reused_tokens = reused
        stats.shifted_tokens = shifted
        stats.fragments_hit = sum(1 for span in layout.fragments if span.end <= reused)
        # "auto" that stays exact (the model's measured choice, or no shift possible) recomputes each
        # memory with the question by choice; under "prefix" or "none" a memory is read as text
        computed = "recomputed" if mode != "blend" and plan.requested_reuse == "auto" else "text"
        stats.memory_reuse = ["prefix" if span.end <= reused else computed for span in layout.fragments]
        stats.fragments_recomputed = stats.memory_reuse.count("recomputed")
        # Only the last run of memories (at most separators apart) is placed; earlier ones not yet
        # cached (a conversation whose earlier turns fell out of the prefix cache) are read as text.
        new_spans = (
            last_adjacent_run([span for span in layout.fragments if span.start >= reused]) if mode == "blend" else []
        )
        if not new_spans:
            logits = self.prefill_exact(cache, ids, reused, n)
            stats.prefilled_tokens = n - reused
            return PreparedPrompt(cache, logits[-1], stats, exactness)
        auto = plan.requested_reuse == "auto"
        return prefill_blend(self, cache, layout, ratio, stats, reused, exactness, new_spans, auto)

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

    def decode_one(self, cache: ShiftCache, token: int, slot: int) -> torch.Tensor:
        """The logits after one more token at ``slot`` (its K/V written to ``cache``), through the
        one-token step where the model has one, else a forward pass."""
        if self.step is None:
            return self.forward(cache, torch.tensor([token], device="cpu"), ForwardStep.span(slot, slot + 1))[-1]
        started = time.perf_counter()
        try:
            return self.step(cache, token, slot)
        finally:
            self.costs.observe_pass(1, time.perf_counter() - started)

    @property
    def kv_dtype(self) -> str:
        """The dtype the working cache, fragments and stored chunks hold K/V in (the model's)."""
        return dtype_name(self.model.dtype)

    @property
    def decode_path(self) -> str:
        """``"native"`` (the one-token step in the engine's kernels), ``"torch"`` (the step in
        PyTorch's operators) or ``"transformers"`` (its forward)."""
        if self.step is None:
            return "transformers"
        return "native" if self.step.native_model is not None and kernels() is not None else "torch"

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
    def prefilled(self, tenant: str, ids: torch.Tensor, room: int) -> ShiftCache:
        """A cache holding the exact K/V of ``ids``, with ``room`` slots after.

        ``tenant``'s cached prefixes are reused, and ``ids`` is remembered as one.
        """
        n = ids.numel()
        cache = ShiftCache(self.num_layers, n + room, self.device)
        reused, _, _ = self.prefix_cache.reuse(cache, PromptLayout(ids, (), ids, tenant), "prefix", self.rotate)
        self.prefill_exact(cache, ids, reused, n, logits="none")
        self.prefix_cache.remember(tenant, cache, ids, n, Exactness.whole(n))
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
            scratch = self.prefilled(layout.tenant, conditioning, max(len(spans[i].token_ids) for i in indices))
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

    def cut_or_encode(
        self, turn: torch.Tensor, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False
    ) -> list[Fragment]:
        """Each span's fragment cut from the cached K/V of the prompt ``turn`` where it holds the
        span's tokens; encoded (:meth:`encode_fragments`) where it does not, and always when ``lead``."""
        cut = [None if lead else self.cut_from_turn(turn, layout, span) for span in spans]
        missing = [index for index, fragment in enumerate(cut) if fragment is None]
        encoded = iter(self.encode_fragments(layout, [spans[i] for i in missing], lead) if missing else ())
        return [fragment if fragment is not None else next(encoded) for fragment in cut]

    def cut_from_turn(self, turn: torch.Tensor, layout: PromptLayout, span: FragmentSpan) -> Fragment | None:
        """``span``'s fragment from the K/V of the last place the cached prompt ``turn`` holds its text.

        A span ends with the separator that follows a memory in a prompt, which the message that
        said the text lacks: the separator's K/V is computed after the text's, in the turn's
        context. The keys stay rotated at the positions they had in the turn (``base_position``):
        placing the fragment rotates them once, to where it lands.
        """
        entry, cached = self.prefix_cache.lookup(layout.tenant, turn)
        said = common_prefix(
            torch.tensor(span.token_ids), torch.tensor(self.tokens.encode(span.text, tenant=layout.tenant))
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

    def warm(self, layout: PromptLayout, lead_fragments: bool, turn: torch.Tensor | None = None) -> int:
        spans = list(layout.fragments)
        encode = self.encode_fragments if turn is None else functools.partial(self.cut_or_encode, turn)
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
            self.prefilled(layout.tenant, layout.conditioning, 0)
        return sum(encoded)

    def decode_text(self, token_ids: list[int]) -> str:
        """The answer's text so far (special tokens left out)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def answered(self, layout: PromptLayout, text: str, token_ids: list[int], unencoded: list[FragmentSpan]) -> int:
        """Record an answer: its ids read back as its text, the missed memories' fragments encoded.

        :returns: the fragment tokens encoded.
        """
        # kept even when a stop string cut the text: ids that do not read back as it are never used
        self.tokens.remember_reply(text, token_ids, tenant=layout.tenant)
        # the answer is out: the memories that missed get their fragments for the next call
        return self.encode_missed(layout, unencoded)

    def keep(
        self, plan: PromptPlan, cache: ShiftCache, token_ids: torch.Tensor, filled: int, exactness: Exactness
    ) -> None:
        """Remember a finished call's K/V for prefix reuse (and its store's chunks, when it has one)."""
        tenant = plan.layout.tenant
        self.prefix_cache.remember(tenant, cache, token_ids, filled, exactness)
        if plan.kv_store is not None:
            self.chunks.save_later(plan.kv_store, tenant, cache, token_ids, filled, exactness)

    def clear(self, *, prefixes: bool, fragments: bool) -> None:
        """Forget cached prompt prefixes (and which chunks were written) and/or fragments."""
        if prefixes:
            self.prefix_cache.clear()
            self.chunks.forget_known()
        if fragments:
            self.fragments.clear()
