"""KVShiftMiddleware in a LangChain 1.x agent on the bundled model: recall before, write-back after."""

from __future__ import annotations

import asyncio
import warnings

import pytest
from langchain.agents import create_agent
from langchain_core.messages import HumanMessage

from kvshift_memory import MemoryStore
from kvshift_memory.adapters import WriteBackModel
from langchain_kvshift import ChatKVShift, KVShiftMiddleware
from langchain_kvshift.middleware import ORIGINAL

warnings.filterwarnings("ignore", category=DeprecationWarning)

FACTS = ["The budget for the Lisbon trip is 50k euros.", "Ana, my sister, lives in Porto and works as a nurse."]
NEWS = "I just moved to Rua Augusta 12 in Lisbon, and my new phone number is 555 0199, please remember it."


@pytest.fixture
def store(tmp_path):
    with MemoryStore(tmp_path / "store") as store:
        for fact in FACTS:
            store.add(fact, tenant="alice", session_id="earlier")
        store.add("Bob's door code is 4512.", tenant="bob")
        yield store


def _agent(store):
    llm = ChatKVShift(store=store, user_id="alice", max_tokens=20)
    placed = []
    engine = llm.loaded_engine()
    original = engine.generate

    def generate(messages, *args, **kwargs):
        placed.extend(r for m in messages for r in m.get("memories", ()))
        return original(messages, *args, **kwargs)

    engine.generate = generate
    return (
        create_agent(model=llm, tools=[], middleware=[KVShiftMiddleware(store, "alice", "today")]),
        placed,
        engine,
        original,
    )


def test_recalled_memories_are_placed_and_the_next_turn_reuses_the_first(store):
    agent, placed, engine, original = _agent(store)
    try:
        state = agent.invoke({"messages": [HumanMessage("What is the budget for the Lisbon trip?")]})
        marked = state["messages"][0]
        assert marked.additional_kwargs[ORIGINAL] == "What is the budget for the Lisbon trip?"
        assert "⟦mem:" in marked.content and len(state["messages"]) == 2  # replaced in place, not added
        assert {r.text for r in placed} <= set(FACTS) and placed and all(r.tenant == "alice" for r in placed)
        state = agent.invoke({"messages": [*state["messages"], HumanMessage("Where does my sister live?")]})
        usage = state["messages"][-1].usage_metadata
        assert usage["input_token_details"]["cache_read"] >= 0.7 * usage["input_tokens"], usage
        shown = [m for m in state["messages"] if isinstance(m, HumanMessage)]
        assert (
            sum(m.content.count("Porto") for m in shown) == 1
        )  # a memory the conversation shows is not recalled twice
    finally:
        engine.generate = original


def test_the_human_message_is_written_back_when_the_rule_archives_it(store):
    agent, _, engine, original = _agent(store)
    rule = WriteBackModel.bundled()
    try:
        asyncio.run(agent.ainvoke({"messages": [HumanMessage(NEWS)]}))
    finally:
        engine.generate = original
    assert rule.decide(rule.importance(NEWS, "")) == "archive"  # a message the rule keeps
    stored = [r.text for r in store.search("new phone number and address", tenant="alice", k=5)]
    assert NEWS in stored and not any("4512" in text for text in stored)
    assert [r.session_id for r in store.search(NEWS, tenant="alice", k=1)] == ["today"]


def test_instructions_meant_for_a_tool_delete_no_memory_through_an_agent(tmp_path):
    """A create_agent agent with a tool bound and the middleware: six imperatives about things in the world."""
    from langchain_core.tools import tool

    @tool
    def run_task(task: str) -> str:
        """Carry out a task in the user's workspace."""
        return "done"

    import json
    from pathlib import Path

    cases = json.loads((Path(__file__).parents[4] / "tests" / "data" / "tool_instructions.json").read_text("utf-8"))
    memories, instructions = cases["memories"], cases["instructions"]
    with MemoryStore(tmp_path / "store") as store:
        records = [store.add(text, tenant="alice") for text in memories]
        agent = create_agent(
            model=ChatKVShift(store=store, user_id="alice", max_tokens=12),
            tools=[run_task],
            middleware=[KVShiftMiddleware(store, "alice", "today")],
        )
        for instruction in instructions:
            agent.invoke({"messages": [HumanMessage(instruction)]})
        assert [store.get(r.id, tenant="alice") is not None for r in records] == [True] * 6


