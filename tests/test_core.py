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
        monday.chat("What should I cook tonight?")
        assert block in engine.tokenizer.decode(engine.planner.plan(monday._system_messages()).layout.token_ids)
        tuesday = _agent(engine, store, "tuesday").chat("Any plans for the weekend?")
        block_tokens = len(engine.tokenizer(block, add_special_tokens=False).input_ids)
        assert tuesday.stats.reused_tokens >= block_tokens  # the prefix cache, in this process
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
        with pytest.raises(InvalidInputError):
            _agent(engine, store, "x", core_facts="yes")


def _talker(engine, store, session: str, user: str = "ana") -> AgentMemory:
    return AgentMemory(
        engine, store, user_id=user, session_id=session, max_new_tokens=4, recall_min_score=-1.0, core_facts=True
    )


def test_a_fact_the_user_states_joins_the_block_from_the_next_session(tmp_path, tokenizer):
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        engine = _engine(tokenizer)
        monday = _talker(engine, store, "monday")
        stated = monday.chat("I live in Porto and I work as a nurse at the city hospital.").archived
        assert stated is not None and [line.memory_id for line in monday.core()] == [stated.id]
        # this session's window shows the message: the block it places stays as it was, so its K/V is reused
        again = monday.chat("What is a good book to read on a night shift?")
        assert again.core == () and again.stats.reused_tokens > 0
        tuesday = _talker(engine, store, "tuesday").chat("Any idea for dinner?")
        assert [line.memory_id for line in tuesday.core] == [stated.id]
        # another speaker's words, a question and a paste never join on their own
        monday.observe("I am Bob, and I live in Braga.")
        monday.chat("Where is the nearest pharmacy?")
        monday.chat("I wrote this: " + "word " * 120)
        assert [line.memory_id for line in monday.core()] == [stated.id]


def test_a_correction_in_chat_appends_its_new_version_and_a_forget_removes_the_line_at_once(tmp_path, tokenizer):
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        engine = _engine(tokenizer)
        monday = _talker(engine, store, "monday")
        for fact in FACTS:
            monday.chat(fact)
        tuesday = _talker(engine, store, "tuesday")
        before = core_text(tuesday.core())
        reply = tuesday.chat("My daughter Lia was born in 2018, not 2019.")
        assert reply.corrected is not None
        lines = tuesday.core()
        assert core_text(lines).startswith(before) and lines[-1].text.endswith("not 2019.")
        assert [line.superseded for line in lines].count(True) == 1
        wednesday = _talker(engine, store, "wednesday").chat("Hello!")
        assert "born in 2018" in core_text(wednesday.core)
        forgotten = _talker(engine, store, "wednesday")
        assert forgotten.chat("Please forget that I am allergic to peanuts.").decision == "forget"
        shown = str(forgotten._system_messages())
        assert "peanuts" not in shown and all("peanuts" not in line.text for line in forgotten.core())
        assert "peanuts" not in str(_talker(engine, store, "thursday")._system_messages())


def test_the_block_is_the_same_tokens_in_another_process(tmp_path, tokenizer):
    import json
    import subprocess
    import sys

    folder = tmp_path / "store"
    with MemoryStore(folder, embedder=HashEmbedder()) as store:
        agent = _agent(_engine(tokenizer), store, "monday")
        for fact in FACTS:
            agent.pin(store.add(fact, tenant="ana").id)
        here = tokenizer(core_text(agent.core()), add_special_tokens=False).input_ids
    child = f"""
import json
from transformers import AutoTokenizer
from kvshift_memory import MemoryStore
from kvshift_memory.adapters import core_text, placed_lines
from kvshift_memory.engine.loading import bundled_gguf_path
gguf = bundled_gguf_path()
tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
count = lambda text: len(tokenizer(text, add_special_tokens=False).input_ids)
with MemoryStore({str(folder)!r}) as store:
    lines = placed_lines(store, "ana", session_id="tuesday", count_tokens=count)
print(json.dumps(tokenizer(core_text(lines), add_special_tokens=False).input_ids))
"""
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == here


def test_memories_lists_what_the_agent_stored_newest_first(tmp_path, tokenizer):
    with MemoryStore(tmp_path / "store", embedder=HashEmbedder()) as store:
        engine = _engine(tokenizer)
        monday = _talker(engine, store, "monday")
        for fact in FACTS[:2]:
            monday.chat(fact)
        tuesday = _talker(engine, store, "tuesday")
        tuesday.chat(FACTS[2])
        assert [r.text for r in tuesday.memories()] == [FACTS[2], FACTS[1], FACTS[0]]
        assert [r.text for r in tuesday.memories(session_only=True)] == [FACTS[2]]
        assert [r.text for r in tuesday.memories(limit=1, offset=1)] == [FACTS[1]]
        assert _talker(engine, store, "monday", user="bob").memories() == []
        with pytest.raises(InvalidInputError):
            tuesday.memories(limit=0)
