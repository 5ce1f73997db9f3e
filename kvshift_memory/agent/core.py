"""The core block: what the agent always knows about its user, at the front of every prompt.

The memories a user pins are laid in the system message right after the system prompt, one line
each, in the order they were pinned. The block's tokens are therefore the same in every session
and every process of that user: its K/V is reused exactly, from the prefix cache in a process and
from the store's chunks after a restart or on another worker, with no shift and no repair.

What is core (:func:`~kvshift_memory.agent.asks.joins_core` writes the rule down): the memories a
user pins (:meth:`AgentMemory.pin`), the profile a framework keeps for the user (LangMem's profile
item, LlamaIndex's static and fact blocks), and what write-back keeps as a fact the user stated
about themselves (a "remember …", or a statement in the first person). Everything else is
recalled by search.

The block grows only at its end, so what comes before keeps its K/V: a correction of a core
memory appends the new text and marks the old line superseded (its text stays until the block is
compacted). A forget or an unpin removes the line at once (a forgotten text never stays in a
prompt), and compaction drops superseded lines once they pass :data:`COMPACT_SHARE` of the block:
each costs one prefill from the first line it removes. A line write-back appends during a
session is placed from the next session on (this session's window shows the message already, and
the window's K/V stays reused). Lines past the block's token budget are not placed: those
memories are recalled by search, as any other.

The block is kept per user in the store (compare-and-set, like a session's window); what is read
back is untrusted and checked line by line.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .. import inputs
from ..exceptions import InvalidInputError, SessionBusyError
from ..protocols import ChunkStore, Engine, Store

__all__ = [
    "COMPACT_SHARE",
    "CORE_HEADER",
    "CORE_TOKENS",
    "CoreBlock",
    "CoreLine",
    "change_block",
    "core_text",
    "placed_lines",
    "read_block",
    "store_block",
    "system_messages",
]

#: the line that opens the block in the system message
CORE_HEADER = "What you know about the user (kept across conversations; a later line replaces what it updates):"
#: the block's default budget in tokens (``AgentSettings.core_tokens``)
CORE_TOKENS = 2048
#: superseded lines are dropped once they hold more than this share of the block's lines
COMPACT_SHARE = 0.25
_MAX_LINES = 4096
_FORMAT = "kvshift-core/1"
_SAVE_ATTEMPTS = 8


@dataclass(frozen=True)
class CoreLine:
    """One line of the block: a memory's text at a version, and whether a later line replaced it."""

    memory_id: str
    version: int
    text: str
    superseded: bool = False
    #: the session whose write-back appended it (placed from the next session on); ``""``: placed at once
    session_id: str = ""
    #: what the line stands for when a new text is a new memory (a framework's profile item): a
    #: later line of the same key supersedes it
    key: str = ""


@dataclass(frozen=True)
class CoreBlock:
    """A user's core block (immutable: every change returns a new block)."""

    lines: tuple[CoreLine, ...] = ()

    def holds(self, memory_id: str) -> bool:
        """Whether a line (current or superseded) shows ``memory_id``."""
        return any(line.memory_id == memory_id for line in self.lines)

    def updated(self, memory_id: str, version: int, text: str, session_id: str = "") -> CoreBlock:
        """The block with a corrected memory's new version appended, when a line shows that memory."""
        return self.pinned(memory_id, version, text, session_id) if self.holds(memory_id) else self

    def pinned(self, memory_id: str, version: int, text: str, session_id: str = "", key: str = "") -> CoreBlock:
        """The block with the memory appended (unchanged when its current line shows that version);
        earlier lines of the same memory, or of the same ``key``, are marked superseded.

        :param session_id: the session whose write-back appends it (placed from the next session
            on); ``""`` places it at once (a pin, a profile).
        :raises InvalidInputError: the block holds its most lines already.
        """
        if any(line.memory_id == memory_id and line.version == version and not line.superseded for line in self.lines):
            return self
        if len(self.lines) >= _MAX_LINES:
            raise InvalidInputError(f"a core block holds at most {_MAX_LINES} lines")
        marked = tuple(
            replace(line, superseded=True) if line.memory_id == memory_id or (key and line.key == key) else line
            for line in self.lines
        )
        return CoreBlock((*marked, CoreLine(memory_id, version, text, False, session_id, key))).compacted()

    def without_key(self, key: str) -> CoreBlock:
        """The block without the lines of ``key`` (a profile item that is gone)."""
        return CoreBlock(tuple(line for line in self.lines if line.key != key))

    def joined(self, memory_id: str, version: int, text: str, session_id: str) -> CoreBlock:
        """:meth:`pinned` for a memory write-back found core, or the block as it was when it
        holds its most lines (the memory stays recalled by search)."""
        return self if len(self.lines) >= _MAX_LINES else self.pinned(memory_id, version, text, session_id)

    def without(self, memory_id: str) -> CoreBlock:
        """The block without any line of ``memory_id`` (a forget, an unpin: removed at once)."""
        return CoreBlock(tuple(line for line in self.lines if line.memory_id != memory_id))

    def compacted(self, share: float = COMPACT_SHARE) -> CoreBlock:
        """The block without its superseded lines, when they hold more than ``share`` of its lines."""
        superseded = sum(line.superseded for line in self.lines)
        if not self.lines or superseded <= share * len(self.lines):
            return self
        return CoreBlock(tuple(line for line in self.lines if not line.superseded))

    def placed(
        self, budget_tokens: int, count_tokens: Callable[[str], int], session_id: str | None = None
    ) -> tuple[CoreLine, ...]:
        """The lines laid in ``session_id``'s prompt: in order, while the block stays within
        ``budget_tokens`` (the rest stays recalled by search), less the lines this session's
        write-back appended (its window shows them)."""
        placed: list[CoreLine] = []
        used = count_tokens(CORE_HEADER) + 1
        for line in self.lines:
            if session_id and line.session_id == session_id:
                continue
            used += count_tokens(_shown(line.text)) + 1
            if used > budget_tokens:
                break
            placed.append(line)
        return tuple(placed)

    def to_bytes(self) -> bytes:
        lines = [
            [line.memory_id, line.version, line.text, line.superseded, line.session_id, line.key] for line in self.lines
        ]
        return json.dumps({"format": _FORMAT, "lines": lines}, ensure_ascii=False).encode("utf-8")

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> CoreBlock:
        """The block a store holds; an empty one for none.

        :raises InvalidInputError: what is stored is not a block this module wrote.
        """
        if raw is None:
            return cls()
        try:
            state = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise InvalidInputError("the stored core block is not JSON") from None
        if not isinstance(state, dict) or state.get("format") != _FORMAT or not isinstance(state.get("lines"), list):
            raise InvalidInputError("the stored core block is not one this version wrote")
        if len(state["lines"]) > _MAX_LINES:
            raise InvalidInputError(f"the stored core block has over {_MAX_LINES} lines")
        return cls(tuple(_line(entry) for entry in state["lines"]))


