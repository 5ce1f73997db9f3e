"""Long documents as memories: the splitter, and ``MemoryStore.add_document`` with its parts' order and source."""

from __future__ import annotations

import json
import os
import re

import pytest
from store_worker import HashEmbedder

from kvshift_memory import MemoryStore
from kvshift_memory.adapters import in_document_order
from kvshift_memory.exceptions import InvalidInputError, StoreError
from kvshift_memory.store.documents import approximate_tokens, split_document

BRIEF = "\n\n".join(
    f"Section {n}. The Lisbon office opens in {2027 + n}. Marta leads hiring for team {n}; "
    f"Tom reviews the budget of {n * 10}k euros. Receipts go to the shared folder within a week."
    for n in range(1, 13)
)


def _words(text: str) -> list[str]:
    return text.split()


@pytest.mark.parametrize("max_tokens", [8, 40, 120, 10_000])
def test_parts_keep_every_word_in_order_and_stay_within_the_budget(max_tokens):
    parts = split_document(BRIEF, max_tokens)
    assert [w for part in parts for w in _words(part)] == _words(BRIEF)  # nothing lost, reworded or reordered
    assert all(part and part == part.strip() for part in parts)
    assert all(approximate_tokens(part) <= max_tokens for part in parts)
    if max_tokens >= approximate_tokens(BRIEF):
        assert parts == [BRIEF]


def test_cuts_fall_at_the_widest_boundary_that_fits():
    paragraphs = BRIEF.split("\n\n")
    one = approximate_tokens(paragraphs[0])
    assert split_document(BRIEF, one + 2) == paragraphs  # a paragraph each: nothing narrower was needed
    sentences = split_document(paragraphs[0], one - 1)
    assert len(sentences) > 1 and all(re.search(r"[.!?;]$", part) for part in sentences[:-1])


def test_a_word_longer_than_the_budget_is_cut_inside_into_parts_that_fit():
    text = "short words then " + "x" * 5000 + " and more"
    parts = split_document(text, 4, count_tokens=len)  # characters as tokens
    assert all(len(part) <= 4 for part in parts)
    assert "".join(parts).replace(" ", "") == text.replace(" ", "")
    assert "".join(part for part in parts if set(part) == {"x"}) == "x" * 5000


def test_an_unsplittable_word_becomes_parts_within_the_model_tokens(tokenizer):
    import random
    import string

    rng = random.Random(0)
    blob = "".join(rng.choice(string.ascii_letters + string.digits + "+/") for _ in range(43_500))  # base64-like

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    parts = split_document(f"Attached key: {blob} (end).", 200, count)
    assert max(count(part) for part in parts) <= 200
    assert "".join(parts[1:-1]).startswith(blob[:1000]) and blob in "".join(parts)


def test_splitting_counts_linearly_in_the_text():
    calls = []

    def counting(text: str) -> int:
        calls.append(len(text))
        return approximate_tokens(text)

    text = " ".join(["word"] * 20_000)
    parts = split_document(text, 50, counting)
    assert len(parts) == 400
    # each part is counted while it grows word by word: the characters counted stay within
    # (budget + one word) per word, not a multiple of the whole text per word
    assert sum(calls) < 2 * len(text) + 60 * 5 * 20_000


def test_add_document_round_trip_keeps_order_and_source(make_store):
    store = make_store()
    parts = store.add_document(BRIEF, tenant="alice", source="brief.md", max_tokens=60, session_id="planning")
    assert len(parts) > 3
    assert [p.part for p in parts] == list(range(len(parts)))
    assert len({p.document for p in parts}) == 1 and all(p.source == "brief.md" for p in parts)
    assert [w for p in parts for w in _words(p.text)] == _words(BRIEF)
    for part in parts:
        got = store.get(part.id, tenant="alice")
        assert (got.document, got.part, got.source, got.session_id) == (
            part.document,
            part.part,
            "brief.md",
            "planning",
        )
    hits = store.search("Who reviews the budget of section 7?", tenant="alice", k=3)
    assert hits and all(hit.document == parts[0].document and hit.part is not None for hit in hits)
    assert store.search("budget", tenant="bob", k=3) == []  # another tenant sees none of it
    again = store.add_document(BRIEF, tenant="alice", max_tokens=60)
    assert again[0].document != parts[0].document and again[0].source is None


def test_hits_come_with_a_documents_parts_in_order_where_its_best_part_ranked(tmp_path, embedder):
    with MemoryStore(tmp_path / "s", embedder=embedder, index_url=":memory:") as store:
        parts = store.add_document(BRIEF, tenant="alice", max_tokens=60)
        note = store.add("Bob's door code is 4512.", tenant="alice")
        other = store.add_document("First. " * 15 + "\n\n" + "Second. " * 15, tenant="alice", max_tokens=50)
        hits = [other[1], parts[2], note, parts[0], other[0], parts[1]]
        assert in_document_order(hits) == [other[0], other[1], parts[0], parts[1], parts[2], note]
        assert in_document_order([note]) == [note] and in_document_order([]) == []


