"""Keeping freed memory mapped, so that a new generation's cache does not fault its pages in again.

Every generation allocates a fresh K/V cache (about 100 MB at 2k tokens for the bundled model),
one buffer per layer and kind, and frees caches the prefix pool lets go. glibc's malloc hands
freed blocks of this size back to the kernel (``munmap``, or trimming the heap top), so the next
cache lands on fresh pages, and every first write to a page is a page fault, the copy of a cached
prefix included (``docs/benchmarks/ttft.md``).
Raising the mmap threshold and the trim threshold keeps the blocks in the process for reuse, as
jemalloc or tcmalloc would. It is process-wide, so it is a setting
(``EngineSettings.keep_freed_memory``), applied once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading

__all__ = ["keep_freed_memory"]

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest; blocks above it (the weights) are still mapped apart
_TRIM_THRESHOLD = 1 << 30

_applied: bool | None = None
_lock = threading.Lock()


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks up to 32 MiB, and up to 1 GiB of free heap, mapped.

    :returns: whether the process's malloc took the settings (``False`` off Linux/glibc).
    """
    global _applied
    with _lock:
        if _applied is None:
            _applied = _mallopt()
        return _applied


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
