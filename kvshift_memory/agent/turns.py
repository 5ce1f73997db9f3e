"""A turn of the agent: a window turn, a prepared turn, and the reply it becomes (whole or streamed)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..store.records import MemoryRecord
from .core import CoreLine
from .writeback import Decision

if TYPE_CHECKING:  # the engine's package brings torch: a type here only
    from ..engine.results import ReuseStats

__all__ = ["STREAM_END", "Reply", "ReplyStream", "StreamFailure", "Turn", "TurnPlan"]


@dataclass
class Turn:
    """One exchange in the working window."""

    user: str
    recalled: tuple[Any, ...]
    tokens: int
    reply: str = ""
    reply_ids: list[int] | None = None
    importance: float = 0.0
    decision: Decision = "window"
    archived: Any = None  # the memory record the user's message became, when archived
    previous: str = ""  # what the message answered: archived with it when it is archived later

    def messages(self) -> list[dict[str, Any]]:
        user: dict[str, Any] = {"role": "user", "content": self.user}
        if self.recalled:
            user["memories"] = list(self.recalled)
        assistant: dict[str, Any] = {"role": "assistant", "content": self.reply}
        if self.reply_ids is not None:
            assistant["token_ids"] = self.reply_ids
        return [user, assistant]


@dataclass
class Reply:
    """The answer to one :meth:`AgentMemory.chat` turn.

    :param message: the user's message this answers.
    :param text: the assistant's answer.
    :param stats: the engine's :class:`~kvshift_memory.ReuseStats` for the turn (TTFT, reused,
        recomputed and prefilled tokens, fragments hit and missed).
    :param recalled: the memories recalled into this turn, most relevant last.
    :param core: the lines of the user's core block this turn's system message showed, in order.
    :param decision: the write-back decision, a :data:`~kvshift_memory.agent.writeback.Decision`:
        ``"archive"``, ``"defer"``, ``"window"``, ``"forget"``, ``"forget_ambiguous"`` or
        ``"correction_ambiguous"``.
    :param importance: the write-back classifier's importance of the turn.
    :param archived: the memory the message was archived as (or the correction's new version).
    :param corrected: the memory version this message superseded, when it was a correction.
    :param forgotten: the memory this message asked to forget and that was deleted.
    :param evicted_turns: turns that left the window before this one.
    :param retrieval_s: seconds from the call until the engine started: corrections, the store
        search and assembling the prompt (the engine's ``stats.ttft_s`` counts from there;
        :attr:`ttft_s` is the sum).
    :param finish_reason: ``"stop"``, ``"length"``, or ``"interrupted"`` (a stream closed early).
    """

    message: str
    text: str
    stats: ReuseStats
    recalled: list[MemoryRecord] = field(default_factory=list)
    core: tuple[CoreLine, ...] = ()
    decision: Decision = "window"
    importance: float = 0.0
    archived: MemoryRecord | None = None
    corrected: MemoryRecord | None = None
    forgotten: MemoryRecord | None = None
    evicted_turns: int = 0
    retrieval_s: float = 0.0
    finish_reason: str = "stop"

    @property
    def ttft_s(self) -> float:
        """Seconds from the call to the first token: retrieval plus the engine's TTFT."""
        return self.retrieval_s + self.stats.ttft_s


@dataclass
class TurnPlan:
    """A turn prepared but not committed: nothing in the agent's state has changed yet."""

    message: str
    recalled: list[Any]
    corrected: Any
    correction: Any
    forget: tuple[Decision, Any] | None  # a request to forget: what it did, and the memory deleted
    kept_turns: list[Turn]
    evicted: list[Turn]
    messages: list[dict[str, Any]]
    retrieval_s: float
    ambiguous_correction: bool = False  # worded as a correction, matched no single memory: changes nothing
    core: tuple[CoreLine, ...] = ()  # the core block's lines the system message shows


STREAM_END = object()


@dataclass(frozen=True)
class StreamFailure:
    """What an async stream's worker thread raised, handed to the event loop."""

    error: BaseException


class ReplyStream(Iterator[str]):
    """Text pieces of a streamed turn; :attr:`reply` holds the :class:`Reply` once it has ended.

    The session stays busy until the stream is exhausted or closed (closing commits the turn with
    the text produced so far).

    :param commit: writes the finished turn back (``plan``, the generation's result, the text,
        its stats) and returns its reply; ``release``: frees the session, after a commit or a failure.
    """

    def __init__(
        self,
        plan: TurnPlan,
        steps: Any,
        *,
        commit: Callable[[TurnPlan, Any, str, Any], Reply],
        release: Callable[[], None],
    ) -> None:
        self._plan, self._steps = plan, steps
        self._commit, self._release = commit, release
        self._pieces: list[str] = []
        self.reply: Reply | None = None

    def __iter__(self) -> ReplyStream:
        return self

    def __next__(self) -> str:
        if self.reply is not None:
            raise StopIteration
        try:
            piece = next(self._steps)
        except StopIteration:
            self._end()
            raise
        except BaseException:
            self._release()
            self.reply = None
            raise
        self._pieces.append(piece)
        return piece

    def close(self) -> None:
        """Stop generating and commit the turn with what was said so far."""
        if self.reply is None:
            self._steps.close()
            self._end()

    def _end(self) -> None:
        try:
            self.reply = self._commit(self._plan, self._steps.result, "".join(self._pieces), self._steps.stats)
        finally:
            self._release()

    def __del__(self) -> None:  # an abandoned stream must not leave its session busy forever
        if getattr(self, "reply", 1) is None:
            try:
                self.close()
            except Exception:
                pass
