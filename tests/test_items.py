"""Items (named memories, the layer under LangGraph's store): a put and a delete change an item as
one, racing writers leave no orphan, and ``index=False`` keeps a value away from the embedder."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from kvshift_memory.adapters import (
    delete_item,
    get_item,
    item_of,
    item_tenants,
    list_items,
    put_item,
    refresh_item,
    sweep_items,
)
from kvshift_memory.exceptions import InvalidInputError
from kvshift_memory.store import MemoryStore
from kvshift_memory.store.layout import parse_head, split_key

sys.path.insert(0, str(Path(__file__).parent))
from store_worker import HashEmbedder  # noqa: E402


class CountingEmbedder(HashEmbedder):
    """Counts every text it is given: what reaches the embedder (a remote API, for some users)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def embed(self, texts):
        self.texts.extend(texts)
        return super().embed(texts)


def live_memories(store: MemoryStore, tenant: str) -> list[str]:
    """Ids of every memory of ``tenant`` whose head is live, read from the tier (visible or not)."""
    ids = []
    for key in store.tier.scan(f"h/{tenant}/"):
        head = parse_head(store.tier.get(key))
        if head is not None and not head.deleted:
            ids.append(split_key(key)[2])
    return ids


def later(store: MemoryStore, seconds: float) -> None:
    """Move the store's tier clock ``seconds`` ahead (what gc and check() judge ages by)."""
    real_now = type(store.tier).now
    store.tier.now = lambda: real_now(store.tier) + seconds  # type: ignore[method-assign]


