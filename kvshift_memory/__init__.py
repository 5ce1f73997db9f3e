"""kvshift-memory: agent memory whose recalled items bring their precomputed KV cache.

The public surface is what ``__all__`` lists; everything else is private and may change.
"""

from . import exceptions
from .engine import EngineSettings, GenerationResult, GenerationStream, KVShiftEngine, ReuseStats, ScoreResult
from .exceptions import (
    ContextOverflowError,
    InvalidInputError,
    KVShiftError,
    ModelLoadError,
    ModelNotFoundError,
)

__version__ = "0.1.0"

__all__ = [
    "ContextOverflowError",
    "EngineSettings",
    "GenerationResult",
    "GenerationStream",
    "InvalidInputError",
    "KVShiftEngine",
    "KVShiftError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ReuseStats",
    "ScoreResult",
    "__version__",
    "exceptions",
]
