"""The engine and the store together: fragments stored once, fetched later, refused when damaged
or stale, and re-encoded from text so that the answer does not change."""

from __future__ import annotations

import pytest
from safetensors.torch import load as load_safetensors
from test_codec import reseal

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import KVShiftEngine, MemoryStore
from kvshift_memory.blobs import read_header

FACTS = [
    "Budget for the Lisbon trip: 50k euros.",
    "The flight to Lisbon leaves on 12 May at 7am from gate B12.",
    "Ana, my sister, lives in Porto and works as a nurse.",
    "The hotel in Lisbon is the Casa Azul, booked for five nights.",
]
QUESTION = "When does the flight to Lisbon leave?"
# Every stored fragment placed as it is: memories this short are otherwise recomputed whole (the
# blend's minimum repair covers them), so the store would not be read at all.
SHIFT_ONLY = {"reuse": "blend", "recompute_ratio": 0.0}


@pytest.fixture
def store(tmp_path, embedder):
    with MemoryStore(tmp_path / "store", embedder=embedder) as made:
        yield made


def blob_keys(store: MemoryStore, record) -> list[str]:
    return list(store.tier.scan(f"f/{record.tenant}/{record.id}/"))


def cold(engine: KVShiftEngine, store: MemoryStore) -> None:
    """Nothing in RAM: fragments must come from the disk tier (or be encoded). The cost model
    starts blank too: what earlier tests taught it on a busy machine must not decide these counts."""
    engine.clear_cache()
    engine.costs.clear()
    store.clear_cache()


@pytest.mark.model
def test_fragments_are_stored_once_and_fetched_later(bundled_engine, store):
    records = [store.add(text, tenant="alice") for text in FACTS]
    cold(bundled_engine, store)
    first = bundled_engine.generate(QUESTION, records, max_new_tokens=12, **SHIFT_ONLY)
    assert (first.stats.fragments_missed, first.stats.fragments_loaded) == (4, 0)
    # encoded after the answer: the first memory's lead fragment too, as it opens the memory block
    assert [len(blob_keys(store, r)) for r in records] == [2, 1, 1, 1]
    assert store.stats()["fragments_by_codec"] == {"int8": 5}
    cold(bundled_engine, store)
    second = bundled_engine.generate(QUESTION, records, max_new_tokens=12, **SHIFT_ONLY)
    assert (second.stats.fragments_hit, second.stats.fragments_loaded, second.stats.fragments_missed) == (4, 4, 0)
    assert second.stats.encoded_tokens == 0 and second.stats.reused_tokens > 0
    # plain texts with the same words share the in-process fragments, but never write to the store
    assert store.stats()["fragments"] == 5


@pytest.mark.model
def test_lead_fragments_are_stored_beside_the_ordinary_ones_and_fetched_for_the_first_memory(bundled_engine, store):
    records = [store.add(text, tenant="alice") for text in FACTS]
    cold(bundled_engine, store)
    assert bundled_engine.warm(records) == 4
    assert all(len(blob_keys(store, r)) == 2 for r in records)
    cold(bundled_engine, store)
    assert bundled_engine.warm(records) == 0  # both found in the store
    for order in (records, records[::-1]):  # whichever memory comes first reads its lead fragment
        cold(bundled_engine, store)
        stats = bundled_engine.generate(QUESTION, order, max_new_tokens=1, **SHIFT_ONLY).stats
        assert (stats.fragments_loaded, stats.fragments_missed, stats.encoded_tokens) == (4, 0, 0)
        layout = bundled_engine.planner.plan(QUESTION, order, reuse="blend", recompute_ratio=0.0).layout
        lead_digest = layout.context_digest(layout.fragments[0], lead=True)
        loaded = list(bundled_engine.runner.fragments.values())
        assert [f.token_ids for f in loaded if f.context_digest == lead_digest] == [layout.fragments[0].token_ids]