def test_parts_are_cut_by_the_model_tokens_when_given(make_store, tokenizer):
    store = make_store()

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    parts = store.add_document(BRIEF, tenant="alice", max_tokens=50, count_tokens=count)
    assert all(count(p.text) <= 50 for p in parts)


def test_add_document_refuses_bad_input_and_writes_nothing(make_store):
    store = make_store()
    bad = [
        {"text": ""},
        {"text": "   "},
        {"text": 42},
        {"text": "x" * 1_000_001},
        {"text": BRIEF, "max_tokens": 0},
        {"text": BRIEF, "max_tokens": True},
        {"text": BRIEF, "max_tokens": "60"},
        {"text": BRIEF, "count_tokens": "len"},
        {"text": BRIEF, "source": ""},
        {"text": BRIEF, "source": "x" * 5000},
        {"text": BRIEF, "source": 7},
        {"text": BRIEF, "tenant": ""},
        {"text": BRIEF, "tenant": "a\n"},
        {"text": BRIEF, "importance_score": 2.0},
    ]
    for options in bad:
        with pytest.raises(InvalidInputError):
            store.add_document(**{"tenant": "alice", **options})
    assert store.stats()["memories"] == 0


def test_a_failing_part_takes_the_parts_before_it_back(make_store, monkeypatch):
    store = make_store()
    writes = 0
    original = store._write_version

    def failing(record, raw_head, head):
        nonlocal writes
        writes += 1
        if writes == 3:
            raise StoreError("disk full")
        return original(record, raw_head, head)

    monkeypatch.setattr(store, "_write_version", failing)
    with pytest.raises(StoreError):
        store.add_document(BRIEF, tenant="alice", max_tokens=40)
    monkeypatch.undo()
    assert store.search("Lisbon office", tenant="alice", k=10) == []


def test_a_stored_part_with_a_forged_document_field_is_refused(tmp_path, embedder):
    with MemoryStore(tmp_path / "s", embedder=embedder) as store:
        (part, *_) = store.add_document(BRIEF, tenant="alice", max_tokens=60, source="brief.md")
        (key,) = store.tier.scan(f"r/alice/{part.id}/1/")
        for forged in ({"document": "../../etc"}, {"part": -1}, {"part": True}, {"document": None}, {"source": 3}):
            stored = json.loads(store.tier.get(key))
            store.tier.set(key, json.dumps({**stored, **forged}).encode())
            store.clear_cache()
            assert store.get(part.id, tenant="alice") is None


ZEBRA = "\n\n".join(f"Zebra note {n}: the zebra crossing on street {n} is repainted in spring." for n in range(20))


def test_a_reader_sees_all_of_a_documents_parts_or_none(make_store):
    import threading

    store = make_store(embedder=HashEmbedder())
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            hits = store.search("zebra crossing repainted", tenant="alice", k=400)
            by_document: dict[str, int] = {}
            for hit in hits:
                by_document[hit.document] = by_document.get(hit.document, 0) + 1
            seen.extend(by_document.values())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(6):
            assert len(store.add_document(ZEBRA, tenant="alice", max_tokens=20)) == 20
    finally:
        done.set()
        reader.join()
    assert seen and set(seen) <= {20}, sorted(set(seen))


_KILLED_MID_DOCUMENT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from store_worker import HashEmbedder
from kvshift_memory import MemoryStore

store = MemoryStore({folder!r}, embedder=HashEmbedder())
add_part = MemoryStore.add_owned
written = []

def add_then_die(self, *args, **kwargs):
    written.append(add_part(self, *args, **kwargs))
    if len(written) == 11:  # 11 of 20 parts are durable: the writer dies before the document is
        os.kill(os.getpid(), signal.SIGKILL)
    return written[-1]

MemoryStore.add_owned = add_then_die
store.add_document({text!r}, tenant="alice", max_tokens=20)
"""


def test_kill_9_mid_document_leaves_no_part_visible_and_check_removes_them(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    folder = tmp_path / "store"
    with MemoryStore(folder, embedder=HashEmbedder()) as store:
        kept = store.add("The zebra crossing near the school is new.", tenant="alice")
    script = _KILLED_MID_DOCUMENT.format(tests=str(Path(__file__).parent), folder=str(folder), text=ZEBRA)
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == -signal.SIGKILL
    with MemoryStore(folder, embedder=HashEmbedder()) as store:
        assert [hit.id for hit in store.search("zebra crossing repainted", tenant="alice", k=50)] == [kept.id]
        heads = [key for key in store.tier.scan("h/alice/")]
        assert len(heads) == 12  # the 11 parts are stored, invisible
        assert store.check().problems == []  # within the grace: the writer may still be publishing
        real_now = type(store.tier).now
        store.tier.now = lambda: real_now(store.tier) + 120  # gc's grace is judged by the tier's clock
        report = store.check()
        assert report.ok and len(report.repaired) == 11
        assert all("no document row names it" in line for line in report.problems)
        assert store.get(kept.id, tenant="alice") is not None
        again = store.add_document(ZEBRA, tenant="alice", max_tokens=20)  # and a whole one is whole
        assert len(store.search("zebra crossing repainted", tenant="alice", k=50)) == len(again) + 1 == 21