def test_the_same_request_to_forget_later_is_carried_out_again_and_a_replay_deletes_nothing(tmp_path):
    from langchain_core.messages import AIMessage

    with MemoryStore(tmp_path / "store") as store:
        store.add("The door code of the office is 4417.", tenant="alice")
        kept = store.add("The office wifi password is tulip.", tenant="alice")
        middleware = KVShiftMiddleware(store, "alice", "today")
        forget = "Forget the door code of the office."
        first = [HumanMessage(forget, id="m1"), AIMessage("Done.", id="a1")]
        middleware.after_model({"messages": first}, None)
        assert not [r for r in store.search("door code", tenant="alice", k=4) if "door code" in r.text]
        new_code = store.add("The door code of the office is 9902 now.", tenant="alice")
        later = [*first, HumanMessage("It changed.", id="m2"), AIMessage("Noted.", id="a2")]
        later += [HumanMessage(forget, id="m3"), AIMessage("Done.", id="a3")]
        for _ in range(2):  # the second time a replay of the same state: nothing more is deleted
            middleware.after_model({"messages": later}, None)
            assert store.get(new_code.id, tenant="alice") is None
            assert store.get(kept.id, tenant="alice") is not None


def test_the_users_core_block_and_langmem_profile_lead_the_system_message_in_every_session(tmp_path):
    from langchain_kvshift import KVShiftStore

    with MemoryStore(tmp_path / "store") as memory_store:
        store = KVShiftStore(memory_store, tenant_at=1)  # LangMem's layout: ("memories", user_id)
        store.put(("memories", "alice"), "profile", {"content": "Alice Moreau, a pharmacist in Lyon."})
        store.put(("memories", "bob"), "profile", {"content": "Bob Kane, a pilot in Oslo."})
        llm = ChatKVShift(store=memory_store, user_id="alice", max_tokens=8)
        engine = llm.loaded_engine()
        prompts: list[str] = []
        original = engine.generate

        def generate(messages, *args, **kwargs):
            prompts.append(messages[0]["content"] if messages[0]["role"] == "system" else "")
            return original(messages, *args, **kwargs)

        engine.generate = generate
        middleware = KVShiftMiddleware(profile=("memories", "{user_id}", "profile"))
        agent = create_agent(model=llm, tools=[], middleware=[middleware], store=store, system_prompt="Be brief.")
        try:
            for session in ("monday", "tuesday"):
                agent.invoke(
                    {"messages": [HumanMessage("Hello, what should I cook tonight?")]},
                    context={"user_id": "alice", "session_id": session},
                )
            store.put(("memories", "alice"), "profile", {"content": "Alice Moreau, a pharmacist in Paris now."})
            agent.invoke(
                {"messages": [HumanMessage("Any plans?")]}, context={"user_id": "alice", "session_id": "wednesday"}
            )
        finally:
            engine.generate = original
    monday, tuesday, wednesday = prompts
    assert monday == tuesday and monday.startswith("Be brief.") and "Alice Moreau, a pharmacist in Lyon." in monday
    assert "Oslo" not in monday  # one user's profile is never another's
    # a new profile supersedes the last; alone in the block, the superseded line passes the share: compacted
    assert wednesday.endswith("Alice Moreau, a pharmacist in Paris now.") and "Lyon" not in wednesday


@pytest.mark.parametrize(
    "settings",
    [{"profile": "profile"}, {"profile": ("profile",)}, {"profile": ("memories", 3)}, {"core_tokens": 0}],
)
def test_a_bad_core_setting_is_refused(settings):
    from kvshift_memory import InvalidInputError

    with pytest.raises(InvalidInputError):
        KVShiftMiddleware(**settings)
