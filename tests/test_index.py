"""The Qdrant index replays the store's log idempotently, and repairs what a crash left half-done."""

from __future__ import annotations

import json

from kvshift_memory.store.index import IndexedState, QdrantIndex


class Log:
    def __init__(self):
        self.entries: list[bytes] = []

    def add(self, tenant, memory_id):
        self.entries.append(json.dumps({"tenant": tenant, "id": memory_id}).encode())

    def read(self, start):
        return self.entries[start:]


def vec(i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(4)]


def test_sync_replays_the_log_and_keeps_in_flight_adds_pending(tmp_path):
    for location in (":memory:", str(tmp_path / "index")):
        index = QdrantIndex(location, 4, "test")
        log, states = Log(), {}
        state_of = lambda t, m: states.get((t, m))  # noqa: E731
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
    index = QdrantIndex(str(tmp_path / "index"), 4, "test")
    log, states = Log(), {("a", "m1"): IndexedState(1, None, vec(0)), ("a", "m2"): IndexedState(1, None, vec(1))}
    log.add("a", "m1")
    log.add("a", "m2")
    index.sync(log.read, lambda t, m: states.get((t, m)))
    assert index.count() == 2
    assert index.rebuild(iter([("a", "m1")]), log.read, lambda t, m: states.get((t, m))) == 1
    assert index.count() == 1


def test_an_index_of_another_embedder_is_refused(tmp_path):
    import pytest

    from kvshift_memory.exceptions import StoreError

    QdrantIndex(str(tmp_path / "index"), 4, "test").count()
    with pytest.raises(StoreError, match="embeds with"):
        QdrantIndex(str(tmp_path / "index"), 8, "other").count()


def test_the_keyword_path_lifts_a_memory_that_names_the_rare_word(tmp_path):
    index = QdrantIndex(":memory:", 4, "test")
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


def test_an_index_built_without_the_keyword_path_is_rebuilt_from_the_log(tmp_path):
    from qdrant_client import QdrantClient, models

    folder = tmp_path / "index"
    old = QdrantClient(path=str(folder))
    old.create_collection("kvshift_memories", vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE))
    old.upsert("kvshift_memories", points=[models.PointStruct(id=1, vector=vec(3), payload={"tenant": "alice"})])
    old.close()
    index = QdrantIndex(str(folder), 4, "test", hold_s=0)
    log, states = Log(), {("alice", "m1"): IndexedState(1, None, vec(0), ("lisbon",))}
    log.add("alice", "m1")
    hits = index.search(vec(3), "alice", None, 5, log.read, lambda t, m: states.get((t, m)), terms=["lisbon"], keyword_weight=0.1)
    assert [h.memory_id for h in hits] == ["m1"]  # the old point is gone, the log was replayed
    index.close()
