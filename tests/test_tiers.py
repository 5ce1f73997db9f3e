"""The KV tiers: one behaviour suite, run against every backend."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading

import pytest

from kvshift_memory.exceptions import InvalidInputError, StoreError
from kvshift_memory.store.tiers import BLOB_PREFIX, DiskTier, HotTier, RedisTier, open_tier


@pytest.fixture
def tier(backend, tmp_path, request):
    if backend == "memory":
        made = HotTier()
    elif backend == "disk":
        made = DiskTier(tmp_path / "kv")
    else:
        from conftest import empty_redis

        made = RedisTier(empty_redis(backend, request))
    yield made
    made.close()


def test_get_set_delete(tier):
    assert tier.get("a") is None
    tier.set("a", b"1")
    assert tier.get("a") == b"1"
    tier.set("a", b"\x00\xff" * 50_000)  # binary, and large enough for diskcache to use a file
    assert tier.get("a") == b"\x00\xff" * 50_000
    assert tier.delete("a") is True
    assert tier.delete("a") is False
    assert tier.get("a") is None


def test_compare_and_set(tier):
    assert tier.compare_and_set("h", None, b"v1") is True
    assert tier.compare_and_set("h", None, b"v1") is False  # no longer absent
    assert tier.compare_and_set("h", b"other", b"v2") is False
    assert tier.get("h") == b"v1"
    assert tier.compare_and_set("h", b"v1", b"v2") is True
    assert tier.compare_and_set("h", b"v2", None) is True
    assert tier.get("h") is None


def test_counter_and_log(tier):
    assert [tier.incr("n") for _ in range(3)] == [1, 2, 3]
    assert [tier.append("log", f"e{i}".encode()) for i in range(4)] == [0, 1, 2, 3]
    assert tier.read_log("log", 0) == [b"e0", b"e1", b"e2", b"e3"]
    assert tier.read_log("log", 3) == [b"e3"]
    assert tier.read_log("log", 4) == []
    assert tier.read_log("missing", 0) == []


def test_scan_is_by_literal_prefix(tier):
    for key in ("r/a/1", "r/a/2", "r/ab/1", "r/a*/1", "x/a/1"):
        tier.set(key, b"")
    assert sorted(tier.scan("r/a/")) == ["r/a/1", "r/a/2"]
    assert sorted(tier.scan("r/a*/")) == ["r/a*/1"]  # glob characters are not patterns


def test_concurrent_compare_and_set_has_one_winner(tier):
    wins = []

    def race(i: int) -> None:
        if tier.compare_and_set("head", None, str(i).encode()):
            wins.append(i)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1 and tier.get("head") == str(wins[0]).encode()


def test_hot_tier_evicts_blobs_only():
    hot = HotTier(blob_bytes=1000)
    hot.set("r/record", b"x" * 5000)  # records are never evicted, whatever their size
    for i in range(5):
        hot.set(f"{BLOB_PREFIX}{i}", b"b" * 400)
    assert hot.get("r/record") == b"x" * 5000
    assert [hot.get(f"{BLOB_PREFIX}{i}") is not None for i in range(5)] == [False, False, False, True, True]
    hot.set(f"{BLOB_PREFIX}huge", b"h" * 2000)  # larger than the bound: not kept, evicts nothing
    assert hot.get(f"{BLOB_PREFIX}huge") is None and hot.get(f"{BLOB_PREFIX}4") is not None


def test_disk_tier_refuses_objects(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    with pytest.raises(InvalidInputError):
        tier.set("k", {"an": "object"})  # type: ignore[arg-type]
    tier.set("k", b"bytes")
    # a tampered row marked "pickled" (mode 4) must be refused, never deserialised
    tier.close()
    with sqlite3.connect(tmp_path / "kv" / "cache.db") as db:
        db.execute("UPDATE Cache SET mode = 4 WHERE key = 'k'")
    tier = DiskTier(tmp_path / "kv")
    with pytest.raises(StoreError):
        tier.get("k")
    tier.close()


def test_open_tier_urls(tmp_path):
    assert isinstance(open_tier("memory://"), HotTier)
    assert isinstance(open_tier(tmp_path / "a"), DiskTier)
    assert isinstance(open_tier(f"file://{tmp_path}/b"), DiskTier)
    with pytest.raises(InvalidInputError, match="scheme"):
        open_tier("ftp://example.com/x")


def test_unreachable_redis_is_a_clear_error():
    with pytest.raises(StoreError, match="cannot reach Redis"):
        RedisTier("redis://127.0.0.1:1/0")


def test_a_damaged_database_is_a_store_error(tmp_path):
    DiskTier(tmp_path / "kv").close()
    (tmp_path / "kv" / "cache.db").write_bytes(b"this is not a database" * 200)
    with pytest.raises(StoreError, match="damaged|failed"):
        tier = DiskTier(tmp_path / "kv")
        tier.get("anything")


@pytest.mark.timeout(60)  # a wait with no timeout hangs here rather than raising
def test_a_writer_waits_for_a_locked_folder_only_so_long(tmp_path):

    from conftest import held_elsewhere
    from kvshift_memory.exceptions import KVShiftError, StoreBusyError

    holder, waiter = DiskTier(tmp_path / "kv"), DiskTier(tmp_path / "kv", lock_timeout_s=0.5)
    holder.set("held", b"0")

    @contextlib.contextmanager
    def write_transaction():
        with holder._cache.transact():
            holder._cache.set("held", b"1")  # a write: the folder's lock is taken
            yield

    with held_elsewhere(write_transaction()):
        with pytest.raises(StoreBusyError) as raised:
            waiter.set("k", b"v")
        assert isinstance(raised.value, KVShiftError)
    waiter.set("k", b"v")  # free again: the refused write changed nothing and can be retried
    assert waiter.get("k") == b"v"
    holder.close()
    waiter.close()


def test_rows_naming_files_outside_the_folder_are_refused_and_never_deleted(tmp_path):
    outside = tmp_path / "outside" / "victim.txt"
    outside.parent.mkdir()
    outside.write_text("precious")
    tier = DiskTier(tmp_path / "kv")
    tier.set("f/relative", b"x" * 100_000)  # large: diskcache keeps it in a file the row names
    tier.set("f/absolute", b"y" * 100_000)
    tier.close()
    with sqlite3.connect(tmp_path / "kv" / "cache.db") as db:
        db.execute("UPDATE Cache SET filename = ? WHERE key = 'f/relative'", ("../outside/victim.txt",))
        db.execute("UPDATE Cache SET filename = ? WHERE key = 'f/absolute'", (str(outside),))
    tier = DiskTier(tmp_path / "kv")
    for key in ("f/relative", "f/absolute"):
        with pytest.raises(StoreError, match="not one of the folder's"):
            tier.get(key)
        assert tier.delete(key)  # the row goes ...
        assert tier.get(key) is None
    assert outside.read_text() == "precious"  # ... the file it named stays
    tier.close()


def test_a_pickled_key_planted_in_the_folder_is_never_read(tmp_path):
    import pickle

    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    tier = DiskTier(tmp_path / "kv")
    tier.set("h/a/1", b"{}")
    tier.close()
    with sqlite3.connect(tmp_path / "kv" / "cache.db") as db:
        db.execute(
            "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count, tag, size, mode, "
            "filename, value)"
            " VALUES (?, 0, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
            (pickle.dumps(Payload()), b"v"),
        )
        db.execute("UPDATE Cache SET mode = 4, value = ? WHERE key = 'h/a/1'", (pickle.dumps(Payload()),))
    tier = DiskTier(tmp_path / "kv")
    assert list(tier.scan("")) == ["h/a/1"] and list(tier.scan("h/")) == ["h/a/1"]
    with pytest.raises(StoreError, match="pickled"):
        tier.get("h/a/1")
    tier.close()
    assert not marker.exists()


_HOSTILE_FILES = """
import os, sys
sys.path.insert(0, {tests!r})
from store_worker import HashEmbedder
from kvshift_memory import MemoryStore, StoreError

