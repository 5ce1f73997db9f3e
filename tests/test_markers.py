"""Span markers: parsed strictly, stripped always, never a way into another tenant."""

from __future__ import annotations

import pytest

from kvshift_memory.exceptions import InvalidInputError
from kvshift_memory.markers import (
    marked_user_message,
    parse_markers,
    render_marker,
    render_memories,
    resolve_markers,
    strip_markers,
)


def test_well_formed_markers_split_the_text():
    spans = parse_markers("before ⟦mem:abc@3⟧the fact⟦/mem⟧ after")
    assert [(s.text, s.memory_id, s.version) for s in spans] == [
        ("before ", None, None),
        ("the fact", "abc", 3),
        (" after", None, None),
    ]


@pytest.mark.parametrize(
    "text,plain",
    [
        ("⟦mem:abc@1⟧unterminated", "unterminated"),
        ("stray ⟦/mem⟧ close", "stray  close"),
        ("⟦mem:abc⟧no version⟦/mem⟧", "no version"),
        ("⟦mem:abc@0⟧version zero⟦/mem⟧", "version zero"),
        ("⟦mem:abc@-1⟧negative⟦/mem⟧", "negative"),
        ("⟦mem:a b@1⟧space in id⟦/mem⟧", "space in id"),
        ("dangling ⟦mem", "dangling "),
        ("⟦MEM:abc@1⟧case⟦/mem⟧", "⟦MEM:abc@1⟧case"),  # not a marker: only the close is stripped
    ],
)
def test_malformed_markers_degrade_to_plain_text(text, plain):
    spans = parse_markers(text)
    assert all(span.memory_id is None for span in spans)
    assert "".join(span.text for span in spans) == plain == strip_markers(text)


def test_nested_markers_never_make_the_outer_span():
    spans = parse_markers("⟦mem:outer@1⟧a ⟦mem:inner@2⟧b⟦/mem⟧ c⟦/mem⟧")
    assert [(s.text, s.memory_id) for s in spans] == [("a ", None), ("b", "inner"), (" c", None)]
    assert "⟦" not in "".join(s.text for s in spans)


def test_marker_text_is_checked():
    with pytest.raises(InvalidInputError):
        parse_markers(b"bytes")  # type: ignore[arg-type]
    assert parse_markers("") == []
    long_text = "x" * 200_000 + "⟦mem:abc@1⟧fact⟦/mem⟧"
    assert parse_markers(long_text)[-1].memory_id == "abc"


class _RecordsStore:
    """What resolve_markers asks of a store: get(id, tenant=...) of the caller's own tenant."""

    def __init__(self, *records):
        self.records = {(r.id, r.tenant): r for r in records}

    def get(self, memory_id, *, tenant):
        return self.records.get((memory_id, tenant))


def _record(text="The budget is 50k.", tenant="alice", memory_id="m1"):
    from kvshift_memory.store.records import MemoryRecord, text_hash

    return MemoryRecord(memory_id, 2, text, tenant, "s1", 0.0, text_hash(text))


def test_resolution_needs_tenant_session_version_and_hash():
    record = _record()
    store = _RecordsStore(record)
    marker = render_marker(record)
    assert resolve_markers(f"A {marker} B", store, tenant="alice") == ["A ", record, " B"]
    assert resolve_markers(marker, store, tenant="alice", session_id="s1") == [record]
    assert resolve_markers(marker, store, tenant="alice", session_id="s2") == [record.text]
    assert resolve_markers(marker, store, tenant="bob") == [record.text]
    assert resolve_markers("⟦mem:m1@1⟧The budget is 50k.⟦/mem⟧", store, tenant="alice") == [record.text]
    assert resolve_markers("⟦mem:m1@2⟧The budget is 90k.⟦/mem⟧", store, tenant="alice") == ["The budget is 90k."]
    with pytest.raises(InvalidInputError):
        resolve_markers(marker, store, tenant="")


def test_marked_memories_become_memories_where_their_markers_stood():
    budget, sister = _record(), _record("Ana lives in Porto.", memory_id="m2")
    store = _RecordsStore(budget, sister)
    block = render_memories([budget, sister], "You remember:")
    assert (
        block == f"You remember:\n{render_marker(budget)}\n{render_marker(sister)}" and render_memories([], "x") == ""
    )
    marked = f"Human: hi\n{render_marker(budget)}\nAI: hello\n{render_marker(sister)}\nHuman: and?"
    message = marked_user_message(marked, store, tenant="alice")
    assert message["memories"] == [budget, sister]
    assert message["content"] == "Human: hi\nAI: hello\nHuman: and?"  # each fragment ends its line
    assert message["memories_at"] == [len("Human: hi\n"), len("Human: hi\nAI: hello\n")]
    # another tenant, or no store: the memories are plain text and no marker is left
    for message in (marked_user_message(marked, store, tenant="bob"), marked_user_message(marked)):
        assert message == {"role": "user", "content": strip_markers(marked)} and "⟦" not in message["content"]
    assert marked_user_message(marked, store, tenant="alice", session_id="s2")["content"] == strip_markers(marked)


@pytest.mark.parametrize(
    "unit",
    [
        "⟦mem:abc@1⟧",  # openings that never close
        "⟦mem:abc@1⟧x",
        "⟦mem:abc@1⟧a⟦/mem⟧",  # well-formed spans, each a store lookup
        "⟦mem:abc@1⟧⟦mem:abc@1⟧b⟦/mem⟧",  # nested
        "⟦mem " + "x" * 290,  # marker-shaped openings the strip pattern scans ahead of
    ],
)
@pytest.mark.timeout(120)  # a pattern that backtracks takes hours on a million characters, not seconds
def test_a_hostile_million_characters_are_handled_without_backtracking(unit):
    from kvshift_memory.inputs import MAX_TEXT_CHARS

    text = (unit * (MAX_TEXT_CHARS // len(unit) + 1))[:MAX_TEXT_CHARS]
    store = _RecordsStore(_record(memory_id="abc"))
    parse_markers(text)
    message = marked_user_message(text, store, tenant="alice")
    assert strip_markers(message["content"]) == message["content"]  # nothing marker-shaped reaches the model
