"""The index replays the store's log idempotently, and repairs what a crash left half-done."""

from __future__ import annotations

import json
import uuid

from kvshift_memory.store.index import IndexedState, MemoryIndex, open_index


class Log:
    def __init__(self):
        self.entries: list[bytes] = []

    def add(self, tenant, memory_id):
        self.entries.append(json.dumps({"tenant": tenant, "id": memory_id, "n": uuid.uuid4().hex}).encode())

    def read(self, start):
        return self.entries[start:]


def vec(i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(4)]


def test_sync_replays_the_log_and_keeps_in_flight_adds_pending(tmp_path):
    for location in (":memory:", str(tmp_path / "index")):
        index = open_index(location, 4, "test")
        log, states = Log(), {}
        state_of = lambda t, m, states=states: states.get((t, m))  # noqa: E731
        log.add("alice", "m1")
        states[("alice", "m1")] = IndexedState(1, None, vec(0))
        log.add("alice", "m2")  # intent logged, head not written yet (an add in flight)
        hits = index.search(vec(1), "alice", None, 5, log.read, state_of)
        assert [h.memory_id for h in hits] == ["m1"]
        states[("alice", "m2")] = IndexedState(1, "s", vec(1))  # the head lands; no new log entry
        hits = index.search(vec(1), "alice", None, 5, log.read, state_of)
        assert hits[0].memory_id == "m2"  # the pending entry was retried
        assert [h.memory_id for h in index.search(vec(1), "alice", "s", 5, log.read, state_of)] == ["m2"]
        assert index.search(vec(1), "bob", None, 5, log.read, state_of) == []
        states[("alice", "m1")] = IndexedState(1, None, None)  # deleted
        log.add("alice", "m1")
        assert [h.memory_id for h in index.search(vec(0), "alice", None, 5, log.read, state_of)] == ["m2"]
        assert index.sync(log.read, state_of) == 0  # nothing new: replay is incremental
        index.close()


def test_rebuild_drops_points_of_no_memory(tmp_path):
    index = open_index(str(tmp_path / "index"), 4, "test")
    log, states = Log(), {("a", "m1"): IndexedState(1, None, vec(0)), ("a", "m2"): IndexedState(1, None, vec(1))}
    log.add("a", "m1")
    log.add("a", "m2")
    index.sync(log.read, lambda t, m: states.get((t, m)))
    assert index.count() == 2
    assert index.rebuild({("a", "m1"): states[("a", "m1")]}, log.read, lambda t, m: states.get((t, m))) == 1
    assert index.count() == 1


def test_an_index_of_another_embedder_is_refused(tmp_path):
    import pytest

    from kvshift_memory.exceptions import StoreError

    index = open_index(str(tmp_path / "index"), 4, "test")
    log = Log()
    log.add("a", "m1")
    index.sync(log.read, lambda t, m: IndexedState(1, None, vec(0)))
    index.close()  # writes the folder's snapshot, which names its embedder
    with pytest.raises(StoreError, match="embeds with"):
        open_index(str(tmp_path / "index"), 8, "other").count()


def test_a_new_process_starts_from_the_snapshot_and_replays_only_the_rest(tmp_path):
    log, states, asked = Log(), {}, []

    def state_of(tenant, memory_id):
        asked.append(memory_id)
        return states.get((tenant, memory_id))

    for n in range(3):
        log.add("alice", f"m{n}")
        states[("alice", f"m{n}")] = IndexedState(1, None, vec(n), ("word",))
    first = open_index(str(tmp_path / "index"), 4, "test")
    first.sync(log.read, state_of)
    first.close()
    log.add("alice", "m3")
    states[("alice", "m3")] = IndexedState(1, "s", vec(3))
    asked.clear()
    second = open_index(str(tmp_path / "index"), 4, "test")
    hits = second.search(vec(3), "alice", None, 5, log.read, state_of, terms=["word"], keyword_weight=0.1)
    assert asked == ["m3"]  # the other three came from the snapshot
    assert {h.memory_id for h in hits} == {"m0", "m1", "m2", "m3"} and hits[0].memory_id == "m3"
    second.close()


