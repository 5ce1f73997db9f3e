"""Packed linear layers: same results as nn.Linear, same fingerprint, skipped where they do not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import KVShiftEngine
from kvshift_memory.engine.fingerprint import model_fingerprint
from kvshift_memory.engine.packing import PackedLinear, pack_linear_layers

MESSAGES = [{"role": "user", "content": "Where does Ana live, and what does she do?"}]
MEMORIES = ["My sister Ana lives in Porto.", "Ana works as a nurse at the city hospital."]


def _linears(model: torch.nn.Module) -> int:
    return sum(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a_packed_engine_answers_as_the_plain_one(tokenizer, family):
    plain_model = tiny_model(TINY_CONFIGS[family]())
    count = _linears(plain_model)
    packed = KVShiftEngine(copy.deepcopy(plain_model), tokenizer)
    plain = KVShiftEngine(plain_model, tokenizer, pack_weights=False)
    assert packed.packed_layers == count > 0 and _linears(packed.model) == 0
    assert plain.packed_layers == 0 and _linears(plain.model) == count
    assert packed.fingerprint == plain.fingerprint
    for reuse in ("none", "blend"):
        a = packed.score(MESSAGES, MEMORIES, " Porto, as a nurse.", reuse=reuse)
        b = plain.score(MESSAGES, MEMORIES, " Porto, as a nurse.", reuse=reuse)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert packed.generate(MESSAGES, MEMORIES, reuse=reuse, max_new_tokens=8).token_ids == (
            plain.generate(MESSAGES, MEMORIES, reuse=reuse, max_new_tokens=8).token_ids
        )


def test_packing_keeps_the_fingerprint_and_it_still_tells_checkpoints_apart(tokenizer):
    model = tiny_model(TINY_CONFIGS["llama"](), seed=0)
    before = model_fingerprint(model, tokenizer)
    other = tiny_model(TINY_CONFIGS["llama"](), seed=0)
    with torch.no_grad():  # differ only inside one linear weight, which packing takes out of the state_dict
        other.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    assert pack_linear_layers(model) > 0 and pack_linear_layers(other) > 0
    assert model_fingerprint(model, tokenizer) == before
    assert model_fingerprint(other, tokenizer) != before
    assert pack_linear_layers(model) == 0  # already packed: nothing left to do


def test_models_packing_does_not_apply_to_are_left_as_loaded(tokenizer, caplog):
    model = tiny_model(TINY_CONFIGS["llama"]()).to(torch.bfloat16)
    with caplog.at_level("INFO", logger="kvshift_memory"):
        assert pack_linear_layers(model) == 0
    assert "float32" in caplog.text and not any(isinstance(m, PackedLinear) for m in model.modules())


def test_engines_loaded_from_the_same_files_share_their_packed_weights(tmp_path, tokenizer):
    import os

    tiny_model(TINY_CONFIGS["llama"]()).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    first, second = KVShiftEngine.from_pretrained(tmp_path), KVShiftEngine.from_pretrained(tmp_path)
    packed = [(a.weight, b.weight) for a, b in zip(_packed(first), _packed(second), strict=True)]
    assert packed and all(a is b for a, b in packed)  # one copy, packed once
    assert first.generate("hi", max_new_tokens=4).text == second.generate("hi", max_new_tokens=4).text
    for weights in tmp_path.glob("*.safetensors"):  # the files written again: other weights, packed anew
        os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    third = KVShiftEngine.from_pretrained(tmp_path)
    assert all(a.weight is not c.weight for a, c in zip(_packed(first), _packed(third), strict=True))
    unshared = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer)  # given a model: nothing shared
    assert all(a.weight is not u.weight for a, u in zip(_packed(first), _packed(unshared), strict=True))


def _packed(engine: KVShiftEngine) -> list[PackedLinear]:
    return [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
