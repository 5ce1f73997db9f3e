"""MemoryStore: the API, versions, lifecycle, isolation and bad input, on every backend."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvshift_memory import MemoryRecord, MemoryStore
from kvshift_memory.exceptions import InvalidInputError, MemoryNotFoundError, StoreError
from kvshift_memory.store.records import text_hash

FACTS = [
    "Budget for the Lisbon trip: 50k.",
    "My sister Ana lives in Porto and works as a nurse.",
    "The flight to Lisbon leaves on 12 May at 7am.",
    "I am allergic to peanuts.",
]


def test_add_get_search(make_store):
    store = make_store()
    records = [store.add(text, tenant="alice", session_id="trip") for text in FACTS]
    assert [r.version for r in records] == [1] * 4 and len({r.id for r in records}) == 4
    got = store.get(records[0].id, tenant="alice")
    assert got.text == FACTS[0] and got.status == "live" and got.session_id == "trip"
    assert got.source_text_hash == text_hash(FACTS[0]) and got.access_count == 1
    hits = store.search("When does my plane depart?", tenant="alice", k=2)
    assert len(hits) == 2 and hits[0].text == FACTS[2]
    assert hits[0].score >= hits[1].score
    assert store.search("peanut allergy", tenant="alice", session_id="trip", k=1)[0].text == FACTS[3]
    assert store.search("peanut allergy", tenant="alice", session_id="other", k=4) == []
    assert store.get(records[2].id, tenant="alice").access_count == 2  # one search hit, then this get


def test_list_shows_a_users_memories_newest_first_with_versions_sessions_and_pages(make_store):
    store = make_store()
    first = store.add("I live in Porto.", tenant="alice", session_id="monday")
    dog = store.add("My dog is called Pepper.", tenant="alice", session_id="monday")
    gone = store.add("The door code is 4417.", tenant="alice", session_id="tuesday")
    store.add("Bob's secret.", tenant="bob")
    store.delete(gone.id, tenant="alice")
    moved = store.supersede(first.id, "I live in Lisbon now.", tenant="alice")
    listed = store.list("alice")
    assert [r.text for r in listed] == ["I live in Lisbon now.", "My dog is called Pepper."]  # newest first
    assert [r.access_count for r in listed] == [0, 0]  # listing is not reading them
    versions = store.list("alice", include_superseded=True)
    assert [(r.id, r.version, r.status) for r in versions] == [
        (moved.id, 2, "live"),
        (dog.id, 1, "live"),
        (first.id, 1, "superseded"),
    ]
    assert [r.id for r in store.list("alice", session_id="monday")] == [
        moved.id,
        dog.id,
    ]  # a new version keeps its session
    assert store.list("alice", session_id="tuesday") == []  # its one memory is deleted
    assert [r.text for r in store.list("alice", limit=1, offset=1)] == ["My dog is called Pepper."]
    assert store.list("alice", offset=5) == [] and store.list("nobody") == []
    assert [r.text for r in store.list("bob")] == ["Bob's secret."]  # never another tenant's
    for bad in ({"limit": 0}, {"limit": 1001}, {"limit": "9"}, {"offset": -1}, {"offset": True}):
        with pytest.raises(InvalidInputError):
            store.list("alice", **bad)
    for tenant in ("", "a\x00b", 7):
        with pytest.raises(InvalidInputError):
            store.list(tenant)
    with pytest.raises(InvalidInputError):
        store.list("alice", include_superseded="yes")


def test_supersede_keeps_the_chain_and_search_sees_only_the_live_version(make_store):
    store = make_store()
    old = store.add("The budget is 50k.", tenant="alice")
    store.add("My cat is called Tom.", tenant="alice")
    new = store.supersede(old.id, "The budget is 70k.", tenant="alice")
    assert (new.id, new.version, new.text) == (old.id, 2, "The budget is 70k.")
    assert store.get(old.id, tenant="alice").text == "The budget is 70k."
    texts = [r.text for r in store.search("what is the budget", tenant="alice", k=4)]
    assert "The budget is 70k." in texts and "The budget is 50k." not in texts
    history = store.history(old.id, tenant="alice")
    assert [(r.version, r.text, r.status) for r in history] == [
        (1, "The budget is 50k.", "superseded"),
        (2, "The budget is 70k.", "live"),
    ]
    third = store.supersede(old.id, "The budget is 90k.", tenant="alice")
    assert third.version == 3 and len(store.history(old.id, tenant="alice")) == 3


def test_delete_and_gc_erase_everything_of_a_memory(make_store):
    store = make_store()
    keep = store.add("Keep me.", tenant="alice")
    gone = store.add("Forget me.", tenant="alice")
    store.supersede(gone.id, "Forget me, version two.", tenant="alice")
    assert store.delete(gone.id, tenant="alice") is True
    assert store.delete(gone.id, tenant="alice") is False
    assert store.get(gone.id, tenant="alice") is None
    assert [r.text for r in store.search("forget", tenant="alice", k=4)] == ["Keep me."]
    # tombstoned in its history until gc erases it
    assert [(r.version, r.status) for r in store.history(gone.id, tenant="alice")] == [
        (1, "superseded"),
        (2, "deleted"),
    ]
    report = store.gc()
    assert report.erased_memories == 1
    with pytest.raises(MemoryNotFoundError):
        store.history(gone.id, tenant="alice")
    leftovers = [key for key in store.tier.scan("") if gone.id in key and not key.startswith("h/")]
    assert leftovers == []  # text, vectors and counters erased; only the tombstone head stays
    assert store.get(keep.id, tenant="alice").text == "Keep me."
    assert store.check().ok


def test_ttl_expires_a_memory(make_store):
    store = make_store()
    short = store.add("Expires soon.", tenant="alice", ttl_s=1.0)
    assert store.get(short.id, tenant="alice") is not None  # read at once: a loaded machine may embed slowly
    lasting = store.add("Stays.", tenant="alice")
    time.sleep(max(0.0, short.expires_at - time.time()) + 0.2)
    assert store.get(short.id, tenant="alice") is None
    assert [r.text for r in store.search("expires", tenant="alice", k=4)] == ["Stays."]
    assert store.gc().erased_memories == 1
    assert store.get(lasting.id, tenant="alice") is not None


def test_find_by_hash_and_stats(make_store):
    store = make_store()
    record = store.add(FACTS[0], tenant="alice")
    assert store.find_by_hash(text_hash(FACTS[0]), tenant="alice").id == record.id
    assert store.find_by_hash(text_hash("never stored"), tenant="alice") is None
    stats = store.stats()
    assert (stats["memories"], stats["versions"], stats["fragments"]) == (1, 1, 0)


def test_records_reopen_from_disk(tmp_path, embedder):
    with MemoryStore(tmp_path / "s", embedder=embedder) as store:
        record = store.add(FACTS[1], tenant="alice", importance_score=0.9, semantic_keywords=["family", "Porto"])
    with MemoryStore(tmp_path / "s", embedder=embedder) as store:
        again = store.get(record.id, tenant="alice")
        assert again.text == FACTS[1] and again.importance_score == 0.9
        assert again.semantic_keywords == ("family", "Porto")
        assert store.search("Where does my sister live?", tenant="alice", k=1)[0].id == record.id


# ---------------------------------------------------------------- isolation: B never gets A's


def test_tenant_isolation(make_store):
    store = make_store()
    secret = "Alice's bank PIN is 4921."
    a = store.add(secret, tenant="alice", session_id="s")
    b_own = store.add("Bob likes chess.", tenant="bob")

    # by search, even with A's exact text as the query
    assert all(r.tenant == "bob" for r in store.search(secret, tenant="bob", k=10))
    assert [r.id for r in store.search(secret, tenant="bob", k=10)] == [b_own.id]
    # by id, through every entry point
    assert store.get(a.id, tenant="bob") is None
    with pytest.raises(MemoryNotFoundError):
        store.supersede(a.id, "Alice's PIN is 0000.", tenant="bob")
    with pytest.raises(MemoryNotFoundError):
        store.history(a.id, tenant="bob")
    assert store.delete(a.id, tenant="bob") is False
    # by guessing the text hash
    assert store.find_by_hash(a.source_text_hash, tenant="bob") is None
    # by a forged record: fragment reads and writes need a live record of that tenant with that text
    forged = MemoryRecord(**{**a.as_dict(), "tenant": "bob"})
    assert store.load_fragment(forged, "0" * 32) is None
    assert store.save_fragment(forged, "0" * 32, b"anything") is False
    wrong_text = MemoryRecord(**{**a.as_dict(), "text": "Alice's bank PIN is 0000."})
    assert store.save_fragment(wrong_text, "0" * 32, b"anything") is False
    # and A's memory is untouched
    assert store.get(a.id, tenant="alice").text == secret
    assert store.history(a.id, tenant="alice")[-1].version == 1


def test_forged_markers_resolve_only_for_the_callers_tenant(make_store):
    from kvshift_memory.markers import render_marker, resolve_markers

    store = make_store()
    a = store.add("Alice's bank PIN is 4921.", tenant="alice", session_id="s1")
    marker = render_marker(a)
    # bob copies alice's marker, text and all: plain text for him, no record
    assert resolve_markers(f"hi {marker}", store, tenant="bob") == [f"hi {a.text}"]
    # alice herself: resolves in her tenant, and in the right session only
    resolved = resolve_markers(marker, store, tenant="alice", session_id="s1")
    assert len(resolved) == 1 and isinstance(resolved[0], MemoryRecord) and resolved[0].id == a.id
    assert resolve_markers(marker, store, tenant="alice", session_id="s2") == [a.text]
    # wrong hash (edited text), wrong version: plain text
    assert resolve_markers(f"⟦mem:{a.id}@1⟧Alice's PIN is 0000.⟦/mem⟧", store, tenant="alice") == [
        "Alice's PIN is 0000."
    ]
    assert resolve_markers(f"⟦mem:{a.id}@2⟧{a.text}⟦/mem⟧", store, tenant="alice") == [a.text]


# ---------------------------------------------------------------- bad input


def test_bad_input_is_refused_clearly_and_loses_nothing(make_store):
    store = make_store()
    kept = store.add("Something to keep.", tenant="alice")
    bad_calls = [
        lambda: store.add("", tenant="alice"),
        lambda: store.add("   \n", tenant="alice"),
        lambda: store.add("bad \ud800 surrogate", tenant="alice"),
        lambda: store.add(123, tenant="alice"),
        lambda: store.add(b"bytes", tenant="alice"),
        lambda: store.add("x" * 1_000_001, tenant="alice"),
        lambda: store.add("ok", tenant=""),
        lambda: store.add("ok", tenant=None),
        lambda: store.add("ok", tenant="a\nb"),
        lambda: store.add("ok", tenant="a" * 257),
        lambda: store.add("ok", tenant="alice", session_id=5),
        lambda: store.add("ok", tenant="alice", importance_score=2.0),
        lambda: store.add("ok", tenant="alice", importance_score=float("nan")),
        lambda: store.add("ok", tenant="alice", semantic_keywords="not a list"),
        lambda: store.add("ok", tenant="alice", ttl_s=-1),
        lambda: store.add("ok", tenant="alice", ttl_s=float("inf")),
        lambda: store.get(None, tenant="alice"),
        lambda: store.get("", tenant="alice"),
        lambda: store.search("", tenant="alice"),
        lambda: store.search("q", tenant="alice", k=0),
        lambda: store.search("q", tenant="alice", k="4"),
        lambda: store.search("q", tenant="alice", k=10**6),
        lambda: store.supersede(kept.id, "", tenant="alice"),
        lambda: store.find_by_hash("not-a-hash", tenant="alice"),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidInputError):
            call()
    assert store.get("no-such-id", tenant="alice") is None
    with pytest.raises(MemoryNotFoundError):
        store.supersede("no-such-id", "text", tenant="alice")
    assert store.delete("no-such-id", tenant="alice") is False
    # well-defined results: huge text and control characters are stored verbatim
    huge = store.add("word " * 20_000, tenant="alice")
    assert store.get(huge.id, tenant="alice").text == "word " * 20_000
    controls = store.add("tab\there\x00nul\x1bescape\u202eRTL", tenant="alice")
    assert store.get(controls.id, tenant="alice").text == "tab\there\x00nul\x1bescape\u202eRTL"
    # nothing was lost
    assert store.get(kept.id, tenant="alice").text == "Something to keep."
    assert store.stats()["memories"] == 3
    assert store.check().ok


def test_constructor_refuses_bad_settings(tmp_path, embedder):
    for options in ({}, {"codec": "int3"}, {"group_size": 3}, {"hot_bytes": -1}, {"lock_timeout_s": 0}):
        with pytest.raises(InvalidInputError):
            MemoryStore(**({"path": tmp_path} if options else {}), embedder=embedder, **options)
    with pytest.raises(InvalidInputError):
        MemoryStore(kv_url="ftp://x", embedder=embedder)
    with pytest.raises(StoreError):
        MemoryStore(kv_url="redis://127.0.0.1:1/0", embedder=embedder)
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(StoreError, match="store folder"):
        MemoryStore(tmp_path / "a-file", embedder=embedder)


def test_damaged_records_are_reported_not_served(make_store):
    store = make_store()
    record = store.add("A fact.", tenant="alice")
    (key,) = store.tier.scan(f"r/alice/{record.id}/1/")  # the version's record, under its writer's key
    store.tier.set(key, b'{"not": "a record"}')
    assert store.get(record.id, tenant="alice") is None
    report = store.check()
    assert not report.ok and any(record.id in problem for problem in report.problems)


def test_two_stores_on_one_folder_see_each_others_writes(tmp_path, embedder):
    """Each store has its own in-memory index, kept in step through the folder's log."""
    first = MemoryStore(tmp_path / "s", embedder=embedder)
    second = MemoryStore(tmp_path / "s", embedder=embedder)
    record = first.add("The spare key is under the blue pot.", tenant="alice")
    assert first.search("where is the key", tenant="alice", k=1)[0].id == record.id
    assert second.search("where is the key", tenant="alice", k=1)[0].id == record.id
    second.supersede(record.id, "The spare key is with the neighbour.", tenant="alice")
    assert first.search("where is the key", tenant="alice", k=1)[0].text == "The spare key is with the neighbour."
    first.close()
    second.close()


