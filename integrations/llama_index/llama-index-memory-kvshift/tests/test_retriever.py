"""KVShiftRetriever: a user's document parts as marked nodes, shifted into KVShiftLLM's prompt by a query engine."""

from __future__ import annotations

import pytest
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, QueryBundle

from kvshift_memory import KVShiftEngine, MemoryStore
from kvshift_memory.adapters import parse_markers
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.memory.kvshift import KVShiftRetriever

pytestmark = pytest.mark.model

BRIEF = "\n\n".join(
    f"Section {n}. The Lisbon office opens in {2027 + n}. Marta leads hiring for team {n}; "
    f"Tom reviews the budget of {n * 10}k euros. Receipts go to the shared folder within a week."
    for n in range(1, 13)
)


@pytest.fixture()
def store(tmp_path):
    with MemoryStore(tmp_path / "store") as store:
        yield store


def test_nodes_carry_markers_order_and_source_and_only_the_users_own(store):
    engine = KVShiftEngine.shared()
    parts = store.add_document(
        BRIEF, tenant="alice", source="brief.md", max_tokens=150, count_tokens=engine.count_tokens
    )
    store.add("Bob's door code is 4512.", tenant="bob")
    nodes = KVShiftRetriever(store, "alice", k=3).retrieve(QueryBundle("Who reviews the budget?"))
    assert len(nodes) == 3
    by_id = {p.id: p for p in parts}
    for node in nodes:
        text = node.node.get_content(metadata_mode=MetadataMode.LLM)
        (span,) = [piece for piece in parse_markers(text) if piece.memory_id]
        assert span.text == by_id[span.memory_id].text and node.node.metadata["source"] == "brief.md"
    assert [n.node.metadata["part"] for n in nodes] == sorted(n.node.metadata["part"] for n in nodes)
    others = KVShiftRetriever(store, "alice", k=10).retrieve(QueryBundle("door code"))
    assert "4512" not in " ".join(n.node.get_content() for n in others)


def test_a_query_engine_shifts_the_retrieved_parts_k_v_into_the_prompt(store):
    engine = KVShiftEngine.shared()
    parts = store.add_document(
        BRIEF, tenant="alice", source="brief.md", max_tokens=150, count_tokens=engine.count_tokens
    )
    for part in parts:  # encoded once, at ingestion, as an application would
        engine.warm([part], tenant="alice", lead_fragments=False)
    llm = KVShiftLLM(store=store, user_id="alice", max_tokens=16, reuse="blend")  # auto: exact on this model
    seen = []
    original = engine.generate

    def generate(*args, **kwargs):
        result = original(*args, **kwargs)
        seen.append(result.stats)
        return result

    engine.generate = generate
    try:
        query_engine = RetrieverQueryEngine.from_args(KVShiftRetriever(store, "alice", k=2), llm=llm)
        response = query_engine.query("Who reviews the budget of team 3?")
    finally:
        del engine.generate
    assert str(response) and "⟦" not in str(response)
    assert seen[-1].memory_reuse == ["shifted", "shifted"] and seen[-1].encoded_tokens == 0