def clock_ahead(store: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Move the store's own clock (what an item's expiry is judged by): set ``[0]`` to the seconds ahead."""
    ahead = [0.0]
    real_now = store.now
    monkeypatch.setattr(store, "now", lambda: real_now() + ahead[0])
    return ahead


def test_a_put_replaces_the_memory_and_the_row_is_the_truth(make_store):
    store = make_store(embedder=HashEmbedder())
    first = put_item(store, "alice", ("notes",), "city", {"text": "Alice lives in Porto."}, "Alice lives in Porto.")
    second = put_item(store, "alice", ("notes",), "city", {"text": "Alice lives in Lisbon."}, "Alice lives in Lisbon.")
    assert second.memory.id != first.memory.id
    assert store.get(first.memory.id, tenant="alice") is None  # the old text is never recalled again
    assert [r.text for r in store.search("where does Alice live", tenant="alice", k=5)] == ["Alice lives in Lisbon."]
    assert get_item(store, "alice", ("notes",), "city").value == {"text": "Alice lives in Lisbon."}
    # a value changed, text the same: the memory stays
    third = put_item(
        store, "alice", ("notes",), "city", {"text": "Alice lives in Lisbon.", "since": 2024}, second.memory.text
    )
    assert third.memory.id == second.memory.id and third.created_at == first.created_at
    assert live_memories(store, "alice") == [second.memory.id]
    assert item_tenants(store) == {"alice"}


def test_index_false_never_reaches_the_embedder_nor_search(make_store):
    embedder = CountingEmbedder()
    store = make_store(embedder=embedder)
    put_item(store, "alice", ("notes",), "pin", {"pin": "4821"}, '{"pin": "4821"}', index=False)
    assert embedder.texts == []
    item = get_item(store, "alice", ("notes",), "pin")
    assert item is not None and item.value == {"pin": "4821"} and not item.memory.indexed
    put_item(store, "alice", ("notes",), "city", {"text": "Alice lives in Porto."}, "Alice lives in Porto.")
    assert [r.text for r in store.search("pin 4821", tenant="alice", k=10)] == ["Alice lives in Porto."]
    assert store.check().ok and embedder.texts == ["Alice lives in Porto.", "pin 4821"]
    # indexing it later embeds it then
    put_item(store, "alice", ("notes",), "pin", {"pin": "4821"}, '{"pin": "4821"}')
    assert '{"pin": "4821"}' in embedder.texts
    with pytest.raises(InvalidInputError):
        put_item(store, "alice", ("notes",), "pin", {"pin": "1"}, "x", index="no")  # type: ignore[arg-type]


def test_racing_put_and_delete_leave_one_truth_and_no_orphan(make_store):
    """600 rounds: one thread puts a key while another deletes it; no undocumented error, the item
    is whole or gone, recall never shows a deleted item, and no memory is left that no item names."""
    store = make_store(embedder=HashEmbedder())
    errors: list[BaseException] = []
    for trial in range(600):
        before, after = f"Round {trial}: the code is 1234.", f"Round {trial}: the code is 5678."
        put_item(store, "alice", ("notes",), "code", {"text": before}, before)
        start = threading.Barrier(2)

        def put(start=start, text=after) -> None:
            start.wait()
            try:
                put_item(store, "alice", ("notes",), "code", {"text": text}, text)
            except BaseException as exc:  # noqa: BLE001 - every error is counted
                errors.append(exc)

        def delete(start=start) -> None:
            start.wait()
            try:
                delete_item(store, "alice", ("notes",), "code")
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=put), threading.Thread(target=delete)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        item = get_item(store, "alice", ("notes",), "code")
        shown = [
            r.text for r in store.search(f"Round {trial} code", tenant="alice", k=5) if f"Round {trial}:" in r.text
        ]
        if item is None:
            assert shown == [], f"round {trial}: recall shows a deleted item"
        else:
            assert item.value["text"] == item.memory.text == after and shown == [after]
    assert errors == []
    later(store, 3600)  # past gc's grace: whatever a refused writer left is collected
    store.gc()
    named = {item.memory.id for item in list_items(store, "alice")}
    assert set(live_memories(store, "alice")) == named


def test_a_memory_no_row_names_is_invisible_and_gc_removes_it_after_the_grace(make_store):
    """What a put killed before publishing leaves: invisible at once, collected once it is old."""
    store = make_store(embedder=HashEmbedder())
    put_item(store, "alice", ("notes",), "code", {"text": "The code is 1234."}, "The code is 1234.")
    row_key = next(iter(store.tier.scan("i/alice/")))
    orphan = store.add_owned(  # what put_item does before it publishes the row
        "The code is 9999.",
        tenant="alice",
        session_id=None,
        importance_score=0.5,
        semantic_keywords=(),
        ttl_s=None,
        index=True,
        item=row_key,
    )
    assert store.get(orphan.id, tenant="alice") is None
    assert "The code is 9999." not in [r.text for r in store.search("code", tenant="alice", k=5)]
    store.gc()
    assert orphan.id in live_memories(store, "alice"), "a put in flight must keep its memory"
    later(store, 3600)
    store.gc()
    assert orphan.id not in live_memories(store, "alice")
    assert get_item(store, "alice", ("notes",), "code").memory.text == "The code is 1234."


def test_a_put_stalled_past_the_grace_is_fenced_and_writes_again(make_store):
    store = make_store(embedder=HashEmbedder())
    put_item(store, "alice", ("notes",), "code", {"text": "The code is 1234."}, "The code is 1234.")
    real_cas = store.tier.compare_and_set
    stalled = []

    def stall_first_row_publish(key, expected, value):
        if key.startswith("i/") and not stalled:
            stalled.append(key)
            later(store, 3600)  # the writer sleeps past the grace; gc runs meanwhile
            store.gc()
        return real_cas(key, expected, value)

    store.tier.compare_and_set = stall_first_row_publish  # type: ignore[method-assign]
    item = put_item(store, "alice", ("notes",), "code", {"text": "The code is 5678."}, "The code is 5678.")
    assert stalled
    got = get_item(store, "alice", ("notes",), "code")
    assert got is not None and got.memory.id == item.memory.id and got.memory.text == "The code is 5678."
    assert set(live_memories(store, "alice")) == {item.memory.id}


def test_items_refuse_values_too_deep_for_json(make_store):
    store = make_store(embedder=HashEmbedder())
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    with pytest.raises(InvalidInputError, match="nested too deeply"):
        put_item(store, "alice", ("notes",), "deep", deep, "deep")
    assert list(list_items(store, "alice")) == []


def test_a_forged_item_field_never_reaches_another_tenants_row(make_store):
    import json

    store = make_store(embedder=HashEmbedder())
    put_item(store, "alice", ("m",), "a", {"text": "Alice's secret is 77."}, "Alice's secret is 77.")
    bob = put_item(store, "bob", ("m",), "b", {"text": "Bob likes jazz."}, "Bob likes jazz.").memory
    alice_row = next(iter(store.tier.scan("i/alice/")))
    (record_key,) = store.tier.scan(f"r/bob/{bob.id}/")
    forged = json.loads(store.tier.get(record_key))
    forged["item"] = alice_row
    store.tier.set(record_key, json.dumps(forged).encode())
    assert store.get(bob.id, tenant="bob") is None  # the row it names is not Bob's: not live
    assert item_of(store, store.search("secret", tenant="alice", k=1)[0]).value["text"] == "Alice's secret is 77."


def test_an_items_ttl_lives_in_its_row_by_the_stores_clock(make_store, monkeypatch):
    import json

    store = make_store(embedder=HashEmbedder())
    ahead = clock_ahead(store, monkeypatch)
    item = put_item(
        store, "alice", ("m",), "trip", {"text": "Alice flies on Friday."}, "Alice flies on Friday.", ttl_s=60
    )
    assert item.ttl_s == 60 and item.expires_at is not None
    assert store.get(item.memory.id, tenant="alice").expires_at is None  # the row, not the memory, expires
    ahead[0] = 45
    refreshed = get_item(store, "alice", ("m",), "trip", refresh=True)
    assert refreshed is not None and refreshed.expires_at > item.expires_at
    ahead[0] = 90
    assert get_item(store, "alice", ("m",), "trip") is not None  # past the first expiry, within the refreshed one
    ahead[0] = 106
    assert get_item(store, "alice", ("m",), "trip") is None
    assert store.get(item.memory.id, tenant="alice") is None  # its memory went with it, for every reader
    assert store.search("Friday", tenant="alice", k=5) == []
    assert list(list_items(store, "alice")) == []
    assert refresh_item(store, refreshed) == refreshed  # an expired item is not revived by a refresh
    assert not delete_item(store, "alice", ("m",), "trip")  # gone already; its row is a tombstone now
    assert live_memories(store, "alice") == []
    # an expiry a row carries is untrusted: a forged one is refused, never read as "never expires"
    put_item(store, "alice", ("m",), "pin", {"text": "PIN"}, "PIN", ttl_s=60)
    (row_key,) = [key for key in store.tier.scan("i/alice/") if b'"deleted"' not in (store.tier.get(key) or b"")]
    good_row = store.tier.get(row_key) or b"{}"
    for forged in ("soon", -1, True):
        store.tier.set(row_key, json.dumps({**json.loads(good_row), "expires_at": forged}).encode())
        assert get_item(store, "alice", ("m",), "pin") is None
    store.tier.set(row_key, good_row)
    assert get_item(store, "alice", ("m",), "pin") is not None
    with pytest.raises(InvalidInputError, match="ttl_s"):
        put_item(store, "alice", ("m",), "bad", {"text": "x"}, "x", ttl_s=0)


def test_a_refreshing_read_at_the_instant_of_expiry_refreshes_or_finds_nothing(make_store, monkeypatch):
    store = make_store(embedder=HashEmbedder())
    item = put_item(store, "alice", ("m",), "trip", {"text": "Alice flies on Friday."}, "Alice", ttl_s=60)
    assert item.expires_at is not None
    # the clock crosses the expiry during the read: its first reading is just before, every later one after
    readings = iter([item.expires_at - 0.001])
    monkeypatch.setattr(store, "now", lambda: next(readings, item.expires_at + 0.001))
    got = get_item(store, "alice", ("m",), "trip", refresh=True)
    assert got is not None and got.expires_at == item.expires_at - 0.001 + 60
    assert get_item(store, "alice", ("m",), "trip") is not None  # refreshed in the row, for every reader
    # a sweep that wins the race: the read finds nothing rather than an item already gone
    swept = put_item(store, "alice", ("m",), "swept", {"text": "Gone."}, "Gone.", ttl_s=60)
    real_set = store.tier.compare_and_set

    def sweep_first(key, expected, value):
        store.tier.set(key, b'{"deleted": true}')
        return real_set(key, expected, value)

    monkeypatch.setattr(store.tier, "compare_and_set", sweep_first)
    monkeypatch.setattr(store, "now", lambda: swept.expires_at - 1)
    assert get_item(store, "alice", ("m",), "swept", refresh=True) is None


def test_sweep_removes_only_expired_items_and_a_put_after_expiry_starts_over(make_store, monkeypatch):
    store = make_store(embedder=HashEmbedder())
    ahead = clock_ahead(store, monkeypatch)
    old = put_item(store, "alice", ("m",), "old", {"text": "Short lived."}, "Short lived.", ttl_s=60)
    put_item(store, "bob", ("m",), "kept", {"text": "Bob stays."}, "Bob stays.")
    ahead[0] = 120
    again = put_item(store, "alice", ("m",), "old", {"text": "Short lived."}, "Short lived.")
    assert again.memory.id != old.memory.id and again.created_at > old.created_at and again.expires_at is None
    assert set(live_memories(store, "alice")) == {again.memory.id}  # the expired item's memory was retired
    put_item(store, "alice", ("m",), "brief", {"text": "Brief."}, "Brief.", ttl_s=10)
    ahead[0] = 200
    assert sweep_items(store) == 1 and sweep_items(store) == 0
    assert {item.key for item in list_items(store)} == {"old", "kept"}
