"""The blend: memories' cached fragments placed in the prompt, and a chosen share of their tokens recomputed.

Each fragment is RoPE-shifted to its slot in the prompt (:meth:`KVShiftEngine.place`). Its K/V
was computed without the other memories before it, so the question is run once over the shifted
cache and the fragment tokens the question attends to most are recomputed in full context: the
tokens the question reads are the ones whose missing cross-fragment context would change the
answer; a token nobody attends to cannot change it, however stale its K/V. How much that costs and
keeps is measured in ``docs/benchmarks/fidelity.md``.

The memory that opens the system message's memory block follows the shared prefix and nothing
else: it is read from its *lead* fragment, encoded right after the prefix, instead of being shifted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..kv.cache import ForwardStep, ShiftCache
from .fragments import source_of
from .planning import PreparedPrompt
from .prompt import FragmentSpan, PromptLayout
from .results import ReuseStats
from .settings import EngineSettings

if TYPE_CHECKING:
    from .engine import KVShiftEngine

__all__ = ["choose_recompute", "last_adjacent_run", "lead_possible", "prefill_blend", "reads_lead", "recompute_count"]

# The blend ranks fragment tokens by the attention of the prompt's last tokens (the ones the answer
# is generated from); measured as good as all question tokens, at a fraction of the cost.
_SELECTION_QUERIES = 8


@torch.inference_mode()
def prefill_blend(
    engine: KVShiftEngine,
    cache: ShiftCache,
    layout: PromptLayout,
    ratio: float,
    stats: ReuseStats,
    reused: int,
    exact_until: int,
    new_spans: list[FragmentSpan],
) -> PreparedPrompt:
    """Fill ``cache`` after its ``reused`` slots: exact up to the first of ``new_spans``, those
    memories placed from their fragments and repaired, then the question.

    :param new_spans: a run of adjacent memory spans, none of them inside the reused slots.
    :param stats: counts are added to it.
    """
    ids, n = layout.token_ids, layout.length
    first = new_spans[0].start
    lead = new_spans[:1] if reads_lead(engine, layout, new_spans[0]) else []
    if not lead and recomputes_everything(engine.settings, new_spans, ratio):
        # memories this short are recomputed whole anyway: one exact pass, without fetching
        # their fragments or ranking their tokens first (which made short prompts slower than
        # full recompute); the answer is full recompute's
        logits = engine.prefill_exact(cache, ids, reused, n)
        recomputed = torch.zeros(n, dtype=torch.bool, device="cpu")
        for span in new_spans:
            recomputed[span.start : span.end] = True
        stats.fragments_recomputed = len(new_spans)
        stats.recomputed_tokens = int(recomputed.sum())
        stats.prefilled_tokens = n - reused - stats.recomputed_tokens
        return PreparedPrompt(cache, logits[-1], stats, exact_until, recomputed)
    engine.prefill_exact(cache, ids, reused, first, logits="none")
    shifted_spans = new_spans[len(lead) :]
    # The cost model may find a short stored fragment cheaper to recompute than to fetch.
    inline = [span for span in shifted_spans if _recompute_instead(engine, layout, span)]
    fetched = [span for span in shifted_spans if span not in inline]
    origins = dict.fromkeys(map(id, inline), "recomputed")
    placed, fragments = [], []
    for spans, is_lead in ((lead, True), (fetched, False)):
        if spans:
            found, found_origins = engine.fragments.fetch(layout, spans, engine.encode_fragments, lead=is_lead)
            placed += spans
            fragments += found
            origins.update(zip(map(id, spans), found_origins, strict=True))
    if placed:
        engine.place(cache, placed, fragments)
    for span in inline:  # its K/V is computed in the pass below; the selection pass must read no garbage
        for layer in range(engine.num_layers):
            keys, values = cache.buffer(layer)
            keys[..., span.start : span.end, :].zero_()
            values[..., span.start : span.end, :].zero_()
    exact_until = min(exact_until, first)  # not past a lead fragment: one from a store went through its codec
    tail = layout.tail_start
    candidates = [torch.arange(s.start, s.end, device="cpu") for s in fetched]
    total = sum(s.end - s.start for s in shifted_spans)
    count = min(recompute_count(engine.settings, total, ratio), sum(c.numel() for c in candidates))
    forced = (
        torch.cat([torch.arange(s.start, s.end, device="cpu") for s in inline])
        if inline
        else torch.zeros(0, dtype=torch.long, device="cpu")
    )
    if count > 0:
        capture: list[torch.Tensor] = []
        # The question's earlier tokens only feed the ranking queries' context: like recomputed
        # fragment tokens they read the prefix and a window (a little KL for a shorter pass,
        # ``docs/benchmarks/fidelity.md``); the ranking queries read everything.
        selection = ForwardStep(
            torch.arange(tail, n, device="cpu"),
            n,
            capture=capture,
            capture_queries=_SELECTION_QUERIES,
            local_window=engine.settings.recompute_window,
            local_before=n - _SELECTION_QUERIES,
            anchor=layout.anchor_length,
        )
        engine.forward(cache, ids[tail:n], selection, logits="none")
        chosen = choose_recompute(capture, [(s.start, s.end) for s in fetched], count)
        chosen = torch.cat([chosen, forced]).sort().values
    else:
        chosen = forced
    if chosen.numel():
        queries = torch.cat([chosen, torch.arange(tail, n, device="cpu")])
        step = ForwardStep(
            queries,
            key_length=n,
            # recomputing every fragment token is a full recompute: no window, so it is exact
            local_window=None if chosen.numel() == total else engine.settings.recompute_window,
            local_before=tail,
            anchor=layout.anchor_length,
        )
        logits = engine.forward(cache, ids[queries], step)
    else:
        logits = engine.prefill_exact(cache, ids, tail, n)
    recomputed = torch.zeros(n, dtype=torch.bool, device="cpu")
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
    return PreparedPrompt(cache, logits[-1], stats, exact_until, recomputed)


def choose_recompute(capture: list[torch.Tensor], spans: list[tuple[int, int]], count: int) -> torch.Tensor:
    """The ``count`` fragment slots with the most attention from the question.

    :param capture: per layer, the attention mass each key slot received (``[key_length]``).
    :param spans: the fragments' slot ranges ``[start, end)``.
    :returns: the chosen slots, ascending.
    """
    candidates = torch.cat([torch.arange(start, end, device="cpu") for start, end in spans])
    if count <= 0:
        return candidates[:0]
    if count >= candidates.numel():
        return candidates
    mass = torch.stack([layer[candidates] for layer in capture])
    mass = mass / mass.sum(dim=1, keepdim=True).clamp_min(1e-30)
    top = mass.mean(dim=0).topk(count).indices.cpu()  # the capture is on the model's device
    return candidates[top].sort().values


def recompute_count(settings: EngineSettings, total: int, ratio: float) -> int:
    """How many of ``total`` shifted fragment tokens the blend recomputes at ``ratio``."""
    if ratio <= 0:
        return 0
    return min(total, max(round(ratio * total), settings.min_recompute_tokens))


def recomputes_everything(settings: EngineSettings, spans: list[FragmentSpan], ratio: float) -> bool:
    total = sum(span.end - span.start for span in spans)
    return total > 0 and recompute_count(settings, total, ratio) >= total


def lead_possible(settings: EngineSettings, layout: PromptLayout, span: FragmentSpan) -> bool:
    """Whether ``span``, opening the layout's memory block, can have a lead fragment.

    It can when the prompt starts with the conditioning (the memories are in its system
    message, and no fixed ``fragments_after`` replaced it) and the lead fragment differs from
    the ordinary one (a non-empty encode context).
    """
    conditioning = layout.conditioning
    return (
        settings.lead_fragments
        and bool(span.context)
        and torch.equal(layout.token_ids[: conditioning.numel()], conditioning)
    )


def reads_lead(engine: KVShiftEngine, layout: PromptLayout, span: FragmentSpan) -> bool:
    """Whether ``span`` is read from its lead fragment rather than shifted.

    It is when it opens the memory block right after the conditioning and its lead fragment is
    cached, or when neither fragment is (it has to be encoded now: better as it reads here).
    With only its ordinary fragment cached it is shifted: no encoding at question time.
    """
    if span.start != layout.conditioning.numel() or not lead_possible(engine.settings, layout, span):
        return False
    return engine.fragments.available(layout, span, lead=True) or not engine.fragments.available(layout, span)


def last_adjacent_run(spans: list[FragmentSpan]) -> list[FragmentSpan]:
    """The trailing spans that follow each other without a gap."""
    run = spans[-1:]
    for span in reversed(spans[:-1]):
        if span.end != run[0].start:
            break
        run.insert(0, span)
    return run


def _recompute_instead(engine: KVShiftEngine, layout: PromptLayout, span: FragmentSpan) -> bool:
    """Whether the cost model finds a stored memory cheaper to recompute than to fetch.

    Only a memory with a store and whose fragment is not in this process's pool is a
    candidate (a pooled fragment costs a copy; a text without a record has nowhere to be
    fetched from).
    """
    if source_of(span) is None or not engine.costs.recompute_cheaper(len(span.token_ids)):
        return False
    return engine.fragments.pooled(layout, span) is None
