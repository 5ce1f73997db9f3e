"""KVShiftStore: a LangGraph store over the memory store, and agents that use it for many users."""

from __future__ import annotations

import asyncio
import json
import warnings

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool

from kvshift_memory import InvalidInputError, MemoryStore
from kvshift_memory.adapters import get_item
from langchain_kvshift import ChatKVShift, KVShiftMiddleware, KVShiftStore

warnings.filterwarnings("ignore", category=DeprecationWarning)


@pytest.fixture
def memory_store(tmp_path):
    with MemoryStore(tmp_path / "store") as store:
        yield store


def test_put_get_search_delete_round_trip_with_namespace_isolation(memory_store):
    store = KVShiftStore(memory_store)
    store.put(("alice", "memories"), "budget", {"text": "The budget for the Lisbon trip is 50k euros.", "kind": "fact"})
    store.put(("alice", "memories"), "sister", {"text": "Ana, my sister, lives in Porto.", "kind": "family"})
    store.put(("alice", "prefs"), "food", {"content": "Alice is vegetarian."})
    store.put(("bob", "memories"), "code", {"text": "Bob's door code is 4512."})

    item = store.get(("alice", "memories"), "budget")
    assert item.value["kind"] == "fact" and item.key == "budget" and item.namespace == ("alice", "memories")
    assert store.get(("bob", "memories"), "budget") is None  # another tenant's namespace holds no such key

    hits = store.search(("alice", "memories"), query="Where does my sister live?", limit=1)
    assert [hit.key for hit in hits] == ["sister"] and hits[0].score is not None
    everything_of_alice = store.search(("alice",), query="door code", limit=10)
    assert {hit.key for hit in everything_of_alice} == {"budget", "sister", "food"}  # never Bob's
    assert [hit.key for hit in store.search(("alice",), filter={"kind": "family"})] == ["sister"]
    assert store.search(("alice", "memories"), filter={"kind": {"$ne": "fact"}})[0].key == "sister"

    assert store.list_namespaces(prefix=("alice",)) == [("alice", "memories"), ("alice", "prefs")]
    assert store.list_namespaces(suffix=("*", "memories"), max_depth=1) == [
        ("alice",),
        ("bob",),
    ]

    store.delete(("alice", "memories"), "budget")
    assert store.get(("alice", "memories"), "budget") is None
    assert "budget" not in {hit.key for hit in store.search(("alice",), query="budget Lisbon")}


def test_a_put_again_replaces_the_memory_and_a_put_after_delete_makes_a_new_one(memory_store):
    store = KVShiftStore(memory_store)
    store.put(("alice", "m"), "city", {"text": "Alice lives in Porto."})
    first = get_item(memory_store, "alice", ("alice", "m"), "city").memory
    store.put(("alice", "m"), "city", {"text": "Alice lives in Lisbon now."})
    second = get_item(memory_store, "alice", ("alice", "m"), "city").memory
    # the item row moves to a new memory in one compare-and-set: no reader sees the text ahead of the value
    assert second.id != first.id and memory_store.get(first.id, tenant="alice") is None
    assert [r.text for r in memory_store.search("where does Alice live", tenant="alice", k=5)] == [second.text]
    store.delete(("alice", "m"), "city")
    store.put(("alice", "m"), "city", {"text": "Alice lives in Madrid."})
    third = get_item(memory_store, "alice", ("alice", "m"), "city").memory
    assert third.id != first.id and third.version == 1  # ids are never reused