def test_a_damaged_snapshot_is_ignored_and_the_log_replayed(tmp_path):
    log, states = Log(), {("alice", "m1"): IndexedState(1, None, vec(1))}
    log.add("alice", "m1")
    folder = tmp_path / "index"
    first = open_index(str(folder), 4, "test")
    first.sync(log.read, lambda t, m: states.get((t, m)))
    first.close()
    snapshot = folder / "index.safetensors"
    for damage in (b"garbage", snapshot.read_bytes()[:-9]):
        snapshot.write_bytes(damage)
        index = open_index(str(folder), 4, "test")
        assert [
            h.memory_id for h in index.search(vec(1), "alice", None, 5, log.read, lambda t, m: states.get((t, m)))
        ] == ["m1"]


def test_a_log_that_went_backwards_is_replayed_whole():
    """The tier emptied (Redis restarted without its data) or restored from an older snapshot: the
    entry the index applied last is gone, and new entries must still be indexed."""
    index = open_index(":memory:", 4, "test")
    log, states = Log(), {}
    state_of = lambda t, m: states.get((t, m))  # noqa: E731
    for n in range(3):
        log.add("alice", f"m{n}")
        states[("alice", f"m{n}")] = IndexedState(1, None, vec(n))
    assert len(index.search(vec(0), "alice", None, 5, log.read, state_of)) == 3
    log.entries.clear()
    states.clear()  # restarted empty ...
    for n in range(4):  # ... then more writes than the index had applied: the log is as long again
        log.add("alice", f"new{n}")
        states[("alice", f"new{n}")] = IndexedState(1, None, vec(n % 4))
    assert {h.memory_id for h in index.search(vec(0), "alice", None, 10, log.read, state_of)} == {
        f"new{n}" for n in range(4)
    }
    log.entries[:] = log.entries[:2]  # restored from an older snapshot: the last two writes lost
    del states[("alice", "new2")], states[("alice", "new3")]
    log.add("alice", "later")
    states[("alice", "later")] = IndexedState(1, None, vec(3))
    assert {h.memory_id for h in index.search(vec(0), "alice", None, 10, log.read, state_of)} == {
        "new0",
        "new1",
        "later",
    }


def test_the_keyword_path_lifts_a_memory_that_names_the_rare_word(tmp_path):
    index = open_index(":memory:", 4, "test")
    log, states = Log(), {}
    state_of = lambda t, m: states.get((t, m))  # noqa: E731
    # every memory is as near the query by embedding; only one names "marley"
    for n in range(6):
        log.add("alice", f"m{n}")
        words = ("dance", "studio", "floor") + (("marley",) if n == 4 else ())
        states[("alice", f"m{n}")] = IndexedState(1, None, [1.0, 0.1 * n, 0.0, 0.0], words)
    dense = index.search(vec(0), "alice", None, 3, log.read, state_of)
    assert "m4" not in [h.memory_id for h in dense]
    hybrid = index.search(vec(0), "alice", None, 3, log.read, state_of, terms=["marley", "floor"], keyword_weight=0.05)
    assert hybrid[0].memory_id == "m4"
    assert hybrid[0].score > dense[0].score  # cosine plus the keyword share
    # another tenant's keywords are never candidates
    assert index.search(vec(0), "bob", None, 3, log.read, state_of, terms=["marley"], keyword_weight=1.0) == []


def test_a_folder_that_qdrants_local_mode_wrote_is_never_unpickled(tmp_path):
    """Qdrant's local mode keeps pickled rows in a sqlite file; a tampered one would run code on
    load. The index never opens such a folder with Qdrant: it reads only its own snapshot."""
    import pickle
    import sqlite3

    from qdrant_client import QdrantClient, models

    folder, marker = tmp_path / "index", tmp_path / "pwned"
    old = QdrantClient(path=str(folder))
    old.create_collection(
        "kvshift_memories", vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE)
    )
    old.upsert("kvshift_memories", points=[models.PointStruct(id=1, vector=vec(3), payload={"tenant": "alice"})])
    old.close()

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (database,) = folder.rglob("storage.sqlite")
    with sqlite3.connect(database) as connection:
        connection.execute("UPDATE points SET point = ?", (pickle.dumps(Payload()),))
    index = open_index(str(folder), 4, "test")
    log, states = Log(), {("alice", "m1"): IndexedState(1, None, vec(0), ("lisbon",))}
    log.add("alice", "m1")
    hits = index.search(
        vec(3), "alice", None, 5, log.read, lambda t, m: states.get((t, m)), terms=["lisbon"], keyword_weight=0.1
    )
    assert [h.memory_id for h in hits] == ["m1"]
    index.close()
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(Payload())) is not None and marker.exists()  # the payload does run when unpickled


