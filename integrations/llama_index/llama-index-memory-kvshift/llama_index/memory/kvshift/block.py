"""``KVShiftMemoryBlock``: the user's long-term memories as a block of LlamaIndex's ``Memory``.

``Memory`` keeps the session's recent messages in its chat store and asks each of its blocks for
content to put in front of them. This block recalls, for the latest user message, the memories of
the user from a :class:`kvshift_memory.MemoryStore` (every earlier session of theirs), rendered in
span markers (``docs/how-it-works.md``), so that ``llama_index.llms.kvshift.KVShiftLLM`` built
with the same store and user places their stored fragments instead of reading their text again.

Build the ``Memory`` with ``insert_method="user"``: the memories then join the latest user
message, and every earlier message of the prompt stays as it was, so each turn reuses the
previous one's cache (with the default, the system message would change every turn).

The user's messages are written back as the bundled write-back rule decides, when a block first
sees them; a message the rule defers (a question that states nothing new) is stored when
``Memory`` flushes it out of its window.

``KVShiftMemoryBlock(core=True)`` shows the user's core block instead (``docs/how-it-works.md``:
the facts they stated about themselves, what they pinned, and the content of ``core_blocks``, such
as a ``StaticMemoryBlock``'s text or a ``FactExtractionMemoryBlock``'s facts, one line per block):
a system message at the front of the prompt, the same in every session, so its K/V is reused
exactly from one conversation to the next. Give the ``Memory`` both: a core block, and a recall
block (which writes back).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from typing import Any

from llama_index.core.base.llms.types import ChatMessage, MessageRole, TextBlock
from llama_index.core.memory import BaseMemoryBlock
from pydantic import ConfigDict, Field, PrivateAttr

from kvshift_memory import InvalidInputError, MemoryRecord, MemoryStore
from kvshift_memory.adapters import (
    CORE_TOKENS,
    RECALL,
    Decision,
    WriteBackModel,
    archive,
    archived_text,
    change_block,
    core_text,
    explicit_request,
    last_sentence,
    message_key,
    placed_lines,
    read_block,
    recall,
    render_memories,
)

__all__ = ["KVShiftMemoryBlock"]

# rough characters per token, to size a truncation without the caller's tokenizer
_CHARS_PER_TOKEN = 4
# write-back decisions kept, oldest forgotten first (a forgotten one is judged again, harmlessly:
# a stored text is not stored twice, and a request to forget is never carried out on a flush)
_MAX_DECISIONS = 4096


class KVShiftMemoryBlock(BaseMemoryBlock[str]):
    """Memories of ``user_id`` recalled for the latest user message, in span markers.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the same one to KVShiftLLM).
    :param user_id: the tenant: recall, write-back and markers never cross it.
    :param recall_k: memories recalled per user message, most relevant last, each at least
        ``recall_min_score`` similar to it; memories whose text the window shows already are skipped.
    :param memories_header: the line in front of the recalled memories.
    :param write_back: archive the user's messages the bundled write-back rule finds worth keeping.
    :param core: show the user's core block (a system message) instead of recalled memories; a
        core block writes nothing back.
    :param core_tokens: the core block's budget (about four characters a token; past it, lines
        are recalled by search).
    :param core_facts: facts the user states about themselves join the core block on their own
        (``AgentSettings.core_facts``), placed where a core block is in the ``Memory``.
    :param core_blocks: LlamaIndex blocks whose content joins the core block, one line each
        (a changed content appends a line that supersedes the last); messages ``Memory`` flushes
        are handed to them (a fact block extracts its facts from them).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str = Field(default="user_memories", description="The name of the memory block.")
    description: str | None = Field(default="What the user said in earlier sessions, recalled by relevance.")
    store: MemoryStore = Field(exclude=True)
    user_id: str
    recall_k: int = Field(default=RECALL.k, gt=0)
    recall_min_score: float = RECALL.min_score
    memories_header: str = "What you remember about the user:"
    write_back: bool = True
    core: bool = False
    core_facts: bool = True
    core_tokens: int = Field(default=CORE_TOKENS, gt=0)
    core_blocks: list[BaseMemoryBlock] = Field(default_factory=list, exclude=True)
    _rule: WriteBackModel = PrivateAttr(default_factory=WriteBackModel.bundled)
    # the write-back decision of each user message seen in this process, by (session, message digest)
    # by (session, the message's digest, the digest of the reply it follows)
    _decisions: dict[tuple[str, str, str], Decision] = PrivateAttr(default_factory=dict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    # a core block's content is a system message, which ``Memory`` takes from any block (its
    # type variable allows one content type per class, this class has a mode of each)
    async def _aget(  # type: ignore[override]
        self, messages: list[ChatMessage] | None = None, **block_kwargs: Any
    ) -> str | list[ChatMessage]:
        """The memories recalled for the latest user message of ``messages``; ``""`` for none.

        The message is written back first (a request to forget is carried out before the recall);
        a memory whose text the window shows already, the message's own included, is not recalled.

        :raises InvalidInputError: ``messages`` is not a list of ``ChatMessage``; ``StoreError``:
            the store cannot be searched or written.
        """
        messages = _checked(messages)
        session_id = block_kwargs.get("session_id")
        session = session_id if isinstance(session_id, str) and session_id else "default"
        if self.core:
            contents = [(block.name, _text(await block.aget(messages, **block_kwargs))) for block in self.core_blocks]
            return await asyncio.to_thread(self._core_messages, contents, session)
        return await asyncio.to_thread(self._recall_and_write_back, messages, session)

    async def _aput(self, messages: list[ChatMessage]) -> None:
        """Write back the user messages ``Memory`` flushes out of its window that are not stored yet.

        :raises InvalidInputError: not a list of ``ChatMessage``; ``StoreError``: the store cannot be written.
        """
        messages = _checked(messages)
        if self.core:
            for block in self.core_blocks:
                await block.aput(messages)
            return
        await asyncio.to_thread(self._write_back_flushed, messages)

    async def atruncate(self, content: Any, tokens_to_truncate: int) -> Any:
        """``content`` without its least relevant memories (its first lines), about
        ``tokens_to_truncate`` tokens shorter; ``None`` when no memory is left. A core block is
        never cut here (its budget is ``core_tokens``): cutting it would change every later token."""
        if not isinstance(content, str):
            return content
        header, *lines = content.split("\n")
        removed = 0
        while lines and removed < tokens_to_truncate:
            removed += len(lines.pop(0)) // _CHARS_PER_TOKEN + 1
        return "\n".join([header, *lines]) if lines else None

    # ------------------------------------------------------------------ internals

    def _core_messages(self, contents: list[tuple[str, str]], session: str) -> list[ChatMessage]:
        """The core block as a system message (none when empty), ``contents`` placed in it first."""
        for name, text in contents:
            self._place_content(name, text)
        lines = placed_lines(
            self.store,
            self.user_id,
            session_id=session,
            count_tokens=lambda text: len(text) // _CHARS_PER_TOKEN + 1,
            budget_tokens=self.core_tokens,
        )
        return [ChatMessage(role=MessageRole.SYSTEM, content=core_text(lines))] if lines else []

    def _place_content(self, name: str, text: str) -> None:
        """A core block's content as its line: a new memory the first time, a new version when it changed."""
        key = f"block\0{name}"
        if not text.strip():
            change_block(self.store, self.user_id, lambda block: block.without_key(key))
            return
        lines = read_block(self.store, self.user_id).lines
        current = next((line for line in lines if line.key == key and not line.superseded), None)
        if current is not None and current.text == text:
            return
        live = None if current is None else self.store.get(current.memory_id, tenant=self.user_id)
        if live is not None:
            memory = self.store.supersede(live.id, text, tenant=self.user_id, expected_version=live.version)
        else:
            memory = self.store.add(text, tenant=self.user_id, session_id=None, importance_score=1.0)
        change_block(
            self.store, self.user_id, lambda block: block.pinned(memory.id, memory.version, memory.text, "", key)
        )

    def _recall_and_write_back(self, messages: list[ChatMessage], session: str) -> str:
        users = [i for i, message in enumerate(messages) if message.role == MessageRole.USER]
        if not users:
            return ""
        query = messages[users[-1]].content or ""
        if not query.strip():
            return ""
        if self.write_back:
            self._write_back(query, _reply_before(messages, users[-1]), session, flushed=False)
        # what the user and the assistant said: a tool's result ("Porto.") shows no memory of the user's
        shown = [
            message.content.strip()
            for message in messages
            if message.role in (MessageRole.USER, MessageRole.ASSISTANT) and message.content and message.content.strip()
        ]
        hits = recall(
            self.store,
            query,
            user_id=self.user_id,
            session_id=session,
            k=self.recall_k + len(shown),
            min_score=self.recall_min_score,
        )
        recalled = [hit for hit in hits if not _is_shown(hit, shown)][-self.recall_k :]
        return render_memories(recalled, self.memories_header)

    def _write_back_flushed(self, messages: list[ChatMessage]) -> None:
        if not self.write_back:
            return
        for i, message in enumerate(messages):
            if message.role == MessageRole.USER and message.content:
                session = message.additional_kwargs.get("session_id")
                session = session if isinstance(session, str) and session else "default"
                self._write_back(message.content, _reply_before(messages, i), session, flushed=True)

    def _write_back(self, text: str, reply: str, session: str, *, flushed: bool) -> None:
        """Archive ``text`` (the user's message after ``reply``) as the rule decides, once.

        A message decided already is decided again only when it was deferred and is now flushed
        (a deferred message is stored when it leaves the window); one stored already (by an
        earlier process over the same chat store) is not stored again, and a request to forget
        is carried out only when first seen, never again on its way out of the window. The same
        words after another reply are another message (a second "forget …" is carried out too).
        """
        previous, after = last_sentence(reply), message_key(reply)
        key = (session, hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest(), after)
        with self._lock:
            decided = self._decisions.get(key)
            if decided is not None and not (flushed and decided == "defer"):
                return
            if decided is None and flushed and explicit_request(text) == "forget":
                return
            self._decisions[key] = "window"  # taken: a concurrent call for the same message returns
        if self._stored(archived_text(text, previous)):
            return
        _, decision, _ = archive(
            self._rule,
            self.store,
            text,
            previous,
            user_id=self.user_id,
            session_id=session,
            window=not flushed,
            message_key=after,
            core_facts=self.core_facts,
        )
        with self._lock:
            self._decisions[key] = decision
            while len(self._decisions) > _MAX_DECISIONS:
                del self._decisions[next(iter(self._decisions))]

    def _stored(self, text: str) -> bool:
        if not text.strip():
            return False
        return any(hit.text == text for hit in self.store.search(text, tenant=self.user_id, k=2))


def _checked(messages: Any) -> list[ChatMessage]:
    if messages is None:
        return []
    if not isinstance(messages, list) or not all(isinstance(m, ChatMessage) for m in messages):
        raise InvalidInputError("messages must be a list of ChatMessage")
    return messages


def _text(content: Any) -> str:
    """A block's content as text: a string, or the text of its content blocks, one per line."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(part.text for part in content if isinstance(part, TextBlock))
    return ""


def _reply_before(messages: list[ChatMessage], index: int) -> str:
    """The reply the user message at ``index`` follows (``""`` for none)."""
    for message in reversed(messages[:index]):
        if message.role == MessageRole.ASSISTANT and message.content:
            return message.content
    return ""


def _is_shown(record: MemoryRecord, shown: list[str]) -> bool:
    """Whether the window shows ``record``'s text already: it is a message, or a message archived
    after the question it answered (:func:`~kvshift_memory.adapters.archived_text`)."""
    return any(record.text == text or record.text.endswith(f"\n{text}") for text in shown)
