"""The blend: memories' cached fragments placed in the prompt, and a chosen share of their tokens recomputed.

Each fragment is RoPE-shifted to its slot in the prompt (:meth:`ModelRunner.place <.runner.ModelRunner.place>`). Its K/V
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
from ..kv.fragment import Fragment
from .fragments import source_of
from .planning import PreparedPrompt
from .prefix_cache import Exactness
from .prompt import FragmentSpan, PromptLayout
from .results import ReuseStats
from .settings import EngineSettings

if TYPE_CHECKING:
    from .passes import ModelPasses

__all__ = ["choose_recompute", "last_adjacent_run", "lead_possible", "prefill_blend", "reads_lead", "recompute_count"]

# The blend ranks fragment tokens by the attention of the prompt's last tokens (the ones the answer
# is generated from); measured as good as all question tokens, at a fraction of the cost.
_SELECTION_QUERIES = 8
#: the most tokens between two memories that still place them as one run
_SEPARATOR_TOKENS = 8


@torch.inference_mode()
def prefill_blend(
    runner: ModelPasses,
    cache: ShiftCache,
    layout: PromptLayout,
    ratio: float,
    stats: ReuseStats,
    reused: int,
    exactness: Exactness,
    new_spans: list[FragmentSpan],
    auto: bool,
) -> PreparedPrompt:
    """Fill ``cache`` after its ``reused`` slots: exact up to the first of ``new_spans``, those
    memories placed from their fragments and repaired, then the question.

    A memory with no cached fragment is computed in the pass that runs the question, as full
    recompute would (its fragment is encoded after the answer: ``ModelRunner.encode_missed``),
    so a miss never costs an encoding at question time. With ``auto``, a memory too short for
    shifting to pay is recomputed exactly too.

    :param new_spans: a run of memory spans, at most a separator apart (:func:`last_adjacent_run`),
        none of them inside the reused slots.
    :param stats: counts are added to it.
    """
    ids, n = layout.token_ids, layout.length
    first, tail = new_spans[0].start, layout.tail_start
    lead = new_spans[:1] if reads_lead(runner, layout, new_spans[0]) else []
    shifted_spans = new_spans[len(lead) :]
    origins = {id(span): _planned_origin(runner, layout, span, auto) for span in shifted_spans}
    to_shift = [span for span in shifted_spans if origins[id(span)] == "shifted"]
    shifted_total = sum(span.end - span.start for span in to_shift)
    if not lead and (
        not to_shift
        or recompute_count(runner.settings, shifted_total, ratio) >= shifted_total
        or (auto and shifted_total < runner.settings.min_recompute_tokens + n - tail)
    ):
        # Nothing worth shifting: one exact pass, without fetching fragments or ranking their
        # tokens first (which made short prompts slower than full recompute); the answer is
        # full recompute's.
        logits = runner.prefill_exact(cache, ids, reused, n)
        recomputed = torch.zeros(n, dtype=torch.bool, device="cpu")
        for span in new_spans:
            recomputed[span.start : span.end] = True
            if origins[id(span)] == "shifted":
                origins[id(span)] = "recomputed"
        _count(runner, layout, stats, new_spans, origins, recomputed)
        stats.recomputed_tokens = int(recomputed.sum())
        stats.prefilled_tokens = n - reused - stats.recomputed_tokens
        return PreparedPrompt(cache, logits[-1], stats, exactness, recomputed, _unencoded(new_spans, origins))
    runner.prefill_exact(cache, ids, reused, first, logits="none")
    placed: list[FragmentSpan] = []
    fragments: list[Fragment] = []
    for spans, is_lead in ((lead, True), (to_shift, False)):
        if not spans:
            continue
        found, found_origins = runner.fragments.find(layout, spans, lead=is_lead)
        for span, fragment, origin in zip(spans, found, found_origins, strict=True):
            origins[id(span)] = origin if fragment is None else ("lead" if is_lead else "shifted")
            if fragment is not None:
                placed.append(span)
                fragments.append(fragment)
                stats.fragments_loaded += origin == "store"
    if placed:
        runner.place(cache, placed, fragments)
    shifted = [span for span in placed if origins[id(span)] == "shifted"]
    # computed in the repair pass below: the memories not shifted, and the separators between memories
    inline = [(s.start, s.end) for s in new_spans if origins[id(s)] not in ("lead", "shifted")]
    inline += [(a.end, b.start) for a, b in zip(new_spans, new_spans[1:], strict=False) if b.start > a.end]
    for start, end in inline:  # the selection pass must read no garbage there
        for layer in range(runner.num_layers):
            keys, values = cache.buffer(layer)
            keys[..., start:end, :].zero_()
            values[..., start:end, :].zero_()
    exactness = exactness.blended_from(first)  # not past a lead fragment: one from a store went through its codec
    candidate_total = sum(span.end - span.start for span in shifted)
    count = min(recompute_count(runner.settings, candidate_total, ratio), candidate_total)
    forced = (
        torch.cat([torch.arange(start, end, device="cpu") for start, end in inline])
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
            local_window=runner.settings.recompute_window,
            local_before=n - _SELECTION_QUERIES,
            anchor=layout.anchor_length,
        )
        runner.forward(cache, ids[tail:n], selection, logits="none")
        chosen = choose_recompute(capture, [(s.start, s.end) for s in shifted], count)
        chosen = torch.cat([chosen, forced]).sort().values
    else:
        chosen = forced
    if chosen.numel():
        queries = torch.cat([chosen, torch.arange(tail, n, device="cpu")])
        step = ForwardStep(
            queries,
            key_length=n,
            # recomputing every fragment token is a full recompute: no window, so it is exact
            local_window=None
            if chosen.numel() == tail - first - sum(s.end - s.start for s in lead)
            else runner.settings.recompute_window,
            local_before=tail,
            anchor=layout.anchor_length,
        )
        logits = runner.forward(cache, ids[queries], step)
    else:
        logits = runner.prefill_exact(cache, ids, tail, n)
    recomputed = torch.zeros(n, dtype=torch.bool, device="cpu")
    recomputed[chosen] = True
    _count(runner, layout, stats, new_spans, origins, recomputed)
    stats.recomputed_tokens = int(chosen.numel())
    stats.prefilled_tokens = (first - reused) + (n - tail)
    return PreparedPrompt(cache, logits[-1], stats, exactness, recomputed, _unencoded(new_spans, origins))


def _planned_origin(runner: ModelPasses, layout: PromptLayout, span: FragmentSpan, auto: bool) -> str:
    """What a memory not read from its lead fragment will get, before anything is loaded:
    ``"shifted"`` (a fragment is cached), ``"recomputed"`` (shifting would not pay) or ``"missed"``."""
    if auto and span.end - span.start < runner.settings.min_recompute_tokens:
        return "recomputed"  # the repair alone would recompute as many tokens: exact costs no more
    if source_of(span) is not None and runner.costs.recompute_cheaper(len(span.token_ids)):
        if runner.fragments.pooled(layout, span) is None:  # a pooled fragment costs only a copy
            return "recomputed"
    return "shifted" if runner.fragments.available(layout, span) else "missed"


def _count(
    runner: ModelPasses,
    layout: PromptLayout,
    stats: ReuseStats,
    spans: list[FragmentSpan],
    origins: dict[int, str],
    recomputed: torch.Tensor,
) -> None:
    """Add what each of ``spans`` got to ``stats`` (per memory in ``stats.memory_reuse``)."""
    index = {span.start: i for i, span in enumerate(layout.fragments)}
    for span in spans:
        origin = origins[id(span)]
        stats.memory_reuse[index[span.start]] = origin
        if origin in ("lead", "shifted"):
            stats.fragments_hit += 1
            stats.reused_tokens += span.end - span.start - int(recomputed[span.start : span.end].sum())
        elif origin == "recomputed":
            stats.fragments_recomputed += 1
        else:
            stats.fragments_missed += 1
            stats.fragments_rejected += origin == "rejected"


def _unencoded(spans: list[FragmentSpan], origins: dict[int, str]) -> list[FragmentSpan]:
    """The memories that found no usable fragment (their fragments are encoded after the answer)."""
    return [span for span in spans if origins[id(span)] in ("missed", "rejected")]


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


def reads_lead(runner: ModelPasses, layout: PromptLayout, span: FragmentSpan) -> bool:
    """Whether ``span`` is read from its lead fragment rather than shifted: it opens the memory
    block right after the conditioning and its lead fragment is cached."""
    if span.start != layout.conditioning.numel() or not lead_possible(runner.settings, layout, span):
        return False
    return runner.fragments.available(layout, span, lead=True)


def last_adjacent_run(spans: list[FragmentSpan]) -> list[FragmentSpan]:
    """The trailing spans that follow each other with at most a separator between them (a
    framework joins the documents it retrieved with a blank line): the separators are computed
    in the repair pass. A longer stretch of text between two memories ends the run."""
    run = spans[-1:]
    for span in reversed(spans[:-1]):
        if not 0 <= run[0].start - span.end <= _SEPARATOR_TOKENS:
            break
        run.insert(0, span)
    return run
