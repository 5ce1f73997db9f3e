"""Each shiftable family: the attention we install matches transformers', and a RoPE shift is exact.

The shift claim: keys cached at positions p.. and rotated by delta equal the keys the model
computes at positions p+delta.. for the same tokens (relative error <= 1e-4), and the next-token
logits computed over the shifted cache equal those over the cache encoded there (<= 1e-3).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY_CONFIGS, TINY_SHAPE, VOCAB, tiny_model
from kvshift_memory.engine.attention import ATTENTION_NAME
from kvshift_memory.engine.families import SHIFTABLE_FAMILIES, position_scheme
from kvshift_memory.kv.cache import ForwardStep, ShiftCache
from kvshift_memory.kv.rope import shift_keys

DELTAS = (1, 37, 500, 2000, 4000)
PREFIX, FRAGMENT, QUERY = 6, 24, 3


def test_every_shiftable_family_has_a_tiny_config():
    assert set(TINY_CONFIGS) == set(SHIFTABLE_FAMILIES)


def _encode(model, ids: torch.Tensor, offset: int) -> ShiftCache:
    """Run ``ids`` at positions ``offset..`` into a fresh cache (slot i holds token i)."""
    cache = ShiftCache(model.config.num_hidden_layers, ids.numel() + QUERY)
    step = ForwardStep.span(0, ids.numel())
    with torch.inference_mode(), cache.stepping(step):
        model(input_ids=ids[None], position_ids=(step.slots + offset)[None], cache=cache, use_cache=True)
    return cache


def _next_logits(model, cache: ShiftCache, query: torch.Tensor, start: int, offset: int) -> torch.Tensor:
    step = ForwardStep.span(start, start + query.numel())
    with torch.inference_mode(), cache.stepping(step):
        out = model(input_ids=query[None], position_ids=(step.slots + offset)[None], cache=cache, use_cache=True)
    return out.logits[0, -1]


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def family_model(request):
    model = tiny_model(TINY_CONFIGS[request.param]())
    reference = tiny_model(TINY_CONFIGS[request.param]())  # same seed: same weights, stock attention
    model.set_attn_implementation(ATTENTION_NAME)
    return request.param, model, reference


def test_kvshift_attention_matches_transformers(family_model):
    name, model, reference = family_model
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(input_ids=ids[None]).logits[0]
    cache = ShiftCache(model.config.num_hidden_layers, ids.numel())
    step = ForwardStep.span(0, ids.numel())
    with torch.inference_mode(), cache.stepping(step):
        got = model(
            input_ids=ids[None], position_ids=step.slots[None], cache=cache, use_cache=True, logits_to_keep=0
        ).logits[0]
    assert (got - expected).abs().max() <= 1e-4, name


def shift_errors(model, scheme, delta: int) -> tuple[float, float]:
    """Encode random tokens at 0 and at ``delta``; shift the first cache by ``delta``.

    :returns: (max relative key error over layers, max next-token logit error).
    """
    generator = torch.Generator().manual_seed(delta)
    ids = torch.randint(3, VOCAB, (PREFIX + FRAGMENT,), generator=generator)
    query = torch.randint(3, VOCAB, (QUERY,), generator=generator)
    at_origin, at_target = _encode(model, ids, 0), _encode(model, ids, delta)
    n, worst = ids.numel(), 0.0
    with torch.inference_mode():
        for layer in range(model.config.num_hidden_layers):
            keys = at_origin.buffer(layer)[0][..., :n, :]
            expected = at_target.buffer(layer)[0][..., :n, :]
            keys.copy_(shift_keys(keys, scheme.layers[layer], delta))
            worst = max(worst, float((keys - expected).abs().max() / expected.abs().max()))
    logits = _next_logits(model, at_origin, query, n, delta) - _next_logits(model, at_target, query, n, delta)
    return worst, float(logits.abs().max())


@pytest.mark.parametrize("delta", DELTAS)
def test_shifted_keys_and_logits_match_encoding_at_the_target(family_model, delta):
    name, model, _ = family_model
    scheme = position_scheme(model)
    assert scheme.shiftable, scheme.reason
    key_error, logit_error = shift_errors(model, scheme, delta)
    assert key_error <= 1e-4, f"{name}: relative key error {key_error:.2e} at delta {delta}"
    assert logit_error <= 1e-3, f"{name}: logit error {logit_error:.2e} at delta {delta}"


def test_zero_shift_is_a_copy():
    keys = torch.randn(1, 2, 5, 16)
    model = tiny_model(TINY_CONFIGS["llama"]())
    layer = position_scheme(model).layers[0]
    assert torch.equal(shift_keys(keys, layer, 0), keys)


def test_partial_rotary_leaves_pass_through_channels_alone():
    model = tiny_model(TINY_CONFIGS["gpt_neox"]())
    layer = position_scheme(model).layers[0]
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert layer.rotary_dim < head_dim
    keys = torch.randn(1, 2, 5, head_dim)
    shifted = shift_keys(keys, layer, 123)
    assert torch.equal(shifted[..., layer.rotary_dim :], keys[..., layer.rotary_dim :])
    assert not torch.allclose(shifted[..., : layer.rotary_dim], keys[..., : layer.rotary_dim])


# ---------------------------------------------------------------- families that must fall back

FALLBACK_CONFIGS = {
    "gpt2 (absolute positions)": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024
    ),
    "llama with dynamic NTK": lambda: transformers.LlamaConfig(
        **{**TINY_SHAPE, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}
    ),
    "phi3 with LongRoPE": lambda: transformers.Phi3Config(
        **TINY_SHAPE,
        pad_token_id=0,
        original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
        },
    ),
}


@pytest.mark.parametrize("label", sorted(FALLBACK_CONFIGS))
def test_unshiftable_positions_are_detected(label):
    scheme = position_scheme(tiny_model(FALLBACK_CONFIGS[label]()))
    assert not scheme.shiftable
    assert scheme.blocks_shift(10)
    assert scheme.layers == ()


def test_sliding_window_blocks_shift_only_past_the_window():
    config = transformers.MistralConfig(**TINY_SHAPE, sliding_window=64)
    scheme = position_scheme(tiny_model(config))
    assert scheme.shiftable and scheme.min_sliding_window == 64
    assert scheme.blocks_shift(64) is None
    assert "sliding attention window" in scheme.blocks_shift(65)


@pytest.mark.model
@pytest.mark.parametrize("delta", (*DELTAS, 8000))
def test_shift_is_exact_on_the_bundled_model(bundled_engine, delta):
    key_error, logit_error = shift_errors(bundled_engine.model, bundled_engine.position_scheme, delta)
    print(f"bundled model, delta {delta}: relative key error {key_error:.1e}, logit error {logit_error:.1e}")
    assert key_error <= 1e-4
    assert logit_error <= 1e-3
