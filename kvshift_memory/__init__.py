"""kvshift-memory: agent memory whose recalled items bring their precomputed KV cache.

The public surface is what ``__all__`` lists; everything else is private and may change.

Names load on first use: ``from kvshift_memory import MemoryStore`` does not import torch (a
process that only stores and searches memories never pays for the model stack).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import exceptions
from .exceptions import (
    ContextOverflowError,
    CorruptFragmentError,
    CorruptRecordError,
    InvalidInputError,
    KVShiftError,
    MemoryNotFoundError,
    ModelLoadError,
    ModelNotFoundError,
    SessionBusyError,
    StoreBusyError,
    StoreError,
    VersionConflictError,
)
from .messages import Message

if TYPE_CHECKING:
    from .agent import AgentMemory, AgentSettings, Reply, ReplyStream
    from .engine import (
        EngineSettings,
        GenerationResult,
        GenerationStream,
        Grammar,
        KVShiftEngine,
        ReuseStats,
        ScoreResult,
    )
    from .store import CheckReport, GCReport, MemoryRecord, MemoryStore

__version__ = "0.1.0"

_LAZY = {
    "AgentMemory": ".agent",
    "AgentSettings": ".agent",
    "Reply": ".agent",
    "ReplyStream": ".agent",
    "EngineSettings": ".engine",
    "GenerationResult": ".engine",
    "GenerationStream": ".engine",
    "Grammar": ".engine",
    "KVShiftEngine": ".engine",
    "ReuseStats": ".engine",
    "ScoreResult": ".engine",
    "CheckReport": ".store",
    "GCReport": ".store",
    "MemoryRecord": ".store",
    "MemoryStore": ".store",
}

__all__ = [
    "AgentMemory",
    "AgentSettings",
    "CheckReport",
    "ContextOverflowError",
    "CorruptFragmentError",
    "CorruptRecordError",
    "EngineSettings",
    "GCReport",
    "GenerationResult",
    "GenerationStream",
    "Grammar",
    "InvalidInputError",
    "KVShiftEngine",
    "KVShiftError",
    "MemoryNotFoundError",
    "MemoryRecord",
    "Message",
    "MemoryStore",
    "ModelLoadError",
    "ModelNotFoundError",
    "Reply",
    "ReplyStream",
    "ReuseStats",
    "ScoreResult",
    "SessionBusyError",
    "StoreBusyError",
    "StoreError",
    "VersionConflictError",
    "__version__",
    "exceptions",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