def test_async_operations_and_the_batch_run_in_order(memory_store):
    store = KVShiftStore(memory_store)

    async def run():
        await store.aput(("alice", "m"), "a", {"text": "Alice plays the cello."})
        return await store.aget(("alice", "m"), "a"), await store.asearch(("alice",), query="music instrument")

    item, hits = asyncio.run(run())
    assert item.value["text"] == "Alice plays the cello." and hits[0].key == "a"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.put((), "k", {"text": "x"}), "(?i)namespace"),
        (lambda s: s.put(("alice",), "", {"text": "x"}), "key"),
        (lambda s: s.put(("alice",), "k", {"text": float("nan")}), "JSON"),
        (lambda s: s.put(("alice",), "k", {"blob": "x" * (2 << 20)}), "bytes"),
        (lambda s: s.put(("alice",), "k", {"text": "x"}, ttl=0), "minutes"),
        (lambda s: s.search(("alice",), filter={"kind": {"$regex": "x"}}), "operator"),
    ],
)
def test_bad_input_is_a_clear_error_and_writes_nothing(memory_store, call, match):
    store = KVShiftStore(memory_store)
    store.put(("alice",), "kept", {"text": "Alice keeps this."})
    with pytest.raises((InvalidInputError, ValueError, NotImplementedError), match=match):
        call(store)
    assert [hit.key for hit in store.search(("alice",))] == ["kept"]


def test_tampered_rows_are_ignored_never_followed(memory_store):
    store = KVShiftStore(memory_store)
    store.put(("alice", "m"), "a", {"text": "Alice's secret is 77."})
    store.put(("bob", "m"), "b", {"text": "Bob likes jazz."})
    bob_memory = get_item(memory_store, "bob", ("bob", "m"), "b").memory
    alice_row = next(key for key in memory_store.tier.scan("i/alice/"))
    # Bob's memory names Alice's row as its item: never followed across tenants
    (record_key,) = memory_store.tier.scan(f"r/bob/{bob_memory.id}/")
    forged = json.loads(memory_store.tier.get(record_key))
    memory_store.tier.set(record_key, json.dumps({**forged, "item": alice_row}).encode())
    assert store.search(("bob",), query="secret") == []
    memory_store.tier.set(alice_row, b"{not json")
    assert store.get(("alice", "m"), "a") is None and store.search(("alice",)) == []
    memory_store.tier.set(alice_row, json.dumps({"id": "../../etc", "namespace": ["alice", "m"], "key": "a"}).encode())
    assert store.get(("alice", "m"), "a") is None


def test_langmems_layout_finds_a_users_item_among_a_hundred_others(memory_store):
    """LangMem keeps every user under ("memories", user_id): with the default tenant_at the users share
    one tenant, and a search of one user's namespace must still find that user's item at limit 1."""
    store = KVShiftStore(memory_store)
    for user in range(100):
        store.put(("memories", f"user{user}"), "home", {"content": f"User {user} lives in Lisbon near the river."})
    store.put(("memories", "alice"), "home", {"content": "Alice lives in Porto near the bridge."})
    hits = store.search(("memories", "alice"), query="where does this user live", limit=1)
    assert [(hit.namespace, hit.value["content"]) for hit in hits] == [
        (("memories", "alice"), "Alice lives in Porto near the bridge.")
    ]
    # the documented setting: the user's label is the tenant
    per_user = KVShiftStore(memory_store, tenant_at=1)
    per_user.put(("memories", "bob"), "home", {"content": "Bob lives in Faro."})
    assert [hit.key for hit in per_user.search(("memories", "bob"), query="where does Bob live", limit=1)] == ["home"]
    assert per_user.search(("memories", "carol"), query="where does Bob live") == []


def test_an_admin_view_reaches_every_tenant(memory_store):
    store = KVShiftStore(memory_store)
    store.put(("alice", "m"), "a", {"text": "Alice plays the cello."})
    store.put(("bob", "m"), "b", {"text": "Bob plays the drums."})
    found = store.search((), query="which instrument", limit=10)
    assert {(hit.namespace[0], hit.key) for hit in found} == {("alice", "a"), ("bob", "b")}
    assert [hit.score for hit in found] == sorted((hit.score for hit in found), reverse=True)
    assert {hit.key for hit in store.search(())} == {"a", "b"}
    assert store.list_namespaces() == [("alice", "m"), ("bob", "m")]


