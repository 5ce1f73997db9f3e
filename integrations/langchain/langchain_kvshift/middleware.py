"""``KVShiftMiddleware``: recall and write-back for LangChain 1.x agents (``create_agent``).

Before a model call that answers a new human message, the memories the message recalls from the
user's store are put in front of it, in span markers (``docs/how-it-works.md``), so that a
:class:`~langchain_kvshift.ChatKVShift` built with the same store and user places their stored
fragments instead of reading their text. The marked message replaces the original in the agent's
state (same id), so the next turn's prompt starts with this one and the engine reuses it exactly.
After the final answer, the human's message is written back when the bundled write-back rule
finds it worth keeping.
"""

from __future__ import annotations

import asyncio
from typing import Any

from langchain.agents.middleware import AgentMiddleware, AgentState
from langchain_core.messages import AIMessage, HumanMessage
from langgraph.runtime import Runtime

from kvshift_memory import MemoryStore
from kvshift_memory.adapters import WriteBackModel, archive, last_sentence, parse_markers, recall, render_memories

__all__ = ["KVShiftMiddleware"]

# the human's own words, kept on the marked message (the content also holds the recalled memories)
ORIGINAL = "kvshift_original"


class KVShiftMiddleware(AgentMiddleware):
    """Recalled memories before the model call, write-back after the answer.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the same one to ChatKVShift).
    :param user_id: the tenant: recall never crosses it.
    :param session_id: archived messages are stored under it; recall reaches all the user's sessions.
    :param recall_k: memories recalled per message (most relevant last), each with a similarity of
        at least ``recall_min_score``; memories the conversation shows already are skipped.
    :param write_back: archive the human's messages the bundled write-back rule finds worth keeping.
    """

    def __init__(
        self,
        store: MemoryStore,
        user_id: str,
        session_id: str,
        *,
        recall_k: int = 4,
        recall_min_score: float = 0.3,
        memories_header: str = "What you remember about the user:",
        write_back: bool = True,
    ) -> None:
        super().__init__()
        self.store = store
        self.user_id = user_id
        self.session_id = session_id
        self.recall_k = recall_k
        self.recall_min_score = recall_min_score
        self.memories_header = memories_header
        self.write_back = write_back
        self._rule = WriteBackModel.bundled()

    def before_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Put the memories the last human message recalls in front of it (once per message).

        :raises StoreError: the store cannot be searched.
        """
        messages = state["messages"]
        last = messages[-1] if messages else None
        if not isinstance(last, HumanMessage) or ORIGINAL in last.additional_kwargs or not last.text.strip():
            return None
        shown = {
            (span.memory_id, span.version)
            for m in messages
            for span in parse_markers(m.text)
            if span.memory_id and span.version is not None
        }
        recalled = recall(
            self.store,
            last.text,
            user_id=self.user_id,
            session_id=self.session_id,
            exclude=shown,
            k=self.recall_k,
            min_score=self.recall_min_score,
        )
        if not recalled:
            return None
        block = render_memories(recalled, self.memories_header)
        content = f"{block}\n\n{last.text}"
        return {"messages": [HumanMessage(content=content, id=last.id, additional_kwargs={ORIGINAL: last.text})]}

    def after_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Archive the human message the final answer replied to, when it is worth keeping.

        :raises StoreError: the store cannot be written.
        """
        messages = state["messages"]
        if (
            not self.write_back
            or len(messages) < 2
            or not isinstance(messages[-1], AIMessage)
            or messages[-1].tool_calls
        ):
            return None
        human = next((m for m in reversed(messages[:-1]) if isinstance(m, HumanMessage)), None)
        if human is None:
            return None
        text = human.additional_kwargs.get(ORIGINAL, human.text)
        reply = next((m.text for m in reversed(messages[: messages.index(human)]) if isinstance(m, AIMessage)), "")
        archive(self._rule, self.store, text, last_sentence(reply), user_id=self.user_id, session_id=self.session_id)
        return None

    async def abefore_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """:meth:`before_model` in a worker thread (the store's search embeds the message)."""
        return await asyncio.to_thread(self.before_model, state, runtime)

    async def aafter_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """:meth:`after_model` in a worker thread."""
        return await asyncio.to_thread(self.after_model, state, runtime)
