"""The index replays the store's log idempotently, and repairs what a crash left half-done."""

from __future__ import annotations

import json
import uuid
import warnings

import pytest

from kvshift_memory import CorruptRecordError, InvalidInputError, MemoryStore
from kvshift_memory.store.index import IndexedState, MemoryIndex, open_index


class Log:
    """The store's side of an index, in miniature: the change log, each memory's state, and
    which memories the index asked about."""

    def __init__(self, states=None):
        self.entries: list[bytes] = []
        self.states = {} if states is None else states
        self.asked: list[str] = []

    def add(self, tenant, memory_id):
        self.entries.append(json.dumps({"tenant": tenant, "id": memory_id, "n": uuid.uuid4().hex}).encode())

    def read_log(self, start):
        return self.entries[start:]

    def index_state(self, tenant, memory_id):
        self.asked.append(memory_id)
        return self.states.get((tenant, memory_id))


def vec(i: int) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(4)]


def test_sync_replays_the_log_and_keeps_in_flight_adds_pending(tmp_path):
    for location in (":memory:", str(tmp_path / "index")):
        log = Log()
        states = log.states
        index = open_index(location, 4, "test", source=log)
        log.add("alice", "m1")
        states[("alice", "m1")] = IndexedState(1, None, vec(0))
        log.add("alice", "m2")  # intent logged, head not written yet (an add in flight)
        hits = index.search(vec(1), "alice", None, 5)
        assert [h.memory_id for h in hits] == ["m1"]
        states[("alice", "m2")] = IndexedState(1, "s", vec(1))  # the head lands; no new log entry
        hits = index.search(vec(1), "alice", None, 5)
        assert hits[0].memory_id == "m2"  # the pending entry was retried
        assert [h.memory_id for h in index.search(vec(1), "alice", "s", 5)] == ["m2"]
        assert index.search(vec(1), "bob", None, 5) == []
        states[("alice", "m1")] = IndexedState(1, None, None)  # deleted
        log.add("alice", "m1")
        assert [h.memory_id for h in index.search(vec(0), "alice", None, 5)] == ["m2"]
        assert index.sync() == 0  # nothing new: replay is incremental
        index.close()


def test_rebuild_drops_points_of_no_memory(tmp_path):
    states = {("a", "m1"): IndexedState(1, None, vec(0)), ("a", "m2"): IndexedState(1, None, vec(1))}
    log = Log(states)
    index = open_index(str(tmp_path / "index"), 4, "test", source=log)
    log.add("a", "m1")
    log.add("a", "m2")
    index.sync()
    assert index.count() == 2
    assert index.rebuild({("a", "m1"): states[("a", "m1")]}) == 1
    assert index.count() == 1


def test_an_index_of_another_embedder_is_refused(tmp_path):
    import pytest

    from kvshift_memory.exceptions import StoreError

    log = Log({("a", "m1"): IndexedState(1, None, vec(0))})
    index = open_index(str(tmp_path / "index"), 4, "test", source=log)
    log.add("a", "m1")
    index.sync()
    index.close()  # writes the folder's snapshot, which names its embedder
    with pytest.raises(StoreError, match="embeds with"):
        open_index(str(tmp_path / "index"), 8, "other", source=log).count()


def test_a_new_process_starts_from_the_snapshot_and_replays_only_the_rest(tmp_path):
    log = Log()
    states = log.states
    for n in range(3):
        log.add("alice", f"m{n}")
        states[("alice", f"m{n}")] = IndexedState(1, None, vec(n), ("word",))
    first = open_index(str(tmp_path / "index"), 4, "test", source=log)
    first.sync()
    first.close()
    log.add("alice", "m3")
    states[("alice", "m3")] = IndexedState(1, "s", vec(3))
    log.asked.clear()
    second = open_index(str(tmp_path / "index"), 4, "test", source=log)
    hits = second.search(vec(3), "alice", None, 5, terms=["word"], keyword_weight=0.1)
    assert log.asked == ["m3"]  # the other three came from the snapshot
    assert {h.memory_id for h in hits} == {"m0", "m1", "m2", "m3"} and hits[0].memory_id == "m3"
    second.close()


def test_a_damaged_snapshot_is_ignored_and_the_log_replayed(tmp_path):
    log = Log({("alice", "m1"): IndexedState(1, None, vec(1))})
    log.add("alice", "m1")
    folder = tmp_path / "index"
    first = open_index(str(folder), 4, "test", source=log)
    first.sync()
    first.close()
    snapshot = folder / "index.safetensors"
    for damage in (b"garbage", snapshot.read_bytes()[:-9]):
        snapshot.write_bytes(damage)
        index = open_index(str(folder), 4, "test", source=log)
        assert [h.memory_id for h in index.search(vec(1), "alice", None, 5)] == ["m1"]