def test_keyword_rarity_is_counted_among_the_tenants_own_memories():
    """Another tenant storing the same word many times must not move this tenant's scores."""
    log, states = Log(), {}
    state_of = lambda t, m: states.get((t, m))  # noqa: E731
    for n in range(4):
        log.add("alice", f"a{n}")
        states[("alice", f"a{n}")] = IndexedState(1, None, vec(n % 4), ("lisbon",) if n == 0 else ("porto",))
    index = MemoryIndex(":memory:", 4, "test")
    before = index.search(vec(1), "alice", None, 4, log.read, state_of, terms=["lisbon"], keyword_weight=1.0)
    for n in range(50):
        log.add("bob", f"b{n}")
        states[("bob", f"b{n}")] = IndexedState(1, None, vec(2), ("lisbon",))
    after = index.search(vec(1), "alice", None, 4, log.read, state_of, terms=["lisbon"], keyword_weight=1.0)
    assert [(h.memory_id, h.score) for h in after] == [(h.memory_id, h.score) for h in before]
    assert after[0].memory_id == "a0"


def test_the_keyword_scores_follow_qdrants_idf():
    """The in-process index scores keywords as Qdrant's IDF modifier does (one tenant, one corpus)."""
    from qdrant_client import QdrantClient, models

    from kvshift_memory.store.keywords import sparse_terms

    rng = __import__("random").Random(3)
    words = ["lisbon", "porto", "madrid", "budget", "flight", "hotel", "museum", "dinner"]
    log, states = Log(), {}
    client = QdrantClient(":memory:")
    client.create_collection(
        "c", vectors_config={}, sparse_vectors_config={"k": models.SparseVectorParams(modifier=models.Modifier.IDF)}
    )
    for n in range(60):
        chosen = tuple(rng.sample(words, rng.randint(1, 4)))
        log.add("alice", f"m{n}")
        states[("alice", f"m{n}")] = IndexedState(1, None, vec(n % 4), chosen)
        indices, values = sparse_terms(chosen)
        client.upsert(
            "c", points=[models.PointStruct(id=n, vector={"k": models.SparseVector(indices=indices, values=values)})]
        )
    index = MemoryIndex(":memory:", 4, "test")
    query = ["lisbon", "museum", "dinner"]
    ours = index.search(
        vec(0), "alice", None, 60, log.read, lambda t, m: states.get((t, m)), terms=query, keyword_weight=1.0
    )
    assert len(ours) == 60
    indices, values = sparse_terms(query)
    theirs = client.query_points(
        "c", query=models.SparseVector(indices=indices, values=values), using="k", limit=60
    ).points
    keyword = {f"m{p.id}": p.score for p in theirs}
    dense = {f"m{n}": 1.0 if n % 4 == 0 else 0.0 for n in range(60)}
    for hit in ours:
        assert abs(hit.score - (dense[hit.memory_id] + keyword.get(hit.memory_id, 0.0))) < 1e-4


def test_a_thread_waits_for_a_busy_index_only_so_long():
    import time

    import pytest

    from conftest import held_elsewhere
    from kvshift_memory.exceptions import StoreBusyError

    index = MemoryIndex(":memory:", 4, "test", lock_timeout_s=0.2)
    log = Log()
    with held_elsewhere(index._locked()):
        started = time.perf_counter()
        with pytest.raises(StoreBusyError):
            index.search(vec(0), "alice", None, 5, log.read, lambda t, m: None)
        assert time.perf_counter() - started < 1.0
    assert index.search(vec(0), "alice", None, 5, log.read, lambda t, m: None) == []
