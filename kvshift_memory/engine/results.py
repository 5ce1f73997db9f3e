"""What a generation or a scoring call returns: text or log-probabilities, with reuse statistics."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, overload

import torch

__all__ = ["GenerationResult", "ReuseStats", "ScoreResult"]

ReuseMode = Literal["none", "prefix", "blend"]


@dataclass
class ReuseStats:
    """How one prompt was built, and what it cost.

    Token counts partition the prompt: ``prompt_tokens == reused_tokens + recomputed_tokens +
    encoded_tokens + prefilled_tokens``.

    :param reuse: the reuse that was applied (may be less than asked, see ``fallback_reason``).
    :param requested_reuse: what the caller asked for (``"auto"`` when left to the engine).
    :param ttft_s: seconds from the start of the call to the first generated token (or, when
        scoring, to the first distribution).
    :param reused_tokens: prompt tokens whose K/V came from a cache (prefix or fragment) as they were.
    :param restored_tokens: of the reused, those read from stored chunks (``kv_store``): K/V an
        earlier process, or another worker, computed.
    :param chunks_rejected: stored chunks refused (corrupt, or not this prompt's, model's or
        tenant's); their tokens were computed instead.
    :param shifted_tokens: of the reused, those taken from a cached prompt that had a stretch before
        them cut out (a working window whose oldest turns were evicted), RoPE-shifted into place.
    :param recomputed_tokens: fragment tokens the blend recomputed in full context.
    :param encoded_tokens: fragment tokens encoded during this call (fragments not cached yet).
    :param prefilled_tokens: the other prompt tokens computed during this call.
    :param fragments_hit: memories whose fragment was already cached (in this process or in a store).
    :param fragments_missed: memories encoded during this call.
    :param fragments_loaded: of the hits, those fetched from a memory store's tier.
    :param fragments_rejected: stored fragments refused (corrupt, or not matching the memory) and
        re-encoded from text instead.
    :param fragments_recomputed: stored memories the cost model found cheaper to recompute with
        the question than to fetch, or that the blend recomputes whole anyway (their tokens fewer
        than ``min_recompute_tokens``); their tokens count as recomputed.
    :param recompute_ratio: the share of fragment tokens the blend was asked to recompute.
    :param fallback_reason: why the requested reuse was not applied, when it was not.
    """

    reuse: ReuseMode
    requested_reuse: str
    prompt_tokens: int
    ttft_s: float = 0.0
    reused_tokens: int = 0
    restored_tokens: int = 0
    shifted_tokens: int = 0
    recomputed_tokens: int = 0
    encoded_tokens: int = 0
    prefilled_tokens: int = 0
    fragments_hit: int = 0
    fragments_missed: int = 0
    fragments_loaded: int = 0
    fragments_rejected: int = 0
    fragments_recomputed: int = 0
    chunks_rejected: int = 0
    recompute_ratio: float = 0.0
    generated_tokens: int = 0
    decode_tokens_per_s: float = 0.0
    total_s: float = 0.0
    fallback_reason: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    """A finished generation.

    :param finish_reason: ``"stop"`` (end-of-turn token or a stop string) or ``"length"``
        (``max_new_tokens`` reached).
    """

    text: str
    token_ids: list[int]
    stats: ReuseStats
    finish_reason: Literal["stop", "length"]


@dataclass
class ScoreResult(Sequence[float]):
    """Per-token log-probabilities of a continuation; a sequence of floats with extras.

    :param token_ids: the continuation's tokens.
    :param distributions: with ``return_distributions=True``, the log-softmax over the whole
        vocabulary at each continuation position (``[len, vocab]``, float32), else ``None``.
    """

    logprobs: list[float]
    token_ids: list[int]
    stats: ReuseStats
    distributions: torch.Tensor | None = field(default=None, repr=False)

    @overload
    def __getitem__(self, index: int) -> float: ...
    @overload
    def __getitem__(self, index: slice) -> list[float]: ...
    def __getitem__(self, index):
        return self.logprobs[index]

    def __len__(self) -> int:
        return len(self.logprobs)

    def __iter__(self) -> Iterator[float]:
        return iter(self.logprobs)
