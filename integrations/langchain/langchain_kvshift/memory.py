"""``KVShiftMemory``: memory for langchain-classic chains (``ConversationChain``) that brings K/V along.

A chain renders its memory into prompt text and sends one flat message. This memory renders the
conversation so far, each turn after the memories recalled for it, then the memories the new
input recalls, each wrapped in a span marker (``docs/how-it-works.md``); :class:`~langchain_kvshift.ChatKVShift`
built with the same store and user resolves the markers and places the memories' stored fragments
instead of reading their text again. A turn's memories stay with that turn, so every prompt
starts with the previous one (up to its reply), which the engine reuses exactly; only the
previous reply, the newly recalled memories (placed) and the new input are new.
"""

from __future__ import annotations

from typing import Any

from langchain_classic.base_memory import BaseMemory
from pydantic import ConfigDict, Field, PrivateAttr

from kvshift_memory import InvalidInputError, MemoryStore
from kvshift_memory.adapters import RECALL, WriteBackModel, archive, last_sentence, recall, render_memories

__all__ = ["KVShiftMemory"]


class KVShiftMemory(BaseMemory):
    """The conversation of one session, plus the memories its input recalls from the user's store.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the same one to ChatKVShift).
    :param user_id: the tenant: recall and markers never cross it.
    :param session_id: this conversation; archived turns are stored under it, recall reaches all
        of the user's sessions.
    :param recall_k: memories recalled per input, most relevant last; ``recall_min_score`` is the
        least similarity a recalled memory needs. They rank as :class:`~kvshift_memory.AgentMemory`
        ranks them (``kvshift_memory.adapters.recall``).
    :param write_back: archive the human's turns the bundled write-back rule finds worth keeping
        (``kvshift_memory.adapters.archive``), so that later sessions recall them.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: MemoryStore = Field(exclude=True)
    user_id: str
    session_id: str
    memory_key: str = "history"
    input_key: str | None = None
    human_prefix: str = "Human"
    ai_prefix: str = "AI"
    memories_header: str = "What you remember about the user:"
    recall_k: int = RECALL.k
    recall_min_score: float = RECALL.min_score
    write_back: bool = True
    _turns: list[tuple[list[Any], str, str]] = PrivateAttr(default_factory=list)  # (recalled, human, ai)
    _recalled: list[Any] = PrivateAttr(default_factory=list)  # what the last input recalled, for its turn
    _shown: set[tuple[str, int]] = PrivateAttr(default_factory=set)  # (id, version) the conversation shows
    _rule: WriteBackModel = PrivateAttr(default_factory=WriteBackModel.bundled)

    @property
    def memory_variables(self) -> list[str]:
        return [self.memory_key]

    def _input(self, inputs: dict[str, Any]) -> str:
        if self.input_key is not None:
            value = inputs.get(self.input_key)
        else:
            others = [value for key, value in inputs.items() if key != self.memory_key and key != "stop"]
            value = others[0] if len(others) == 1 else None
        if not isinstance(value, str):
            raise InvalidInputError(f"KVShiftMemory needs one text input (set input_key); got keys {sorted(inputs)}")
        return value

    def load_memory_variables(self, inputs: dict[str, Any]) -> dict[str, str]:
        """The conversation so far, then the memories the input recalls, in markers.

        :raises InvalidInputError: no single text input; ``StoreError``: the store cannot be searched.
        """
        query = self._input(inputs)
        lines = []
        for recalled, human, ai in self._turns:
            lines += [render_memories(recalled, self.memories_header)] if recalled else []
            lines += [f"{self.human_prefix}: {human}", f"{self.ai_prefix}: {ai}"]
        self._recalled = recall(
            self.store,
            query,
            user_id=self.user_id,
            session_id=self.session_id,
            exclude=self._shown,
            k=self.recall_k,
            min_score=self.recall_min_score,
        )
        if self._recalled:
            lines.append(render_memories(self._recalled, self.memories_header))
        return {self.memory_key: "\n".join(lines)}

    def save_context(self, inputs: dict[str, Any], outputs: dict[str, str]) -> None:
        """Add the turn to the conversation and archive the human's message when it is worth it.

        :raises InvalidInputError: no single text input or output; ``StoreError``: the store cannot be written.
        """
        human = self._input(inputs)
        texts = [value for value in outputs.values() if isinstance(value, str)]
        if len(texts) != 1:
            raise InvalidInputError(f"KVShiftMemory needs one text output; got keys {sorted(outputs)}")
        previous = last_sentence(self._turns[-1][2]) if self._turns else ""
        self._turns.append((self._recalled, human, texts[0]))
        self._shown.update((record.id, record.version) for record in self._recalled)
        self._recalled = []
        if self.write_back:
            _, decision, record = archive(
                self._rule, self.store, human, previous, user_id=self.user_id, session_id=self.session_id
            )
            if record is not None and decision == "archive":
                self._shown.add((record.id, record.version))

    def clear(self) -> None:
        """Forget the conversation (the store keeps what was archived)."""
        self._turns.clear()
        self._shown.clear()
        self._recalled = []
