"""Each shiftable family: the attention we install matches transformers', and a RoPE shift is exact.

The shift claim: keys cached at positions p.. and rotated by delta equal the keys the model
computes at positions p+delta.. for the same tokens (relative error <= 1e-4), and the next-token
logits computed over the shifted cache equal those over the cache encoded there (<= 1e-3).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from conftest import TINY_CONFIGS, TINY_SHAPE, VOCAB, num_layers, shift_errors, tiny_model, vision_language
from kvshift_memory.engine.attention import ATTENTION_NAME
from kvshift_memory.engine.families import SHIFTABLE_FAMILIES, position_scheme
from kvshift_memory.kv.cache import ForwardStep, ShiftCache
from kvshift_memory.kv.rope import shift_keys

DELTAS = (1, 37, 500, 2000, 4000)


def test_every_shiftable_family_has_a_tiny_config():
    assert set(TINY_CONFIGS) == set(SHIFTABLE_FAMILIES)


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
    cache = ShiftCache(num_layers(model), ids.numel())
    step = ForwardStep.span(0, ids.numel())
    with torch.inference_mode(), cache.stepping(step):
        got = model(
            input_ids=ids[None], position_ids=step.slots[None], cache=cache, use_cache=True, logits_to_keep=0
        ).logits[0]
    assert (got - expected).abs().max() <= 1e-4, name


@pytest.mark.parametrize("delta", DELTAS)
def test_shifted_keys_and_logits_match_encoding_at_the_target(family_model, delta):
    name, model, _ = family_model
    scheme = position_scheme(model)
    assert scheme.shiftable, scheme.reason
    key_errors, logit_error = shift_errors(model, scheme, delta)
    key_error = max(key_errors)
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
    assert not scheme.shiftable and scheme.reason
    assert scheme.layers == ()


def test_sliding_window_layers_mask_as_transformers_does():
    """Gemma 3's layout (five sliding layers to one full, two RoPE bases) with a window of 16:
    over 64 tokens the installed attention gives the stock model's logits."""
    config = lambda: transformers.Gemma3TextConfig(  # noqa: E731
        **{**TINY_SHAPE, "num_hidden_layers": 6},
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
    )
    model, reference = tiny_model(config()), tiny_model(config())
    model.set_attn_implementation(ATTENTION_NAME)
    ids = torch.randint(3, VOCAB, (64,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = reference(input_ids=ids[None]).logits[0]
    cache = ShiftCache(6, ids.numel())
    step = ForwardStep.span(0, ids.numel())
    with torch.inference_mode(), cache.stepping(step):
        got = model(input_ids=ids[None], position_ids=step.slots[None], cache=cache, use_cache=True, logits_to_keep=0)
    assert (got.logits[0] - expected).abs().max() <= 1e-4
    scheme = position_scheme(model)
    assert scheme.layers[0] is scheme.layers[4] and scheme.layers[0] is not scheme.layers[5]  # one table per RoPE base


# ---------------------------------------------------------------- text decoders inside multimodal models


@pytest.mark.parametrize("kind", ["gemma3", "mistral3"])
def test_conditional_generation_models_shift_through_their_text_decoder(kind, tokenizer):
    from conftest import MEMORIES
    from kvshift_memory import KVShiftEngine

    model = vision_language(kind)
    engine = KVShiftEngine(model, tokenizer)
    assert engine.runner.position_scheme.shiftable, engine.runner.position_scheme.reason
    key_errors, logit_error = shift_errors(model, engine.runner.position_scheme, 500)
    key_error = max(key_errors)
    assert key_error <= 1e-4 and logit_error <= 1e-3
    blended = engine.generate("What is the budget?", MEMORIES, max_new_tokens=4)
    assert blended.stats.reuse == "blend" and blended.stats.fallback_reason is None
    engine.clear_cache()
    first = engine.generate("What is the budget?", MEMORIES, reuse="prefix", max_new_tokens=4)
    again = engine.generate("What is the budget?", MEMORIES, reuse="prefix", max_new_tokens=4)
    full = engine.generate("What is the budget?", MEMORIES, reuse="none", max_new_tokens=4)
    assert again.stats.reused_tokens > 0 and first.token_ids == again.token_ids == full.token_ids


def test_a_decoder_without_a_rotary_module_falls_back_with_a_reason(tokenizer):
    from conftest import MEMORIES
    from kvshift_memory import KVShiftEngine

    class TablesElsewhere(torch.nn.Module):  # a rotary module whose frequencies are not where transformers puts them
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    model = vision_language("gemma3")
    decoder = model.model.language_model
    decoder.rotary_emb = TablesElsewhere(decoder.rotary_emb)
    engine = KVShiftEngine(model, tokenizer)
    result = engine.generate("What is the budget?", MEMORIES, reuse="blend", max_new_tokens=1)
    assert result.stats.reuse == "prefix" and "no rotary embedding module" in result.stats.fallback_reason


@pytest.mark.model
@pytest.mark.parametrize("delta", (*DELTAS, 8000))
def test_shift_is_exact_on_the_bundled_model(bundled_engine, delta):
    key_errors, logit_error = shift_errors(bundled_engine.model, bundled_engine.runner.position_scheme, delta)
    key_error = max(key_errors)
    print(f"bundled model, delta {delta}: relative key error {key_error:.1e}, logit error {logit_error:.1e}")
    assert key_error <= 1e-4
    assert logit_error <= 1e-3
