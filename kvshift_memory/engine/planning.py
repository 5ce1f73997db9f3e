"""Planning a call: the prompt's layout, the reuse it will get, and what its prefill leaves behind.

:meth:`KVShiftEngine.plan <kvshift_memory.engine.KVShiftEngine.plan>` returns a :class:`PromptPlan`
and :meth:`KVShiftEngine.prefill <kvshift_memory.engine.KVShiftEngine.prefill>` turns one into a
:class:`PreparedPrompt`. ``generate`` and ``score`` are those two steps and a decoding loop;
benchmarks and tests that look inside a prompt (which slots the blend recomputed, the K/V it
placed) call the two steps themselves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .. import inputs
from ..exceptions import ContextOverflowError, InvalidInputError
from ..kv.cache import ShiftCache
from ..messages import Message
from ..protocols import ChunkStore
from .families import PositionScheme
from .prefix_cache import Exactness
from .prompt import FragmentSpan, PromptLayout, ScopedTokens, TokenMemo, build_layout
from .results import ReuseMode, ReuseStats
from .settings import EngineSettings
from .speakers import cast_speakers

__all__ = ["Planner", "PreparedPrompt", "PromptPlan"]

_AUTO_EXACT = (
    'reuse="auto" is exact on this model (EngineSettings.auto_shifts=False): its blend changed too many '
    "answers (docs/benchmarks/long_memory.md); memories recomputed"
)


@dataclass(frozen=True)
class PromptPlan:
    """What one call will run.

    :param layout: the tokenised prompt with its memory spans.
    :param reuse: the reuse that will be applied.
    :param requested_reuse: what the caller asked for (``"auto"`` when left to the engine).
    :param recompute_ratio: the blend's share of shifted fragment tokens to recompute.
    :param fallback_reason: why ``reuse`` is less than was asked, when it is.
    :param extra_tokens: slots kept after the prompt (the answer's, or the scored continuation's).
    :param kv_store: where the prompt's K/V chunks are read from and written to (``None``: nowhere).
    """

    layout: PromptLayout
    reuse: ReuseMode
    requested_reuse: str
    recompute_ratio: float
    fallback_reason: str | None
    extra_tokens: int
    kv_store: ChunkStore | None = None


@dataclass
class PreparedPrompt:
    """A prompt whose K/V are in ``cache`` and whose next-token logits are known."""

    cache: ShiftCache
    logits: torch.Tensor
    stats: ReuseStats
    #: how far the slots hold what full recompute would (a later prompt may reuse them)
    exactness: Exactness
    #: which slots the blend recomputed (all ``False`` for shift only; ``None`` when no memory was
    #: placed, as for ``reuse="none"``)
    recomputed: torch.Tensor | None = None
    #: memories that found no usable fragment: computed with the question, their fragments
    #: encoded after the answer (:meth:`ModelRunner.encode_missed <.runner.ModelRunner.encode_missed>`)
    unencoded: list[FragmentSpan] = field(default_factory=list)


class Planner:
    """Builds :class:`PromptPlan` objects for one model, tokenizer and settings.

    :param max_positions: the model's context window.
    :param position_scheme: whether (and up to what length) the model's positions can be shifted.
    """

    def __init__(
        self, tokens: TokenMemo, settings: EngineSettings, max_positions: int, position_scheme: PositionScheme
    ) -> None:
        self._tokens = tokens
        self._settings = settings
        self._max_positions = max_positions
        self._position_scheme = position_scheme
        self._default: torch.Tensor | None = None

    def plan(
        self,
        messages: Sequence[Mapping[str, Any]] | str,
        memories: Sequence[Any] | None = None,
        *,
        reuse: str | None = None,
        recompute_ratio: float | None = None,
        extra_tokens: int = 1,
        fragments_after: str | None = None,
        encode_context: str | None = None,
        tenant: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        kv_store: ChunkStore | None = None,
    ) -> PromptPlan:
        """The :class:`PromptPlan` ``KVShiftEngine.generate`` would run, with ``extra_tokens`` slots
        after the prompt (its answer's); the other arguments as ``generate`` takes them. Nothing is
        computed or cached: ``engine.runner.prefill(plan)`` computes it.

        :raises InvalidInputError: bad messages, memories or parameters.
        :raises ContextOverflowError: the prompt plus ``extra_tokens`` exceeds the context window.
        """
        settings = self._settings
        extra_tokens = inputs.check_non_negative_int(extra_tokens, "extra_tokens")
        if kv_store is not None and not isinstance(kv_store, ChunkStore):
            raise InvalidInputError(
                f"kv_store must be a MemoryStore (load_chunk, save_chunk, codec), not {type(kv_store).__name__}"
            )
        tenant = inputs.check_tenant(tenant)
        checked = inputs.check_messages(messages)
        bound = inputs.check_tools(tools)
        texts = inputs.check_memories(memories)
        requested = inputs.check_reuse(reuse)
        ratio = settings.recompute_ratio if recompute_ratio is None else inputs.check_ratio(recompute_ratio)
        given = list(memories or ())
        for message in checked:
            if "memories" in message:
                given.extend(message["memories"])
                message["memories"] = inputs.check_memories(message["memories"])
        tokens = self._tokens.scoped(tenant)
        layout = build_layout(tokens, checked, texts, settings.system_prompt, settings.memory_header, bound)
        if fragments_after is not None:
            fixed: list[Message] = [
                {"role": "system", "content": inputs.check_text(fragments_after, "fragments_after")}
            ]
            layout = replace(layout, conditioning=self._conditioning_after(tokens, fixed))
        if layout.fragments:
            layout = replace(layout, default_conditioning=self._default_conditioning())
        if encode_context is None:
            encode_context = settings.encode_context
        else:
            encode_context = inputs.check_text(encode_context, "encode_context", allow_empty=True)
        records = [None if isinstance(memory, str) else memory for memory in given]
        layout = replace(
            layout,
            tenant=tenant,
            fragments=tuple(
                replace(s, record=r, context=self._context_ids(tokens, encode_context, s.text))
                for s, r in zip(layout.fragments, records, strict=True)
            ),
        )
        self._check_fits(layout, extra_tokens)
        mode: ReuseMode
        fallback = None
        if requested is None or requested == "auto":
            mode = "blend" if layout.fragments and settings.auto_shifts else "prefix"
            if layout.fragments and not settings.auto_shifts:
                fallback = _AUTO_EXACT
        else:
            mode = requested
        if mode == "blend":
            fallback = self._position_scheme.reason
            if fallback is not None:
                mode = "prefix"
        if mode == "blend":
            no_room = self.no_room_to_encode(layout)
            if no_room is not None:
                mode, fallback = "prefix", f"{no_room}: exact prefix reuse"
        return PromptPlan(layout, mode, requested or "auto", ratio, fallback, extra_tokens, kv_store)

    def _conditioning_after(self, tokens: ScopedTokens, system: list[Message]) -> torch.Tensor:
        """The conditioning of a prompt whose system message is ``system`` (empty: the engine's own)."""
        question: list[Message] = [{"role": "user", "content": "?"}]  # only the system message matters here
        settings = self._settings
        return build_layout(tokens, system + question, [], settings.system_prompt, settings.memory_header).conditioning

    def _default_conditioning(self) -> torch.Tensor:
        """The conditioning of the engine's own system message (the engine's text, no tenant's)."""
        if self._default is None:
            self._default = self._conditioning_after(self._tokens.scoped(""), [])
        return self._default

    def continuation_ids(self, continuation: Any, tenant: str | None, vocab_size: int) -> list[int]:
        """A scored continuation's token ids: text tokenised as content, or ids checked against the vocabulary.

        :raises InvalidInputError: empty or malformed, or an id outside the vocabulary.
        """
        continuation = inputs.check_continuation(continuation)
        if isinstance(continuation, str):
            return list(self._tokens.encode(continuation, tenant=inputs.check_tenant(tenant)))
        if max(continuation) >= vocab_size:
            raise InvalidInputError(f"continuation holds token id {max(continuation)} >= vocabulary size {vocab_size}")
        return list(continuation)

    def warm_layout(
        self,
        memories: Sequence[Any],
        messages: Sequence[Mapping[str, Any]] | str | None,
        fragments_after: str | None,
        encode_context: str | None,
        tenant: str | None,
        from_turn: Sequence[Mapping[str, Any]] | None,
    ) -> tuple[PromptLayout | None, torch.Tensor | None]:
        """What ``KVShiftEngine.warm`` encodes: the memories' layout (``None`` when nothing can be
        shifted) and the token ids of the turn ``from_turn`` names.

        :raises InvalidInputError: bad messages, memories or turn.
        :raises ContextOverflowError: the system message, encode context and a memory exceed the window.
        """
        if messages is None:
            messages = [{"role": "user", "content": "?"}]  # only the system message matters here
        plan = self.plan(
            messages,
            memories,
            reuse="blend",
            recompute_ratio=0.0,
            fragments_after=fragments_after,
            encode_context=encode_context,
            tenant=tenant,
        )
        turn = None
        if from_turn is not None:
            turn = self.plan(from_turn, reuse="prefix", extra_tokens=0, tenant=tenant).layout.token_ids
        no_room = self.no_room_to_encode(plan.layout)
        if no_room is not None:
            raise ContextOverflowError(no_room)
        if plan.reuse != "blend" or not plan.layout.fragments:
            return None, turn
        return plan.layout, turn

    def no_room_to_encode(self, layout: PromptLayout) -> str | None:
        """Why one of the layout's memories cannot be encoded after its conditioning and encode
        context within the context window, or ``None`` when all can."""
        if not layout.fragments:
            return None
        tightest = max(layout.fragments, key=lambda span: len(span.context) + len(span.token_ids))
        if layout.conditioning.numel() + len(tightest.context) + len(tightest.token_ids) <= self._max_positions:
            return None
        return (
            f"a memory of {len(tightest.token_ids)} tokens does not fit after the "
            f"{layout.conditioning.numel()} tokens of "
            f"system message and {len(tightest.context)} of encode context it is encoded after, in the model's "
            f"context window of {self._max_positions}"
        )

    def _check_fits(self, layout: PromptLayout, extra_tokens: int) -> None:
        for index, span in enumerate(layout.fragments):
            if len(span.token_ids) + extra_tokens >= self._max_positions:
                raise ContextOverflowError(
                    f"memories[{index}] alone takes {len(span.token_ids)} tokens; "
                    f"the model's context window is {self._max_positions}"
                )
        if layout.length + extra_tokens > self._max_positions:
            raise ContextOverflowError(
                f"the prompt takes {layout.length} tokens and {extra_tokens} more were asked for; "
                f"the model's context window is {self._max_positions}"
            )

    def _context_ids(self, tokens: ScopedTokens, encode_context: str, memory: str) -> tuple[int, ...]:
        """The ids of the encode context ``memory``'s fragment is encoded after."""
        if self._settings.match_speakers:
            encode_context = cast_speakers(encode_context, memory)
        return tokens.encode(encode_context)
