"""KVShiftRetriever: a user's document parts as marked documents, shifted into ChatKVShift's prompt."""

from __future__ import annotations

import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from kvshift_memory import KVShiftEngine, MemoryStore
from kvshift_memory.adapters import parse_markers
from langchain_kvshift import ChatKVShift, KVShiftRetriever

BRIEF = "\n\n".join(
    f"Section {n}. The Lisbon office opens in {2027 + n}. Marta leads hiring for team {n}; "
    f"Tom reviews the budget of {n * 10}k euros. Receipts go to the shared folder within a week."
    for n in range(1, 13)
)


@pytest.fixture
def store(tmp_path):
    with MemoryStore(tmp_path / "store") as store:
        yield store


def test_documents_carry_markers_order_and_source_and_only_the_users_own(store):
    engine = KVShiftEngine.shared()
    parts = store.add_document(
        BRIEF, tenant="alice", source="brief.md", max_tokens=150, count_tokens=engine.count_tokens
    )
    store.add("Bob's door code is 4512.", tenant="bob")
    docs = KVShiftRetriever(store=store, user_id="alice", k=3).invoke("Who reviews the budget?")
    assert len(docs) == 3
    by_id = {p.id: p for p in parts}
    for doc in docs:
        (span,) = [piece for piece in parse_markers(doc.page_content) if piece.memory_id]
        assert span.memory_id == doc.metadata["id"] and span.text == by_id[span.memory_id].text
        assert doc.metadata["source"] == "brief.md" and doc.metadata["document"] == parts[0].document
    assert [d.metadata["part"] for d in docs] == sorted(d.metadata["part"] for d in docs)  # the document's order
    searched = KVShiftRetriever(store=store, user_id="alice", k=3, document_order=False).invoke(
        "Who reviews the budget?"
    )
    assert {d.metadata["id"] for d in searched} == {d.metadata["id"] for d in docs}
    assert "4512" not in " ".join(
        d.page_content for d in KVShiftRetriever(store=store, user_id="alice", k=10).invoke("door code")
    )


def test_a_rag_chain_shifts_the_retrieved_parts_k_v_into_the_prompt(store):
    engine = KVShiftEngine.shared()
    parts = store.add_document(
        BRIEF, tenant="alice", source="brief.md", max_tokens=150, count_tokens=engine.count_tokens
    )
    for part in parts:  # encoded once, at ingestion, as an application would
        engine.warm([part], tenant="alice", lead_fragments=False)
    retriever = KVShiftRetriever(store=store, user_id="alice", k=2)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    llm = ChatKVShift(store=store, user_id="alice", max_tokens=16, reuse="blend")  # auto: exact on this model
    seen = []

    def remember_stats(message):
        seen.append(message.response_metadata["reuse_stats"])
        return message

    chain = (
        {
            "context": retriever | RunnableLambda(lambda docs: "\n".join(d.page_content for d in docs)),
            "question": RunnablePassthrough(),
        }
        | prompt
        | llm
        | RunnableLambda(remember_stats)
        | StrOutputParser()
    )
    answer = chain.invoke("Who reviews the budget of team 3?")
    assert answer and "⟦" not in answer
    assert seen[-1]["memory_reuse"] == ["shifted", "shifted"] and seen[-1]["fragments_hit"] == 2
    assert seen[-1]["encoded_tokens"] == 0
