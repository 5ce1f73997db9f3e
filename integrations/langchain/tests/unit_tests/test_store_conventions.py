"""KVShiftStore keeps LangGraph's store conventions: ``put(..., ttl=)`` with reads that refresh it,
``ttl={...}`` and ``index={"dims", "embed", "fields"}`` in the constructor, JSON-path fields per put.

The embedder is a LangChain ``Embeddings`` of the caller's (here a bag of hashed words, so these
tests load no weights); time moves by the memory store's clock, the one its writers share."""

from __future__ import annotations

import hashlib
import math
import threading

import pytest
from langchain_core.embeddings import Embeddings

from kvshift_memory import InvalidInputError, MemoryStore
from kvshift_memory.adapters import get_item
from langchain_kvshift import KVShiftStore

DIMS = 64


class BagOfWords(Embeddings):
    """Each word hashed to one of ``DIMS`` axes, L2-normalised: texts sharing words score high."""

    def __init__(self) -> None:
        self.documents: list[str] = []
        self.queries: list[str] = []

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * DIMS
        for word in text.lower().replace(".", " ").replace("?", " ").split():
            vector[int(hashlib.sha256(word.encode()).hexdigest(), 16) % DIMS] += 1.0
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.documents.extend(texts)
        return [self._vector(text) for text in texts]

    def embed_query(self, text: str) -> list[float]:
        self.queries.append(text)
        return self._vector(text)


