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