folder = {folder!r}
with MemoryStore(folder, embedder=HashEmbedder()) as store:
    record = store.add("A long fact. " * 4000, tenant="alice")  # its value lives in a file of its own
    other = store.add("Ana lives in Lisbon.", tenant="alice")
    store.save_chunk("0" * 32, b"x" * 100_000, tenant="alice")
    store.save_chunk("1" * 32, b"y" * 100_000, tenant="alice")
files = [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
files = sorted(path for path in files if path.endswith(".val"))
record_file, *chunk_files = sorted(files, key=lambda path: "chunks" in path)
for path in (record_file, chunk_files[0]):
    os.remove(path)
    os.mkfifo(path)  # a reader that opens it waits for a writer forever
with open(chunk_files[1], "r+b") as sparse:
    sparse.truncate(6 << 30)  # 6 GiB of nothing on disk
os.makedirs(os.path.join(folder, "index"), exist_ok=True)
os.mkfifo(os.path.join(folder, "index", "index.safetensors"))
store = MemoryStore(folder, embedder=HashEmbedder())
for read in (lambda: store.get(record.id, tenant="alice"), lambda: store.load_chunk("0" * 32, tenant="alice"),
             lambda: store.load_chunk("1" * 32, tenant="alice")):
    try:
        print("read", read() is not None)
    except StoreError as exc:
        print("refused", type(exc).__name__)
print("search", [hit.id == other.id for hit in store.search("Where does Ana live?", tenant="alice", k=1)])
print("check", store.check().ok)
"""


def test_hostile_files_in_a_store_folder_are_refused_without_hanging(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = _HOSTILE_FILES.format(tests=str(Path(__file__).parent), folder=str(tmp_path / "store"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # the record read as missing or refused, the chunks refused, the snapshot ignored (the log
    # replayed), and check() reports the damage
    assert done.stdout.splitlines() == [
        "read False",
        "refused CorruptRecordError",
        "refused CorruptRecordError",
        "search [True]",
        "check False",
    ], done.stdout


def test_inspecting_a_mistyped_folder_is_an_error_that_creates_nothing(tmp_path, capsys):
    from kvshift_memory.cli import main

    for command in ("inspect", "check", "gc"):
        assert main([command, str(tmp_path / "no-such-store")]) == 2
        assert "no store at" in capsys.readouterr().err
        assert main([command, str(tmp_path)]) == 2  # a folder, but not a store's
    assert list(tmp_path.iterdir()) == []


_FULL_DISK = """
import os, shutil, sys
sys.path.insert(0, {tests!r})
from store_worker import HashEmbedder
from kvshift_memory import MemoryStore, StoreError

folder = {folder!r}
store = MemoryStore(folder, embedder=HashEmbedder(), index_url=":memory:", chunk_bytes=1 << 40)
kept = store.add("Kept from before the disk filled.", tenant="alice")
def fill() -> int:
    written = 0
    try:
        while True:
            store.save_chunk(os.urandom(16).hex(), os.urandom(1 << 20), tenant="alice")
            written += 1
    except StoreError:
        return written
print("chunks", fill() > 10)
record = store.add("My passport number ends in 4471.", tenant="alice")  # a memory outranks the chunks
print("added", store.get(record.id, tenant="alice").text)
print("kept", store.get(kept.id, tenant="alice").text)
print("chunks again", fill() > 10)
before = shutil.disk_usage(folder).free
report = store.gc()
print("gc freed", report.freed_chunk_bytes > 10 << 20, shutil.disk_usage(folder).free > before + (10 << 20))
print("added after gc", store.add("Another memory.", tenant="alice") is not None)
store.close()
"""


def test_a_full_disk_frees_the_chunks_before_refusing_a_memory(tmp_path):
    """On a small tmpfs of its own (a mount namespace), chunks fill the disk; a memory is stored anyway."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    mount = tmp_path / "disk"
    mount.mkdir()
    script = _FULL_DISK.format(tests=str(Path(__file__).parent), folder=str(mount / "store"))
    command = f'mount -t tmpfs -o size=48m tmpfs {mount} && exec {sys.executable} -c "$SCRIPT"'
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            raise AssertionError("this machine cannot make a mount namespace (unshare -rm) for a small disk")
        pytest.skip("no mount namespace here (unshare -rm) for a small disk of the test's own")
    done = subprocess.run(
        [unshare, "-rm", "sh", "-c", command],
        env={**os.environ, "SCRIPT": script},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "chunks True",
        "added My passport number ends in 4471.",
        "kept Kept from before the disk filled.",
        "chunks again True",
        "gc freed True True",
        "added after gc True",
    ], done.stdout + done.stderr[-3000:]
