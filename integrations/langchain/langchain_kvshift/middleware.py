"""``KVShiftMiddleware``: recall and write-back for LangChain 1.x agents (``create_agent``).

Before a model call that answers a new human message, the memories the message recalls from the
user's store are put in front of it, in span markers (``docs/how-it-works.md``), so that a
:class:`~langchain_kvshift.ChatKVShift` built with the same store and user places their stored
fragments instead of reading their text. The marked message replaces the original in the agent's
state (same id), so the next turn's prompt starts with this one and the engine reuses it exactly.
After the final answer, the human's message is written back when the bundled write-back rule
finds it worth keeping.

The user's core block (``docs/how-it-works.md``: the facts they stated about themselves, what
they pinned, and with ``profile=`` the profile item LangMem's profile pattern keeps, one per user)
is laid after the system prompt of every model call, in the same order in every session, so its
K/V is reused exactly from one conversation to the next and restored from the store after a
restart. A memory the block shows is still recalled next to a question about it (a small model
answers from what is next to the question).

One agent serves every user: the user (and session) come from the run's context
(``agent.invoke(..., context={"user_id": "alice", "session_id": "s1"})``, a dict or an object with
those attributes) and the store from ``create_agent(store=KVShiftStore(...))``, unless given at
construction; the model call is told the same user, so a :class:`~langchain_kvshift.ChatKVShift`
reuses K/V and resolves memories for that user only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, AgentState, ModelRequest, ModelResponse
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langgraph.runtime import Runtime

from kvshift_memory import InvalidInputError, MemoryStore, inputs
from kvshift_memory.adapters import (
    CORE_TOKENS,
    RECALL,
    CoreLine,
    WriteBackModel,
    archive,
    change_block,
    core_text,
    get_item,
    last_sentence,
    message_key,
    parse_markers,
    placed_lines,
    recall,
    render_memories,
)
from langchain_kvshift.chat_models import ChatKVShift
from langchain_kvshift.store import KVShiftStore

__all__ = ["KVShiftMiddleware"]

# the human's own words, kept on the marked message (the content also holds the recalled memories)
ORIGINAL = "kvshift_original"
# characters per token, to size the core block for a model whose tokenizer this cannot count with
_CHARS_PER_TOKEN = 4


class KVShiftMiddleware(AgentMiddleware):
    """Recalled memories before the model call, write-back after the answer.

    :param store: the :class:`~kvshift_memory.MemoryStore`; default: the one under the agent's
        :class:`~langchain_kvshift.KVShiftStore` (``runtime.store``).
    :param user_id: the tenant, for an agent of one user; default: the run context's ``user_id``.
        Recall never crosses it.
    :param session_id: archived messages are stored under it (default: the run context's
        ``session_id``, else ``"default"``); recall reaches all the user's sessions.
    :param recall_k: memories recalled per message (most relevant last), each with a similarity of
        at least ``recall_min_score``; memories the conversation shows already are skipped.
    :param write_back: archive the human's messages the bundled write-back rule finds worth keeping.
    :param core: lay the user's core block after the system prompt of every model call.
    :param core_tokens: the block's budget in tokens (lines past it are recalled by search).
    :param core_facts: facts the human states about themselves join the block on their own
        (``AgentSettings.core_facts``); ``False`` keeps the block to what is pinned and the profile.
    :param profile: the namespace and key of the user's profile item, ``"{user_id}"`` standing
        for the user (LangMem's ``("memories", "{user_id}", "profile")``): its text is a line of
        the core block, and a new profile appends a line that supersedes the last one.
    :raises InvalidInputError: a bad ``core_tokens`` or ``profile``.
    """

    def __init__(
        self,
        store: MemoryStore | None = None,
        user_id: str | None = None,
        session_id: str | None = None,
        *,
        recall_k: int = RECALL.k,
        recall_min_score: float = RECALL.min_score,
        memories_header: str = "What you remember about the user:",
        write_back: bool = True,
        core: bool = True,
        core_tokens: int = CORE_TOKENS,
        profile: tuple[str, ...] | None = None,
        core_facts: bool = True,
    ) -> None:
        super().__init__()
        if profile is not None and not (
            isinstance(profile, tuple) and len(profile) >= 2 and all(isinstance(label, str) for label in profile)
        ):
            raise InvalidInputError(
                f"profile is a namespace and a key, as ('memories', '{{user_id}}', 'profile'), got {profile!r}"
            )
        self.core = core
        self.core_tokens = inputs.check_positive_int(core_tokens, "core_tokens")
        self.profile = profile
        self.core_facts = core_facts
        self.store = store
        self.user_id = user_id
        self.session_id = session_id
        self.recall_k = recall_k
        self.recall_min_score = recall_min_score
        self.memories_header = memories_header
        self.write_back = write_back
        self._rule = WriteBackModel.bundled()

    def who(self, runtime: Runtime[Any] | None) -> tuple[MemoryStore, str, str | None]:
        """The store, user and session of this run.

        :raises InvalidInputError: no user given or in the run's context, or no store given and
            the agent's store is not a :class:`KVShiftStore`.
        """
        context = getattr(runtime, "context", None)

        def from_context(name: str) -> Any:
            return context.get(name) if isinstance(context, dict) else getattr(context, name, None)

        user = self.user_id or from_context("user_id")
        if not isinstance(user, str) or not user:
            raise InvalidInputError(
                "KVShiftMiddleware needs the user: KVShiftMiddleware(user_id=...), or "
                "agent.invoke(..., context={'user_id': ...})"
            )
        store = self.store
        if store is None:
            agent_store = getattr(runtime, "store", None)
            if not isinstance(agent_store, KVShiftStore):
                raise InvalidInputError(
                    "KVShiftMiddleware needs a store: KVShiftMiddleware(store=...), "
                    "or create_agent(store=KVShiftStore(...))"
                )
            store = agent_store.memory_store
        session = self.session_id or from_context("session_id")
        return store, user, session if isinstance(session, str) and session else None

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
        """Lay the user's core block after the system prompt, and tell a ChatKVShift model whose
        call this is (its K/V reuse and memory markers follow the user)."""
        return handler(self._for_user(request))

    async def awrap_model_call(
        self, request: ModelRequest, handler: Callable[[ModelRequest], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        """:meth:`wrap_model_call` for async runs (the store is read in a worker thread)."""
        return await handler(await asyncio.to_thread(self._for_user, request))

    def core_lines(self, runtime: Runtime[Any] | None, model: BaseChatModel | None = None) -> tuple[CoreLine, ...]:
        """The lines of the user's core block this run's prompt shows (the profile item read first).

        :raises InvalidInputError: as :meth:`who`; :class:`StoreError`: the store failed.
        """
        if not self.core:
            return ()
        store, user, session = self.who(runtime)
        if self.profile is not None:
            self._place_profile(store, user, runtime)
        engine = model.engine if isinstance(model, ChatKVShift) else None
        if engine is not None:

            def count(text: str) -> int:
                return engine.count_tokens(text, tenant=user)
        else:

            def count(text: str) -> int:
                return len(text) // _CHARS_PER_TOKEN + 1

        # without a session, a fact stated in this conversation is placed at once (nothing tells it from the next)
        return placed_lines(store, user, session_id=session, count_tokens=count, budget_tokens=self.core_tokens)

    def _place_profile(self, store: MemoryStore, user: str, runtime: Runtime[Any] | None) -> None:
        """Append the profile item's text to the core block when it changed (a line per profile
        version, the last one current), or take its lines out when the item is gone."""
        assert self.profile is not None
        *namespace, key = (label.replace("{user_id}", user) for label in self.profile)
        agent_store = getattr(runtime, "store", None)
        tenant = agent_store.tenant_of(namespace) if isinstance(agent_store, KVShiftStore) else user
        item = get_item(store, tenant, namespace, key)
        line_key = "profile\0" + "\0".join([*namespace, key])
        if item is None:
            change_block(store, user, lambda block: block.without_key(line_key))
        else:
            memory = item.memory
            change_block(store, user, lambda block: block.pinned(memory.id, memory.version, memory.text, "", line_key))

    def _for_user(self, request: ModelRequest) -> ModelRequest:
        lines = self.core_lines(request.runtime, request.model)
        if lines:
            system = request.system_prompt
            block = core_text(lines)
            request = request.override(system_message=SystemMessage(f"{system}\n\n{block}" if system else block))
        if not isinstance(request.model, ChatKVShift):
            return request
        store, user, _ = self.who(request.runtime)
        # recall reaches every session of the user, so its markers resolve in every session
        settings = {**request.model_settings, "store": store, "user_id": user, "session_id": None}
        return request.override(model_settings=settings)

    def before_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """Put the memories the last human message recalls in front of it (once per message).

        :raises InvalidInputError: as :meth:`who`.
        :raises StoreError: the store cannot be searched.
        """
        store, user, session = self.who(runtime)
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
            store,
            last.text,
            user_id=user,
            session_id=session,
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

        :raises InvalidInputError: as :meth:`who`.
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
        store, user, session = self.who(runtime)
        # the message's id (LangGraph gives every message one) tells a replay from the same words sent again
        key = human.id or message_key(reply)
        archive(
            self._rule,
            store,
            text,
            last_sentence(reply),
            user_id=user,
            session_id=session or "default",
            message_key=key,
            core_facts=self.core_facts,
        )
        return None

    async def abefore_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """:meth:`before_model` in a worker thread (the store's search embeds the message)."""
        return await asyncio.to_thread(self.before_model, state, runtime)

    async def aafter_model(self, state: AgentState[Any], runtime: Runtime[Any]) -> dict[str, Any] | None:
        """:meth:`after_model` in a worker thread."""
        return await asyncio.to_thread(self.after_model, state, runtime)