def test_a_log_that_went_backwards_is_replayed_whole():
    """The tier emptied (Redis restarted without its data) or restored from an older snapshot: the
    entry the index applied last is gone, and new entries must still be indexed."""
    log = Log()
    states = log.states
    index = open_index(":memory:", 4, "test", source=log)
    for n in range(3):
        log.add("alice", f"m{n}")
        states[("alice", f"m{n}")] = IndexedState(1, None, vec(n))
    assert len(index.search(vec(0), "alice", None, 5)) == 3
    log.entries.clear()
    states.clear()  # restarted empty ...
    for n in range(4):  # ... then more writes than the index had applied: the log is as long again
        log.add("alice", f"new{n}")
        states[("alice", f"new{n}")] = IndexedState(1, None, vec(n % 4))
    assert {h.memory_id for h in index.search(vec(0), "alice", None, 10)} == {f"new{n}" for n in range(4)}
    log.entries[:] = log.entries[:2]  # restored from an older snapshot: the last two writes lost
    del states[("alice", "new2")], states[("alice", "new3")]
    log.add("alice", "later")
    states[("alice", "later")] = IndexedState(1, None, vec(3))
    assert {h.memory_id for h in index.search(vec(0), "alice", None, 10)} == {
        "new0",
        "new1",
        "later",
    }


def test_the_keyword_path_lifts_a_memory_that_names_the_rare_word(tmp_path):
    log = Log()
    states = log.states
    index = open_index(":memory:", 4, "test", source=log)
    # every memory is as near the query by embedding; only one names "marley"
    for n in range(6):
        log.add("alice", f"m{n}")
        words = ("dance", "studio", "floor") + (("marley",) if n == 4 else ())
        states[("alice", f"m{n}")] = IndexedState(1, None, [1.0, 0.1 * n, 0.0, 0.0], words)
    dense = index.search(vec(0), "alice", None, 3)
    assert "m4" not in [h.memory_id for h in dense]
    hybrid = index.search(vec(0), "alice", None, 3, terms=["marley", "floor"], keyword_weight=0.05)
    assert hybrid[0].memory_id == "m4"
    assert hybrid[0].score > dense[0].score  # cosine plus the keyword share
    # another tenant's keywords are never candidates
    assert index.search(vec(0), "bob", None, 3, terms=["marley"], keyword_weight=1.0) == []


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
    log = Log({("alice", "m1"): IndexedState(1, None, vec(0), ("lisbon",))})
    index = open_index(str(folder), 4, "test", source=log)
    log.add("alice", "m1")
    hits = index.search(vec(3), "alice", None, 5, terms=["lisbon"], keyword_weight=0.1)
    assert [h.memory_id for h in hits] == ["m1"]
    index.close()
    assert not marker.exists()
    assert pickle.loads(pickle.dumps(Payload())) is not None and marker.exists()  # the payload does run when unpickled


def test_keyword_rarity_is_counted_among_the_tenants_own_memories():
    """Another tenant storing the same word many times must not move this tenant's scores."""
    log = Log()
    states = log.states
    for n in range(4):
        log.add("alice", f"a{n}")
        states[("alice", f"a{n}")] = IndexedState(1, None, vec(n % 4), ("lisbon",) if n == 0 else ("porto",))
    index = MemoryIndex(":memory:", 4, "test", source=log)
    before = index.search(vec(1), "alice", None, 4, terms=["lisbon"], keyword_weight=1.0)
    for n in range(50):
        log.add("bob", f"b{n}")
        states[("bob", f"b{n}")] = IndexedState(1, None, vec(2), ("lisbon",))
    after = index.search(vec(1), "alice", None, 4, terms=["lisbon"], keyword_weight=1.0)
    assert [(h.memory_id, h.score) for h in after] == [(h.memory_id, h.score) for h in before]
    assert after[0].memory_id == "a0"


