"""The kvshift attention function against a dense reference written from the visibility rule.

The blend's recompute pass sends scattered query slots with a local window and an anchor; the
attention function splits them into chunks and gathers only the keys each chunk can see. Whatever
the chunking, the result must equal plain softmax attention under the rule stated in
:class:`~kvshift_memory.kv.cache.ForwardStep`.
"""

from __future__ import annotations

import pytest
import torch

from kvshift_memory.engine.attention import kvshift_attention
from kvshift_memory.kv.cache import ForwardStep, current_step

HEADS, KV_HEADS, DIM = 6, 2, 16


def _reference(query, key, value, slots, step: ForwardStep | None, sliding_window=None, softcap=None):
    """Softmax attention, the mask spelt out query by query from the rule."""
    n = key.shape[2]
    group = HEADS // KV_HEADS
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = (query @ key.transpose(-1, -2)) * DIM**-0.5
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    mask = torch.zeros(len(slots), n, dtype=torch.bool)
    for row, slot in enumerate(slots.tolist()):
        for j in range(n):
            ok = j <= slot
            if sliding_window is not None:
                ok &= j > slot - sliding_window
            if step is not None and step.local_window is not None and slot < step.local_before:
                ok &= j > slot - step.local_window or j < step.anchor
            mask[row, j] = ok
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return (probs @ value).transpose(1, 2)


def _run(query, key, value, step, **kwargs):
    token = current_step.set(step)
    try:
        return kvshift_attention(torch.nn.Module(), query, key, value, None, **kwargs)[0]
    finally:
        current_step.reset(token)


def _tensors(queries: int, keys: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, HEADS, queries, DIM, generator=generator),
        torch.randn(1, KV_HEADS, keys, DIM, generator=generator),
        torch.randn(1, KV_HEADS, keys, DIM, generator=generator),
    )


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window,anchor", [(8, 5), (16, 0), (64, 3), (1000, 5)])
def test_scattered_queries_with_local_window_match_the_rule(seed, window, anchor):
    n, tail = 300, 280
    generator = torch.Generator().manual_seed(100 + seed)
    chosen = torch.randperm(tail - anchor, generator=generator)[:90].add(anchor).sort().values
    slots = torch.cat([chosen, torch.arange(tail, n)])
    step = ForwardStep(slots, key_length=n, local_window=window, local_before=tail, anchor=anchor)
    query, key, value = _tensors(slots.numel(), n, seed)
    got = _run(query, key, value, step)
    torch.testing.assert_close(got, _reference(query, key, value, slots, step), rtol=1e-5, atol=1e-5)
    assert step.plans, "the chunk plan is built once per pass and kept on the step"


def test_chunk_plans_are_shared_by_layers_but_not_across_windows():
    n = 200
    slots = torch.cat([torch.arange(10, 190, 7), torch.arange(190, n)])
    step = ForwardStep(slots, key_length=n, local_window=32, local_before=190, anchor=4)
    query, key, value = _tensors(slots.numel(), n, 0)
    first = _run(query, key, value, step)
    again = _run(query, key, value, step)
    windowed = _run(query, key, value, step, sliding_window=20)
    assert torch.equal(first, again)
    assert {key[1] for key in step.plans} == {None, 20}
    torch.testing.assert_close(
        windowed, _reference(query, key, value, slots, step, sliding_window=20), rtol=1e-5, atol=1e-5
    )


def test_contiguous_span_after_a_cache_matches_the_rule():
    n, start = 120, 100
    slots = torch.arange(start, n)
    query, key, value = _tensors(slots.numel(), n, 3)
    got = _run(query, key, value, ForwardStep.span(start, n))
    torch.testing.assert_close(got, _reference(query, key, value, slots, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_capture_records_the_last_queries_mass(softcap):
    n, start = 90, 60
    slots = torch.arange(start, n)
    capture: list[torch.Tensor] = []
    step = ForwardStep(slots, key_length=n, capture=capture, capture_queries=4)
    query, key, value = _tensors(slots.numel(), n, 5)
    got = _run(query, key, value, step, softcap=softcap)
    torch.testing.assert_close(got, _reference(query, key, value, slots, None, softcap=softcap), rtol=1e-5, atol=1e-5)
    (mass,) = capture
    assert mass.shape == (n,)
    # each of the last 4 queries spreads probability 1 per head over its keys
    assert mass.sum().item() == pytest.approx(4 * HEADS, rel=1e-5)
    assert mass[-3:].gt(0).all() and mass[: n - 30].gt(0).any()


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_capture_with_windowed_leading_queries(softcap):
    """The blend's selection pass: the question's earlier tokens read the anchor and a window, the
    ranking ones (whose attention is recorded) read everything."""
    n, start, ranked = 200, 150, 4
    slots = torch.arange(start, n)
    capture: list[torch.Tensor] = []
    step = ForwardStep(
        slots, key_length=n, capture=capture, capture_queries=ranked, local_window=24, local_before=n - ranked, anchor=6
    )
    query, key, value = _tensors(slots.numel(), n, 8)
    got = _run(query, key, value, step, softcap=softcap)
    torch.testing.assert_close(got, _reference(query, key, value, slots, step, softcap=softcap), rtol=1e-5, atol=1e-5)
    unwindowed = _reference(query, key, value, slots, None, softcap=softcap)
    assert not torch.allclose(got[:, : n - start - ranked], unwindowed[:, : n - start - ranked], atol=1e-3)
    (mass,) = capture
    assert mass.sum().item() == pytest.approx(ranked * HEADS, rel=1e-5)
    assert mass[6:100].gt(0).all(), "the ranking queries see keys outside the window"
