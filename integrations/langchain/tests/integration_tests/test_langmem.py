"""LangMem's memory tools on KVShiftStore, as LangMem's quick start writes them: one namespace per
user, ``("memories", "{langgraph_user_id}")``, filled in from the run's config, and the store found
by the tools at run time (LangGraph injects it)."""

from __future__ import annotations

import json
import warnings

import langmem
import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.messages import HumanMessage, ToolMessage
from langgraph.func import entrypoint

from langchain_kvshift import ChatKVShift, KVShiftStore

warnings.filterwarnings("ignore", category=DeprecationWarning)

NAMESPACE = ("memories", "{langgraph_user_id}")


@pytest.fixture
def store(tmp_path):
    # LangMem names the user second: that label is the tenant, so users never share a search or a cache
    return KVShiftStore(tmp_path / "memories", tenant_at=1)


def user(name: str) -> dict:
    return {"configurable": {"langgraph_user_id": name}}


def test_manage_and_search_tools_create_update_find_and_delete_per_user(store):
    manage = langmem.create_manage_memory_tool(namespace=NAMESPACE)
    search = langmem.create_search_memory_tool(namespace=NAMESPACE)

    @entrypoint(store=store)
    def tools(call: dict) -> str:
        return (manage if call.pop("tool") == "manage" else search).invoke(call)

    created = tools.invoke({"tool": "manage", "content": "Alice's favourite city is Porto."}, user("alice"))
    memory_id = created.split()[-1]
    tools.invoke({"tool": "manage", "content": "Alice's sister Ana is a nurse."}, user("alice"))
    tools.invoke({"tool": "manage", "content": "Bob's door code is 4512."}, user("bob"))
    found = json.loads(tools.invoke({"tool": "search", "query": "which city does she like", "limit": 1}, user("alice")))
    assert [(hit["key"], hit["value"]["content"]) for hit in found] == [(memory_id, "Alice's favourite city is Porto.")]
    assert found[0]["namespace"] == ["memories", "alice"] and found[0]["score"] is not None
    assert "4512" not in tools.invoke({"tool": "search", "query": "door code"}, user("alice"))

    tools.invoke(
        {"tool": "manage", "action": "update", "id": memory_id, "content": "Alice's favourite city is Lisbon."},
        user("alice"),
    )
    assert store.get(("memories", "alice"), memory_id).value == {"content": "Alice's favourite city is Lisbon."}
    hits = json.loads(tools.invoke({"tool": "search", "query": "favourite city"}, user("alice")))
    assert "Alice's favourite city is Porto." not in [hit["value"]["content"] for hit in hits]  # never recalled again

    tools.invoke({"tool": "manage", "action": "delete", "id": memory_id}, user("alice"))
    assert store.get(("memories", "alice"), memory_id) is None
    assert [hit.value["content"] for hit in store.search(("memories", "alice"))] == ["Alice's sister Ana is a nurse."]
    assert [hit.value["content"] for hit in store.search(("memories", "bob"))] == ["Bob's door code is 4512."]


@wrap_model_call
def search_then_answer(request, handler):
    """A small model seldom calls a tool unforced, and once it has, calls it again and again: the
    first model call of a run searches, the next one answers."""
    searched = any(isinstance(m, ToolMessage) for m in request.messages)
    return handler(request.override(tool_choice="none" if searched else "search_memory"))


def test_langmems_quick_start_agent_searches_only_its_users_memories(store):
    manage = langmem.create_manage_memory_tool(namespace=NAMESPACE)

    @entrypoint(store=store)
    def remember(call: dict) -> str:
        return manage.invoke(call)

    remember.invoke({"content": "Alice's favourite city is Porto."}, user("alice"))
    remember.invoke({"content": "Bob's door code is 4512."}, user("bob"))
    agent = create_agent(
        model=ChatKVShift(max_tokens=64),
        tools=[manage, langmem.create_search_memory_tool(namespace=NAMESPACE)],
        middleware=[search_then_answer],
        store=store,
    )
    state = agent.invoke(
        {"messages": [HumanMessage("What is my favourite city? Search your memories.")]}, user("alice")
    )
    kinds = [type(m).__name__ for m in state["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
    call, result, answer = state["messages"][1:]
    assert call.tool_calls[0]["name"] == "search_memory" and result.status != "error", result.content
    found = [hit["value"]["content"] for hit in json.loads(result.content)]
    assert found == ["Alice's favourite city is Porto."]  # Alice's one memory; never Bob's
    assert answer.content and not answer.tool_calls
    usage = answer.usage_metadata
    assert usage["input_token_details"]["cache_read"] >= call.usage_metadata["input_tokens"], usage
