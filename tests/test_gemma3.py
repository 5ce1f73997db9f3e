"""Gemma 3 270M, the second shipped model, on its real weights: sliding-window layers (a window of
512 on five layers of six) and two RoPE bases (10,000 on sliding layers, 1,000,000 on full ones).

Every test here uses the ``gemma_engine`` fixture, so all are marked ``model``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import MEMORIES, first_logits, shift_errors


def _long_conversation(min_tokens: int, engine) -> list[dict[str, str]]:
    """Turns about other things, at least ``min_tokens`` long: pushes memories out of the window."""
    messages: list[dict[str, str]] = []
    i = 0
    while engine.count_tokens(" ".join(m["content"] for m in messages)) < min_tokens:
        messages.append({"role": "user", "content": f"Tell me about harbour number {i} on the coast."})
        messages.append(
            {"role": "assistant", "content": f"Harbour {i} has fishing boats, a lighthouse and a fish market."}
        )
        i += 1
    return messages + [{"role": "user", "content": "What is the budget for the trip?"}]


def test_loads_by_name_with_a_table_per_rope_base(gemma_engine):
    model = gemma_engine.model
    config = model.config.get_text_config(decoder=True)
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.sliding_window == 512
    scheme = gemma_engine.runner.position_scheme
    assert scheme.shiftable, scheme.reason
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == "sliding_attention"]
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    assert len(sliding) == 15 and len(full) == 3
    assert scheme.layers[sliding[0]] is not scheme.layers[full[0]]
    assert not scheme.layers[sliding[0]].inv_freq.equal(scheme.layers[full[0]].inv_freq)
    # measured: the blend changed too many of the agent's answers on this model (long_memory.md)
    assert gemma_engine.settings.auto_shifts is False
    stats = gemma_engine.generate("What is the budget?", MEMORIES, max_new_tokens=1).stats
    assert stats.reuse == "prefix" and "auto_shifts=False" in (stats.fallback_reason or "")


@pytest.fixture
def float64_angles(gemma_engine, monkeypatch):
    """Gemma's rotary module computes its angles ``position * inv_freq`` in fp32, whose rounding at
    position 8,000 moves keys by ~1e-4 (relative) against the exact angle, and the next-token
    logits by ~1e-2; a shift rotates by the exact angle (``kv/rope.py`` computes it in float64).
    Comparing the two needs the same angles on both sides: here, exact ones."""
    rotary = gemma_engine.model.model.rotary_emb

    def forward(x, position_ids, layer_type):
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq").to(torch.float64)
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    monkeypatch.setattr(rotary, "forward", forward)


@pytest.mark.parametrize("delta", (37, 2000, 8000))
def test_shift_is_exact_on_every_layer_type(gemma_engine, float64_angles, delta):
    config = gemma_engine.model.config.get_text_config(decoder=True)
    key_errors, logit_error = shift_errors(gemma_engine.model, gemma_engine.runner.position_scheme, delta)
    by_type = {
        kind: max(error for error, layer in zip(key_errors, config.layer_types, strict=True) if layer == kind)
        for kind in ("sliding_attention", "full_attention")
    }
    print(f"gemma-3-270m, delta {delta}: relative key error by layer type {by_type}, logit error {logit_error:.1e}")
    assert max(by_type.values()) <= 1e-4  # the bar of every family in test_families.py
    assert logit_error <= 1e-3


def test_prefix_reuse_is_exact(gemma_engine):
    gemma_engine.clear_cache()
    first = gemma_engine.generate("What is the budget for the trip?", MEMORIES, reuse="prefix", max_new_tokens=8)
    messages = [
        {"role": "user", "content": "What is the budget for the trip?"},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And who is allergic to peanuts?"},
    ]
    reused = gemma_engine.generate(messages, MEMORIES, reuse="prefix", max_new_tokens=8)
    full = gemma_engine.generate(messages, MEMORIES, reuse="none", max_new_tokens=8)
    assert reused.stats.reused_tokens >= 0.8 * reused.stats.prompt_tokens
    assert reused.token_ids == full.token_ids
    gemma_engine.generate(messages[:1], MEMORIES, reuse="prefix", max_new_tokens=1)  # the cache holds turn 1 again
    got = first_logits(gemma_engine, messages, MEMORIES, reuse="prefix")
    expected = first_logits(gemma_engine, messages, MEMORIES, reuse="none")
    assert (got - expected).abs().max() <= 1e-3


def test_a_fragment_beyond_the_sliding_window_gives_full_recompute_logits(gemma_engine):
    """Memories placed more than 512 tokens before the question: the sliding layers no longer see
    them, the full layers do, in the blend exactly as in full recompute."""
    messages = _long_conversation(600, gemma_engine)
    expected = first_logits(gemma_engine, messages, MEMORIES, reuse="none")
    layout = gemma_engine.planner.plan(messages, MEMORIES, reuse="blend").layout
    assert layout.length - layout.tail_start > 512
    recomputed = first_logits(gemma_engine, messages, MEMORIES, reuse="blend", ratio=1.0)
    assert (recomputed - expected).abs().max() <= 1e-3
    gemma_engine.clear_cache()
    gemma_engine.warm(MEMORIES[:1])
    lead = gemma_engine.generate(messages, MEMORIES[:1], reuse="blend", max_new_tokens=1)
    assert lead.stats.reuse == "blend" and lead.stats.fragments_hit == 1
    got = first_logits(gemma_engine, messages, MEMORIES[:1], reuse="blend")
    alone = first_logits(gemma_engine, messages, MEMORIES[:1], reuse="none")
    assert (got - alone).abs().max() <= 1e-3