def test_the_keyword_scores_follow_qdrants_idf():
    """The in-process index scores keywords as Qdrant's IDF modifier does (one tenant, one corpus)."""
    from qdrant_client import QdrantClient, models

    from kvshift_memory.store.keywords import sparse_terms

    rng = __import__("random").Random(3)
    words = ["lisbon", "porto", "madrid", "budget", "flight", "hotel", "museum", "dinner"]
    log = Log()
    states = log.states
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
    index = MemoryIndex(":memory:", 4, "test", source=log)
    query = ["lisbon", "museum", "dinner"]
    ours = index.search(vec(0), "alice", None, 60, terms=query, keyword_weight=1.0)
    assert len(ours) == 60
    indices, values = sparse_terms(query)
    theirs = client.query_points(
        "c", query=models.SparseVector(indices=indices, values=values), using="k", limit=60
    ).points
    keyword = {f"m{p.id}": p.score for p in theirs}
    dense = {f"m{n}": 1.0 if n % 4 == 0 else 0.0 for n in range(60)}
    for hit in ours:
        assert abs(hit.score - (dense[hit.memory_id] + keyword.get(hit.memory_id, 0.0))) < 1e-4


@pytest.mark.timeout(60)  # a wait with no timeout hangs here rather than raising
def test_a_thread_waits_for_a_busy_index_only_so_long():

    from conftest import held_elsewhere
    from kvshift_memory.exceptions import StoreBusyError

    index = MemoryIndex(":memory:", 4, "test", source=Log(), lock_timeout_s=0.2)
    with held_elsewhere(index._locked()):
        with pytest.raises(StoreBusyError):
            index.search(vec(0), "alice", None, 5)
    assert index.search(vec(0), "alice", None, 5) == []


# --------------------------------------------------------------------------- a Qdrant server
# No Qdrant server runs here: qdrant-client's own in-process implementation (local mode, the
# same API) stands in for it, one instance shared by every client a test opens for an http URL.

OWNER_A, OWNER_B = "a" * 32, "b" * 32


class _SharedServer:
    """What ``QdrantClient(url=...)`` returns in these tests: the one local instance (closing a
    client leaves the server's data, as on a real server); the arguments of each opening are kept."""

    def __init__(self) -> None:
        from qdrant_client import QdrantClient

        self.instance = QdrantClient(":memory:")
        self.openings: list[dict] = []

    def client(self, **kwargs):
        self.openings.append(kwargs)
        server = self

        class _Client:
            def __getattr__(self, name):
                return getattr(server.instance, name)

            def close(self) -> None:
                pass

        return _Client()


@pytest.fixture()
def qdrant_server(monkeypatch):
    import qdrant_client

    server = _SharedServer()
    monkeypatch.setattr(qdrant_client, "QdrantClient", server.client)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Payload indexes have no effect in the local Qdrant")  # a server's have
        yield server


def _qdrant(owner: str, source: Log | None = None, **kwargs):
    return open_index("http://qdrant.test:6333", 4, "test", source=source or Log(), owner=lambda: owner, **kwargs)


def test_stores_sharing_a_qdrant_collection_never_touch_each_others_points(qdrant_server):
    indexes, logs, states = {}, {}, {}
    for owner in (OWNER_A, OWNER_B):
        logs[owner] = Log()
        indexes[owner], states[owner] = _qdrant(owner, logs[owner]), logs[owner].states
        for i, memory_id in enumerate(("m1", "m2")):  # the same tenant and ids in both stores
            logs[owner].add("alice", memory_id)
            states[owner][("alice", memory_id)] = IndexedState(1, None, vec(i if owner == OWNER_A else 3 - i))

    def search(owner, i):
        return indexes[owner].search(vec(i), "alice", None, 5)

    assert search(OWNER_A, 0)[0].memory_id == "m1" and search(OWNER_B, 0)[0].memory_id == "m2"
    assert all(hit.score > 0.99 or hit.score < 0.01 for hit in search(OWNER_A, 0))  # only A's points
    assert indexes[OWNER_A].count() == indexes[OWNER_B].count() == 2
    assert qdrant_server.instance.count("kvshift_memories").count == 4

    # check() of A: its states name only its memories; B's points are no strays of A
    dropped = indexes[OWNER_A].rebuild(dict(states[OWNER_A]))
    assert dropped == 0 and indexes[OWNER_B].count() == 2
    # A's log went backwards (its tier restored): A starts again, B's points and sync state stay
    logs[OWNER_A].entries = logs[OWNER_A].entries[:1]
    states[OWNER_A].pop(("alice", "m2"))
    assert [hit.memory_id for hit in search(OWNER_A, 1)] == ["m1"]
    assert indexes[OWNER_B].count() == 2 and {h.memory_id for h in search(OWNER_B, 1)} == {"m1", "m2"}


