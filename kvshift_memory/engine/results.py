"""What a generation or a scoring call returns: text or log-probabilities, with reuse statistics."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal, overload

import torch

__all__ = ["GenerationResult", "GenerationStream", "ReuseStats", "ScoreResult"]

ReuseMode = Literal["none", "prefix", "blend"]


@dataclass
class ReuseStats:
    """How one prompt was built, and what it cost.

    Token counts partition the prompt: ``prompt_tokens == reused_tokens + recomputed_tokens +
    prefilled_tokens``.

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
    :param recomputed_tokens: memory tokens computed with the question in the prompt's context:
        the shifted fragments' tokens the blend repaired, and the memories it did not shift.
    :param encoded_tokens: fragment tokens encoded *after* the answer, for later calls (the
        memories that missed; not part of the prompt's partition).
    :param prefilled_tokens: the other prompt tokens computed during this call.
    :param fragments_hit: memories whose fragment was already cached (in this process or in a
        store), after this prompt's system message or after the engine's own.
    :param fragments_missed: memories with no usable fragment: computed with the question, their
        fragments encoded after the answer.
    :param fragments_loaded: of the hits, those fetched from a memory store's tier.
    :param fragments_rejected: of the misses, stored fragments refused (corrupt, or not matching
        the memory).
    :param fragments_recomputed: memories with a fragment, or too short to need one, computed
        with the question because shifting would not pay: fewer tokens than
        ``min_recompute_tokens`` (``reuse="auto"``), a fetch the cost model finds dearer than
        recomputing, a repair that would recompute them whole anyway, or ``"auto"`` staying exact
        on this model (``fallback_reason`` says why).
    :param memory_reuse: per memory of the prompt, in order, what it got: ``"prefix"`` (inside
        the reused prefix), ``"lead"`` (its lead fragment), ``"shifted"`` (its fragment, shifted
        and repaired), ``"recomputed"``, ``"missed"``, ``"rejected"`` (computed with the question),
        or ``"text"`` (read as text: not in the blend's run, or a mode without one).
    :param recompute_ratio: the share of fragment tokens the blend was asked to recompute.
    :param weights: the engine's weight format (``EngineSettings.weights``; its dtype's name when unset).
    :param kv_dtype: the dtype the K/V was computed and held in.
    :param decode_path: what ran the decoding steps after the first token: ``"native"`` (the
        engine's one-token step in its own kernels), ``"torch"`` (that step in PyTorch's operators:
        no C compiler, or not the CPU) or ``"transformers"`` (transformers' forward: a family
        without a step, or ``one_token_step=False``).
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
    weights: str = ""
    kv_dtype: str = ""
    decode_path: str = ""
    fallback_reason: str | None = None
    memory_reuse: list[str] = field(default_factory=list)

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
    def __getitem__(self, index: int | slice) -> float | list[float]:
        return self.logprobs[index]

    def __len__(self) -> int:
        return len(self.logprobs)

    def __iter__(self) -> Iterator[float]:
        return iter(self.logprobs)


class GenerationStream(Iterator[str]):
    """Text pieces of a generation as they are produced.

    After the last piece, :attr:`result` holds the :class:`GenerationResult`; :attr:`stats`
    is available from the first piece on (``ttft_s`` is final by then).
    """

    def __init__(self, steps: Iterator[str | ReuseStats | GenerationResult]) -> None:
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
