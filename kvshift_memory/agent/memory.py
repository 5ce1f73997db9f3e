"""AgentMemory: the turn loop over an engine and a store, with a working window that shifts.

One turn (:meth:`AgentMemory.chat`):

1. *corrections*: a message worded as a correction supersedes the closest stored memory;
2. *recall*: the store's two paths (embedding and keywords) search all of the user's sessions;
   memories already visible in the window are left out, this session's are ranked a little higher;
3. *assembly*: ``[system] + [window turns, each user message with the memories recalled for it] +
   [new user message with the newly recalled memories, most relevant last]``. The prompt only ever
   grows at its end, so the engine reuses the previous turn's cache exactly and prefills only the
   new message, its template tokens and the repair of the newly recalled fragments;
4. *window shift*: when the window passes its budget, its oldest turns leave it; the engine
   finds the rest of the window in its cache behind the cut and re-encodes its positions (RoPE
   shift) instead of recomputing it, the system prompt staying as attention sink;
5. *write-back*: every user message that carries information is archived as a memory (with
   ``reuse="blend"``, its fragment encoded now when it is important, else on first recall); a content-free one
   ("ok thanks") stays in the window only; one the rule is unsure of waits in the window and is
   archived when it leaves it (or when the session is closed). "Remember …" always archives,
   "forget …" deletes the closest memory (:meth:`AgentMemory.forget`).

Calls on one ``AgentMemory`` are serialised: a second ``chat`` waits for the first to finish.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .. import inputs
from ..exceptions import InvalidInputError, MemoryNotFoundError, SessionBusyError
from .corrections import is_correction_cue
from .recall import archive, archived_text, forget_closest, last_sentence, recall
from .writeback import Decision, WriteBackModel, explicit_request

__all__ = ["AgentMemory", "AgentSettings", "Reply", "ReplyStream"]

# template tokens a message costs around its content (`<|im_start|>user\n` ... `<|im_end|>\n`)
_MESSAGE_OVERHEAD = 6


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
    :param reuse: ``"prefix"`` (default: exact reuse of the system prompt and the session's earlier
        turns, recalled memories recomputed with the question, so answers are full recompute's),
        ``"blend"`` (recalled memories' stored fragments shifted into place, a share of their tokens
        recomputed: faster on long memories, and it changes some answers) or ``"none"`` (the
        baseline). Chosen by answer retention against ``"none"`` first, then time to first token
        (docs/benchmarks/writeback.md).
    :param recompute_ratio: the blend's share of recalled fragment tokens recomputed (``None``: the
        engine's default; 0 is shift only, which loses copied names and numbers).
    :param correction_min_score: a correction supersedes the closest memory only when at least this
        similar to it.
    :param busy_timeout_s: how long a call waits for another call on the same session to finish.
    :param write_back: ``False`` answers without remembering: no turn is archived or corrected
        (questions asked of a memory, as a benchmark asks them); the window still works.
    """

    system_prompt: str | None = None
    recall_k: int = 4
    recall_min_score: float = 0.3
    importance_weight: float = 0.1
    session_weight: float = 0.05
    window_tokens: int = 2048
    window_keep: float = 0.6
    max_new_tokens: int = 96
    reuse: str = "prefix"
    recompute_ratio: float | None = None
    correction_min_score: float = 0.5
    busy_timeout_s: float = 300.0
    write_back: bool = True

    def __post_init__(self) -> None:
        if self.system_prompt is not None:
            inputs.check_text(self.system_prompt, "system_prompt")
        inputs.check_positive_int(self.recall_k, "recall_k")
        inputs.check_positive_int(self.window_tokens, "window_tokens")
        inputs.check_positive_int(self.max_new_tokens, "max_new_tokens")
        inputs.check_ratio(self.window_keep, "window_keep")
        inputs.check_ratio(self.importance_weight, "importance_weight")
        inputs.check_ratio(self.session_weight, "session_weight")
        for name in ("recall_min_score", "correction_min_score"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= value <= 1.0:
                raise InvalidInputError(f"{name} must be a number in [-1, 1], got {value!r}")
        if self.reuse not in inputs.REUSE_MODES:
            raise InvalidInputError(f"reuse must be one of {inputs.REUSE_MODES}, got {self.reuse!r}")
        if self.recompute_ratio is not None:
            inputs.check_ratio(self.recompute_ratio)
        if (
            isinstance(self.busy_timeout_s, bool)
            or not isinstance(self.busy_timeout_s, (int, float))
            or self.busy_timeout_s < 0
        ):
            raise InvalidInputError(f"busy_timeout_s must be a number >= 0, got {self.busy_timeout_s!r}")


@dataclass
class _Turn:
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
    :param decision: the write-back decision, a :data:`~kvshift_memory.agent.writeback.Decision`:
        ``"archive"``, ``"defer"``, ``"window"``, ``"forget"`` or ``"forget_ambiguous"``.
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
    stats: Any
    recalled: list[Any] = field(default_factory=list)
    decision: Decision = "window"
    importance: float = 0.0
    archived: Any = None
    corrected: Any = None
    forgotten: Any = None
    evicted_turns: int = 0
    retrieval_s: float = 0.0
    finish_reason: str = "stop"

    @property
    def ttft_s(self) -> float:
        """Seconds from the call to the first token: retrieval plus the engine's TTFT."""
        return self.retrieval_s + self.stats.ttft_s


@dataclass
class _Plan:
    """A turn prepared but not committed: nothing in the agent's state has changed yet."""

    message: str
    recalled: list[Any]
    corrected: Any
    correction: Any
    forget: tuple[Decision, Any] | None  # a request to forget: what it did, and the memory deleted
    kept_turns: list[_Turn]
    evicted: list[_Turn]
    messages: list[dict[str, Any]]
    retrieval_s: float


_STREAM_END = object()


@dataclass(frozen=True)
class _StreamFailure:
    error: BaseException


class ReplyStream(Iterator[str]):
    """Text pieces of a streamed turn; :attr:`reply` holds the :class:`Reply` once it has ended.

    The session stays busy until the stream is exhausted or closed (closing commits the turn with
    the text produced so far).
    """

    def __init__(self, memory: AgentMemory, plan: _Plan, steps: Any) -> None:
        self._memory, self._plan, self._steps = memory, plan, steps
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
            self._memory._release()
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
            self.reply = self._memory._commit(self._plan, self._steps.result, "".join(self._pieces), self._steps.stats)
        finally:
            self._memory._release()

    def __del__(self) -> None:  # an abandoned stream must not leave its session busy forever
        if getattr(self, "reply", 1) is None:
            try:
                self.close()
            except Exception:
                pass


class AgentMemory:
    """The memory of one user's session: recall with KV reuse, a working window, write-back.

    :param engine: a :class:`~kvshift_memory.KVShiftEngine`.
    :param store: a :class:`~kvshift_memory.MemoryStore` (shared by all of the user's sessions).
    :param user_id: the tenant: memories never cross it.
    :param session_id: this conversation; recall also reaches the user's other sessions.
    :param settings: :class:`AgentSettings`; keyword arguments override its fields.
    :param writeback: the write-back rule (default: the bundled one, ``WriteBackModel.bundled()``).
    :raises InvalidInputError: bad ids or settings.

    Use it as a context manager (or call :meth:`close`) so that turns still waiting in the window
    to be archived are archived when the session ends.
    """

    def __init__(
        self,
        engine: Any,
        store: Any,
        *,
        user_id: str,
        session_id: str,
        settings: AgentSettings | None = None,
        writeback: WriteBackModel | None = None,
        **overrides: Any,
    ) -> None:
        self.engine = engine
        self.store = store
        self.user_id = inputs.check_identifier(user_id, "user_id")
        self.session_id = inputs.check_identifier(session_id, "session_id")
        try:
            self.settings = replace(settings or AgentSettings(), **overrides)
        except TypeError as exc:
            raise InvalidInputError(f"unknown AgentMemory setting: {exc}") from None
        self.writeback = writeback or WriteBackModel.bundled()
        self._window: list[_Turn] = []
        self._previous = ""  # the last turn's text (a reply, or an observed turn): a write-back feature
        self._lock = threading.Lock()
        self._stream_thread: int | None = None

    # ------------------------------------------------------------------ memories

    def add(self, text: str, *, importance_score: float = 0.5) -> Any:
        """Store ``text`` as a memory of this user and session, and encode its fragment now.

        :returns: the :class:`~kvshift_memory.MemoryRecord`.
        :raises InvalidInputError: empty, over-long or non-text input.
        :raises StoreError: the store refused the write.
        """
        record = self.store.add(
            text, tenant=self.user_id, session_id=self.session_id, importance_score=importance_score
        )
        self._warm([record])
        return record

    def correct(self, text: str, memory_id: str | None = None) -> tuple[Any, Any]:
        """Supersede a memory with ``text``: the given one, or the stored memory closest to ``text``.

        The old version stays in :meth:`history` and is never recalled again.

        :returns: (old version, new version).
        :raises MemoryNotFoundError: no such live memory (or, without ``memory_id``, none close enough).
        :raises VersionConflictError: another writer superseded it first.
        """
        text = inputs.check_text(text, "text")
        if memory_id is None:
            target = self._correction_target(text, require_cue=False)
            if target is None:
                raise MemoryNotFoundError("no stored memory is close enough to that correction")
        else:
            target = self.store.get(memory_id, tenant=self.user_id)
            if target is None:
                raise MemoryNotFoundError(f"no live memory {memory_id!r}")
        self._acquire(stream=False)
        try:
            new = self._supersede(target, text)
        finally:
            self._release()
        self._warm([new])
        return target, new

    def forget(self, text_or_id: str) -> Any:
        """Delete a memory of this user: the one with this id, or the one closest to this text.

        The memory is tombstoned (:meth:`history` shows it deleted), never recalled again, also
        after a restart, and the window turns that showed it leave the window.

        :param text_or_id: a memory id, or what the memory was about ("the door code"; a request
            such as "forget what I said about the door code" works too).
        :returns: the deleted memory's record.
        :raises InvalidInputError: empty, non-text or over-long input.
        :raises MemoryNotFoundError: no such memory, or two memories are equally close to the text
            (nothing is deleted: name it more precisely, or pass its id).
        :raises StoreError: the store could not be searched or written.
        """
        text = inputs.check_text(text_or_id, "text_or_id")
        self._acquire(stream=False)
        try:
            by_id = None
            if text == text.strip() and len(text) <= 256 and text.isprintable():
                by_id = self.store.get(text, tenant=self.user_id)
            if by_id is not None:
                forgotten = by_id if self.store.delete(by_id.id, tenant=self.user_id) else None
            else:
                _, forgotten = forget_closest(self.store, text, user_id=self.user_id)
            if forgotten is None:
                raise MemoryNotFoundError(
                    f"no stored memory is clearly the one meant by {text[:80]!r} (none close enough, or two equally close); nothing was deleted"
                )
            self._window = _forgetting(self._window, forgotten)
            return forgotten
        finally:
            self._release()

    def close(self) -> list[Any]:
        """End the session: the turns still waiting in the window to be archived are archived now.

        The window stays as it is (the agent may go on); calling it again archives nothing twice.

        :returns: the memories archived.
        :raises StoreError: the store could not be written.
        """
        self._acquire(stream=False)
        try:
            archived = [
                self._archive_deferred(turn)
                for turn in self._window
                if turn.decision == "defer" and turn.archived is None
            ]
            return [record for record in archived if record is not None]
        finally:
            self._release()

    def __enter__(self) -> AgentMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def observe(self, text: str) -> Any:
        """Write back a turn the agent did not answer: an imported transcript, another participant.

        The turn is classified like a chat turn (and a correction supersedes like one); it does
        not enter the working window and nothing is generated.

        :returns: the memory it was archived as (or a correction's new version), else ``None``.
        :raises InvalidInputError: empty, non-text or over-long text.
        :raises StoreError: the store could not be searched or written.
        """
        text = inputs.check_text(text, "text")
        self._acquire(stream=False)
        try:
            # a transcript's "forget about it" is someone's words, not a request to this memory
            _, correction = self._apply_correction(text)
            _, _, archived = self._write_back(text, correction, None, window=False)
            self._previous = text
            return archived
        finally:
            self._release()

    def history(self, memory_id: str) -> list[Any]:
        """Every version of a memory of this user, oldest first."""
        return self.store.history(memory_id, tenant=self.user_id)

    @property
    def window(self) -> list[tuple[str, str]]:
        """The working window: (user message, reply) of each turn in it, oldest first."""
        return [(turn.user, turn.reply) for turn in self._window]

    # ------------------------------------------------------------------ the turn

    def chat(
        self,
        message: str,
        *,
        stream: bool = False,
        max_new_tokens: int | None = None,
        reuse: str | None = None,
    ) -> Reply | ReplyStream:
        """Answer ``message`` with recalled memories and the working window, then write back.

        :param stream: return a :class:`ReplyStream` of text pieces.
        :param reuse: override ``settings.reuse`` for this turn.
        :raises InvalidInputError: empty, non-text or over-long message, bad parameters.
        :raises ContextOverflowError: the message does not fit the model even with an empty window.
        :raises SessionBusyError: another call on this session did not finish in
            ``settings.busy_timeout_s``, or this thread still holds an open stream of it.
        :raises StoreError: the store could not be searched or written.
        """
        message = inputs.check_text(message, "message")
        max_new_tokens = inputs.check_positive_int(max_new_tokens or self.settings.max_new_tokens, "max_new_tokens")
        reuse = inputs.check_reuse(reuse) or self.settings.reuse
        self._acquire(stream)
        try:
            plan = self._plan(message, max_new_tokens)
            steps = self.engine.generate(
                plan.messages,
                reuse=reuse,
                recompute_ratio=self.settings.recompute_ratio,
                max_new_tokens=max_new_tokens,
                stream=True,
                namespace=self.user_id,
            )
        except BaseException:
            self._release()
            raise
        reply_stream = ReplyStream(self, plan, steps)
        if stream:
            return reply_stream
        for _ in reply_stream:
            pass
        return reply_stream.reply

    async def achat(self, message: str, *, max_new_tokens: int | None = None, reuse: str | None = None) -> Reply:
        """:meth:`chat`, run in a worker thread so the event loop keeps running."""
        return await asyncio.to_thread(self.chat, message, max_new_tokens=max_new_tokens, reuse=reuse)

    async def astream(
        self, message: str, *, max_new_tokens: int | None = None, reuse: str | None = None
    ) -> AsyncIterator[str]:
        """:meth:`chat` with ``stream=True``, as an async iterator of text pieces.

        A worker thread drives the stream and hands pieces to the event loop, which never waits
        on the model. Leaving the iteration early (``break``, cancellation, ``aclose()``) ends the
        turn at the next piece; an iterator that is dropped without being closed finishes its
        reply in the worker. Either way the session is released without waiting for
        ``busy_timeout_s``.
        """
        reply_stream = await asyncio.to_thread(
            self.chat, message, stream=True, max_new_tokens=max_new_tokens, reuse=reuse
        )
        self._stream_thread = None  # driven by the worker below, not by the thread that opened it
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()
        stop = threading.Event()

        def deliver(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody reads any more
                stop.set()

        def drive() -> None:
            # next() and close() of one stream stay in this thread: a generator cannot be closed
            # from another thread while it is running
            try:
                for piece in reply_stream:
                    if stop.is_set():
                        reply_stream.close()
                        break
                    deliver(piece)
            except BaseException as exc:  # the stream released the session; the reader re-raises it
                deliver(_StreamFailure(exc))
                return
            deliver(_STREAM_END)

        worker = threading.Thread(target=drive, name=f"kvshift-stream-{self.session_id}", daemon=True)
        worker.start()
        try:
            while True:
                item = await pieces.get()
                if item is _STREAM_END:
                    break
                if isinstance(item, _StreamFailure):
                    raise item.error
                yield item
        finally:
            stop.set()
            await asyncio.to_thread(worker.join)

    # ------------------------------------------------------------------ internals

    def _acquire(self, stream: bool) -> None:
        if self._stream_thread == threading.get_ident():
            raise SessionBusyError(
                f"session {self.session_id!r} has a streamed reply still open in this thread; read it to the end or close it first"
            )
        if not self._lock.acquire(timeout=self.settings.busy_timeout_s):
            raise SessionBusyError(
                f"session {self.session_id!r} is busy with another turn (waited {self.settings.busy_timeout_s} s)"
            )
        self._stream_thread = threading.get_ident() if stream else None

    def _release(self) -> None:
        self._stream_thread = None
        if self._lock.locked():
            self._lock.release()

    def _system_messages(self) -> list[dict[str, Any]]:
        if self.settings.system_prompt is None:
            return []
        return [{"role": "system", "content": self.settings.system_prompt}]

    def _warm(self, records: Sequence[Any]) -> None:
        # recalled memories go into user messages, never where a lead fragment is read
        self.engine.warm(list(records), self._system_messages() or None, lead_fragments=False, namespace=self.user_id)

    def _visible(self, turns: Sequence[_Turn]) -> set[tuple[str, int]]:
        """(id, version) of the memories whose text the window already shows."""
        seen = {(r.id, r.version) for turn in turns for r in turn.recalled}
        seen.update((turn.archived.id, turn.archived.version) for turn in turns if turn.archived is not None)
        return seen

    def _write_back(
        self, text: str, correction: Any, forget: tuple[Decision, Any] | None, *, window: bool
    ) -> tuple[float, Decision, Any]:
        """Classify a finished turn and archive it when it carries information.

        A correction was already stored as the new version of the memory it corrects, and a
        request to forget already deleted what it named (``forget``): neither is archived again.
        ``window``: a deferred turn waits in the window (else it is archived now).
        """
        if forget is not None:
            return 0.0, forget[0], forget[1]
        if correction is not None:
            if self.settings.reuse == "blend":
                self._warm([correction])
            return self.writeback.importance(text, self._previous), "archive", correction
        if not self.settings.write_back:
            return self.writeback.importance(text, self._previous), "window", None
        importance, decision, archived = archive(
            self.writeback,
            self.store,
            text,
            self._previous,
            user_id=self.user_id,
            session_id=self.session_id,
            window=window,
            requests=window,  # only a chat turn (the one with a window) is the user's own request
        )
        # fragments are read only by the blend; a less important memory's is encoded when first recalled
        if archived is not None and self.settings.reuse == "blend" and importance >= self.writeback.eager_threshold:
            self._warm([archived])
        return importance, decision, archived

    def _archive_deferred(self, turn: _Turn) -> Any:
        """Archive a turn that waited in the window (it is leaving it, or the session is closing)."""
        turn.archived = self.store.add(
            archived_text(turn.user, turn.previous),
            tenant=self.user_id,
            session_id=self.session_id,
            importance_score=turn.importance,
        )
        return turn.archived

    def _apply_forget(self, text: str) -> tuple[Decision, Any] | None:
        """When ``text`` asks to forget something, delete the memory it names and take it out of the window.

        :returns: (``"forget"`` or ``"forget_ambiguous"``, the memory deleted or ``None``), or
            ``None`` when ``text`` is no such request.
        """
        if not self.settings.write_back or explicit_request(text) != "forget":
            return None
        decision, forgotten = forget_closest(self.store, text, user_id=self.user_id)
        if forgotten is not None:
            self._window = _forgetting(self._window, forgotten)
        return decision, forgotten

    def _apply_correction(self, text: str) -> tuple[Any, Any]:
        """When ``text`` corrects a stored memory, supersede it and take it out of the window.

        :returns: (the version corrected, its new version), or ``(None, None)``.
        """
        corrected = self._correction_target(text)
        if corrected is None:
            return None, None
        return corrected, self._supersede(corrected, text)

    def _supersede(self, target: Any, text: str) -> Any:
        """Store ``text`` as the new version of ``target``; no window turn shows the old one any more."""
        # the version the correction was aimed at: a text changed meanwhile is not overwritten
        new = self.store.supersede(target.id, text, tenant=self.user_id, expected_version=target.version)
        self._window = [_without(turn, target) for turn in self._window]
        return new

    def _correction_target(self, message: str, require_cue: bool = True) -> Any:
        if require_cue and not (self.settings.write_back and is_correction_cue(message)):
            return None
        hits = self.store.search(message, tenant=self.user_id, k=1)
        if hits and hits[0].score >= self.settings.correction_min_score:
            return hits[0]
        return None

    def _recall(self, message: str, exclude: set[tuple[str, int]]) -> list[Any]:
        settings = self.settings
        return recall(
            self.store,
            message,
            user_id=self.user_id,
            session_id=self.session_id,
            exclude=exclude,
            k=settings.recall_k,
            min_score=settings.recall_min_score,
            importance_weight=settings.importance_weight,
            session_weight=settings.session_weight,
        )

    def _tokens(self, text: str, recalled: Sequence[Any] = ()) -> int:
        def count(piece: str) -> int:
            return self.engine.count_tokens(piece, namespace=self.user_id)

        return count(text) + sum(count(r.text) + 1 for r in recalled) + (2 + _MESSAGE_OVERHEAD if recalled else 0)

    def _plan(self, message: str, max_new_tokens: int) -> _Plan:
        started = time.perf_counter()
        forget = self._apply_forget(message)
        corrected, correction = (None, None) if forget else self._apply_correction(message)
        turns = list(self._window)
        exclude = self._visible(turns)
        if correction is not None:
            exclude.add((correction.id, correction.version))  # its text is the message itself
        recalled = self._recall(message, exclude)

        needed = self._tokens(message, recalled) + _MESSAGE_OVERHEAD + max_new_tokens
        evicted: list[_Turn] = []
        budget = self.settings.window_tokens
        if sum(t.tokens for t in turns) + needed > budget:
            target = int(budget * self.settings.window_keep)
            while turns and sum(t.tokens for t in turns) + needed > target:
                evicted.append(turns.pop(0))
            if evicted:  # what shifted out may be recalled again, now that the window no longer shows it
                recalled = self._recall(
                    message, self._visible(turns) | ({(correction.id, correction.version)} if correction else set())
                )
        messages = self._system_messages()
        for turn in turns:
            messages.extend(turn.messages())
        user: dict[str, Any] = {"role": "user", "content": message}
        if recalled:
            user["memories"] = recalled
        messages.append(user)
        retrieval_s = time.perf_counter() - started
        return _Plan(message, recalled, corrected, correction, forget, turns, evicted, messages, retrieval_s)

    def _commit(self, plan: _Plan, result: Any, text: str, stats: Any) -> Reply:
        """Write the finished turn back: window, archive, stats. Runs once per turn, under the lock."""
        # what leaves the window is archived, not dropped, unless it carried nothing
        for evicted in plan.evicted:
            if evicted.decision == "defer" and evicted.archived is None:
                self._archive_deferred(evicted)
        previous = self._previous
        importance, decision, archived = self._write_back(plan.message, plan.correction, plan.forget, window=True)
        turn = _Turn(
            user=plan.message,
            recalled=tuple(plan.recalled),
            tokens=self._tokens(plan.message, plan.recalled) + _MESSAGE_OVERHEAD,
            reply=result.text if result is not None else text,
            reply_ids=list(result.token_ids) if result is not None else None,
            importance=importance,
            decision=decision,
            archived=archived if decision not in ("forget", "forget_ambiguous") else None,
            previous=previous,
        )
        turn.tokens += self.engine.count_tokens(turn.reply, namespace=self.user_id) + _MESSAGE_OVERHEAD
        self._window = plan.kept_turns + [turn]
        self._previous = last_sentence(turn.reply)
        return Reply(
            message=plan.message,
            text=turn.reply,
            stats=stats,
            recalled=list(plan.recalled),
            decision=decision,
            importance=importance,
            archived=turn.archived,
            corrected=plan.corrected,
            forgotten=archived if decision == "forget" else None,
            evicted_turns=len(plan.evicted),
            retrieval_s=plan.retrieval_s,
            finish_reason=result.finish_reason if result is not None else "interrupted",
        )


def _without(turn: _Turn, record: Any) -> _Turn:
    """``turn`` without ``record`` (any version of it) among its recalled memories."""
    kept = tuple(r for r in turn.recalled if r.id != record.id)
    return turn if len(kept) == len(turn.recalled) else replace(turn, recalled=kept)


def _forgetting(turns: Sequence[_Turn], record: Any) -> list[_Turn]:
    """The window without ``record``: neither the turn that stated it nor a memory recalled into a turn."""
    return [_without(turn, record) for turn in turns if turn.archived is None or turn.archived.id != record.id]