def test_a_collection_prefix_and_an_api_key_reach_the_server(qdrant_server, monkeypatch):
    monkeypatch.delenv("QDRANT_API_KEY", raising=False)
    log = Log({("alice", "m1"): IndexedState(1, None, vec(0))})
    log.add("alice", "m1")
    team = _qdrant(OWNER_A, log, api_key="s3cret", collection_prefix="team-a")
    assert team.search(vec(0), "alice", None, 5)[0].memory_id == "m1"
    assert qdrant_server.openings[-1] == {"url": "http://qdrant.test:6333", "api_key": "s3cret"}
    names = {c.name for c in qdrant_server.instance.get_collections().collections}
    assert names == {"team-a_memories", "team-a_sync_state"}
    other = _qdrant(OWNER_A)  # the same store under the default prefix sees nothing of team-a's
    assert other.search(vec(0), "alice", None, 5) == []
    monkeypatch.setenv("QDRANT_API_KEY", "from-env")
    _qdrant(OWNER_A).count()
    assert qdrant_server.openings[-1]["api_key"] == "from-env"
    assert "s3cret" not in repr(team.__dict__.get("location"))


def test_qdrant_options_are_checked(tmp_path):
    for bad in ("", "a/b", "x" * 65, "é", None):
        with pytest.raises(InvalidInputError, match="collection_prefix"):
            _qdrant(OWNER_A, collection_prefix=bad)
    with pytest.raises(InvalidInputError, match="api_key"):
        _qdrant(OWNER_A, api_key="line\nbreak")
    for location in (":memory:", str(tmp_path / "index")):
        with pytest.raises(InvalidInputError, match="Qdrant"):
            open_index(location, 4, "test", source=Log(), api_key="k")
        with pytest.raises(InvalidInputError, match="Qdrant"):
            open_index(location, 4, "test", source=Log(), collection_prefix="team-a")


def test_a_collection_from_before_points_named_their_store_is_rebuilt(qdrant_server):
    from qdrant_client import models

    server = qdrant_server.instance
    server.create_collection(
        "kvshift_memories",
        vectors_config=models.VectorParams(size=4, distance=models.Distance.COSINE),
        sparse_vectors_config={"keywords": models.SparseVectorParams(modifier=models.Modifier.IDF)},
        metadata={"embedder": "test"},
    )
    server.upsert("kvshift_memories", points=[models.PointStruct(id=str(uuid.uuid4()), vector={"": vec(0)})])
    log = Log({("alice", "m1"): IndexedState(1, None, vec(1))})
    log.add("alice", "m1")
    index = _qdrant(OWNER_A, log)
    assert [hit.memory_id for hit in index.search(vec(1), "alice", None, 5)] == ["m1"]
    assert server.count("kvshift_memories").count == 1  # the old, unowned point went with its collection


def test_every_process_of_a_store_shares_one_identity(tmp_path):
    class Fixed:
        dimension, name = 4, "fixed"

        def embed(self, texts):
            return [vec(0) for _ in texts]

    first = MemoryStore(tmp_path / "s", embedder=Fixed(), index_url=":memory:")
    second = MemoryStore(tmp_path / "s", embedder=Fixed(), index_url=":memory:")
    assert first._store_id() == second._store_id() != MemoryStore(tmp_path / "t", embedder=Fixed())._store_id()
    first.tier.set("store_id", b"../../not-an-id")
    with pytest.raises(CorruptRecordError):
        second._store_id()
    with pytest.raises(InvalidInputError, match="Qdrant"):
        MemoryStore(tmp_path / "u", embedder=Fixed(), index_api_key="k")


def test_a_search_scores_only_the_callers_rows_whoever_else_is_stored():
    """Bob's ten memories beside 200k of Mallory's: his search scores his ten rows, as it does alone
    (counted, not timed: docs/benchmarks/store.md has the times)."""
    import numpy as np

    index = MemoryIndex(":memory:", 8, "test", source=Log())
    rng = np.random.default_rng(0)
    for i in range(10):
        index._upsert(
            f"b{i}",
            rng.normal(size=8),
            ([], []),
            {"tenant": "bob", "memory_id": f"b{i}", "version": 1, "session_id": None},
        )
    query = rng.normal(size=8).tolist()
    alone = index._search(query, "bob", None, 4, ["anything"], 0.05)
    scored_alone = index.scored_rows
    for i in range(200_000):
        payload = {"tenant": "mallory", "memory_id": f"m{i}", "version": 1, "session_id": None}
        index._upsert(f"m{i}", rng.normal(size=8), ([], []), payload)
    index.scored_rows = 0
    beside = index._search(query, "bob", None, 4, ["anything"], 0.05)
    assert beside == alone and index.scored_rows == scored_alone == 10
    assert {hit.memory_id for hit in index._search(query, "bob", "no such session", 4, [], 0.0)} == set()
