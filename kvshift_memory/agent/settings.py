"""The agent's settings, as data."""

from __future__ import annotations

from dataclasses import dataclass

from .. import inputs
from ..exceptions import InvalidInputError
from .core import CORE_TOKENS
from .recall import RECALL

__all__ = ["AgentSettings"]


@dataclass(frozen=True)
class AgentSettings:
    """Behaviour of an :class:`AgentMemory`.

    :param system_prompt: the system message; ``None`` uses the engine's.
    :param recall_k: memories recalled per turn at most.
    :param recall_min_score: a memory less similar than this to the message is not recalled.
    :param importance_weight: how much a memory's importance adds to its similarity when ranking.
    :param session_weight: how much being from this session adds to a memory's similarity.
    :param window_tokens: budget of the working window (turns and the memories recalled into them).
    :param window_keep: share of the budget the window is cut back to when it passes it (several
        turns leave at once, so the window shifts rarely).
    :param max_new_tokens: default reply length bound.
    :param reuse: ``"auto"`` (default: exact reuse of the system prompt and the session's earlier
        turns; a recalled memory whose fragment is long enough for shifting to pay is shifted in
        and repaired by the blend, a shorter one is recomputed with the question; on a model whose
        ``EngineSettings.auto_shifts`` is false, the shipped ones, every one is recomputed),
        ``"prefix"`` (recalled memories always recomputed with the question, so answers are full
        recompute's), ``"blend"`` (every recalled memory's fragment shifted in) or ``"none"``
        (the baseline). Measured in ``docs/benchmarks/long_memory.md`` and
        ``docs/benchmarks/writeback.md``.
    :param recompute_ratio: the blend's share of recalled fragment tokens recomputed (``None``: the
        engine's default; 0 is shift only, which loses copied names and numbers).
    :param correction_min_score: a correction supersedes a memory only when at least this similar
        to it (and about the same subject, holding the value it negates).
    :param busy_timeout_s: how long a call waits for another call on the same session to finish.
    :param write_back: ``False`` answers without remembering: no turn is archived or corrected
        (questions asked of a memory, as a benchmark asks them); the window still works.
    :param resume: keep the session in the store: its working window (saved after every turn)
        and its K/V (the engine's chunks), so that an ``AgentMemory`` of the same user and session
        in another process, or on another worker, continues where it stopped without prefilling
        the conversation again. ``False`` keeps both in this process only.
    :param core_tokens: the token budget of the user's core block (:mod:`.core`: the memories
        pinned with :meth:`AgentMemory.pin`, laid after the system prompt in every session);
        pinned memories past it are recalled by search.
    :param core_facts: facts the user states about themselves join the core block on their own
        (from the next session on; :func:`~kvshift_memory.agent.asks.joins_core`). ``False``
        keeps the block to what is pinned.
    """

    system_prompt: str | None = None
    recall_k: int = RECALL.k
    recall_min_score: float = RECALL.min_score
    importance_weight: float = RECALL.importance_weight
    session_weight: float = RECALL.session_weight
    window_tokens: int = 2048
    window_keep: float = 0.6
    max_new_tokens: int = 96
    reuse: str = "auto"
    recompute_ratio: float | None = None
    correction_min_score: float = 0.5
    busy_timeout_s: float = 300.0
    write_back: bool = True
    resume: bool = True
    core_tokens: int = CORE_TOKENS
    core_facts: bool = True

    def __post_init__(self) -> None:
        if self.system_prompt is not None:
            inputs.check_text(self.system_prompt, "system_prompt")
        inputs.check_positive_int(self.recall_k, "recall_k")
        inputs.check_positive_int(self.window_tokens, "window_tokens")
        inputs.check_positive_int(self.core_tokens, "core_tokens")
        inputs.check_positive_int(self.max_new_tokens, "max_new_tokens")
        inputs.check_ratio(self.window_keep, "window_keep")
        inputs.check_ratio(self.importance_weight, "importance_weight")
        inputs.check_ratio(self.session_weight, "session_weight")
        for name in ("recall_min_score", "correction_min_score"):
            inputs.check_number(getattr(self, name), name, -1, 1)
        for name in ("write_back", "resume", "core_facts"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.reuse not in inputs.REUSE_MODES:
            raise InvalidInputError(f"reuse must be one of {inputs.REUSE_MODES}, got {self.reuse!r}")
        if self.recompute_ratio is not None:
            inputs.check_ratio(self.recompute_ratio)
        inputs.check_number(self.busy_timeout_s, "busy_timeout_s", 0, 1e9, unit="seconds")
