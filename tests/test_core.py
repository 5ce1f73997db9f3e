"""The core block: pinned memories at the front of every session's prompt (agent/core.py)."""

from __future__ import annotations

import pytest
from store_worker import HashEmbedder

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import AgentMemory, InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.agent.core import CORE_HEADER, CoreBlock, core_text

FACTS = [
    "My name is Ana Duarte and I live in Porto.",
    "I am allergic to peanuts.",
    "My daughter Lia was born in 2019.",
    "I work as a nurse at the city hospital, on night shifts.",
]


def _count(text: str) -> int:
    return len(text.split())


def test_a_pin_appends_so_the_block_before_it_is_a_prefix():
    block = CoreBlock()
    texts = []
    for number, fact in enumerate(FACTS):
        block = block.pinned(f"m{number}", 1, fact)
        texts.append(core_text(block.lines))
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:], strict=False))
    assert block.pinned("m1", 1, FACTS[1]) == block  # pinned already: unchanged


def test_a_correction_appends_and_marks_the_old_line_then_compaction_drops_it():
    block = CoreBlock()
    for number, fact in enumerate(FACTS):
        block = block.pinned(f"m{number}", 1, fact)
    before = core_text(block.lines)
    corrected = block.updated("m0", 2, "My name is Ana Duarte and I live in Lisbon now.")
    assert core_text(corrected.lines).startswith(before)  # appended: the K/V before it is reused
    assert [line.superseded for line in corrected.lines] == [True, False, False, False, False]
    assert corrected.updated("m9", 2, "not pinned") == corrected
    twice = corrected.updated("m1", 2, "I am allergic to peanuts and shellfish.")  # 2 of 6 superseded
    assert [line.memory_id for line in twice.lines] == ["m2", "m3", "m0", "m1"]
    assert "Porto" not in core_text(twice.lines)


def test_forget_removes_the_line_and_the_budget_places_only_what_fits():
    block = CoreBlock()
    for number, fact in enumerate(FACTS):
        block = block.pinned(f"m{number}", 1, fact)
    assert "peanuts" not in core_text(block.without("m1").lines)
    placed = block.placed(_count(CORE_HEADER) + 1 + _count(FACTS[0]) + 1 + _count(FACTS[1]) + 1, _count)
    assert [line.memory_id for line in placed] == ["m0", "m1"]


@pytest.mark.parametrize(
    "stored",
    [
        b"not json",
        b'{"format": "other", "lines": []}',
        b'{"format": "kvshift-core/1", "lines": [["m0", 0, "x", false]]}',
        b'{"format": "kvshift-core/1", "lines": [["", 1, "x", false]]}',
        b'{"format": "kvshift-core/1", "lines": [["m0", 1, "", false]]}',
        b'{"format": "kvshift-core/1", "lines": [["m0", 1, "x", "yes"]]}',
        b'{"format": "kvshift-core/1", "lines": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ],
)
def test_a_damaged_stored_block_is_refused(stored):
    with pytest.raises(InvalidInputError):
        CoreBlock.from_bytes(stored)


def _engine(tokenizer) -> KVShiftEngine:
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"](), seed=0), tokenizer, chunk_tokens=32)
    engine.costs.recompute_cheaper = lambda tokens: False  # a tiny model computes faster than it reads
    return engine


def _agent(engine, store, session: str, user: str = "ana", **settings) -> AgentMemory:
    settings.setdefault("max_new_tokens", 4)
    return AgentMemory(engine, store, user_id=user, session_id=session, write_back=False, **settings)


def test_every_session_and_process_starts_with_the_same_core_block_and_restores_it(tmp_path, tokenizer):
    folder = tmp_path / "store"
    with MemoryStore(folder, embedder=HashEmbedder(), codec="fp32") as store:
        engine = _engine(tokenizer)
        monday = _agent(engine, store, "monday")
        records = [store.add(fact, tenant="ana") for fact in FACTS]
        for record in records:
            monday.pin(record.id)
        block = core_text(monday.core())
        first = monday.chat("What should I cook tonight?")
        assert block in engine.tokenizer.decode(engine.planner.plan(monday._system_messages()).layout.token_ids)
        tuesday = _agent(engine, store, "tuesday").chat("Any plans for the weekend?")
        block_tokens = len(engine.tokenizer(block, add_special_tokens=False).input_ids)
        assert tuesday.stats.reused_tokens >= block_tokens  # the prefix cache, in this process
        assert not {r.id for r in first.recalled} & {r.id for r in records}  # shown by the block: not recalled
        assert engine.flush_chunks(timeout_s=60)
    with MemoryStore(folder, embedder=HashEmbedder(), codec="fp32") as store:  # a new process
        later = _engine(tokenizer)
        wednesday = _agent(later, store, "wednesday").chat("How is the weather?")
        # from the stored chunks: the block's full chunks, then the part of another session's chunk it shares
        assert wednesday.stats.restored_tokens >= block_tokens
        someone_else = _agent(later, store, "monday", user="bob")
        assert "Porto" not in str(someone_else._system_messages())  # one user's block is never another's
        assert someone_else.chat("Hello?").stats.restored_tokens == 0


def test_a_forgotten_or_corrected_core_memory_changes_the_block_at_once(tmp_path, tokenizer):
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        agent = _agent(_engine(tokenizer), store, "monday")
        records = [store.add(fact, tenant="ana") for fact in FACTS]
        for record in records:
            agent.pin(record.id)
        before = core_text(agent.core())
        old, new = agent.correct("My daughter Lia was born in 2018, not 2019.", records[2].id)
        assert core_text(agent.core()).startswith(before) and "2018" in core_text(agent.core())
        agent.forget(records[1].id)
        assert "peanuts" not in str(agent._system_messages())
        assert all(line.memory_id != records[1].id for line in agent.core())
        agent.unpin(records[0].id)
        assert "Porto" not in str(agent._system_messages()) and store.get(records[0].id, tenant="ana") is not None


def test_pinned_memories_past_the_budget_are_recalled_not_lost(tmp_path, tokenizer):
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        engine = _engine(tokenizer)
        budget = engine.count_tokens(CORE_HEADER) + engine.count_tokens(FACTS[0]) + 2  # the header and one line
        agent = _agent(engine, store, "monday", core_tokens=budget, recall_min_score=-1.0)
        records = [store.add(fact, tenant="ana") for fact in FACTS]
        for record in records:
            agent.pin(record.id)
        shown = str(agent._system_messages())
        assert FACTS[0] in shown and FACTS[3] not in shown
        reply = agent.chat("Where do I work, and on which shifts?")
        assert records[3].id in {r.id for r in reply.recalled}
        with pytest.raises(InvalidInputError):
            _agent(engine, store, "x", core_tokens=0)
