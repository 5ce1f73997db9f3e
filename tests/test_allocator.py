"""keep_freed_memory: a new cache's buffers land on pages already mapped, and the setting governs it."""

from __future__ import annotations

import ctypes
import platform
import subprocess
import sys
import textwrap

import pytest

import kvshift_memory.engine.runner as runner_module
from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import EngineSettings, KVShiftEngine
from kvshift_memory.exceptions import InvalidInputError

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


# Run in a process of its own: a test module before this one in the same worker leaves its own
# allocations and threads, and a page-fault count is the whole process's. Fresh, the counts say
# what the setting promises: freed cache memory stays in malloc's arena, and the next cache lands
# there. (Without the setting glibc's dynamic thresholds sometimes keep it too, sometimes trim it:
# no control run here could say which.)
_SECOND_CACHE = textwrap.dedent(
    """
    import ctypes, resource, torch
    from kvshift_memory.engine.allocator import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
        )]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def cache_sized_buffers():  # 60 buffers of a 2k-token cache's layer (3 heads x 2112 slots x 64 dims, fp32)
        buffers = [torch.empty(1, 3, 2112, 64) for _ in range(60)]
        for buffer in buffers:
            buffer.fill_(1.0)
        return buffers

    kept = keep_freed_memory()
    del cache_sized_buffers()[:]  # allocate, touch and free one cache's worth
    free_in_arena = libc.mallinfo2().fordblks
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffers = cache_sized_buffers()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    cache = sum(b.numel() * b.element_size() for b in buffers)
    print(kept, free_in_arena, cache, faults, cache // 4096)
    """
)


def _second_cache() -> tuple[str, int, int, int, int]:
    done = subprocess.run([sys.executable, "-c", _SECOND_CACHE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kept, *counts = done.stdout.split()
    free_in_arena, cache, faults, pages = map(int, counts)
    return kept, free_in_arena, cache, faults, pages


@glibc
def test_a_second_cache_reuses_the_freed_pages():
    if not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"):
        pytest.skip("mallinfo2 is glibc 2.33's")
    kept, free_in_arena, cache, faults, pages = _second_cache()
    assert kept == "True"
    assert free_in_arena >= cache  # the freed cache stayed mapped, in malloc's arena
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
