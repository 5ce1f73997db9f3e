"""Decoding: the token loop after a prefill, streaming with stop strings, and teacher-forced scoring."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from .. import inputs
from ..kv.cache import ForwardStep
from .planning import PromptPlan
from .prefix_cache import Exactness
from .results import GenerationResult, ReuseStats, ScoreResult

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .grammar import GrammarMatcher
    from .passes import ModelPasses

__all__ = [
    "Sampling",
    "eos_ids",
    "generate_steps",
    "held_back",
    "penalise_repeats",
    "pick_token",
    "score_continuation",
]


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked: greedy at ``temperature`` 0, else sampled (see ``generate``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0

    @classmethod
    def checked(cls, temperature: Any, top_p: Any, top_k: Any, seed: Any, repetition_penalty: Any) -> Sampling:
        """:raises InvalidInputError: a value out of its range or of the wrong type."""
        inputs.check_sampling(temperature, top_p, top_k, seed, repetition_penalty)
        return cls(float(temperature), float(top_p), int(top_k), seed, float(repetition_penalty))


def eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """The token ids that end an answer: the tokenizer's and the generation config's."""
    ids = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(int(i) for i in source)
    return frozenset(ids)


def penalise_repeats(logits: torch.Tensor, generated: list[int], penalty: float) -> torch.Tensor:
    """``logits`` with the tokens of this answer made less likely (CTRL's repetition penalty:
    a positive logit divided by ``penalty``, a negative one multiplied). The prompt's tokens are
    left alone, so an answer still copies names and numbers from it freely."""
    if penalty == 1.0 or not generated:
        return logits
    seen = torch.tensor(sorted(set(generated)), device=logits.device)
    scores = logits[seen]
    return logits.index_copy(0, seen, torch.where(scores > 0, scores / penalty, scores * penalty))


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """The next token: the most likely at temperature 0, else drawn with ``generator``."""
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    # sampled on the CPU with a CPU generator: a seed draws the same tokens on every device
    scores = logits.cpu() / sampling.temperature
    top_k, top_p = sampling.top_k, sampling.top_p
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


def generate_steps(
    runner: ModelPasses,
    plan: PromptPlan,
    sampling: Sampling,
    stops: list[str],
    started: float,
    matcher: GrammarMatcher | None = None,
) -> Iterator[str | ReuseStats | GenerationResult]:
    """Prefill ``plan`` and decode: yields the stats at the first token, text pieces, then the result.

    With ``matcher``, only tokens its grammar allows are picked, and the answer ends with the grammar.

    The K/V computed (prompt and answer) is remembered for prefix reuse when the generator ends,
    closed early included.
    """
    generator = None
    if sampling.temperature > 0.0:
        generator = torch.Generator()
        generator.seed() if sampling.seed is None else generator.manual_seed(sampling.seed)
    layout = plan.layout
    prepared = runner.prefill(plan)
    cache, logits, stats = prepared.cache, prepared.logits, prepared.stats
    n = layout.length
    filled = n  # slots holding finished K/V: an interrupted step leaves its slot out
    generated: list[int] = []
    text, emitted = "", 0
    finish: Literal["stop", "length"] = "length"
    decode_started = None
    try:
        while True:
            logits = penalise_repeats(logits, generated, sampling.repetition_penalty)
            if matcher is not None:
                logits = matcher.mask(logits)
            token = pick_token(logits, sampling, generator)
            if decode_started is None:
                decode_started = time.perf_counter()
                stats.ttft_s = decode_started - started
                yield stats
            if token in runner.eos_token_ids:
                finish = "stop"
                break
            generated.append(token)
            if matcher is not None:
                matcher.consume(token)
            text = runner.decode_text(generated)
            cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            ready = len(text) - held_back(text, stops)
            if ready > emitted:
                yield text[emitted:ready]
                emitted = ready
            if matcher is not None and matcher.finished:
                finish = "stop"
                break
            if len(generated) == plan.extra_tokens:
                break
            slot = n + len(generated) - 1
            logits = runner.decode_one(cache, token, slot)
            filled = slot + 1
        if len(text) > emitted:
            yield text[emitted:]
        elapsed = time.perf_counter() - decode_started
        stats.generated_tokens = len(generated)
        stats.decode_path = runner.decode_path
        stats.decode_tokens_per_s = (len(generated) - 1) / elapsed if len(generated) > 1 and elapsed > 0 else 0.0
        stats.total_s = time.perf_counter() - started
        result = GenerationResult(text=text, token_ids=generated, stats=stats, finish_reason=finish)
        stats.encoded_tokens = runner.answered(layout, text, generated, prepared.unencoded)
        yield result
    finally:
        all_ids = torch.cat([layout.token_ids, torch.tensor(generated, dtype=torch.long, device="cpu")])
        # decoding after an exact prompt is exact too: the next turn may reuse the reply as well
        exact, unblended = (
            filled if bound >= n else bound
            for bound in (prepared.exactness.exact_until, prepared.exactness.unblended_until)
        )
        runner.keep(plan, cache, all_ids, filled, Exactness(exact, unblended))


@torch.inference_mode()
def score_continuation(
    runner: ModelPasses, plan: PromptPlan, cont_ids: list[int], return_distributions: bool, started: float
) -> ScoreResult:
    """Prefill ``plan`` and score ``cont_ids`` as the start of the answer (teacher-forced)."""
    prepared = runner.prefill(plan)
    stats = prepared.stats
    stats.ttft_s = time.perf_counter() - started
    rows = [prepared.logits[None]]
    if len(cont_ids) > 1:
        n = plan.layout.length
        ids = torch.tensor(cont_ids[:-1], device="cpu")
        rows.append(runner.forward(prepared.cache, ids, ForwardStep.span(n, n + ids.numel()), logits="all"))
    distributions = torch.log_softmax(torch.cat(rows), dim=-1)
    picked = distributions.gather(1, torch.tensor(cont_ids, device=distributions.device)[:, None])[:, 0]
    stats.total_s = time.perf_counter() - started
    return ScoreResult(
        logprobs=picked.tolist(),
        token_ids=list(cont_ids),
        stats=stats,
        distributions=distributions if return_distributions else None,
    )


def held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` not to emit yet: the start of a stop string, or an unfinished character."""
    held = 1 if text.endswith("\ufffd") else 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                held = max(held, size)
                break
    return held
