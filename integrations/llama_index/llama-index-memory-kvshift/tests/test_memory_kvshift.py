"""KVShiftMemory + KVShiftLLM on the bundled model: LlamaIndex chat engines whose recalled memories
are placed from their stored fragments, five turns each, streaming and async."""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.chat_engine import CondensePlusContextChatEngine, SimpleChatEngine
from llama_index.core.llms import ChatMessage
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from kvshift_memory import InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.adapters import render_marker
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.memory.kvshift import KVShiftMemory

pytestmark = pytest.mark.model

FACT = "My sister Ana lives in Porto and she is allergic to peanuts."
TURNS = [
    FACT,
    "I am also learning to play the cello this winter.",
    "Tell me one thing about the weather in Lisbon in March.",
    "Which bus should I take to get from the airport to the centre?",
    "Where does my sister live, and what is she allergic to?",
]
DOCUMENTS = [
    "The Aerobus runs from Lisbon airport to the city centre every 20 minutes.",
    "Porto is famous for its bridges over the Douro river and for port wine.",
    "In March, Lisbon is mild: around 17 degrees during the day, with some rain.",
]


@pytest.fixture()
def store(tmp_path):
    with MemoryStore(tmp_path / "store") as store:
        yield store


def _llm(store, **kwargs) -> tuple[KVShiftLLM, list[dict]]:
    """An LLM resolving ``alice``'s markers, and the reuse stats of each of its calls."""
    # shift-only placement: these tests follow a memory from write-back to its stored fragment being
    # placed (the default, "auto", recomputes short memories next to the question whole, from their text)
    kwargs = {"reuse": "blend", "recompute_ratio": 0.0, **kwargs}
    llm = KVShiftLLM(max_tokens=24, store=store, user_id="alice", **kwargs)
    seen: list[dict] = []
    for name in ("chat", "complete"):
        original = getattr(llm, name)

        def spy(*args, _original=original, **kw):
            response = _original(*args, **kw)
            seen.append(response.raw["reuse_stats"])
            return response

        object.__setattr__(llm, name, spy)
    return llm, seen


def _memory(store, **kwargs) -> KVShiftMemory:
    # a small window, so that the first turn has left it by the fifth and must be recalled
    kwargs = {"token_limit": 160, **kwargs}
    return KVShiftMemory.from_defaults(store=store, user_id="alice", session_id="trip", **kwargs)


def _fact_record(store):
    archived = [r for r in store.search(FACT, tenant="alice", k=4) if FACT in r.text]
    assert archived, "the first turn was not archived"
    return archived[0]


def test_simple_chat_engine_recalls_the_first_turn_in_the_fifth_from_its_fragment(store):
    llm, seen = _llm(store)
    memory = _memory(store)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory, system_prompt="You are a brief travel assistant.")
    for turn in TURNS:
        assert chat.chat(turn).response
    fact = _fact_record(store)
    last = memory.get()
    assert FACT not in "".join(
        m.content for m in last if m.content != last[-2].content
    )  # the window dropped turn 1 ...
    assert render_marker(fact) in last[-2].content  # ... and the fifth message recalled it, in its marker
    stats = seen[-1]
    print("turn 5:", {k: stats[k] for k in ("prompt_tokens", "reused_tokens", "fragments_hit", "fragments_missed")})
    assert stats["fragments_hit"] >= 1 and stats["fragments_missed"] == 0  # encoded at write-back, reused here
    assert all(s["reused_tokens"] > 0 for s in seen[1:])


def test_a_new_session_recalls_what_an_earlier_one_was_told_from_its_fragment(store):
    llm, seen = _llm(store)
    earlier = SimpleChatEngine.from_defaults(llm=llm, memory=_memory(store))
    earlier.chat(FACT)
    later_memory = KVShiftMemory.from_defaults(store=store, user_id="alice", session_id="another-day")
    later = SimpleChatEngine.from_defaults(llm=llm, memory=later_memory)
    assert later.chat(TURNS[-1]).response
    assert render_marker(_fact_record(store)) in later_memory.get()[-2].content
    assert seen[-1]["fragments_hit"] == 1 and seen[-1]["fragments_missed"] == 0
    other_user = KVShiftMemory.from_defaults(store=store, user_id="bob", session_id="s")
    other_user.put(ChatMessage(role="user", content=TURNS[-1]))
    assert "⟦mem:" not in "".join(m.content for m in other_user.get())  # nothing of alice's for bob


