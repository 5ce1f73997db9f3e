"""A session that outlives its process: the window saved in the store, the K/V restored (agent/sessions.py)."""

from __future__ import annotations

import json
import logging

import pytest
from test_agent import _new_tokens_bound

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore

CHUNK = 32
TURNS = [
    "Hi, I am planning a trip to Lisbon in May with my sister Ana.",
    "My budget for the trip is 5000 euros, and Ana is vegetarian.",
    "We arrive on the 12th of May at 9am on flight TP1350.",
    "The hotel is called Casa Amora, near Alfama.",
]


@pytest.fixture(scope="module")
def engines():
    """Two engines over the bundled model with small chunks: two workers, or a process and its restart.

    Chunks this small may be judged cheaper to compute than to read when a busy machine slows the
    reads (CI failed so once); what these tests check is the restoring, so the engines always read
    (test_chunks covers the cost model choosing to compute)."""
    engines = [KVShiftEngine.from_pretrained(chunk_tokens=CHUNK) for _ in range(2)]
    for engine in engines:
        engine.costs.recompute_cheaper = lambda tokens: False
    return engines


@pytest.fixture
def folder(tmp_path):
    return tmp_path / "store"


def _store(folder, embedder) -> MemoryStore:
    return MemoryStore(folder, embedder=embedder)


def _agent(engine, store, **settings) -> AgentMemory:
    settings.setdefault("max_new_tokens", 12)
    return AgentMemory(engine, store, user_id="alice", session_id="trip", **settings)


@pytest.mark.model
def test_a_new_process_continues_the_session_with_its_kv_restored(engines, folder, embedder):
    first, later = engines
    for engine in engines:
        engine.clear_cache()
    with _store(folder, embedder) as store:
        agent = _agent(first, store)
        for message in TURNS:
            agent.chat(message)
        window = agent.window
        first.flush_chunks(timeout_s=120)
    with _store(folder, embedder) as store:  # the restart: another engine, the store opened again
        resumed = _agent(later, store)
        assert resumed.window == window
        reply = resumed.chat("Which hotel did I book?")
    stats = reply.stats
    assert stats.restored_tokens > 0 and stats.prefilled_tokens < stats.prompt_tokens
    assert stats.prompt_tokens - stats.reused_tokens <= _new_tokens_bound(later, reply)  # nothing said before
    assert resumed.window[:-1] == window


ALTERNATED = TURNS + ["What is my budget?", "Who comes with me?"]


@pytest.mark.model
def test_two_workers_alternating_turns_each_read_the_conversation_from_cache(engines, folder, embedder):
    """Behind a load balancer: turns of one session land on two workers in turn, each with its own
    engine and store object over one folder; each sees the other's turns and reads the prompt from cache."""
    for engine in engines:
        engine.clear_cache()
    stores = [_store(folder, embedder) for _ in engines]
    workers = [_agent(engine, store) for engine, store in zip(engines, stores, strict=True)]
    shares = []
    for index, message in enumerate(ALTERNATED):
        worker = workers[index % 2]
        reply = worker.chat(message)
        worker.engine.flush_chunks(timeout_s=120)
        assert [user for user, _ in worker.window][-1] == message
        assert len(worker.window) == index + 1  # the other worker's turns are in it
        if index:
            stats = reply.stats
            assert stats.restored_tokens > 0
            # nothing said before is computed again: only this turn's message, template and recalled memories
            assert stats.prompt_tokens - stats.reused_tokens <= _new_tokens_bound(worker.engine, reply)
            shares.append(stats.reused_tokens / stats.prompt_tokens)
    print("shares of the prompt read from cache:", [round(share, 3) for share in shares])
    assert shares[-1] >= 0.9, shares  # the new message's share falls as the conversation grows
    for store in stores:
        store.close()


@pytest.mark.model
def test_two_worker_processes_over_a_redis_cluster_alternate_a_sessions_turns(redis_cluster_url):
    """The same, as deployed: two worker processes, each with its engine and its store over one
    Redis Cluster, answer the turns of one session in turn."""
    from agent_worker import alternate

    from conftest import flushed

    turns = alternate(flushed(redis_cluster_url), ALTERNATED, "--chunk-tokens", str(CHUNK), "--always-restore")
    for index, (message, turn) in enumerate(zip(ALTERNATED, turns, strict=True)):
        assert turn["last_message"] == message
        assert turn["window"] == index + 1  # the other worker's turns are in it
        if index:
            assert turn["restored_tokens"] > 0  # the other worker's turn came from the cluster
            assert turn["prompt_tokens"] - turn["reused_tokens"] <= turn["new_tokens_bound"]
    shares = [turn["reused_tokens"] / turn["prompt_tokens"] for turn in turns[1:]]
    print("shares of the prompt read from cache:", [round(share, 3) for share in shares])
    assert shares[-1] >= 0.9, shares