def _flip_a_bit(blob: bytes) -> bytes:
    damaged = bytearray(blob)
    damaged[len(damaged) // 2] ^= 0x08
    return bytes(damaged)


def _truncate(blob: bytes) -> bytes:
    return blob[: len(blob) * 2 // 3]


def _wrong_shapes(blob: bytes) -> bytes:
    """Valid checksum, but K/V for fewer tokens than the memory has."""
    tensors = load_safetensors(blob)
    tensors["k"] = tensors["k"][:, :, :3].contiguous()
    tensors["v"] = tensors["v"][:, :, :3].contiguous()
    tensors["vs"] = tensors["vs"][:, :, :3].contiguous()
    tensors["token_ids"] = tensors["token_ids"][:3].contiguous()
    return reseal(tensors, read_header(blob)[1])


@pytest.mark.model
@pytest.mark.parametrize("damage", [_flip_a_bit, _truncate, _wrong_shapes, "another memory's blob"])
def test_a_damaged_blob_is_refused_reencoded_and_the_answer_is_unchanged(bundled_engine, store, damage):
    records = [store.add(text, tenant="alice") for text in FACTS]
    bundled_engine.warm(records, lead_fragments=False)  # one blob per memory (the first is then shifted too)
    victim, donor = records[1], records[2]
    [key] = blob_keys(store, victim)
    # the reference: the victim's fragment freshly encoded from text, the others fetched
    store.tier.delete(key)
    cold(bundled_engine, store)
    reference = bundled_engine.generate(QUESTION, records, max_new_tokens=16, **SHIFT_ONLY)
    assert (reference.stats.fragments_loaded, reference.stats.fragments_missed) == (3, 1)

    good = store.tier.get(key)
    if damage == "another memory's blob":
        [donor_key] = blob_keys(store, donor)
        store.tier.set(key, store.tier.get(donor_key))
    else:
        store.tier.set(key, damage(good))
    cold(bundled_engine, store)
    answer = bundled_engine.generate(QUESTION, records, max_new_tokens=16, **SHIFT_ONLY)
    assert answer.stats.fragments_rejected == 1 and answer.stats.fragments_loaded == 3
    assert answer.text == reference.text and answer.token_ids == reference.token_ids
    assert store.corrupt_fragments == 1
    # re-encoded and stored again: the next cold call fetches all four
    cold(bundled_engine, store)
    assert bundled_engine.generate(QUESTION, records, max_new_tokens=1, **SHIFT_ONLY).stats.fragments_loaded == 4


@pytest.mark.model
def test_check_reports_and_drops_a_corrupt_blob(bundled_engine, store):
    records = [store.add(text, tenant="alice") for text in FACTS[:2]]
    bundled_engine.warm(records, lead_fragments=False)
    [key] = blob_keys(store, records[0])
    store.tier.set(key, _flip_a_bit(store.tier.get(key)))
    report = store.check()
    assert report.ok and len(report.repaired) == 1 and "checksum" in report.problems[0]
    assert blob_keys(store, records[0]) == []
    cold(bundled_engine, store)
    stats = bundled_engine.generate(QUESTION, records, max_new_tokens=1, **SHIFT_ONLY).stats
    assert (stats.fragments_loaded, stats.fragments_missed) == (1, 1)


@pytest.mark.model
def test_another_model_finds_old_fragments_stale_and_reencodes(bundled_engine, store, tokenizer):
    records = [store.add(text, tenant="alice") for text in FACTS]
    bundled_engine.warm(records)
    other = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer)
    assert other.fingerprint != bundled_engine.fingerprint
    assert store.stats(model_fingerprint=other.fingerprint)["stale_fragments"] == 8  # lead and ordinary

    answer = other.generate(QUESTION, records, max_new_tokens=8, **SHIFT_ONLY)
    assert (answer.stats.fragments_loaded, answer.stats.fragments_missed) == (0, 4)
    fresh = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer).generate(
        QUESTION, FACTS, max_new_tokens=8, **SHIFT_ONLY
    )
    assert answer.token_ids == fresh.token_ids
    assert store.stats(model_fingerprint=other.fingerprint)["stale_fragments"] == 8  # the old model's, unused

    # even forced under the new model's key, an old blob is refused (fingerprint and shapes differ)
    for record in records:
        keys = blob_keys(store, record)
        old_key = next(k for k in keys if _fingerprint(store, k) == bundled_engine.fingerprint)
        new_key = next(k for k in keys if _fingerprint(store, k) == other.fingerprint)
        store.tier.set(new_key, store.tier.get(old_key))
    cold(other, store)
    forced = other.generate(QUESTION, records, max_new_tokens=8, **SHIFT_ONLY)
    assert forced.stats.fragments_rejected == 4 and forced.token_ids == fresh.token_ids

    freed = store.gc(keep_model_fingerprint=other.fingerprint)
    assert freed.freed_fragments == 8  # the old model's lead and ordinary fragments
    assert store.stats(model_fingerprint=other.fingerprint)["stale_fragments"] == 0


def _fingerprint(store: MemoryStore, key: str) -> str | None:
    return read_header(store.tier.get(key))[1].get("model_fingerprint")


def test_an_unreachable_store_costs_speed_not_the_answer(store, tokenizer, monkeypatch):
    from kvshift_memory.exceptions import StoreError

    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer)
    records = [store.add(text, tenant="alice") for text in FACTS]
    expected = engine.generate(QUESTION, FACTS, max_new_tokens=6, **SHIFT_ONLY).token_ids

    def down(*args, **kwargs):
        raise StoreError("connection refused")

    for name in ("load_fragment", "save_fragment", "has_fragment"):
        monkeypatch.setattr(store, name, down)
    engine.clear_cache()
    answer = engine.generate(QUESTION, records, max_new_tokens=6, **SHIFT_ONLY)
    assert answer.token_ids == expected and answer.stats.fragments_missed == 4