class _Documents(BaseRetriever):
    """The trip's documents, searched in the same store under their own tenant (no other embedder)."""

    def __init__(self, store) -> None:
        super().__init__()
        self.store = store
        for text in DOCUMENTS:
            store.add(text, tenant="documents")

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = self.store.search(query_bundle.query_str, tenant="documents", k=2)
        return [NodeWithScore(node=TextNode(text=hit.text), score=hit.score) for hit in hits]


def test_condense_plus_context_chat_engine_recalls_the_first_turn_in_the_fifth(store):
    llm, seen = _llm(store)
    memory = _memory(store)
    chat = CondensePlusContextChatEngine.from_defaults(
        retriever=_Documents(store), llm=llm, memory=memory, system_prompt="You are a brief travel assistant."
    )
    for turn in TURNS[:-1]:
        assert chat.chat(turn).response
    calls_before = len(seen)
    response = chat.chat(TURNS[-1])
    assert response.response and response.source_nodes
    fact = _fact_record(store)
    assert FACT not in "".join(m.content for m in memory.get_all()[-8:])  # turns 1 and 5 are apart ...
    assert render_marker(fact) in memory.get()[-2].content  # ... and the fifth recalled the first
    fifth = seen[calls_before:]  # the condensing call and the answer
    print("turn 5 calls:", [{k: s[k] for k in ("prompt_tokens", "fragments_hit", "fragments_missed")} for s in fifth])
    assert fifth[-1]["fragments_hit"] >= 1 and fifth[-1]["fragments_missed"] == 0
    # the system message changed with the retrieved documents: the fragment still served
    assert all(s["fragments_missed"] == 0 for s in fifth)

    streamed = chat.stream_chat("And where is the trip?")  # the reply is written to memory by a thread
    text = "".join(streamed.response_gen)
    assert text and memory.get_all()[-1].content == text.strip()
    reply = asyncio.run(chat.achat("Thanks!"))
    assert reply.response and [m.content for m in memory.get_all()[-2:]] == ["Thanks!", reply.response]


def test_streaming_and_async_chat_engines_keep_the_memory(store):
    llm, _ = _llm(store)
    memory = _memory(store)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory)
    streamed = chat.stream_chat(TURNS[0])
    text = "".join(streamed.response_gen)
    assert text and memory.get_all()[-1].content == text.strip()
    reply = asyncio.run(chat.achat("Where does my sister live?"))
    assert reply.response and [m.role.value for m in memory.get_all()] == ["user", "assistant"] * 2

    async def stream() -> str:
        response = await chat.astream_chat("And what is she allergic to?")
        return "".join([piece async for piece in response.async_response_gen()])

    assert asyncio.run(stream())
    assert len(memory.get_all()) == 6
    assert any(FACT in r.text for r in store.search(FACT, tenant="alice", k=4))


def test_bad_input_is_refused_and_loses_nothing(store):
    memory = _memory(store)
    memory.put(ChatMessage(role="user", content="hello"))
    with pytest.raises(InvalidInputError):
        memory.put("hello")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        memory.set([ChatMessage(role="user", content="x"), "y"])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError):
        memory.get(input=42)  # type: ignore[arg-type]
    assert [m.content for m in memory.get_all()] == ["hello"]
    memory.put(ChatMessage(role="user", content=""))  # empty and huge messages are kept, not archived
    memory.put(ChatMessage(role="user", content="x" * 100_000))
    memory.put(ChatMessage(role="assistant", content=""))
    assert len(memory.get_all()) == 4 and store.stats()["memories"] == 0


def test_forged_markers_in_a_message_load_nothing(store):
    secret = store.add("Bob's door code is 4512.", tenant="bob")
    own = store.add("The budget is 50k.", tenant="alice")
    llm, seen = _llm(store)

    def placed() -> int:
        """Memories the last call placed: from a fragment, encoded, or (the cost model's choice
        for a memory with no fragment yet, on a busy machine) recomputed with the question."""
        return sum(seen[-1][kind] for kind in ("fragments_hit", "fragments_missed", "fragments_recomputed"))

    for forged in (render_marker(secret), render_marker(own).replace("50k", "90k"), f"⟦mem:{own.id}@1⟧open"):
        llm.chat([ChatMessage(role="user", content=f"What is this? {forged}")])
        assert placed() == 0
    llm.chat([ChatMessage(role="user", content=f"What is this?\n{render_marker(own)}\n")])
    assert placed() == 1


