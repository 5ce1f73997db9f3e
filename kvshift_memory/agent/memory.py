"""AgentMemory: the turn loop over an engine and a store, with a working window that shifts.

One turn (:meth:`AgentMemory.chat`):

1. *corrections*: a message worded as a correction supersedes the one stored memory about the
   same subject that holds the value it negates; when no single memory is clearly that one, it
   changes nothing and is stored as a statement (``"correction_ambiguous"``);
2. *recall*: the store's two paths (embedding and keywords) search all of the user's sessions;
   memories already visible in the window are left out, this session's are ranked a little higher;
3. *assembly*: ``[system prompt + the user's core block (:mod:`.core`)] + [window turns, each
   user message with the memories recalled for it] +
   [new user message with the newly recalled memories, most relevant last]``. The prompt only ever
   grows at its end, so the engine reuses the previous turn's cache exactly and prefills only the
   new message, its template tokens and the repair of the newly recalled fragments;
4. *window shift*: when the window passes its budget, its oldest turns leave it; the engine
   finds the rest of the window in its cache behind the cut and re-encodes its positions (RoPE
   shift) instead of recomputing it, the system prompt staying as attention sink;
5. *write-back*: every user message that carries information is archived as a memory (its
   fragment encoded now when it is important and long enough to be shifted in, else after the
   answer that first recalls it); a content-free one
   ("ok thanks") stays in the window only; one the rule is unsure of waits in the window and is
   archived when it leaves it (or when the session is closed). "Remember …" always archives,
   "forget …" deletes the closest memory (:meth:`AgentMemory.forget`). What a message asks of
   the memory (remember, forget, correct, nothing) is decided in :mod:`.asks`.

With ``settings.resume`` (the default) the session lives in the store, not in the process: the
window is saved after every change and read back by the next ``AgentMemory`` of the same user and
session (a restart, another worker), and the engine keeps the conversation's K/V in the store's
chunks, so the next process restores it instead of prefilling it (:mod:`.sessions`).

Calls on one ``AgentMemory`` are serialised: a second ``chat`` waits for the first to finish.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, Literal, overload

from .. import inputs
from ..exceptions import InvalidInputError, MemoryNotFoundError, SessionBusyError
from ..protocols import ChunkStore, Engine, Store
from ..store.records import MemoryRecord
from .asks import Asked, archive, carry_out, forget_closest, forget_memory, store_once, supersede
from .core import CoreLine, change_block, placed_lines, read_block, store_block, system_messages
from .recall import archived_text, last_sentence, recall, similarity
from .sessions import decode_window, encode_window
from .settings import AgentSettings
from .turns import STREAM_END, Reply, ReplyStream, StreamFailure, Turn, TurnPlan
from .writeback import Decision, WriteBackModel

__all__ = ["AgentMemory", "AgentSettings", "Reply", "ReplyStream"]

# template tokens a message costs around its content (`<|im_start|>user\n` ... `<|im_end|>\n`)
_MESSAGE_OVERHEAD = 6
# saves of a window another process changed meanwhile: each applies this one's change to theirs
_SAVE_ATTEMPTS = 5


class AgentMemory:
    """The memory of one user's session: recall with KV reuse, a working window, write-back.

    :param engine: a :class:`~kvshift_memory.KVShiftEngine`.
    :param store: a :class:`~kvshift_memory.MemoryStore` (shared by all of the user's sessions).
    :param user_id: the tenant: memories never cross it.
    :param session_id: this conversation; recall also reaches the user's other sessions.
    :param settings: :class:`AgentSettings`; keyword arguments override its fields.
    :param writeback: the write-back rule (default: the bundled one, ``WriteBackModel.bundled()``).
    :raises InvalidInputError: bad ids or settings.
    :raises StoreError: with ``settings.resume``, the saved session could not be read.

    Use it as a context manager (or call :meth:`close`) so that turns still waiting in the window
    to be archived are archived when the session ends.
    """

    def __init__(
        self,
        engine: Engine,
        store: Store,
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
        self._window: list[Turn] = []
        self._previous = ""  # the last turn's text (a reply, or an observed turn): a write-back feature
        self._lock = threading.Lock()
        self._stream_thread: int | None = None
        self._saved: bytes | None = None  # the session's state in the store, as last read or written
        self._shown_core: tuple[CoreLine, ...] = ()  # the core block's lines the last turn's prompt showed
        if self.settings.resume:
            self._refresh()

    # ------------------------------------------------------------------ memories

    def add(self, text: str, *, importance_score: float = 0.5) -> MemoryRecord:
        """Store ``text`` as a memory of this user and session, and encode its fragment now when a
        recall would shift it in (under ``"auto"``, a memory long enough for that to pay).

        :returns: the :class:`~kvshift_memory.MemoryRecord`.
        :raises InvalidInputError: empty, over-long or non-text input.
        :raises StoreError: the store refused the write.
        """
        text = inputs.check_text(text, "text")
        importance_score = inputs.check_ratio(importance_score, "importance_score")
        record = store_once(
            self.store, text, user_id=self.user_id, session_id=self.session_id, importance_score=importance_score
        )
        if self._shifts(record):
            self._warm([record])
        return record

    def add_document(self, text: str, *, source: str | None = None, max_tokens: int = 200) -> list[MemoryRecord]:
        """Store a long text (a brief, notes, a past conversation) as memories of this user and
        session, cut at ``max_tokens`` of the model's tokens (:meth:`MemoryStore.add_document`),
        and encode the fragments of the parts a recall would shift in, once, now.

        :param source: what to call the document (a file name, a URL).
        :returns: the parts' :class:`~kvshift_memory.MemoryRecord` objects, in document order.
        :raises InvalidInputError: empty, over-long or non-text input, a bad source or ``max_tokens``.
        :raises StoreError: the store refused a write (no part is kept).
        """
        parts = self.store.add_document(
            text,
            tenant=self.user_id,
            source=source,
            session_id=self.session_id,
            max_tokens=max_tokens,
            count_tokens=lambda part: self.engine.count_tokens(part, tenant=self.user_id),
        )
        for part in parts:  # one at a time: a long document would not fit one prompt
            if self._shifts(part):
                self._warm([part])
        return parts

    def correct(self, text: str, memory_id: str | None = None) -> tuple[MemoryRecord, MemoryRecord]:
        """Supersede a memory with ``text``: the given one, or the stored memory closest to ``text``.

        The old version stays in :meth:`history` and is never recalled again.

        :returns: (old version, new version).
        :raises MemoryNotFoundError: no such live memory (or, without ``memory_id``, none close enough).
        :raises VersionConflictError: another writer superseded it first.
        """
        text = inputs.check_text(text, "text")
        if memory_id is None:
            target = self._closest(text)
            if target is None:
                raise MemoryNotFoundError("no stored memory is close enough to that correction")
        else:
            target = self.store.get(memory_id, tenant=self.user_id)
            if target is None:
                raise MemoryNotFoundError(f"no live memory {memory_id!r}")
        self._acquire(stream=False)
        try:
            # no turn shows this new version: a core line of it is placed at once
            new = supersede(self.store, target, text, user_id=self.user_id)
            self._window = [_without(turn, target) for turn in self._window]
            self._persist(lambda theirs: [_without(turn, target) for turn in theirs])
        finally:
            self._release()
        self._warm([new])
        return target, new

    def pin(self, memory_id: str) -> tuple[CoreLine, ...]:
        """Put a memory of this user in the core block (:mod:`.core`): at its end, so every
        session after this one starts with it and reuses the K/V of all before it.

        :returns: the block's lines.
        :raises MemoryNotFoundError: no live memory ``memory_id`` of this user.
        :raises StoreError: the store failed.
        """
        record = self.store.get(inputs.check_identifier(memory_id, "memory_id"), tenant=self.user_id)
        if record is None:
            raise MemoryNotFoundError(f"no live memory {memory_id!r}")
        return change_block(self.store, self.user_id, lambda b: b.pinned(record.id, record.version, record.text)).lines

    def unpin(self, memory_id: str) -> tuple[CoreLine, ...]:
        """Take a memory out of the core block (it stays a memory, recalled by search).

        :returns: the block's lines.
        :raises StoreError: the store failed.
        """
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        return change_block(self.store, self.user_id, lambda block: block.without(memory_id)).lines

    def core(self) -> tuple[CoreLine, ...]:
        """The core block's lines, in order (superseded ones until the block is compacted).

        :raises StoreError: the store failed.
        """
        return read_block(self.store, self.user_id).lines

    def forget(self, text_or_id: str) -> MemoryRecord:
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
                forgotten = by_id if forget_memory(self.store, by_id, user_id=self.user_id) else None
            else:
                _, forgotten = forget_closest(self.store, text, user_id=self.user_id)
            if forgotten is None:
                raise MemoryNotFoundError(
                    f"no stored memory is clearly the one meant by {text[:80]!r} "
                    "(none close enough, or two equally close); nothing was deleted"
                )
            self._window = _forgetting(self._window, forgotten)
            self._persist(lambda theirs: _forgetting(theirs, forgotten))
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
            if archived:
                self._persist(lambda theirs: theirs)
            self._store_next_block()
            return [record for record in archived if record is not None]
        finally:
            self._release()

    def __enter__(self) -> AgentMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def observe(self, text: str) -> MemoryRecord | None:
        """Write back a turn the agent did not answer: an imported transcript, another participant.

        The turn is classified like a chat turn; it does not enter the working window and nothing
        is generated. Another participant's words never change a memory: a turn worded as a
        correction or a request to forget is stored as a statement, and changes nothing.

        :returns: the memory it was archived as, else ``None``.
        :raises InvalidInputError: empty, non-text or over-long text.
        :raises StoreError: the store could not be searched or written.
        """
        text = inputs.check_text(text, "text")
        self._acquire(stream=False)
        try:
            # a transcript's "forget about it" or "actually it's not 4321" is someone's words, not the user's
            _, _, archived = self._write_back(text, None, None, window=False)
            self._previous = text
            return archived
        finally:
            self._release()

    def history(self, memory_id: str) -> list[MemoryRecord]:
        """Every version of a memory of this user, oldest first."""
        return self.store.history(memory_id, tenant=self.user_id)

    def memories(self, *, session_only: bool = False, limit: int = 100, offset: int = 0) -> list[MemoryRecord]:
        """This user's live memories, newest first (:meth:`MemoryStore.list`); only this
        session's with ``session_only``.

        :raises InvalidInputError: a bad limit or offset; :class:`StoreError`: the store failed.
        """
        session = self.session_id if session_only else None
        return self.store.list(self.user_id, session_id=session, limit=limit, offset=offset)

    @property
    def window(self) -> list[tuple[str, str]]:
        """The working window: (user message, reply) of each turn in it, oldest first."""
        return [(turn.user, turn.reply) for turn in self._window]

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The turns of the working window, oldest first, with the memories recalled for each and
        the messages each adds to the prompt (:meth:`Turn.messages`). Copies: changing one
        leaves the agent's window as it was."""
        return tuple(
            replace(turn, reply_ids=None if turn.reply_ids is None else list(turn.reply_ids)) for turn in self._window
        )

    # ------------------------------------------------------------------ the turn

    @overload
    def chat(
        self,
        message: str,
        *,
        stream: Literal[False] = False,
        max_new_tokens: int | None = None,
        reuse: str | None = None,
    ) -> Reply: ...

    @overload
    def chat(
        self, message: str, *, stream: Literal[True], max_new_tokens: int | None = None, reuse: str | None = None
    ) -> ReplyStream: ...

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
                tenant=self.user_id,
                kv_store=self.store if self.settings.resume and isinstance(self.store, ChunkStore) else None,
            )
        except BaseException:
            self._release()
            raise
        reply_stream = ReplyStream(plan, steps, commit=self._commit, release=self._release)
        if stream:
            return reply_stream
        for _ in reply_stream:
            pass
        assert reply_stream.reply is not None  # an exhausted stream has committed its reply
        return reply_stream.reply

    async def achat(self, message: str, *, max_new_tokens: int | None = None, reuse: str | None = None) -> Reply:
        """:meth:`chat`, run in a worker thread so the event loop keeps running."""
        return await asyncio.to_thread(lambda: self.chat(message, max_new_tokens=max_new_tokens, reuse=reuse))

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
            lambda: self.chat(message, stream=True, max_new_tokens=max_new_tokens, reuse=reuse)
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
                deliver(StreamFailure(exc))
                return
            deliver(STREAM_END)

        worker = threading.Thread(target=drive, name=f"kvshift-stream-{self.session_id}", daemon=True)
        worker.start()
        try:
            while True:
                item = await pieces.get()
                if item is STREAM_END:
                    break
                if isinstance(item, StreamFailure):
                    raise item.error
                yield item
        finally:
            stop.set()
            await asyncio.to_thread(worker.join)

    # ------------------------------------------------------------------ internals

    def _acquire(self, stream: bool) -> None:
        if self._stream_thread == threading.get_ident():
            raise SessionBusyError(
                f"session {self.session_id!r} has a streamed reply still open in this thread; "
                "read it to the end or close it first"
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

    def _refresh(self) -> None:
        """Take the window from the store when another process saved this session since."""
        raw = self.store.load_session(self.session_id, tenant=self.user_id)
        if raw != self._saved:
            self._window, self._previous = ([], "") if raw is None else decode_window(raw, self.store, self.user_id)
            self._saved = raw

    def _persist(self, change: Callable[[list[Turn]], list[Turn]]) -> None:
        """Save the window; when another process saved this session since it was read, ``change``
        (what this call did to the window) is applied to that window instead, and saved.

        :raises SessionBusyError: other processes kept saving first.
        """
        if not self.settings.resume:
            return
        for _ in range(_SAVE_ATTEMPTS):
            state = encode_window(self._window, self._previous)
            if self.store.save_session(self.session_id, state, tenant=self.user_id, expected=self._saved):
                self._saved = state
                return
            raw = self.store.load_session(self.session_id, tenant=self.user_id)
            theirs = [] if raw is None else decode_window(raw, self.store, self.user_id)[0]
            self._window, self._saved = change(theirs), raw
        raise SessionBusyError(
            f"session {self.session_id!r} kept changing in other processes; its window was not saved"
        )

    def _system_messages(self, placed: tuple[CoreLine, ...] | None = None) -> list[dict[str, Any]]:
        """The system message: the system prompt, then the core block's ``placed`` lines (read
        from the store when not given)."""
        placed = self._core_lines() if placed is None else placed
        return system_messages(self.settings.system_prompt, placed, self.engine.settings.system_prompt)

    def _store_next_block(self) -> None:
        """When the block changed since this session's last prompt, store the K/V of the one the
        next session starts with, so that session (in any process) reads it."""
        if not self.settings.resume:
            return
        following = self._core_lines(this_session=False)
        if following and following != self._shown_core:
            store_block(self.engine, self.store, self.user_id, self._system_messages(following))

    def _core_lines(self, *, this_session: bool = True) -> tuple[CoreLine, ...]:
        """The core block's lines that fit its budget: what this session's system message shows
        (``this_session``), or the next session's."""
        return placed_lines(
            self.store,
            self.user_id,
            session_id=self.session_id if this_session else None,
            count_tokens=lambda text: self.engine.count_tokens(text, tenant=self.user_id),
            budget_tokens=self.settings.core_tokens,
        )

    def _shifts(self, record: Any) -> bool:
        """Whether a recall would shift ``record``'s fragment in (so it is worth encoding now):
        always under ``"blend"``; under ``"auto"`` when the model shifts memories in under it
        (``EngineSettings.auto_shifts``) and the memory is long enough for shifting to pay."""
        if self.settings.reuse == "blend":
            return True
        engine_settings = self.engine.settings
        return (
            self.settings.reuse == "auto"
            and bool(engine_settings.auto_shifts)
            and self.engine.count_tokens(record.text, tenant=self.user_id) >= engine_settings.min_recompute_tokens
        )

    def _warm(self, records: Sequence[Any]) -> None:
        # recalled memories go into user messages, never where a lead fragment is read
        self.engine.warm(list(records), self._system_messages() or None, lead_fragments=False, tenant=self.user_id)

    def _visible(self, turns: Sequence[Turn]) -> set[tuple[str, int]]:
        """(id, version) of the memories whose text the window already shows."""
        seen = {(r.id, r.version) for turn in turns for r in turn.recalled}
        seen.update((turn.archived.id, turn.archived.version) for turn in turns if turn.archived is not None)
        return seen

    def _write_back(
        self,
        text: str,
        correction: Any,
        forget: tuple[Decision, Any] | None,
        *,
        window: bool,
        ambiguous_correction: bool = False,
    ) -> tuple[float, Decision, Any]:
        """Classify a finished turn and archive it when it carries information.

        A correction was already stored as the new version of the memory it corrects, and a
        request to forget already deleted what it named (``forget``): neither is archived again.
        A correction that matched no single memory (``ambiguous_correction``) is stored as a
        statement of its own. ``window``: a deferred turn waits in the window (else it is archived now).
        """
        if forget is not None:
            return 0.0, forget[0], forget[1]
        if ambiguous_correction and self.settings.write_back:
            importance = self.writeback.importance(text, self._previous)
            record = store_once(
                self.store, text, user_id=self.user_id, session_id=self.session_id, importance_score=importance
            )
            return importance, "correction_ambiguous", record
        if correction is not None:
            if self._shifts(correction):
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
            core_facts=self.settings.core_facts,
        )
        # a less important memory's fragment is encoded after the answer that first recalls it
        if archived is not None and importance >= self.writeback.eager_threshold and self._shifts(archived):
            self._warm([archived])
        return importance, decision, archived

    def _archive_deferred(self, turn: Turn) -> Any:
        """Archive a turn that waited in the window (it is leaving it, or the session is closing)."""
        turn.archived = self.store.add(
            archived_text(turn.user, turn.previous),
            tenant=self.user_id,
            session_id=self.session_id,
            importance_score=turn.importance,
        )
        return turn.archived

    def _closest(self, message: str) -> Any:
        """The stored memory closest to ``message``, when close enough (an explicit :meth:`correct`)."""
        hits = self.store.search(message, tenant=self.user_id, k=1)
        if hits and similarity(hits[0]) >= self.settings.correction_min_score:
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
            return self.engine.count_tokens(piece, tenant=self.user_id)

        return count(text) + sum(count(r.text) + 1 for r in recalled) + (2 + _MESSAGE_OVERHEAD if recalled else 0)

    def _plan(self, message: str, max_new_tokens: int) -> TurnPlan:
        started = time.perf_counter()
        if self.settings.resume:
            self._refresh()  # another worker may have answered this session's last turn
        asked = (
            carry_out(
                self.store,
                message,
                user_id=self.user_id,
                session_id=self.session_id,
                min_score=self.settings.correction_min_score,
            )
            if self.settings.write_back
            else Asked()
        )
        forget, corrected, correction = asked.forget, asked.corrected, asked.correction
        if forget is not None and forget[1] is not None:
            self._window = _forgetting(self._window, forget[1])
        if corrected is not None:  # no window turn shows the old version any more
            self._window = [_without(turn, corrected) for turn in self._window]
        turns = list(self._window)
        core = self._shown_core = self._core_lines()
        # a memory the block shows is still recalled next to a question about it: the shipped
        # models answered from the block alone far less often (docs/benchmarks/core_memory.md)
        exclude = self._visible(turns)
        if correction is not None:
            exclude.add((correction.id, correction.version))  # its text is the message itself
        recalled = self._recall(message, exclude)

        needed = self._tokens(message, recalled) + _MESSAGE_OVERHEAD + max_new_tokens
        evicted: list[Turn] = []
        budget = self.settings.window_tokens
        if sum(t.tokens for t in turns) + needed > budget:
            target = int(budget * self.settings.window_keep)
            while turns and sum(t.tokens for t in turns) + needed > target:
                evicted.append(turns.pop(0))
            if evicted:  # what shifted out may be recalled again, now that the window no longer shows it
                shown = self._visible(turns)
                if correction is not None:
                    shown.add((correction.id, correction.version))
                recalled = self._recall(message, shown)
        messages = self._system_messages(core)
        recalled = self._fitting(message, recalled, turns, max_new_tokens, messages)
        for turn in turns:
            messages.extend(turn.messages())
        user: dict[str, Any] = {"role": "user", "content": message}
        if recalled:
            user["memories"] = recalled
        messages.append(user)
        retrieval_s = time.perf_counter() - started
        return TurnPlan(
            message,
            recalled,
            corrected,
            correction,
            forget,
            turns,
            evicted,
            messages,
            retrieval_s,
            asked.ambiguous_correction,
            core,
        )

    def _fitting(
        self, message: str, recalled: list[Any], turns: list[Turn], max_new_tokens: int, system: list[dict[str, Any]]
    ) -> list[Any]:
        """``recalled`` without the least relevant memories that would not fit the model's context
        beside the ``system`` message (the system prompt and the core block), the window, the
        message and the reply (a memory stored before parts had a bound, or one longer than the
        model reads, is left out, never an overflow)."""
        room = self.engine.max_positions - sum(self._tokens(m["content"]) + _MESSAGE_OVERHEAD for m in system)
        room -= sum(t.tokens for t in turns) + _MESSAGE_OVERHEAD + max_new_tokens
        while recalled and self._tokens(message, recalled) > room:
            recalled = recalled[1:]  # most relevant last: the first is the least
        return recalled

    def _commit(self, plan: TurnPlan, result: Any, text: str, stats: Any) -> Reply:
        """Write the finished turn back: window, archive, stats. Runs once per turn, under the lock."""
        # what leaves the window is archived, not dropped, unless it carried nothing
        for evicted in plan.evicted:
            if evicted.decision == "defer" and evicted.archived is None:
                self._archive_deferred(evicted)
        previous = self._previous
        importance, decision, archived = self._write_back(
            plan.message, plan.correction, plan.forget, window=True, ambiguous_correction=plan.ambiguous_correction
        )
        turn = Turn(
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
        turn.tokens += self.engine.count_tokens(turn.reply, tenant=self.user_id) + _MESSAGE_OVERHEAD
        self._window = plan.kept_turns + [turn]
        self._previous = last_sentence(turn.reply)
        self._persist(lambda theirs: [*theirs, turn])
        return Reply(
            message=plan.message,
            text=turn.reply,
            stats=stats,
            recalled=list(plan.recalled),
            core=plan.core,
            decision=decision,
            importance=importance,
            archived=turn.archived,
            corrected=plan.corrected,
            forgotten=archived if decision == "forget" else None,
            evicted_turns=len(plan.evicted),
            retrieval_s=plan.retrieval_s,
            finish_reason=result.finish_reason if result is not None else "interrupted",
        )


def _without(turn: Turn, record: Any) -> Turn:
    """``turn`` without ``record`` (any version of it) among its recalled memories."""
    kept = tuple(r for r in turn.recalled if r.id != record.id)
    return turn if len(kept) == len(turn.recalled) else replace(turn, recalled=kept)


def _forgetting(turns: Sequence[Turn], record: Any) -> list[Turn]:
    """The window without ``record``: neither the turn that stated it nor a memory recalled into a turn."""
    return [_without(turn, record) for turn in turns if turn.archived is None or turn.archived.id != record.id]
