"""Devices and dtypes: every tensor the engine makes lives where the model runs, and
``from_pretrained`` takes a device, a dtype (``"auto"`` included) and transformers' own arguments.

No GPU is needed to prove the first point: with torch's default device set to ``meta``, a tensor
made without saying where lands on ``meta`` and any model computation that meets it fails ("Tensor
on device meta is not on the expected device cpu") — exactly how a model on CUDA meets a tensor the
engine left on the CPU. Device-agnostic code runs unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from store_worker import HashEmbedder

from conftest import MEMORIES, TINY_CONFIGS, tiny_model
from kvshift_memory import InvalidInputError, KVShiftEngine, MemoryStore

QUESTION = "What is the budget for the trip?"


@contextlib.contextmanager
def default_device(device: str):
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(previous)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_no_tensor_is_left_on_the_default_device(family, tokenizer, tmp_path):
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS[family]()), tokenizer)
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        records = [store.add(text, tenant="t") for text in MEMORIES]
        expected = {
            mode: engine.generate(QUESTION, MEMORIES, reuse=mode, max_new_tokens=4).text for mode in ("none", "blend")
        }
        engine.warm(records)  # fragments written to the store, to be read back from it (CPU tensors)
        engine.clear_cache()
        store.clear_cache()
        with default_device("meta"):
            stored = engine.generate(QUESTION, records, reuse="blend", recompute_ratio=0.3, max_new_tokens=4)
            answers = {mode: engine.generate(QUESTION, MEMORIES, reuse=mode, max_new_tokens=4) for mode in ("none",)}
            answers["prefix"] = engine.generate(QUESTION, MEMORIES, reuse="prefix", max_new_tokens=4)
            sampled = engine.generate(QUESTION, MEMORIES, temperature=0.8, top_p=0.9, top_k=20, seed=3)
            streamed = "".join(engine.generate(QUESTION, MEMORIES, reuse="blend", stream=True, max_new_tokens=4))
            scored = engine.score(
                QUESTION, MEMORIES, " The budget is 50k euros.", reuse="blend", return_distributions=True
            )
    assert stored.stats.fragments_loaded == len(records)
    assert answers["none"].text == answers["prefix"].text == expected["none"]
    assert streamed == expected["blend"]
    assert sampled.text and scored.logprobs and all(value <= 0 for value in scored.logprobs)


def test_from_pretrained_takes_device_and_dtypes(tmp_path, tokenizer):
    tiny_model(TINY_CONFIGS["qwen2"]()).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reference = None
    for dtype, expected in (("auto", torch.float32), ("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        engine = KVShiftEngine.from_pretrained(tmp_path, device="cpu", dtype=dtype)
        assert engine.model.dtype == expected and engine.device == torch.device("cpu")
        result = engine.generate(QUESTION, MEMORIES, max_new_tokens=3)
        assert result.stats.reuse == "blend" and result.token_ids
        if dtype == "float32":
            reference = result.text
        if dtype == "auto":
            first = result.text
    assert first == reference  # "auto" is the checkpoint's own dtype: fp32 here
    # transformers' own arguments pass through; the engine's settings are told apart from them
    engine = KVShiftEngine.from_pretrained(
        tmp_path, device_map="cpu", attn_implementation="sdpa", low_cpu_mem_usage=True, recompute_ratio=0.2
    )
    assert engine.settings.recompute_ratio == 0.2 and engine.device == torch.device("cpu")


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"device": "cuda:7"}, "not available here"),
        ({"device": "tpu-of-my-dreams"}, "device must be like"),
        ({"device": "cpu", "device_map": "cpu"}, "not both"),
        ({"dtype": "float8"}, "dtype must be"),
        ({"dtype": 3}, "dtype must be"),
    ],
)
def test_bad_device_or_dtype_is_a_clear_error(arguments, message, tmp_path):
    with pytest.raises(InvalidInputError, match=message):
        KVShiftEngine.from_pretrained(tmp_path, **arguments)