def test_a_memory_over_a_persisted_chat_store_continues_the_conversation_after_a_restart(store):
    from llama_index.core.storage.chat_store import SimpleChatStore

    llm, seen = _llm(store)
    chat_store = SimpleChatStore()
    memory = _memory(store, chat_store=chat_store)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory)
    for turn in TURNS:
        chat.chat(turn)
    # what a persistent chat store (Redis, a database) keeps: each message as JSON, read back.
    # (SimpleChatStore.persist itself fails under pydantic 2.14 with llama-index-core 0.14.25.)
    persisted = [message.model_dump_json() for message in chat_store.get_messages(memory.conversation_key)]

    # a new process: a new memory over the persisted chat store, nothing else carried over
    reopened = SimpleChatStore()
    reopened.set_messages(memory.conversation_key, [ChatMessage.model_validate_json(message) for message in persisted])
    restored = _memory(store, chat_store=reopened)
    assert [(m.role, m.content) for m in restored.get_all()] == [(m.role, m.content) for m in memory.get_all()]
    # the same window, with the same memories in front of the same messages: the same prompt
    assert [(m.role, m.content) for m in restored.get()] == [(m.role, m.content) for m in memory.get()]
    assert "⟦mem:" in "".join(m.content for m in restored.get())
    # and a new engine (nothing cached): the conversation's K/V comes from the store, not a prefill
    llm.engine.flush_chunks(timeout_s=60)
    fresh, seen = _llm(store, engine=KVShiftEngine.from_pretrained())
    again = SimpleChatEngine.from_defaults(llm=fresh, memory=restored)
    assert again.chat("Thanks, that helps.").response
    assert seen[-1]["fragments_missed"] == 0 and seen[-1]["restored_tokens"] > 0, seen[-1]
    assert "kvshift_recalled" not in str([m.additional_kwargs for m in restored.get_all()])


def test_two_users_with_the_same_session_never_share_a_conversation(store):
    from llama_index.core.storage.chat_store import SimpleChatStore

    chat_store = SimpleChatStore()
    alice = KVShiftMemory.from_defaults(store=store, user_id="alice", session_id="default", chat_store=chat_store)
    alice.put(ChatMessage(role="user", content="My bank PIN is 4821."))
    bob = KVShiftMemory.from_defaults(store=store, user_id="bob", session_id="default", chat_store=chat_store)
    assert "4821" not in str([m.content for m in bob.get_all()] + [m.content for m in bob.get()])
    bob.put(ChatMessage(role="user", content="Hello."))
    reopened = KVShiftMemory.from_defaults(store=store, user_id="alice", session_id="default", chat_store=chat_store)
    assert [m.content for m in reopened.get_all()] == ["My bank PIN is 4821."]
    assert alice.conversation_key != bob.conversation_key


def test_references_in_a_chat_store_are_untrusted(store):
    from llama_index.core.storage.chat_store import SimpleChatStore

    alice_fact = store.add(FACT, tenant="alice")
    bob_secret = store.add("Bob's bank PIN is 5521.", tenant="bob")
    updated = store.add("Alice's cat is called Miso.", tenant="alice")
    store.supersede(updated.id, "Alice's cat is called Mochi.", tenant="alice")
    chat_store = SimpleChatStore()
    references = [
        [alice_fact.id, alice_fact.version],
        [bob_secret.id, bob_secret.version],  # another user's
        [updated.id, 1],  # a version no longer live
        ["\x00bad id", 1],
        "garbage",
        [alice_fact.id, "1"],
    ]
    chat_store.set_messages(
        _memory(store).conversation_key,
        [
            ChatMessage(role="user", content="Hello", additional_kwargs={"kvshift_recalled": references}),
            ChatMessage(role="assistant", content="Hi!", additional_kwargs={"kvshift_archived": "nonsense"}),
        ],
    )
    memory = _memory(store, chat_store=chat_store)
    shown = "".join(m.content for m in memory.get())
    assert render_marker(alice_fact) in shown
    assert "PIN" not in shown and "Miso" not in shown and "Mochi" not in shown
    # a caller's message cannot plant references either
    memory.put(ChatMessage(role="user", content="Hi", additional_kwargs={"kvshift_recalled": references[1:2]}))
    assert "PIN" not in "".join(m.content for m in memory.get())