def test_a_put_with_index_false_is_stored_but_never_embedded_or_found(memory_store):
    embedded: list[str] = []
    real_embed = memory_store.embedder.embed

    def counting(texts):
        embedded.extend(texts)
        return real_embed(texts)

    memory_store.embedder.embed = counting
    store = KVShiftStore(memory_store)
    store.put(("alice", "m"), "pin", {"text": "My bank PIN is 4821."}, index=False)
    assert embedded == []
    assert store.get(("alice", "m"), "pin").value == {"text": "My bank PIN is 4821."}
    assert store.search(("alice",), query="bank PIN") == []
    embedded.clear()  # the search embedded its query
    store.put(("alice", "m"), "note", {"text": "Buy milk.", "secret": "do not embed"}, index=["text"])
    assert embedded == ["Buy milk."]


SYSTEM = (
    "You are a travel assistant for a small team planning trips to Lisbon, Porto and Madrid. You remember "
    "what each user told you in earlier conversations and use it when it helps. Budgets are in euros; dates "
    "are in European format. Answer in one or two sentences, and say so when you do not know."
)


@tool
def lookup_fact(topic: str) -> str:
    """Look up a fact about a topic in the team's notes."""
    return {"budget": "The budget is 50k euros."}.get(topic.lower(), "The notes say the trip is to Lisbon.")


@wrap_model_call
def call_a_tool_first(request, handler):
    """A small model seldom calls a tool unforced: the first model call of a run must call one."""
    if not any(isinstance(m, ToolMessage) for m in request.messages):
        request = request.override(tool_choice="any")
    return handler(request)


def test_one_agent_serves_two_users_from_context_and_reuses_its_prompt(memory_store):
    store = KVShiftStore(memory_store)
    store.put(("alice", "memories"), "sister", {"text": "Ana, my sister, lives in Porto and works as a nurse."})
    store.put(("bob", "memories"), "code", {"text": "Bob's door code is 4512."})
    agent = create_agent(
        model=ChatKVShift(max_tokens=24),
        tools=[],
        system_prompt=SYSTEM,
        middleware=[KVShiftMiddleware()],
        store=store,
    )
    state = agent.invoke(
        {"messages": [HumanMessage("Where does my sister live?")]}, context={"user_id": "alice", "session_id": "s1"}
    )
    assert "Porto" in state["messages"][0].content and "4512" not in state["messages"][0].content
    first = state["messages"][-1].usage_metadata
    state = agent.invoke(
        {"messages": [*state["messages"], HumanMessage("What does she do for work?")]},
        context={"user_id": "alice", "session_id": "s1"},
    )
    usage = state["messages"][-1].usage_metadata
    # the whole first turn is read from cache (prompt and answer, but for the answer's last token, which
    # was picked and never run through the model); the rest is the new message
    assert usage["input_token_details"]["cache_read"] >= first["input_tokens"] + first["output_tokens"] - 1, usage
    assert usage["input_token_details"]["cache_read"] >= 0.7 * usage["input_tokens"], usage
    bob = agent.invoke({"messages": [HumanMessage("What is my door code?")]}, context={"user_id": "bob"})
    shown = bob["messages"][0].content
    assert "4512" in shown and "Porto" not in shown
    with pytest.raises(InvalidInputError, match="needs the user"):
        agent.invoke({"messages": [HumanMessage("Who am I?")]})


def test_a_tool_call_round_trip_through_create_agent(memory_store):
    agent = create_agent(model=ChatKVShift(max_tokens=48), tools=[lookup_fact], middleware=[call_a_tool_first])
    state = agent.invoke({"messages": [HumanMessage("What is the budget? Look it up in the notes.")]})
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call, result, answer = state["messages"][1:]
    assert call.tool_calls[0]["name"] == "lookup_fact" and result.name == "lookup_fact"
    assert isinstance(answer, AIMessage) and answer.content and not answer.tool_calls
