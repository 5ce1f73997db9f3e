"""What changes a memory: a correction only of the same subject and the value it negates, a
request to forget only about what the user told, never a tool's instruction nor another
speaker's words; a restated fact stays one memory and a bare question none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshift_memory import AgentMemory, MemoryStore
from kvshift_memory.adapters import WriteBackModel, archive
from kvshift_memory.agent.asks import find_correction
from kvshift_memory.agent.corrections import corrects, is_correction_cue

CASES = json.loads((Path(__file__).parent / "data" / "corrections.json").read_text(encoding="utf-8"))["cases"]
RULE = WriteBackModel.bundled()


@pytest.fixture
def store(embedder):
    with MemoryStore(kv_url="memory://", index_url=":memory:", embedder=embedder) as store:
        yield store


def test_the_correction_set_is_large_enough_and_balanced():
    true = [case for case in CASES if case["target"] is not None]
    assert len(CASES) >= 40 and len(true) >= 20 and len(CASES) - len(true) >= 20


def test_corrections_supersede_their_memory_and_near_misses_change_nothing(store):
    """Each case in its own tenant: its memories stored, then the correction looked for as a chat turn does."""
    superseded, near_misses_that_changed = 0, []
    true = [case for case in CASES if case["target"] is not None]
    for number, case in enumerate(CASES):
        tenant = f"case{number}"
        records = [store.add(text, tenant=tenant) for text in case["memories"]]
        decision, target = find_correction(store, case["message"], user_id=tenant, min_score=0.5)
        if case["target"] is None:
            if target is not None:
                near_misses_that_changed.append(case["message"])
            else:
                assert decision in (None, "correction_ambiguous")
        elif target is not None and target.id == records[case["target"]].id:
            superseded += 1
    assert near_misses_that_changed == []
    assert superseded / len(true) >= 0.9, f"{superseded} of {len(true)} true corrections found their memory"


def test_a_negated_statement_followed_by_what_is_true_supersedes_its_memory(store):
    """A correction that says the new value with its own verb ("…, she lives in Braga") was not
    recognised, so the old and the new fact both stayed live."""
    porto = store.add("My sister lives in Porto.", tenant="ana")
    store.add("My sister does not drink coffee.", tenant="ana")
    decision, target = find_correction(
        store, "My sister does not live in Porto, she lives in Braga.", user_id="ana", min_score=0.5
    )
    assert decision == "archive" and target is not None and target.id == porto.id


@pytest.mark.parametrize(
    ("message", "memory", "expected"),
    [
        ("My son is allergic to cats, not peanuts.", "My daughter is allergic to peanuts.", False),
        ("My son is allergic to cats, not peanuts.", "My son is allergic to peanuts.", True),
        ("My father's birthday is not in May, it's in June.", "My mother's birthday is May 3.", False),
        ("The gate code is not 4321, it's 9999.", "The door code is 4321.", False),
        ("The door code is not 4321, it's 9999.", "The door code is 4321.", True),
        ("Actually it's not 4321.", "The door code is 4321.", False),  # names no subject: unsure
    ],
)
def test_corrects_asks_for_the_same_subject_and_the_negated_value(message, memory, expected):
    assert is_correction_cue(message)
    assert corrects(message, memory) is expected


def test_an_unsure_correction_is_stored_and_changes_nothing(bundled_engine, store):
    agent = AgentMemory(bundled_engine, store, user_id="alice", session_id="s1", max_new_tokens=4)
    daughter = agent.add("My daughter is allergic to peanuts.")
    reply = agent.chat("My son is allergic to cats, not peanuts.")
    assert reply.decision == "correction_ambiguous" and reply.corrected is None
    assert store.get(daughter.id, tenant="alice").version == 1
    assert reply.archived is not None and reply.archived.text == "My son is allergic to cats, not peanuts."
    true = agent.chat("My daughter is allergic to eggs, not peanuts.")
    assert true.corrected is not None and true.corrected.id == daughter.id and true.archived.version == 2


def test_another_speakers_correction_never_supersedes(bundled_engine, store):
    agent = AgentMemory(bundled_engine, store, user_id="alice", session_id="s1", max_new_tokens=4)
    code = agent.add("The door code is 4321.")
    observed = agent.observe("Bob: actually the door code is not 4321, it's 9999.")
    assert store.get(code.id, tenant="alice").text == "The door code is 4321."
    assert observed is None or observed.id != code.id


_TOOL_CASES = json.loads((Path(__file__).parent / "data" / "tool_instructions.json").read_text(encoding="utf-8"))
TOOL_INSTRUCTIONS, MEMORIES = _TOOL_CASES["instructions"], _TOOL_CASES["memories"]


def test_instructions_meant_for_a_tool_delete_no_memory(store):
    records = [store.add(text, tenant="alice") for text in MEMORIES]
    decisions = [
        archive(RULE, store, message, "", user_id="alice", session_id="s1", window=True)[1]
        for message in TOOL_INSTRUCTIONS
    ]
    assert "forget" not in decisions and "forget_ambiguous" not in decisions
    assert [store.get(r.id, tenant="alice") is not None for r in records] == [True] * 6
    # a request about what the user told still deletes
    decision, forgotten = archive(
        RULE, store, "Delete what I said about John's email address.", "", user_id="alice", session_id="s1"
    )[1:]
    assert decision == "forget" and forgotten.id == records[0].id


def test_a_restated_fact_is_one_memory_and_a_question_none(store):
    first = archive(RULE, store, "My sister Ana lives in Porto.", "", user_id="alice", session_id="monday")[2]
    again = archive(RULE, store, "My sister Ana lives in Porto.", "", user_id="alice", session_id="tuesday")[2]
    assert again.id == first.id and store.stats()["memories"] == 1
    assert again.last_access is not None  # refreshed
    asked = archive(RULE, store, "Where does my sister live?", "", user_id="alice", session_id="monday")
    assert asked[1] == "window" and asked[2] is None
    assert [r.text for r in store.search("Where does my sister live?", tenant="alice", k=5)] == [first.text]
    # another user's identical words are theirs
    bob = archive(RULE, store, "My sister Ana lives in Porto.", "", user_id="bob", session_id="monday")[2]
    assert bob.id != first.id