def read_block(store: Store, user_id: str) -> CoreBlock:
    """``user_id``'s core block as the store holds it (empty for none).

    :raises InvalidInputError: the stored block is damaged; :class:`StoreError`: the store failed.
    """
    return CoreBlock.from_bytes(store.load_core(tenant=user_id))


def change_block(store: Store, user_id: str, change: Callable[[CoreBlock], CoreBlock]) -> CoreBlock:
    """Apply ``change`` to ``user_id``'s core block and save it by compare-and-set (another
    process's change first is read and ``change`` applied to it).

    :returns: the block as it stands (nothing is written when ``change`` leaves it as it was).
    :raises SessionBusyError: it kept changing in other processes.
    :raises StoreError: the store failed.
    """
    for _ in range(_SAVE_ATTEMPTS):
        raw = store.load_core(tenant=user_id)
        before = CoreBlock.from_bytes(raw)
        block = change(before)
        if block == before or store.save_core(block.to_bytes(), tenant=user_id, expected=raw):
            return block
    raise SessionBusyError(f"the core block of {user_id!r} kept changing in other processes; it was not saved")


def placed_lines(
    store: Store,
    user_id: str,
    *,
    session_id: str | None,
    count_tokens: Callable[[str], int],
    budget_tokens: int = CORE_TOKENS,
) -> tuple[CoreLine, ...]:
    """The lines of ``user_id``'s core block that ``session_id``'s prompt shows (:meth:`CoreBlock.placed`).

    :raises InvalidInputError: the stored block is damaged; :class:`StoreError`: the store failed.
    """
    block = read_block(store, user_id)
    return block.placed(budget_tokens, count_tokens, session_id) if block.lines else ()


def system_messages(system_prompt: str | None, lines: Sequence[CoreLine], default_prompt: str) -> list[dict[str, Any]]:
    """The system message a prompt starts with: ``system_prompt`` (``default_prompt`` for
    ``None``), then the block's ``lines``; none for no prompt and no lines."""
    if system_prompt is None and not lines:
        return []
    system = system_prompt or default_prompt
    return [{"role": "system", "content": f"{system}\n\n{core_text(lines)}" if lines else system}]


def store_block(engine: Engine, store: Store, user_id: str, system: list[dict[str, Any]]) -> None:
    """Compute the ``system`` message once and store its K/V in ``store``'s chunks (when it
    keeps chunks), so a session that starts with it, in any process, reads it.

    :raises StoreError: the store failed.
    """
    if isinstance(store, ChunkStore):
        # a one-token answer to a bare greeting: what is stored is the system message before it
        prompt = [*system, {"role": "user", "content": "Hello."}]
        engine.generate(prompt, max_new_tokens=1, tenant=user_id, kv_store=store)


def core_text(lines: Sequence[CoreLine]) -> str:
    """The block as the system message shows it (``""`` for no lines)."""
    return "" if not lines else "\n".join([CORE_HEADER, *(_shown(line.text) for line in lines)])


def _shown(text: str) -> str:
    """A memory's text as one line of the block (its line breaks and runs of spaces as one space)."""
    return " ".join(text.split())


def _line(entry: Any) -> CoreLine:
    # a line written before lines carried their session and key has four fields: placed at once, no key
    if not (isinstance(entry, list) and len(entry) in (4, 6)):
        raise InvalidInputError("a stored core line is [memory id, version, text, superseded, session id, key]")
    memory_id, version, text, superseded, session_id, key = entry if len(entry) == 6 else [*entry, "", ""]
    if type(version) is not int or version < 1 or not isinstance(superseded, bool):
        raise InvalidInputError("a stored core line has a bad version or superseded flag")
    if not isinstance(key, str) or len(key) > 512:
        raise InvalidInputError("a stored core line has a bad key")
    return CoreLine(
        inputs.check_identifier(memory_id, "memory_id"),
        version,
        inputs.check_text(text, "text"),
        superseded,
        "" if session_id == "" else inputs.check_identifier(session_id, "session_id"),
        key,
    )