def test_racing_supersedes_publish_exactly_one_writer(backend, tmp_path, request):
    """200 times, two threads supersede one memory at once: one wins, the other is told and leaves no trace."""
    import json
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from store_worker import HashEmbedder

    from kvshift_memory.exceptions import VersionConflictError

    embedder = HashEmbedder()  # deterministic: an embedding can be checked against its text
    if backend.startswith("redis"):
        from conftest import empty_redis

        store = MemoryStore(kv_url=empty_redis(backend, request), index_url=":memory:", embedder=embedder)
    elif backend == "disk":
        store = MemoryStore(tmp_path / "s", embedder=embedder)
    else:
        store = MemoryStore(kv_url="memory://", index_url=":memory:", embedder=embedder)
    for trial in range(200):
        record = store.add(f"Trial {trial}: the door code is 1234.", tenant="alice")
        start = threading.Barrier(2)
        outcomes: dict[str, object] = {}

        def write(text: str, start=start, outcomes=outcomes, memory_id=record.id) -> None:
            start.wait()
            try:
                outcomes[text] = store.supersede(memory_id, text, tenant="alice", expected_version=1)
            except VersionConflictError as exc:
                outcomes[text] = exc

        texts = [f"Trial {trial}: the door code is {code}." for code in ("5678", "9012")]
        threads = [threading.Thread(target=write, args=(text,)) for text in texts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        won = [text for text, outcome in outcomes.items() if not isinstance(outcome, Exception)]
        assert len(won) == 1, outcomes
        (refused,) = set(texts) - set(won)
        assert store.get(record.id, tenant="alice").text == won[0]
        assert [r.text for r in store.history(record.id, tenant="alice")] == [record.text, won[0]]
        stored = [json.loads(store.tier.get(key))["text"] for key in store.tier.scan(f"r/alice/{record.id}/")]
        assert refused not in stored, "a refused writer's text is stored"
        (embedding_key,) = store.tier.scan(f"e/alice/{record.id}/2/")
        assert store.tier.get(embedding_key)[32:] == np.asarray(embedder.embed([won[0]])[0], dtype="<f4").tobytes()
    assert store.check().ok
    store.close()


def test_a_stale_expected_version_is_refused_and_changes_nothing(make_store):
    from kvshift_memory.exceptions import VersionConflictError

    store = make_store()
    record = store.add("The budget is 50k.", tenant="alice")
    store.supersede(record.id, "The budget is 70k.", tenant="alice", expected_version=1)
    with pytest.raises(VersionConflictError, match="version 2, not 1"):
        store.supersede(record.id, "The budget is 60k.", tenant="alice", expected_version=1)
    assert [r.text for r in store.history(record.id, tenant="alice")] == ["The budget is 50k.", "The budget is 70k."]
    for bad in (0, -1, "2", 2.0, True):
        with pytest.raises(InvalidInputError):
            store.supersede(record.id, "x", tenant="alice", expected_version=bad)


def test_check_finds_an_embedding_planted_from_another_text(make_store):
    store = make_store()
    target = store.add("The spare key is under the blue pot.", tenant="alice")
    other = store.add("My sister lives in Porto.", tenant="alice")
    (target_key,) = store.tier.scan(f"e/alice/{target.id}/1/")
    (other_key,) = store.tier.scan(f"e/alice/{other.id}/1/")
    store.tier.set(target_key, store.tier.get(other_key))
    report = store.check()
    assert any(target.id in p and "another text" in p for p in report.problems)
    assert any(target.id in r for r in report.repaired)
    assert store.check().problems == []
    assert store.search("where is the spare key", tenant="alice", k=1)[0].id == target.id


def test_tenant_ids_are_one_per_spelling_and_blank_ends_are_refused(make_store):
    import unicodedata

    store = make_store()
    composed, decomposed = unicodedata.normalize("NFC", "José"), unicodedata.normalize("NFD", "José")
    assert composed != decomposed
    record = store.add("I live in Braga.", tenant=decomposed)
    assert record.tenant == composed
    assert store.get(record.id, tenant=composed).text == "I live in Braga."
    assert store.search("where do I live", tenant=composed, k=1)[0].id == record.id
    for tenant in (" ", "alice ", " alice", "\talice", "ali\nce"):
        with pytest.raises(InvalidInputError):
            store.add("A fact.", tenant=tenant)
        with pytest.raises(InvalidInputError):
            store.search("a fact", tenant=tenant)
    assert store.stats()["memories"] == 1


def test_a_tampered_folder_runs_nothing_and_touches_nothing_outside(tmp_path):
    """Planted rows: a pickled record, a pickled key, blob rows naming files outside the folder.
    Opening, searching, checking and gc-ing the store unpickles nothing and leaves those files be."""
    import os
    import pickle
    import sqlite3
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from store_worker import VARIANT, HashEmbedder, int8_blob

    marker, outside = tmp_path / "pwned", tmp_path / "outside" / "victim.txt"
    outside.parent.mkdir()
    outside.write_text("precious")

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    store = MemoryStore(tmp_path / "s", embedder=HashEmbedder())
    kept = store.add("The spare key is under the blue flower pot.", tenant="alice")
    poisoned = store.add("My sister lives in Porto.", tenant="alice")
    assert store.save_fragment(kept, VARIANT, int8_blob(store, kept, n=600))  # large: kept in a file
    (blob_key,) = store.tier.scan("f/")
    (record_key,) = store.tier.scan(f"r/alice/{poisoned.id}/1/")
    store.close()
    with sqlite3.connect(tmp_path / "s" / "kv" / "cache.db") as db:
        db.execute(
            "UPDATE Cache SET filename = ? WHERE key = ?", (os.path.relpath(outside, tmp_path / "s" / "kv"), blob_key)
        )
        db.execute("UPDATE Cache SET mode = 4, value = ? WHERE key = ?", (pickle.dumps(Payload()), record_key))
        db.execute(
            "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, "
            "filename, value)"
            " VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
            (pickle.dumps(Payload()), b"v"),
        )
    store = MemoryStore(tmp_path / "s", embedder=HashEmbedder())
    assert [h.id for h in store.search("where is the spare key", tenant="alice", k=4)] == [kept.id]
    with pytest.raises(StoreError):
        store.load_fragment(store.get(kept.id, tenant="alice"), VARIANT)
    report = store.check()
    assert not report.ok  # the poisoned record cannot be rebuilt ...
    assert any(poisoned.id in p for p in report.problems) and any(blob_key in p for p in report.repaired)
    store.gc()
    store.stats()
    assert store.load_fragment(store.get(kept.id, tenant="alice"), VARIANT) is None  # ... the bad blob row is gone
    store.close()
    assert not marker.exists()
    assert outside.read_text() == "precious"


def test_gc_frees_what_killed_writers_left_and_keeps_writes_in_flight(make_store, monkeypatch):
    import json as json_module

    from kvshift_memory.store import maintenance

    store = make_store()
    record = store.add("The budget is 50k.", tenant="alice")
    store.supersede(record.id, "The budget is 70k.", tenant="alice")
    live = store.get(record.id, tenant="alice")

    def plant(version: int, writer: str, age_s: float) -> None:
        """What a writer killed between its data and its head leaves behind."""
        stale = json_module.loads(store.tier.get(next(iter(store.tier.scan(f"r/alice/{record.id}/2/")))))
        stale.update(version=version, text=f"killed writer {writer}", created_at=time.time() - age_s)
        stale["source_text_hash"] = text_hash(stale["text"])
        store.tier.set(f"r/alice/{record.id}/{version}/{writer}", json_module.dumps(stale).encode())
        store.tier.set(f"e/alice/{record.id}/{version}/{writer}", b"\\0" * 8)

    plant(3, "a" * 32, age_s=3600)  # the next version, abandoned long ago
    plant(3, "b" * 32, age_s=0)  # the next version, being written right now
    plant(2, "c" * 32, age_s=0)  # lost the race for version 2: can never be published
    store.gc()
    left = set(store.tier.scan(f"r/alice/{record.id}/")) | set(store.tier.scan(f"e/alice/{record.id}/"))
    assert not any("a" * 32 in key or "c" * 32 in key for key in left)
    assert any("b" * 32 in key for key in left)
    assert [h.text for h in store.history(record.id, tenant="alice")] == ["The budget is 50k.", "The budget is 70k."]
    assert store.get(record.id, tenant="alice").text == live.text == "The budget is 70k."
    monkeypatch.setattr(maintenance, "ORPHAN_GRACE_S", -1.0)
    store.gc()
    assert not any("b" * 32 in key for key in store.tier.scan(f"r/alice/{record.id}/"))
    # a deleted memory's publication pointers go with everything else
    assert store.delete(record.id, tenant="alice")
    store.gc()
    assert [key for key in store.tier.scan("") if record.id in key and not key.startswith("h/")] == []


def test_check_moves_a_memory_an_earlier_build_wrote(make_store):
    """Heads without a writer, versions under r/t/m/v: unread until check() moves them, never freed by gc()."""
    import json as json_module

    store = make_store()
    first = MemoryRecord("m1", 1, "The budget is 50k.", "alice", "trip", 1.0, text_hash("The budget is 50k."))
    second = MemoryRecord("m1", 2, "The budget is 70k.", "alice", "trip", 2.0, text_hash("The budget is 70k."))
    store.tier.set("r/alice/m1/1", first.to_json())
    store.tier.set("r/alice/m1/2", second.to_json())
    store.tier.set("e/alice/m1/2", b"\0" * 4 * store.index.dimension)
    store.tier.set("h/alice/m1", json_module.dumps({"deleted": False, "v": 2}).encode())
    store.tier.append("log", json_module.dumps({"tenant": "alice", "id": "m1"}).encode())
    assert store.get("m1", tenant="alice") is None
    store.gc()  # must not take the earlier layout's keys for garbage
    report = store.check()
    assert report.ok and any("earlier build" in r for r in report.repaired)
    assert [(r.version, r.text) for r in store.history("m1", tenant="alice")] == [(1, first.text), (2, second.text)]
    assert store.search("what is the budget", tenant="alice", k=1)[0].text == second.text
    assert not [key for key in store.tier.scan("") if key.count("/") == 3 and key[:2] in ("r/", "e/")]
    assert store.check().repaired == []


def test_gc_running_beside_supersedes_loses_no_version(make_store):
    import threading

    store = make_store()
    record = store.add("Version 1 of the plan.", tenant="alice")
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            store.gc()

    collector = threading.Thread(target=collect)
    collector.start()
    try:
        for version in range(2, 41):
            store.supersede(record.id, f"Version {version} of the plan.", tenant="alice", expected_version=version - 1)
    finally:
        stop.set()
        collector.join()
    store.gc()
    assert [r.text for r in store.history(record.id, tenant="alice")] == [
        f"Version {v} of the plan." for v in range(1, 41)
    ]
    assert store.check().ok


def _ahead(store: MemoryStore, seconds: float) -> None:
    """Move the store's tier clock ``seconds`` ahead: what gc judges ages by."""
    real_now = type(store.tier).now
    store.tier.now = lambda: real_now(store.tier) + seconds  # type: ignore[method-assign]


def test_gc_never_frees_the_add_of_a_writer_stalled_past_the_grace(make_store):
    """A writer pauses between its data and its head (GC pause, SIGSTOP) while gc runs 65 s later:
    gc fences the head before it frees the data, the writer's publish is refused and it writes
    again, so the add that returns is there."""
    store = make_store()
    real_cas = store.tier.compare_and_set
    stalls = []

    def stall_once(key, expected, value):
        if key.startswith("h/") and not stalls:
            stalls.append(key)
            _ahead(store, 65)
            store.gc()  # frees the stalled write's record and embedding
        return real_cas(key, expected, value)

    store.tier.compare_and_set = stall_once  # type: ignore[method-assign]
    record = store.add("The vault is in the basement.", tenant="alice")
    assert stalls and stalls[0] != f"h/alice/{record.id}", "the stalled attempt's id is fenced, a new one is used"
    assert store.get(record.id, tenant="alice").text == "The vault is in the basement."
    assert store.search("where is the vault", tenant="alice", k=1)[0].id == record.id
    assert store.check().ok
    store.gc()
    assert store.get(record.id, tenant="alice") is not None


def test_a_stalled_supersede_is_refused_not_lost(make_store):
    from kvshift_memory.exceptions import VersionConflictError

    store = make_store()
    record = store.add("The budget is 50k.", tenant="alice")
    real_cas = store.tier.compare_and_set
    stalls = []

    def stall(key, expected, value):
        if not stalls:
            stalls.append(key)
            _ahead(store, 65)
            store.gc()
        return real_cas(key, expected, value)

    store.tier.compare_and_set = stall  # type: ignore[method-assign]
    with pytest.raises(VersionConflictError):
        store.supersede(record.id, "The budget is 70k.", tenant="alice")
    store.tier.compare_and_set = real_cas  # type: ignore[method-assign]
    assert store.get(record.id, tenant="alice").text == "The budget is 50k."
    assert store.supersede(record.id, "The budget is 70k.", tenant="alice").version == 2  # a retry resolves it


def test_expired_memories_never_make_a_search_come_back_short(make_store):
    store = make_store()
    for index in range(40):
        store.add(f"Reminder {index}: the door code is {1000 + index}.", tenant="alice", ttl_s=30)
    kept = store.add("Groceries: milk and eggs.", tenant="alice")
    _ahead(store, 120)
    store._clock_anchor = None  # read the moved clock now
    hits = store.search("what is the door code", tenant="alice", k=1)
    assert [hit.id for hit in hits] == [kept.id]


def test_a_tampered_access_counter_costs_the_count_not_the_read(make_store):
    store = make_store()
    record = store.add("The spare key is under the mat.", tenant="alice")
    store.tier.set(f"ac/alice/{record.id}", b"not a number")
    assert store.get(record.id, tenant="alice").text == "The spare key is under the mat."
    assert store.search("spare key", tenant="alice", k=1)[0].id == record.id
    report = store.check()
    assert any("access counter" in problem for problem in report.problems), report.problems
    assert store.get(record.id, tenant="alice").access_count == 1  # repaired: counting again


def test_a_key_that_is_not_utf8_in_redis_is_skipped(redis_url, embedder):
    import redis

    from kvshift_memory.adapters import list_items

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    store = MemoryStore(kv_url=redis_url, index_url=":memory:", embedder=embedder)
    record = store.add("The boat is in slip 12.", tenant="alice")
    for prefix in (b"h/", b"i/", b"f/", b"ac/"):
        client.set(prefix + b"\xff\xfe", b"x")
    assert store.stats()["memories"] == 1
    store.gc()
    assert store.check().ok
    assert list(list_items(store)) == []  # what list_namespaces() reads
    assert store.get(record.id, tenant="alice") is not None
    store.close()
