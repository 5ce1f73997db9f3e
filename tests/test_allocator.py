"""keep_freed_memory: a new cache's buffers land on pages already mapped, and the setting governs it."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

import kvshift_memory.engine.runner as runner_module
from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import EngineSettings, KVShiftEngine
from kvshift_memory.engine.allocator import keep_freed_memory
from kvshift_memory.exceptions import InvalidInputError

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def _cache_sized_buffers() -> list[torch.Tensor]:
    """60 buffers of a 2k-token cache's layer size (3 heads x 2112 slots x 64 dims, fp32), written."""
    buffers = [torch.empty(1, 3, 2112, 64) for _ in range(60)]
    for buffer in buffers:
        buffer.fill_(1.0)
    return buffers


@glibc
def test_a_second_cache_reuses_the_freed_pages():
    assert keep_freed_memory() is True
    del _cache_sized_buffers()[:]  # allocate, touch and free one cache's worth
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = _cache_sized_buffers()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = sum(b.numel() * b.element_size() for b in buffers) // 4096
    assert faults < pages // 10, f"{faults} page faults for {pages} pages"


def test_the_setting_decides_and_is_checked(tokenizer, monkeypatch):
    calls = []
    monkeypatch.setattr(runner_module, "keep_freed_memory", lambda: calls.append(1) or True)
    model = tiny_model(TINY_CONFIGS["llama"]())
    KVShiftEngine(model, tokenizer, keep_freed_memory=False)
    assert calls == []
    KVShiftEngine(model, tokenizer)
    assert calls == [1]
    with pytest.raises(InvalidInputError, match="keep_freed_memory"):
        EngineSettings(keep_freed_memory="yes")
