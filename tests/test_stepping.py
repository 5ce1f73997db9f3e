"""The one-token step: the logits transformers' forward gives, for every family it runs, in every
path (the kernels' layer step, the step in PyTorch), and transformers' forward where it has none."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from conftest import TINY_CONFIGS, TINY_SHAPE, tiny_model
from kvshift_memory import KVShiftEngine
from kvshift_memory.engine.native import kernels
from kvshift_memory.engine.stepping import STEP_FAMILIES
from kvshift_memory.kv.cache import ForwardStep, ShiftCache

PROMPT = "Ana lives in Porto and works as a nurse at the city hospital; her brother Rui teaches music."


def _decode_logits(engine: KVShiftEngine, ids: torch.Tensor, start: int, *, step: bool) -> torch.Tensor:
    """Logits after each of ``ids[start:]``, token by token, over the exact K/V of ``ids[:start]``."""
    runner = engine.runner
    cache = ShiftCache(runner.num_layers, ids.numel(), runner.device)
    runner.forward(cache, ids[:start], ForwardStep.span(0, start), logits="none")
    rows = []
    for slot in range(start, ids.numel()):
        token = int(ids[slot])
        if step:
            rows.append(runner.decode_one(cache, token, slot))
        else:
            rows.append(runner.forward(cache, ids[slot : slot + 1], ForwardStep.span(slot, slot + 1))[-1])
    return torch.stack(rows)


def _families():
    configs = dict(TINY_CONFIGS)
    # windows shorter than the prompt, so the step's windowed attention is exercised
    configs["mistral-window"] = lambda: transformers.MistralConfig(**TINY_SHAPE, sliding_window=12)
    configs["gemma3-window"] = lambda: transformers.Gemma3TextConfig(
        **{**TINY_SHAPE, "num_hidden_layers": 3},
        head_dim=16,
        sliding_window=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    return {name: make for name, make in configs.items() if make().model_type in STEP_FAMILIES}


@pytest.mark.parametrize("family", sorted(_families()))
@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_the_step_gives_the_forward_passs_logits(tokenizer, family, weights):
    model = tiny_model(_families()[family]())
    # the reference quantizes first; the engine under test runs a copy of the same weights
    reference = KVShiftEngine(model, tokenizer, weights=weights, one_token_step=False, pack_weights=False)
    engine = KVShiftEngine(copy.deepcopy(reference.model), tokenizer)
    assert engine.runner.step is not None and reference.runner.step is None
    if weights is not None and kernels() is not None:
        assert engine.runner.step.native_model is not None  # the whole token in one kernel call
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    got = _decode_logits(engine, ids, 6, step=True)
    expected = _decode_logits(reference, ids, 6, step=False)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max().clamp_min(1.0)


@pytest.mark.skipif(kernels() is None, reason="no C compiler here: the kernels are not built")
def test_the_kernels_model_step_and_the_step_in_pytorch_agree(tokenizer):
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["gemma3_text"]()), tokenizer, weights="int8")
    ids = torch.tensor(tokenizer(PROMPT)["input_ids"])
    native = _decode_logits(engine, ids, 4, step=True)
    engine.runner.step.native_model = None
    in_torch = _decode_logits(engine, ids, 4, step=True)
    assert (native - in_torch).abs().max() <= 1e-4 * in_torch.abs().max()


def test_generation_says_which_step_decoded(tokenizer):
    stepped = KVShiftEngine(tiny_model(TINY_CONFIGS["qwen3"]()), tokenizer, weights="int8")
    stats = stepped.generate(PROMPT, max_new_tokens=4).stats
    assert stats.decode_path == ("native" if kernels() is not None else "torch")
    plain = KVShiftEngine(tiny_model(TINY_CONFIGS["qwen3"]()), tokenizer, one_token_step=False)
    assert plain.generate(PROMPT, max_new_tokens=4).stats.decode_path == "transformers"
    assert plain.runner.step_reason == "one_token_step=False"


@pytest.mark.parametrize("family", ["phi3", "gpt_neox", "gemma2"])
def test_a_family_without_a_step_decodes_through_transformers(tokenizer, family):
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS[family]()), tokenizer)
    assert engine.runner.step is None and engine.runner.step_reason
    result = engine.generate(PROMPT, max_new_tokens=3)
    assert result.stats.decode_path == "transformers" and result.stats.generated_tokens == 3


def test_steps_and_forward_passes_give_the_same_greedy_answer(tokenizer):
    forward = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, weights="int4", one_token_step=False)
    stepped = KVShiftEngine(copy.deepcopy(forward.model), tokenizer)
    for reuse in ("none", "prefix"):
        a = stepped.generate(PROMPT, reuse=reuse, max_new_tokens=12)
        b = forward.generate(PROMPT, reuse=reuse, max_new_tokens=12)
        assert a.token_ids == b.token_ids


@pytest.mark.model
@pytest.mark.parametrize("engine_name", ["bundled_engine", "gemma_engine"])
def test_the_shipped_models_step_gives_their_forward_passs_logits(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    ids = torch.tensor(engine.tokenizer(PROMPT * 4)["input_ids"])
    got = _decode_logits(engine, ids, ids.numel() - 12, step=True)
    runner_step = engine.runner.step
    try:
        engine.runner.step = None
        expected = _decode_logits(engine, ids, ids.numel() - 12, step=False)
    finally:
        engine.runner.step = runner_step
    print(f"{engine_name}: step against forward, max |delta logit| {(got - expected).abs().max():.1e}")
    assert (got - expected).abs().max() <= 1e-3


def test_streaming_stop_strings_sampling_and_grammars_run_on_the_kernels_step(tokenizer):
    from kvshift_memory import Grammar

    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, weights="int8")
    full = engine.generate("Say something.", max_new_tokens=16)
    assert full.stats.decode_path == ("native" if kernels() is not None else "torch") and len(full.text) > 4
    pieces = list(stream := engine.generate("Say something.", max_new_tokens=16, stream=True))
    assert "".join(pieces) == full.text and stream.result is not None and stream.result.text == full.text
    stop = full.text[2:4]
    cut = engine.generate("Say something.", max_new_tokens=16, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    sampled = dict(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50)
    a, b = (engine.generate("Tell a story.", seed=7, **sampled) for _ in range(2))
    assert a.token_ids == b.token_ids != engine.generate("Tell a story.", seed=8, **sampled).token_ids
    shaped = engine.generate("Pick a number.", grammar=Grammar.regex(r"[0-9]{3}"), max_new_tokens=8)
    assert len(shaped.text) == 3 and shaped.text.isdigit()
