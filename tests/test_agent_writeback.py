"""AgentMemory's write-back on the bundled model: what the user says is kept, forgotten on request,
and found again in a later session (also by a new process, on a reopened store)."""

from __future__ import annotations

import pytest

from kvshift_memory import AgentMemory, InvalidInputError, MemoryStore
from kvshift_memory.agent.writeback import WriteBackModel, is_task_request
from kvshift_memory.exceptions import MemoryNotFoundError


@pytest.fixture
def store(embedder):
    with MemoryStore(kv_url="memory://", index_url=":memory:", embedder=embedder) as store:
        yield store


def _agent(engine, store, session="s1", **settings):
    settings.setdefault("max_new_tokens", 8)
    return AgentMemory(engine, store, user_id="alice", session_id=session, **settings)


def _texts(store, query, k=8):
    return [r.text for r in store.search(query, tenant="alice", k=k)]


def test_a_stated_fact_is_archived_and_small_talk_is_not(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    fact = agent.chat("My landlord's name is Mr. Okonkwo.")
    talk = [agent.chat(message) for message in ("ok thanks", "haha", "good morning!")]
    assert fact.decision == "archive" and fact.archived is not None
    assert all(reply.decision == "window" and reply.archived is None for reply in talk)
    assert store.stats()["memories"] == 1
    assert len(agent.window) == 4  # small talk stays in the conversation, only never stored
    later = _agent(bundled_engine, store, session="s2").chat("ok thanks, haha")
    assert [r.id for r in later.recalled] in ([], [fact.archived.id])  # nothing but the fact can be recalled


def test_an_explicit_remember_always_archives_at_high_importance(bundled_engine, store):
    # a rule that would keep every turn in the window: the request still archives
    never = WriteBackModel(**{**vars(WriteBackModel.bundled()), "archive_threshold": 1.5, "window_threshold": 1.5})
    agent = _agent(bundled_engine, store, writeback=never)
    assert agent.chat("I park on level 3.").decision == "window"
    reply = agent.chat("Remember: I park on level 3.")
    assert reply.decision == "archive" and reply.archived is not None and reply.archived.importance_score == 1.0
    found = _agent(bundled_engine, store, session="s2").chat("Where do I park?")
    assert reply.archived.id in [r.id for r in found.recalled]


def test_forget_in_chat_removes_the_memory_for_good_across_a_restart(bundled_engine, embedder, tmp_path):
    folder = tmp_path / "store"
    with MemoryStore(folder, embedder=embedder) as store:
        agent = _agent(bundled_engine, store)
        code = agent.chat("The door code for the building is 4417.").archived
        keep = agent.chat("My accountant is Sofia Brennan.").archived
        reply = agent.chat("Please forget what I said about the door code.")
        assert reply.decision == "forget" and reply.forgotten.id == code.id and reply.archived is None
        assert all("4417" not in user for user, _ in agent.window)  # the turn that stated it left the window
        history = store.history(code.id, tenant="alice")
        assert [h.status for h in history] == ["deleted"]  # tombstoned, until gc erases it
        asked = _agent(bundled_engine, store, session="s2").chat("What is the door code for my building?")
        assert code.id not in [r.id for r in asked.recalled]
    with MemoryStore(folder, embedder=embedder) as store:  # a new process on the same folder
        assert all("4417" not in text for text in _texts(store, "door code 4417"))
        assert store.get(code.id, tenant="alice") is None and store.get(keep.id, tenant="alice") is not None
        asked = _agent(bundled_engine, store, session="s3").chat("What is the door code for my building?")
        assert code.id not in [r.id for r in asked.recalled]
        assert store.history(code.id, tenant="alice")[-1].status == "deleted"


def test_an_ambiguous_forget_removes_nothing_and_says_so(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    agent.add("The door code for the building is 4417.")
    agent.add("The door code for the garage is 5521.")
    unrelated = agent.chat("Forget what I said about the door code.")
    assert unrelated.decision == "forget_ambiguous" and unrelated.forgotten is None
    far = agent.chat("Forget my cat's vaccination record.")
    assert far.decision == "forget_ambiguous"
    assert store.stats()["memories"] == 2
    with pytest.raises(MemoryNotFoundError, match="nothing was deleted"):
        agent.forget("the door code")
    assert store.stats()["memories"] == 2


def test_forget_by_id_or_text(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    plumber = agent.add("Remember: the plumber is coming on Thursday at 8am.")
    author = agent.add("My favourite author is Chimamanda Ngozi Adichie.")
    assert agent.forget(plumber.id).id == plumber.id
    assert agent.forget("my favourite author").id == author.id
    assert store.stats()["memories"] == 0
    with pytest.raises(MemoryNotFoundError):
        agent.forget(plumber.id)  # gone already: nothing close is left


@pytest.mark.parametrize("bad", ["", "   ", None, 42, "x" * 50_000, "\x00"])
def test_refused_forget_changes_nothing(bundled_engine, store, bad):
    agent = _agent(bundled_engine, store)
    agent.add("My favourite author is Chimamanda Ngozi Adichie.")
    with pytest.raises((InvalidInputError, MemoryNotFoundError)):
        agent.forget(bad)
    assert store.stats()["memories"] == 1


def test_a_correction_still_supersedes(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    old = agent.chat("The budget for the Lisbon trip is 50k euros.").archived
    reply = agent.chat("The budget for the Lisbon trip is not 50k, it is 70k euros.")
    assert reply.corrected.id == old.id and reply.archived.version == 2
    assert [h.status for h in store.history(old.id, tenant="alice")] == ["superseded", "live"]


def test_a_deferred_turn_is_archived_when_it_leaves_the_window_and_found_in_a_new_session(bundled_engine, store):
    # a rule unsure of every turn: each waits in the window until it is shifted out
    unsure = WriteBackModel(**{**vars(WriteBackModel.bundled()), "archive_threshold": 1.5, "window_threshold": 0.0})
    agent = _agent(bundled_engine, store, writeback=unsure, window_tokens=70)
    first = agent.chat("Our dog is called Biscuit and he's a beagle.")
    assert first.decision == "defer" and first.archived is None and store.stats()["memories"] == 0
    replies = [
        agent.chat(m)
        for m in ("I work as a nurse at St Thomas' hospital.", "My son plays the trumpet.", "I drive a red Honda Jazz.")
    ]
    assert sum(r.evicted_turns for r in replies) >= 1
    assert any("Biscuit" in text for text in _texts(store, "dog Biscuit beagle"))
    found = _agent(bundled_engine, store, session="s2").chat("What breed is our dog?")
    assert any("Biscuit" in r.text for r in found.recalled)
    # closing the session archives what still waits, once
    waiting = [user for user, _ in agent.window]
    archived = agent.close()
    assert sorted(r.text for r in archived) == sorted(waiting)
    assert agent.close() == []


def test_a_session_used_as_a_context_manager_archives_what_waits(bundled_engine, store):
    unsure = WriteBackModel(**{**vars(WriteBackModel.bundled()), "archive_threshold": 1.5, "window_threshold": 0.0})
    with _agent(bundled_engine, store, writeback=unsure) as agent:
        assert agent.chat("My blood type is O negative.").decision == "defer"
        assert store.stats()["memories"] == 0
    assert any("O negative" in text for text in _texts(store, "blood type"))


def test_an_observed_transcript_forgets_nothing(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    code = agent.add("The door code for the building is 4417.")
    assert agent.observe("Forget what I said about the door code.") is not None  # archived as a turn
    assert store.get(code.id, tenant="alice") is not None


@pytest.mark.parametrize(
    ("text", "task"),
    [
        ("Convert 50 euros to dollars.", True),
        ("Please translate 'good morning' into French.", True),
        ("Can you summarise this article about Lisbon's trams?", True),
        ("ok, now write a haiku about autumn", True),
        ("Book a table for two on Friday, I am vegetarian.", False),  # speaks of the user too
        ("Marta books the hotel near the river.", False),
        ("Tell me about the Douro valley.", False),  # "me": the rule decides
        ("My sister lives in Porto.", False),
    ],
)
def test_a_task_for_the_assistant_is_not_a_fact(text, task):
    assert is_task_request(text) is task


def test_a_task_is_kept_in_the_window_and_never_recalled_as_a_memory(bundled_engine, store):
    agent = _agent(bundled_engine, store)
    reply = agent.chat("Convert 50 euros to dollars.")
    assert reply.decision == "window" and reply.archived is None
    assert agent.chat("Book a table for two on Friday, I am vegetarian.").archived is not None
    assert "Convert" not in str([r.text for r in store.search("euros dollars", tenant="alice", k=5)])
