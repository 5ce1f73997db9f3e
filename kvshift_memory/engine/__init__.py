"""Model loading, prefill and generation with reuse, the blend, and their statistics."""

from .engine import EngineSettings, KVShiftEngine
from .grammar import Grammar
from .results import GenerationResult, GenerationStream, ReuseStats, ScoreResult

__all__ = [
    "EngineSettings",
    "GenerationResult",
    "GenerationStream",
    "Grammar",
    "KVShiftEngine",
    "ReuseStats",
    "ScoreResult",
]
