"""``KVShiftMemory``: a LlamaIndex chat memory whose recalled memories bring their K/V along.

It keeps the conversation's recent turns verbatim (a window of ``token_limit`` tokens) and, for
each new user message, recalls memories of the user from a :class:`kvshift_memory.MemoryStore`
(all of the user's sessions, ranked as :class:`kvshift_memory.AgentMemory` ranks them). The
recalled memories are rendered in span markers (``docs/how-it-works.md``) in front of the message they were
recalled for, and stay with it, so each turn's prompt starts with the previous one;
``llama_index.llms.kvshift.KVShiftLLM`` built with the same store and user places the memories'
stored fragments instead of reading their text again.

After each reply, the user's message is archived when the bundled write-back rule finds it worth
keeping, and its fragment is encoded at once, so a later turn that recalls it (once the window no
longer shows it) pays nothing to read it.

The conversation lives in a LlamaIndex chat store (``SimpleChatStore`` by default, in this process
only; a persisted one, Redis or a database, survives a restart). Each stored message carries the
ids of the memories shown with it, so a memory restored from it shows the same prompt as before.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.memory import BaseMemory
from llama_index.core.storage.chat_store import BaseChatStore, SimpleChatStore
from pydantic import ConfigDict, Field, PrivateAttr

from kvshift_memory import InvalidInputError, KVShiftEngine, MemoryRecord, MemoryStore
from kvshift_memory.adapters import (
    RECALL,
    WriteBackModel,
    archive,
    last_sentence,
    message_key,
    recall,
    render_memories,
    strip_markers,
)

__all__ = ["KVShiftMemory"]

# template tokens a message costs around its content (`<|im_start|>user\n` ... `<|im_end|>\n`)
_MESSAGE_OVERHEAD = 6
# what a message in the chat store carries besides itself: the (id, version) of the memories shown
# with it, and (an assistant's) what the user message it answers was archived as
_RECALLED = "kvshift_recalled"
_ARCHIVED = "kvshift_archived"
_OWN_KEYS = (_RECALLED, _ARCHIVED)
# memory references read back from one stored message, at most: the chat store is untrusted input
_MAX_REFERENCES = 64


@dataclass
class _Entry:
    """One message of the conversation, and what this memory knows about it."""

    message: ChatMessage
    recalled: list[MemoryRecord] = field(default_factory=list)  # a user message's, shown in front of it
    recall_done: bool = False
    written_back: bool = False  # a user message is classified for write-back once
    archived: MemoryRecord | None = None  # what it was archived as
    tokens: int = 0


class KVShiftMemory(BaseMemory):
    """The recent turns of one session, plus the memories each user message recalls.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the same one to KVShiftLLM).
    :param user_id: the tenant: recall and markers never cross it.
    :param session_id: this conversation; archived messages are stored under it, recall reaches
        all of the user's sessions (this one's memories rank a little higher).
    :param token_limit: the window of verbatim turns, in tokens (with the recalled memories and
        ``initial_token_count``, the chat engine's own system message). Past it, the oldest turns
        leave together until the window is ``window_keep`` of the limit, so the prompt's start
        (which the engine reuses) changes rarely; what left may be recalled again.
    :param recall_k: memories recalled per user message, most relevant last, each at least
        ``recall_min_score`` similar to it; memories the window shows already are skipped.
    :param write_back: archive the user's messages the bundled write-back rule finds worth keeping.
    :param model: the model whose tokens are counted and whose fragments are encoded (the process's
        shared engine for it, as KVShiftLLM uses; ``None``: the bundled model); or pass ``engine``.
    :param fragments_after: the system message fragments are encoded after; default the engine's
        system prompt, as KVShiftLLM's default (both must agree for a fragment to be reused).
    :param chat_store: where the conversation is kept (default: a ``SimpleChatStore`` of this
        process); a memory built over a chat store that holds ``chat_store_key`` continues it.
    :param chat_store_key: the conversation's key in ``chat_store`` (default: made of ``user_id``
        and ``session_id``, so two users with the same session name never share a conversation).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: MemoryStore = Field(exclude=True)
    user_id: str
    session_id: str
    token_limit: int = Field(default=2048, gt=0)
    window_keep: float = Field(default=0.6, gt=0.0, le=1.0)
    recall_k: int = Field(default=RECALL.k, gt=0)
    recall_min_score: float = RECALL.min_score
    memories_header: str = "What you remember about the user:"
    write_back: bool = True
    model: str | None = None
    fragments_after: str | None = None
    chat_store: BaseChatStore = Field(default_factory=SimpleChatStore, exclude=True)
    chat_store_key: str | None = None
    _engine: KVShiftEngine | None = PrivateAttr(default=None)
    _entries: list[_Entry] = PrivateAttr(default_factory=list)
    _start: int = PrivateAttr(default=0)  # the window's first entry
    _pending: tuple[str, list[MemoryRecord]] | None = PrivateAttr(default=None)  # (input, what it recalled)
    _lock: threading.RLock = PrivateAttr(default_factory=threading.RLock)
    _rule: WriteBackModel = PrivateAttr(default_factory=WriteBackModel.bundled)
    _restored: bool = PrivateAttr(default=False)

    def __init__(self, *, engine: KVShiftEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "KVShiftMemory"

    @classmethod
    def from_defaults(cls, **kwargs: Any) -> KVShiftMemory:
        """A memory built from keyword arguments (``store``, ``user_id`` and ``session_id`` are required)."""
        return cls(**kwargs)

    @property
    def engine(self) -> KVShiftEngine:
        if self._engine is None:
            self._engine = KVShiftEngine.shared(self.model)
        return self._engine

    @property
    def tokenizer_fn(self) -> Callable[[str], list[int]]:
        """The model's token ids of a text: chat engines count their system message with it."""
        return lambda text: self.engine.tokenizer.encode(text, add_special_tokens=False)

    # ------------------------------------------------------------------ BaseMemory

    def get(self, input: str | None = None, initial_token_count: int = 0, **kwargs: Any) -> list[ChatMessage]:
        """The window's messages, each user message after the memories recalled for it.

        ``input`` (a message not yet put, as ``CondensePlusContextChatEngine`` asks) recalls for
        it; its memories come last, as a user message of their own, and join it when it is put.
        Without ``input``, the last message, when it is the user's, is recalled for (once).

        :raises InvalidInputError: ``input`` is not text; ``StoreError``: the store cannot be searched.
        """
        if input is not None and not isinstance(input, str):
            raise InvalidInputError(f"input must be text, got {type(input).__name__}")
        with self._lock:
            self._restore()
            query = input if input is not None else self._unrecalled_query()
            recalled = self._recall(query) if query else []
            needed = initial_token_count + self._count(render_memories(recalled, self.memories_header))
            if input is not None:
                needed += self._count(input)
            if self._evict(needed) and query:  # what left the window may be recalled again
                recalled = self._recall(query)
            if input is not None:
                self._pending = (input, recalled)
            elif query:
                self._attach(self._entries[-1], recalled)
                self.chat_store.delete_last_message(self.conversation_key)
                self.chat_store.add_message(self.conversation_key, self._stored(self._entries[-1]))
            messages = [self._rendered(entry) for entry in self._entries[self._start :]]
            if input is not None and recalled:
                messages.append(
                    ChatMessage(role=MessageRole.USER, content=render_memories(recalled, self.memories_header))
                )
            return messages

    def get_all(self) -> list[ChatMessage]:
        """Every message put, as it was put (no recalled memories), including those the window dropped."""
        with self._lock:
            self._restore()
            return [entry.message for entry in self._entries]

    def put(self, message: ChatMessage) -> None:
        """Add a message. A user's message takes the memories ``get(input=...)`` recalled for it;
        an assistant's reply ends the turn and archives the user's message when it is worth it.

        :raises InvalidInputError: not a ``ChatMessage``; ``StoreError``: the store cannot be written.
        """
        if not isinstance(message, ChatMessage):
            raise InvalidInputError(f"put takes a ChatMessage, got {type(message).__name__}")
        with self._lock:
            self._restore()
            message = _without_own_keys(message)
            entry = _Entry(message, tokens=self._count(message.content or ""))
            if message.role == MessageRole.USER and self._pending is not None and self._pending[0] == message.content:
                self._attach(entry, self._pending[1])
            self._pending = None
            self._entries.append(entry)
            archived = self._archive_last_turn() if message.role == MessageRole.ASSISTANT and self.write_back else None
            self.chat_store.add_message(self.conversation_key, self._stored(entry, archived))

    def set(self, messages: list[ChatMessage]) -> None:
        """Replace the conversation with ``messages`` (nothing is recalled for them or archived).

        :raises InvalidInputError: an item that is not a ``ChatMessage``.
        """
        if not isinstance(messages, list) or not all(isinstance(m, ChatMessage) for m in messages):
            raise InvalidInputError("set takes a list of ChatMessage")
        with self._lock:
            messages = [_without_own_keys(m) for m in messages]
            self._entries = [
                _Entry(m, recall_done=True, written_back=True, tokens=self._count(m.content or "")) for m in messages
            ]
            self._start, self._pending, self._restored = 0, None, True
            self.chat_store.set_messages(self.conversation_key, messages)

    def reset(self) -> None:
        """Forget the conversation, in the chat store too (the memory store keeps what was archived)."""
        with self._lock:
            self._entries, self._start, self._pending, self._restored = [], 0, None, True
            self.chat_store.delete_messages(self.conversation_key)

    # ------------------------------------------------------------------ internals

    @property
    def conversation_key(self) -> str:
        """The conversation's key in ``chat_store``: ``chat_store_key``, or one made of the user and
        the session (many users' sessions are called "default": they never share a conversation)."""
        return self.chat_store_key or f"kvshift:{len(self.user_id)}:{self.user_id}:{self.session_id}"

    def _restore(self) -> None:
        """Read the conversation ``chat_store`` holds, once, with the memories shown with each message.

        The chat store is untrusted: references that are malformed, of another user, or to a
        version no longer live are dropped (the message stays, shown without that memory).
        """
        if self._restored:
            return
        self._restored = True
        last_user: _Entry | None = None  # the user message an assistant's reply answers
        for stored in self.chat_store.get_messages(self.conversation_key):
            if not isinstance(stored, ChatMessage):
                continue
            entry = _Entry(
                _without_own_keys(stored),
                self._records(stored.additional_kwargs.get(_RECALLED)),
                recall_done=True,
                written_back=True,
            )
            entry.tokens = self._count(self._rendered(entry).content or "")
            if stored.role == MessageRole.USER:
                last_user = entry
            elif stored.role == MessageRole.ASSISTANT and last_user is not None:
                archived = self._records([stored.additional_kwargs.get(_ARCHIVED)])
                last_user.archived = archived[0] if archived else last_user.archived
            self._entries.append(entry)

    def _records(self, references: Any) -> list[MemoryRecord]:
        """The live memories of this user that ``references`` (``[id, version]`` pairs) name."""
        if not isinstance(references, list):
            return []
        records = []
        for reference in references[:_MAX_REFERENCES]:
            if not (isinstance(reference, list) and len(reference) == 2 and isinstance(reference[1], int)):
                continue
            try:
                record = self.store.get(reference[0], tenant=self.user_id)
            except InvalidInputError:  # a malformed id: never a memory of this user
                continue
            if record is not None and record.version == reference[1]:
                records.append(record)
        return records

    @staticmethod
    def _stored(entry: _Entry, archived: MemoryRecord | None = None) -> ChatMessage:
        """``entry``'s message as the chat store keeps it: with the references this memory reads back."""
        kwargs = dict(entry.message.additional_kwargs)
        if entry.recalled:
            kwargs[_RECALLED] = [[record.id, record.version] for record in entry.recalled]
        if archived is not None:
            kwargs[_ARCHIVED] = [archived.id, archived.version]
        return entry.message.model_copy(update={"additional_kwargs": kwargs})

    def _count(self, text: str) -> int:
        """Tokens the model reads for a message of ``text`` (a marker is not read: its memory is)."""
        text = strip_markers(text)
        return self.engine.count_tokens(text, tenant=self.user_id) + _MESSAGE_OVERHEAD if text else 0

    def _unrecalled_query(self) -> str:
        last = self._entries[-1] if len(self._entries) > self._start else None
        if last is None or last.message.role != MessageRole.USER or last.recall_done:
            return ""
        return last.message.content or ""

    def _shown(self) -> builtins.set[tuple[str, int]]:
        """(id, version) of the memories whose text the window shows already."""
        shown: builtins.set[tuple[str, int]] = builtins.set()
        for entry in self._entries[self._start :]:
            shown.update((record.id, record.version) for record in entry.recalled)
            if entry.archived is not None:
                shown.add((entry.archived.id, entry.archived.version))
        return shown

    def _recall(self, query: str) -> list[MemoryRecord]:
        return recall(
            self.store,
            query,
            user_id=self.user_id,
            session_id=self.session_id,
            exclude=self._shown(),
            k=self.recall_k,
            min_score=self.recall_min_score,
        )

    def _attach(self, entry: _Entry, recalled: list[MemoryRecord]) -> None:
        entry.recalled, entry.recall_done = recalled, True
        entry.tokens = self._count(self._rendered(entry).content or "")

    def _rendered(self, entry: _Entry) -> ChatMessage:
        if not entry.recalled:
            return entry.message
        block = render_memories(entry.recalled, self.memories_header)
        return ChatMessage(role=entry.message.role, content=f"{block}\n\n{entry.message.content or ''}")

    def _evict(self, needed: int) -> bool:
        """Drop the oldest turns when the window and ``needed`` pass the limit; the message being
        answered (the last one) always stays.

        :returns: whether any turn was dropped.
        """
        window = self._entries[self._start :]
        if sum(entry.tokens for entry in window) + needed <= self.token_limit:
            return False
        target = int(self.token_limit * self.window_keep)
        start, total = self._start, sum(entry.tokens for entry in window)
        while start < len(self._entries) - 1 and total + needed > target:
            total -= self._entries[start].tokens
            start += 1
            while start < len(self._entries) - 1 and self._entries[start].message.role != MessageRole.USER:
                total -= self._entries[start].tokens  # a turn leaves whole: its reply goes with it
                start += 1
        dropped = start > self._start
        self._start = start
        return dropped

    def _archive_last_turn(self) -> MemoryRecord | None:
        """Archive the last user message when the rule finds it worth keeping.

        :returns: the memory it was archived as, else ``None``.
        """
        users = [i for i, entry in enumerate(self._entries) if entry.message.role == MessageRole.USER]
        if not users:
            return None
        turn = self._entries[users[-1]]
        if turn.written_back:
            return None
        turn.written_back = True
        replies = [e for e in self._entries[: users[-1]] if e.message.role == MessageRole.ASSISTANT]
        reply = replies[-1].message.content or "" if replies else ""
        _, decision, record = archive(
            self._rule,
            self.store,
            turn.message.content or "",
            last_sentence(reply),
            user_id=self.user_id,
            session_id=self.session_id,
            message_key=message_key(reply),
        )
        if record is None or decision != "archive":  # nothing stored (or a request to forget, which deleted it)
            return None
        turn.archived = record
        # encoded now, after the reply: the turn that recalls it later reads it for free
        self.engine.warm(
            [record],
            fragments_after=self.fragments_after or self.engine.settings.system_prompt,
            lead_fragments=False,
            tenant=self.user_id,
        )
        return record


def _without_own_keys(message: ChatMessage) -> ChatMessage:
    """``message`` without the keys this memory writes into the chat store (a caller's are not trusted)."""
    if not any(key in message.additional_kwargs for key in _OWN_KEYS):
        return message
    kwargs = {k: v for k, v in message.additional_kwargs.items() if k not in _OWN_KEYS}
    return message.model_copy(update={"additional_kwargs": kwargs})