@pytest.mark.model
def test_a_turn_answered_elsewhere_meanwhile_is_kept_beside_this_one(engines, folder, embedder):
    with _store(folder, embedder) as store:
        one, other = _agent(engines[0], store), _agent(engines[1], store)
        one.chat(TURNS[0])
        pending = one.chat(TURNS[1], stream=True)  # planned from a window of one turn
        other.chat(TURNS[2])  # saved first, on the other worker
        list(pending)  # this commit finds the saved window changed: it adds its turn to it
        assert [user for user, _ in one.window] == [TURNS[0], TURNS[2], TURNS[1]]
        assert _agent(engines[0], store).window == one.window


@pytest.mark.model
def test_a_memory_deleted_since_is_not_shown_by_the_resumed_window(engines, folder, embedder):
    with _store(folder, embedder) as store:
        agent = _agent(engines[0], store)
        said = agent.chat("Remember that my door code is 4321.")
        agent.chat("I like long walks by the sea.")
        assert said.archived is not None
        store.delete(said.archived.id, tenant="alice")  # by another process, or the user elsewhere
        resumed = _agent(engines[1], store)
        assert [user for user, _ in resumed.window] == ["I like long walks by the sea."]


@pytest.mark.model
def test_an_unusable_saved_session_starts_an_empty_window_and_loses_no_memory(engines, folder, embedder, caplog):
    with _store(folder, embedder) as store:
        agent = _agent(engines[0], store)
        said = agent.chat("Remember that my door code is 4321.")
        for hostile in (
            b"\x80\x04\x95 a pickle",
            b"{}",
            b"[]",
            json.dumps({"format": "kvshift-session/1", "turns": [{"user": 5}]}).encode(),
            json.dumps({"format": "kvshift-session/1", "turns": [{"recalled": [["../x", 1]]}]}).encode(),
            b"[" * 100_000,  # nested past the parser's recursion limit
        ):
            store.tier.set("s/alice/trip", hostile)
            with caplog.at_level(logging.WARNING, logger="kvshift_memory.agent"):
                resumed = _agent(engines[1], store)
            assert resumed.window == [] and "unusable" in caplog.text
            caplog.clear()
        assert store.get(said.archived.id, tenant="alice").text == said.archived.text
        resumed.chat("Hello again.")
        assert len(_agent(engines[0], store).window) == 1  # a usable state was saved over it


@pytest.mark.model
def test_a_saved_turn_naming_another_users_memory_never_shows_it(engines, folder, embedder):
    with _store(folder, embedder) as store:
        secret = store.add("Bob's bank PIN is 9876.", tenant="bob")
        forged = {
            "format": "kvshift-session/1",
            "previous": "",
            "turns": [
                {
                    "user": "What is the PIN?",
                    "recalled": [[secret.id, secret.version]],
                    "tokens": 10,
                    "reply": "I do not know.",
                    "reply_ids": None,
                    "importance": 0.1,
                    "decision": "window",
                    "archived": None,
                    "previous": "",
                }
            ],
        }
        store.save_session("trip", json.dumps(forged).encode(), tenant="alice", expected=None)
        agent = _agent(engines[0], store)
        assert agent.window == [("What is the PIN?", "I do not know.")]
        assert agent.turns[0].recalled == ()


@pytest.mark.model
def test_resume_off_keeps_the_session_in_the_process(engines, folder, embedder):
    with _store(folder, embedder) as store:
        agent = _agent(engines[0], store, resume=False)
        reply = agent.chat(TURNS[0])
        engines[0].flush_chunks(timeout_s=60)
        assert store.load_session("trip", tenant="alice") is None
        assert store.stats()["chunks"] == 0 and reply.stats.restored_tokens == 0
        assert _agent(engines[1], store, resume=False).window == []


@pytest.mark.parametrize("session", ["", " trip", "a\x00b", "x" * 300, None, 5])
def test_malformed_session_ids_are_refused_by_the_store(folder, embedder, session):
    from kvshift_memory import InvalidInputError
    from kvshift_memory.store.memory_store import MAX_SESSION_BYTES

    with _store(folder, embedder) as store:
        with pytest.raises(InvalidInputError):
            store.load_session(session, tenant="alice")
        with pytest.raises(InvalidInputError):
            store.save_session(session, b"{}", tenant="alice", expected=None)
        with pytest.raises(InvalidInputError):
            store.save_session("trip", "not bytes", tenant="alice", expected=None)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            store.save_session("trip", b"x" * (MAX_SESSION_BYTES + 1), tenant="alice", expected=None)
        assert store.load_session("trip", tenant="alice") is None