class Clock:
    """Moves ``store``'s clock (what expiry is judged by) forward on demand."""

    def __init__(self, store: MemoryStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ahead = 0.0
        real_now = store.now
        monkeypatch.setattr(store, "now", lambda: real_now() + self.ahead)

    def advance(self, minutes: float) -> None:
        self.ahead += minutes * 60


@pytest.fixture
def embeddings() -> BagOfWords:
    return BagOfWords()


@pytest.fixture
def store(embeddings: BagOfWords) -> KVShiftStore:
    return KVShiftStore(index={"dims": DIMS, "embed": embeddings})


def test_an_item_expires_after_its_ttl_and_a_read_restarts_it(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice", "m"), "trip", {"text": "Alice flies to Lisbon on Friday."}, ttl=1)
    store.put(("alice", "m"), "kept", {"text": "Alice keeps this."})
    clock.advance(0.75)
    assert store.get(("alice", "m"), "trip") is not None  # a read: expires a minute from now
    clock.advance(0.75)
    assert store.get(("alice", "m"), "trip", refresh_ttl=False) is not None  # would have expired without it
    clock.advance(0.5)
    assert store.get(("alice", "m"), "trip") is None
    assert [hit.key for hit in store.search(("alice",), query="Lisbon Friday")] == ["kept"]
    assert [hit.key for hit in store.search(("alice",))] == ["kept"]
    memory = store.memory_store
    assert [record.text for record in memory.search("Lisbon Friday", tenant="alice", k=5)] == ["Alice keeps this."]


def test_a_search_hit_is_refreshed_and_refresh_false_leaves_it(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice", "m"), "a", {"text": "Alice plays the cello."}, ttl=1)
    store.put(("alice", "m"), "b", {"text": "Alice plays the cello too."}, ttl=1)
    clock.advance(0.75)
    assert {hit.key for hit in store.search(("alice",), query="cello", limit=1)} == {"a"}
    store.search(("alice",), query="cello", limit=2, refresh_ttl=False)
    clock.advance(0.5)
    assert [hit.key for hit in store.search(("alice",), query="cello")] == ["a"]


def test_default_ttl_and_refresh_on_read_come_from_the_ttl_config(embeddings, monkeypatch):
    store = KVShiftStore(index={"dims": DIMS, "embed": embeddings}, ttl={"default_ttl": 2, "refresh_on_read": False})
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice",), "default", {"text": "Gone in two minutes."})
    store.put(("alice",), "forever", {"text": "Never expires."}, ttl=None)
    item = get_item(store.memory_store, "alice", ("alice",), "default")
    assert item is not None and item.ttl_s == 120
    clock.advance(1.5)
    store.get(("alice",), "default")  # no refresh by default here
    clock.advance(1)
    assert store.get(("alice",), "default") is None
    assert store.get(("alice",), "forever") is not None


def test_a_put_renews_the_expiry_and_an_expired_key_can_be_put_again(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice",), "k", {"text": "First version."}, ttl=1)
    clock.advance(0.75)
    store.put(("alice",), "k", {"text": "First version.", "seen": 2}, ttl=1)
    clock.advance(0.75)
    assert store.get(("alice",), "k").value == {"text": "First version.", "seen": 2}
    clock.advance(1)
    assert store.get(("alice",), "k") is None
    store.put(("alice",), "k", {"text": "Second life."})
    again = store.get(("alice",), "k")
    assert again.value == {"text": "Second life."} and again.created_at == again.updated_at


def test_sweep_frees_expired_items_and_their_memories(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice",), "old", {"text": "Short lived."}, ttl=1)
    store.put(("bob",), "old", {"text": "Bob's short lived."}, ttl=1)
    store.put(("alice",), "kept", {"text": "Kept."})
    memories = {tenant: get_item(store.memory_store, tenant, (tenant,), "old").memory.id for tenant in ("alice", "bob")}
    assert store.sweep_ttl() == 0
    clock.advance(2)
    assert store.sweep_ttl() == 2
    assert store.sweep_ttl() == 0
    for tenant, memory_id in memories.items():
        assert store.memory_store.get(memory_id, tenant=tenant) is None
        assert store.memory_store.history(memory_id, tenant=tenant)[-1].status == "deleted"
    assert store.get(("alice",), "kept") is not None
    assert store.list_namespaces() == [("alice",)]


def test_gc_removes_expired_items_too(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice",), "old", {"text": "Short lived."}, ttl=1)
    clock.advance(2)
    assert store.memory_store.gc().expired_items == 1


def test_the_sweeper_thread_sweeps_until_stopped(store, monkeypatch):
    clock = Clock(store.memory_store, monkeypatch)
    store.put(("alice",), "old", {"text": "Short lived."}, ttl=1)
    clock.advance(2)
    swept = threading.Event()
    real_sweep = store.sweep_ttl
    monkeypatch.setattr(store, "sweep_ttl", lambda: (real_sweep(), swept.set())[0])
    done = store.start_ttl_sweeper(sweep_interval_minutes=0.001)
    assert store.start_ttl_sweeper() is done  # one sweeper per store
    assert swept.wait(timeout=120)
    assert store.stop_ttl_sweeper(timeout=120) and done.done()
    assert store.stop_ttl_sweeper() is True  # none running
    assert get_item(store.memory_store, "alice", ("alice",), "old") is None


def test_async_twins_keep_ttl(store, monkeypatch):
    import asyncio

    clock = Clock(store.memory_store, monkeypatch)

    async def run():
        await store.aput(("alice",), "k", {"text": "Async item."}, ttl=1)
        clock.advance(2)
        return await store.aget(("alice",), "k"), await store.asweep_ttl()

    assert asyncio.run(run()) == (None, 1)


def test_index_embed_is_the_callers_embeddings_and_fields_are_json_paths(embeddings):
    store = KVShiftStore(index={"dims": DIMS, "embed": embeddings, "fields": ["profile.bio", "facts[*].text"]})
    value = {
        "profile": {"bio": "Alice is a cellist.", "pin": "4821"},
        "facts": [{"text": "She lives in Porto."}, {"text": "She flies on Fridays."}],
    }
    store.put(("alice",), "me", value)
    assert embeddings.documents[-1] == "Alice is a cellist.\nShe lives in Porto.\nShe flies on Fridays."
    assert not any("4821" in text for text in embeddings.documents)
    assert [hit.key for hit in store.search(("alice",), query="where does she live")] == ["me"]
    assert embeddings.queries[-1] == "where does she live"
    assert store.get(("alice",), "me").value == value


def test_a_puts_index_fields_override_the_stores_and_no_text_means_not_embedded(store, embeddings):
    store.put(("alice",), "note", {"title": "Groceries", "body": {"text": "Buy milk."}}, index=["body.text"])
    assert embeddings.documents[-1] == "Buy milk."
    before = len(embeddings.documents)
    store.put(("alice",), "numbers", {"count": None}, index=["title"])
    assert len(embeddings.documents) == before  # nothing at the path: stored, not embedded
    assert store.get(("alice",), "numbers").value == {"count": None}
    assert [hit.key for hit in store.search(("alice",), query="milk")] == ["note"]
    whole = KVShiftStore(index={"dims": DIMS, "embed": embeddings, "fields": ["$"]})
    whole.put(("alice",), "all", {"a": "x", "b": 1})
    assert embeddings.documents[-1] == '{"a": "x", "b": 1}'


def test_a_store_in_a_folder_with_an_embedding_function(tmp_path):
    calls: list[list[str]] = []

    def embed(texts: list[str]) -> list[list[float]]:
        calls.append(list(texts))
        return [BagOfWords()._vector(text) for text in texts]

    store = KVShiftStore(tmp_path / "items", index={"dims": DIMS, "embed": embed, "fields": ["content"]})
    store.put(("memories", "alice"), "k", {"content": "Alice likes jazz."})
    assert ["Alice likes jazz."] in calls
    reopened = KVShiftStore(tmp_path / "items", index={"dims": DIMS, "embed": embed})
    assert reopened.get(("memories", "alice"), "k").value == {"content": "Alice likes jazz."}


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"index": {"dims": DIMS + 1}}, "dims"),
        ({"index": {"dims": "64"}}, "dims"),
        ({"index": {"fields": "text"}}, "fields"),
        ({"index": {"fields": []}}, "fields"),
        ({"index": {"fields": ["a[", "b"]}}, "JSON path"),
        ({"index": {"embedder": None}}, "keys"),
        ({"index": ["dims"]}, "dict"),
        ({"ttl": {"default_ttl": -1}}, "minutes"),
        ({"ttl": {"default_ttl": float("inf")}}, "minutes"),
        ({"ttl": {"refresh_on_read": "yes"}}, "True or False"),
        ({"ttl": {"sweep": 1}}, "keys"),
        ({"tenant_at": -1}, "tenant_at"),
        ({"store": 42}, "MemoryStore, a folder"),
    ],
)
def test_bad_settings_are_clear_errors(embeddings, settings, match):
    settings = dict(settings)
    store_arg = settings.pop("store", None)
    index = settings.pop("index", None)
    if isinstance(index, dict) and "dims" in index and "embed" not in index:
        index = {**index, "embed": embeddings}
    elif index is None:
        index = {"dims": DIMS, "embed": embeddings}
    with pytest.raises(InvalidInputError, match=match):
        KVShiftStore(store_arg, index=index, **settings)


def test_an_embedder_for_a_store_that_has_its_own_is_refused(embeddings):
    own = MemoryStore(kv_url="memory://", embedder=BagOfWords())
    with pytest.raises(InvalidInputError, match="own embedder"):
        KVShiftStore(own, index={"dims": DIMS, "embed": embeddings})
    assert KVShiftStore(own, index={"dims": DIMS, "fields": ["text"]}).index_fields == ("text",)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.put(("alice",), "k", {"text": "x"}, ttl=-5), "minutes"),
        (lambda s: s.put(("alice",), "k", {"text": "x"}, ttl="soon"), "minutes"),
        (lambda s: s.put(("alice",), "k", {"text": "x"}, ttl=float("nan")), "minutes"),
        (lambda s: s.put(("alice",), "k", {"text": "x"}, index=["a["]), "JSON path"),
        (lambda s: s.put(("alice",), "k", {"text": "x"}, index="text"), "JSON path|index"),
        (lambda s: s.start_ttl_sweeper(sweep_interval_minutes=-1), "minutes"),
    ],
)
def test_bad_ttl_and_index_arguments_write_nothing(store, call, match):
    store.put(("alice",), "kept", {"text": "Alice keeps this."})
    with pytest.raises((InvalidInputError, ValueError), match=match):
        call(store)
    assert [hit.key for hit in store.search(("alice",))] == ["kept"]
    assert store.get(("alice",), "k") is None


def test_the_settings_docs_integrations_md_shows_run_as_written(tmp_path, monkeypatch, capsys):
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[4] / "docs" / "integrations.md").read_text(encoding="utf-8")
    [block] = [b for b in re.findall(r"^```python\n(.*?)^```", docs, flags=re.S | re.M) if "KVShiftStore(" in b]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(block, "docs/integrations.md", "exec"), namespace)  # our own documentation, run as a user would
    assert capsys.readouterr().out.strip() == str({"content": "Alice flies to Lisbon on Friday."})
    store = namespace["store"]
    assert store.ttl_config["default_ttl"] == 1440 and store.index_fields == ("content", "facts[*].text")
    assert get_item(store.memory_store, "alice", ("memories", "alice"), "trip").ttl_s == 3600
    assert (tmp_path / "memories").is_dir()
