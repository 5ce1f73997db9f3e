"""Several processes on one store: SIGKILLed writers lose nothing that was acknowledged, and
concurrent writers never lose, duplicate or mix up a record."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshift_memory.blobs import verify_blob
from kvshift_memory.exceptions import StoreError
from kvshift_memory.kv.codec import decode_fragment
from kvshift_memory.store import MemoryStore

sys.path.insert(0, str(Path(__file__).parent))
from store_worker import VARIANT, HashEmbedder  # noqa: E402

WORKER = str(Path(__file__).parent / "store_worker.py")


def open_store(kv_url: str, **settings) -> MemoryStore:
    if kv_url.startswith("file://"):
        return MemoryStore(kv_url.removeprefix("file://"), embedder=HashEmbedder(), **settings)
    return MemoryStore(kv_url=kv_url, index_url=":memory:", embedder=HashEmbedder(), **settings)


@pytest.fixture(params=["disk", "redis"])
def shared_url(request, tmp_path):
    if request.param == "disk":
        return f"file://{tmp_path / 'store'}"
    import redis

    url = request.getfixturevalue("redis_url")
    redis.Redis.from_url(url).flushdb()
    return url


def _killable(child: subprocess.Popen, rng: random.Random) -> None:
    """Wait until ``child`` has opened the store, then a random moment of its writing."""
    assert child.stdout is not None and child.stdout.readline() == "ready\n", "the worker did not start"
    time.sleep(rng.uniform(0.05, 0.4))


def test_sigkilled_writers_lose_nothing_acknowledged(shared_url):
    """50 times: a child adds memories (and fragments) until SIGKILLed at a random moment."""
    rng = random.Random(7)
    acknowledged: dict[str, str] = {}
    for _ in range(50):
        child = subprocess.Popen(
            [sys.executable, WORKER, "add-forever", shared_url, "alice"], stdout=subprocess.PIPE, text=True
        )
        _killable(child, rng)
        os.kill(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        for line in out.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue  # a line cut by the kill: its add may or may not have returned
            acknowledged[entry["id"]] = entry["text"]
    assert len(acknowledged) > 50, "the children should have managed some adds"

    store = open_store(shared_url)
    report = store.check()
    assert report.ok, report.problems
    assert not [p for p in report.problems if "fragment" in p], "a torn blob was stored"
    for memory_id, text in acknowledged.items():
        record = store.get(memory_id, tenant="alice")
        assert record is not None and record.text == text
    # every blob that can be served is whole, and decodes
    for key in store.tier.scan("f/"):
        blob = store.tier.get(key)
        verify_blob(blob)
        decode_fragment(blob)
    served = [store.load_fragment(store.get(i, tenant="alice"), VARIANT) for i in list(acknowledged)[:20]]
    assert all(blob is not None for blob in served)
    # what interrupted adds left behind is garbage gc may collect, never a record
    assert store.stats()["memories"] >= len(acknowledged)
    probe_id, probe_text = next(iter(acknowledged.items()))
    assert probe_id in [hit.id for hit in store.search(probe_text, tenant="alice", k=5)]
    store.close()


def test_concurrent_writers_and_readers(shared_url):
    """4 processes each add and read back 200 memories on one store."""
    children = [
        subprocess.Popen(
            [sys.executable, WORKER, "add-and-read", shared_url, f"tenant{i}", "200"], stdout=subprocess.PIPE, text=True
        )
        for i in range(4)
    ]
    reports = []
    for child in children:
        out, _ = child.communicate(timeout=600)
        assert child.returncode == 0
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(report["misread"] == [] for report in reports)
    ids = [entry["id"] for report in reports for entry in report["added"]]
    assert len(ids) == len(set(ids)) == 800  # none lost, none duplicated

    store = open_store(shared_url)
    for i, report in enumerate(reports):
        for entry in report["added"]:
            record = store.get(entry["id"], tenant=f"tenant{i}")
            assert record is not None and record.text == entry["text"]  # not mixed up
            assert store.get(entry["id"], tenant=f"tenant{(i + 1) % 4}") is None
    assert store.stats()["memories"] == 800
    assert store.check().ok
    for i, report in enumerate(reports):
        probe = report["added"][123]
        assert probe["id"] in [hit.id for hit in store.search(probe["text"], tenant=f"tenant{i}", k=5)]
    store.close()


def test_two_processes_superseding_one_memory_publish_one_writer_per_version(shared_url):
    store = open_store(shared_url)
    record = store.add("The door code is 1234.", tenant="alice")
    start = str(time.time() + 3.0)  # after both children have opened the store
    children = [
        subprocess.Popen(
            [sys.executable, WORKER, "supersede-race", shared_url, "alice", record.id, "150", name, start],
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("left", "right")
    ]
    outcomes = [json.loads(child.communicate(timeout=300)[0]) for child in children]
    won = {o["version"]: o["text"] for side in outcomes for o in side if o["version"] is not None}
    refused = {o["text"] for side in outcomes for o in side if o["version"] is None}
    successes = sum(o["version"] is not None for side in outcomes for o in side)
    assert successes == len(won), "two writers were both told they published one version"
    assert refused, "the processes never raced: the test proves nothing"
    history = store.history(record.id, tenant="alice")
    assert [r.version for r in history] == list(range(1, len(won) + 2))
    assert {r.version: r.text for r in history[1:]} == won  # every version is its one successful writer's
    stored = {stored_text(store, key) for key in store.tier.scan(f"r/alice/{record.id}/")}
    assert not stored & refused, "a refused writer's text is stored"
    assert store.check().ok
    store.close()


def stored_text(store: MemoryStore, key: str) -> str:
    return json.loads(store.tier.get(key))["text"]


def test_redis_restarted_empty_mid_process_still_indexes_new_memories():
    """The index had applied more log entries than the restarted server's log holds: it must notice
    and replay, not silently skip the new memories (it used to wait for them to pass its count)."""
    from redis_server import RedisServer

    from conftest import started

    server = started(RedisServer)
    try:
        store = open_store(server.url)
        for n in range(5):
            store.add(f"Old memory number {n} about the garden.", tenant="alice")
        assert len(store.search("the garden", tenant="alice", k=10)) == 5
        server.restart()
        for _ in range(20):  # the client reconnects on its next call
            try:
                fresh = store.add("The spare key is under the blue flower pot.", tenant="alice")
                break
            except StoreError:
                time.sleep(0.1)
        hits = store.search("where is the spare key", tenant="alice", k=10)
        assert [h.id for h in hits] == [fresh.id]  # the old points went with the data they indexed
        store.close()
    finally:
        server.stop()


def test_a_busy_searcher_does_not_keep_another_process_waiting(tmp_path):
    """Each process has its own index: a process searching all the time holds no lock another waits on
    (one that did would make this process's search or add raise StoreBusyError after lock_timeout_s)."""
    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    record = store.add("The spare key is under the blue flower pot.", tenant="alice")
    store.close()
    searcher = subprocess.Popen(
        [sys.executable, WORKER, "search-forever", url, "alice"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert searcher.stdout.readline().strip() == "searching"
        store = open_store(url, lock_timeout_s=2.0)
        for _ in range(5):
            hits = store.search("where is the spare key", tenant="alice", k=1)
            assert hits[0].id == record.id
            store.add(f"Another memory {time.time()}.", tenant="alice")  # writes are not starved either
            time.sleep(0.3)
        store.close()
    finally:
        searcher.kill()
        searcher.wait()


def test_a_writer_whose_clock_is_behind_loses_no_add_to_gc(shared_url):
    """A child whose own clock runs 120 s behind adds 300 memories while this process runs gc in a
    loop: ages are judged by the tier's clock, so no write in flight looks abandoned."""
    store = open_store(shared_url)
    child = subprocess.Popen(
        [sys.executable, WORKER, "add-skewed", shared_url, "alice", "300", "120"], stdout=subprocess.PIPE, text=True
    )
    collections = 0
    while child.poll() is None:
        store.gc()
        collections += 1
    out, _ = child.communicate()
    assert child.returncode == 0
    acknowledged = [json.loads(line) for line in out.splitlines()]
    assert len(acknowledged) == 300 and collections > 10
    store.gc()
    lost = [entry for entry in acknowledged if store.get(entry["id"], tenant="alice") is None]
    assert lost == []
    store.close()


def test_kills_during_item_puts_and_deletes_leave_no_orphan_and_nothing_half_visible(shared_url):
    """40 times: a child puts and deletes items until SIGKILLed at a random moment. Then check():
    no memory is left that no item names, and every item's value and text agree."""
    from kvshift_memory.adapters import list_items
    from kvshift_memory.store.layout import parse_head, split_key

    rng = random.Random(11)
    for _ in range(40):
        child = subprocess.Popen(
            [sys.executable, WORKER, "item-churn", shared_url, "alice"], stdout=subprocess.PIPE, text=True
        )
        _killable(child, rng)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    store = open_store(shared_url)
    items = list(list_items(store, "alice"))
    assert all(item.value["text"] == item.memory.text for item in items)  # nothing half-visible, even before check
    visible = {hit.id for hit in store.search("value of", tenant="alice", k=100)}
    assert visible <= {item.memory.id for item in items}, "a search shows a memory no item names"
    real_now = type(store.tier).now
    store.tier.now = lambda: real_now(store.tier) + 3600  # the children are gone: past the grace
    report = store.check()
    assert report.ok, report.problems
    live = {
        split_key(key)[2]
        for key in store.tier.scan("h/alice/")
        if (head := parse_head(store.tier.get(key))) is not None and not head.deleted
    }
    assert live == {item.memory.id for item in list_items(store, "alice")}
    store.close()
