"""Memories' fragments: encoded once, lead fragments, encode contexts and speakers, the pool.

On a tiny random Llama driven by the bundled tokenizer (``tiny_engine``, shared with
``test_engine.py``): what is checked here is where K/V comes from, not what a trained model says.
"""

from __future__ import annotations

import pytest
import torch

from conftest import MEMORIES, TINY_CONFIGS, first_logits, partition_holds, tiny_model
from kvshift_memory import KVShiftEngine
from kvshift_memory.engine.blend import reads_lead
from kvshift_memory.engine.speakers import cast_speakers
from kvshift_memory.exceptions import ContextOverflowError, InvalidInputError
from kvshift_memory.kv.cache import ShiftCache


def test_warm_encodes_once(tiny_engine):
    tiny_engine.clear_cache()
    assert tiny_engine.warm(MEMORIES, "q") == len(MEMORIES)
    assert len(tiny_engine.runner.fragments) == 2 * len(MEMORIES)  # each memory's lead fragment too
    assert tiny_engine.warm(MEMORIES, "q") == 0
    result = tiny_engine.generate("q", MEMORIES, reuse="blend", max_new_tokens=1)
    assert result.stats.fragments_hit == len(MEMORIES)
    tiny_engine.clear_cache()
    assert tiny_engine.warm(MEMORIES, "q", lead_fragments=False) == len(MEMORIES)
    assert len(tiny_engine.runner.fragments) == len(MEMORIES)
    with pytest.raises(InvalidInputError):
        tiny_engine.warm(MEMORIES, "q", lead_fragments="yes")


def _slot_kv(engine: KVShiftEngine, messages, memories, reuse, ratio=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    plan = engine.planner.plan(messages, memories, reuse=reuse, recompute_ratio=ratio)
    return engine.runner.prefill(plan).cache.view(0, plan.layout.length)


def _span_error(engine: KVShiftEngine, memories, index: int) -> float:
    """Largest |ΔK| over memory ``index``'s slots between the shifted prompt (warmed, no repair) and full recompute."""
    layout = engine.planner.plan("q", memories, reuse="blend", recompute_ratio=0.0).layout
    span = layout.fragments[index]
    full = _slot_kv(engine, "q", memories, "none")
    engine.clear_cache(fragments=False)
    shifted = _slot_kv(engine, "q", memories, "blend", 0.0)
    slots = slice(span.start, span.end)
    return max(float((a[0] - b[0])[..., slots, :].abs().max()) for a, b in zip(full, shifted, strict=True))


def test_the_memory_opening_the_block_is_read_exactly_from_its_lead_fragment(tiny_engine, tokenizer):
    tiny_engine.clear_cache()
    tiny_engine.warm(MEMORIES, "q")
    assert _span_error(tiny_engine, MEMORIES, 0) < 1e-5
    assert _span_error(tiny_engine, MEMORIES, 1) > 1e-3  # the others are shifted: what the blend repairs
    # the lead fragment is the memory's own: another memory opening the block reads its own
    reordered = MEMORIES[::-1]
    assert _span_error(tiny_engine, reordered, 0) < 1e-5
    # a single memory is then exact end to end, at any ratio
    reference = first_logits(tiny_engine, "q", MEMORIES[:1], reuse="none")
    tiny_engine.clear_cache(fragments=False)
    assert (first_logits(tiny_engine, "q", MEMORIES[:1], reuse="blend", ratio=0.0) - reference).abs().max() < 1e-4

    without = KVShiftEngine(tiny_engine.model, tokenizer, fingerprint=tiny_engine.fingerprint, lead_fragments=False)
    without.warm(MEMORIES, "q")
    assert _span_error(without, MEMORIES, 0) > 1e-3


def test_a_lead_fragment_is_not_encoded_at_question_time_when_the_ordinary_one_is_cached(tiny_engine):
    tiny_engine.clear_cache()
    tiny_engine.warm(MEMORIES, "q", lead_fragments=False)
    # shift only: at the default ratio memories this short are recomputed whole, never placed
    stats = tiny_engine.generate("q", MEMORIES, reuse="blend", recompute_ratio=0.0, max_new_tokens=1).stats
    assert stats.fragments_hit == len(MEMORIES) and stats.fragments_missed == 0 and stats.encoded_tokens == 0
    assert _span_error(tiny_engine, MEMORIES, 0) > 1e-3  # shifted, as the others
    # cold, every memory is computed with the question; after the answer the ordinary fragments
    # are encoded, and the lead fragment of the memory opening the block, which is read from then on
    tiny_engine.clear_cache()
    cold = tiny_engine.generate("q", MEMORIES, reuse="blend", recompute_ratio=0.0, max_new_tokens=1).stats
    assert cold.fragments_missed == len(MEMORIES) and partition_holds(cold)
    assert cold.encoded_tokens == sum(tiny_engine.count_tokens(f"{memory}\n") for memory in MEMORIES)
    assert len(tiny_engine.runner.fragments) == len(MEMORIES) + 1
    assert _span_error(tiny_engine, MEMORIES, 0) < 1e-5


def test_memories_in_a_user_message_or_after_a_fixed_system_message_have_no_lead(tiny_engine):
    tiny_engine.clear_cache()
    tiny_engine.warm(MEMORIES, "q")
    messages = [{"role": "user", "content": "q", "memories": MEMORIES}]
    layout = tiny_engine.planner.plan(messages, reuse="blend", recompute_ratio=0.0).layout
    assert not reads_lead(tiny_engine, layout, layout.fragments[0])
    tiny_engine.clear_cache()
    fixed = "You remember what the user told you."
    tiny_engine.warm(MEMORIES, "q", fragments_after=fixed)
    assert len(tiny_engine.runner.fragments) == len(MEMORIES)  # its conditioning is not this prompt's start


def test_fragments_encoded_after_a_fixed_system_message_serve_any_system_message(tiny_engine):
    tiny_engine.clear_cache()
    fixed = "You remember what the user told you."
    assert tiny_engine.warm(MEMORIES, fragments_after=fixed) == len(MEMORIES)
    for documents in ("Document: Lisbon has trams.", "Document: Porto has bridges."):  # a system message that changes
        messages = [{"role": "system", "content": documents}, {"role": "user", "content": "q"}]
        anywhere = tiny_engine.generate(messages, MEMORIES, reuse="blend", max_new_tokens=1, recompute_ratio=0.0)
        assert anywhere.stats.memory_reuse == ["shifted"] * len(MEMORIES)  # found after another system message
        tiny_engine.clear_cache(fragments=False)
        fixed_stats = tiny_engine.generate(
            messages, MEMORIES, reuse="blend", max_new_tokens=1, fragments_after=fixed, recompute_ratio=0.0
        ).stats
        assert fixed_stats.fragments_hit == len(MEMORIES) and fixed_stats.fragments_missed == 0
    with pytest.raises(InvalidInputError):
        tiny_engine.generate("q", MEMORIES, fragments_after="  ")


def test_encode_context_per_call_keys_the_fragments(tiny_engine):
    tiny_engine.clear_cache()
    own = "Alice: I booked the flights to Lisbon.\nBob: Great, and the hotel?"
    assert tiny_engine.warm(MEMORIES, "q", encode_context=own) == len(MEMORIES)
    hit = tiny_engine.generate("q", MEMORIES, reuse="blend", max_new_tokens=1, encode_context=own).stats
    assert hit.fragments_hit == len(MEMORIES) and hit.encoded_tokens == 0
    tiny_engine.clear_cache(fragments=False)
    # settings.encode_context: not warmed
    default = tiny_engine.generate("q", MEMORIES, reuse="blend", max_new_tokens=1).stats
    assert default.fragments_missed == len(MEMORIES) - 1 and default.fragments_hit == 1  # the lead one is shared
    shifted = {}
    for name, context in (("own", own), ("default", None)):
        tiny_engine.clear_cache(fragments=False)
        shifted[name] = tiny_engine.score(
            "q", MEMORIES, "Lisbon", reuse="blend", recompute_ratio=0.0, encode_context=context
        )
    assert shifted["own"].logprobs != shifted["default"].logprobs  # the context shapes the shifted K/V
    full = tiny_engine.score("q", MEMORIES, "Lisbon", reuse="none").logprobs
    exact = tiny_engine.score("q", MEMORIES, "Lisbon", reuse="blend", recompute_ratio=1.0, encode_context=own).logprobs
    assert exact == pytest.approx(full, abs=1e-4)
    # an empty context: fragments follow the system message alone, so no lead fragment is needed
    tiny_engine.clear_cache()
    assert tiny_engine.warm(MEMORIES, "q", encode_context="") == len(MEMORIES)
    assert len(tiny_engine.runner.fragments) == len(MEMORIES)


DIALOGUES = [
    "(1 May)\nJohn: I signed with the Minnesota Wolves.\nTim: Congrats, John!",
    "(2 May)\nTim: I started learning the violin.\nJohn: Nice, Tim.",
    "(3 May)\nAnna: We moved to Porto.\nBen: How is it?",
    "Alice is allergic to peanuts.",
]


def _fragments_by_memory(engine: KVShiftEngine, memories) -> list:
    layout = engine.planner.plan("q", memories, reuse="blend", recompute_ratio=0.0).layout
    by_tokens = {fragment.token_ids: fragment for fragment in engine.runner.fragments.values()}
    return [by_tokens[span.token_ids] for span in layout.fragments]


def test_a_dialogue_is_encoded_after_the_context_recast_with_its_own_speakers(tiny_engine, tokenizer):
    tiny_engine.clear_cache()
    assert tiny_engine.warm(DIALOGUES, "q", lead_fragments=False) == len(DIALOGUES)
    fragments = _fragments_by_memory(tiny_engine, DIALOGUES)
    digests = [fragment.context_digest for fragment in fragments]
    assert digests[0] == digests[1]  # the same two people, whoever speaks first: one context
    assert len(set(digests)) == 3  # John and Tim, Anna and Ben, no speakers
    hit = tiny_engine.generate("q", DIALOGUES, reuse="blend", max_new_tokens=1).stats
    assert hit.fragments_hit == len(DIALOGUES) and hit.encoded_tokens == 0

    # each fragment is exactly the one encoded after the recast context given as the context
    plain = KVShiftEngine(tiny_engine.model, tokenizer, fingerprint=tiny_engine.fingerprint, match_speakers=False)
    context = tiny_engine.settings.encode_context
    for memory, fragment in zip(DIALOGUES, fragments, strict=False):
        plain.clear_cache()
        plain.warm([memory], "q", lead_fragments=False, encode_context=cast_speakers(context, memory))
        (expected,) = _fragments_by_memory(plain, [memory])
        assert expected.context_digest == fragment.context_digest
        pairs = zip(expected.keys + expected.values, fragment.keys + fragment.values, strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)

    # without speaker matching every memory shares the context as written, and reads differently
    plain.clear_cache()
    plain.warm(DIALOGUES, "q", lead_fragments=False)
    assert len({fragment.context_digest for fragment in _fragments_by_memory(plain, DIALOGUES)}) == 1
    shifted = {}
    for name, engine in (("matched", tiny_engine), ("plain", plain)):
        engine.clear_cache(fragments=False)
        shifted[name] = engine.score("q", DIALOGUES, "Wolves", reuse="blend", recompute_ratio=0.0).logprobs
    assert shifted["matched"] != shifted["plain"]
    # full recompute never sees a context: recomputing every token is exact either way
    full = tiny_engine.score("q", DIALOGUES, "Wolves", reuse="none").logprobs
    for engine in (tiny_engine, plain):
        exact = engine.score("q", DIALOGUES, "Wolves", reuse="blend", recompute_ratio=1.0).logprobs
        assert exact == pytest.approx(full, abs=1e-4)


def test_a_dialogue_too_long_after_its_recast_context_falls_back(tiny_engine):
    tiny_engine.clear_cache()
    # short as written, too long once its speaker "A" takes a name of several tokens
    name = "Zxqvwkjhgfdsa"
    memory = f"{name}: hello there"
    context = "A: hi\n" + "A " * (tiny_engine.max_positions // 2)
    assert tiny_engine.count_tokens(cast_speakers(context, memory)) > tiny_engine.max_positions
    assert tiny_engine.warm(["hello there"], "q", encode_context=context) == 1
    with pytest.raises(ContextOverflowError, match="encode context"):
        tiny_engine.warm([memory], "q", encode_context=context)
    result = tiny_engine.generate("q", [memory], reuse="blend", max_new_tokens=1, encode_context=context)
    assert result.stats.reuse == "prefix" and "encode context" in result.stats.fallback_reason


@pytest.mark.parametrize("bad", [5, b"bytes", ["list"], "\ud800", "x" * 3_000_000])
def test_bad_encode_context_is_refused_before_anything_changes(tiny_engine, bad):
    tiny_engine.clear_cache()
    for call in (
        lambda: tiny_engine.warm(MEMORIES, "q", encode_context=bad),
        lambda: tiny_engine.generate("q", MEMORIES, max_new_tokens=1, encode_context=bad),
        lambda: tiny_engine.score("q", MEMORIES, "x", encode_context=bad),
    ):
        with pytest.raises(InvalidInputError, match="encode_context"):
            call()
    assert len(tiny_engine.runner.fragments) == 0 and len(tiny_engine.runner.prefix_cache) == 0


def test_encode_context_too_long_for_the_window(tiny_engine):
    tiny_engine.clear_cache()
    long_context = "memory " * (tiny_engine.max_positions - 20)
    with pytest.raises(ContextOverflowError, match="encode context"):
        tiny_engine.warm(MEMORIES, "q", encode_context=long_context)
    assert len(tiny_engine.runner.fragments) == 0
    # a question is answered all the same, by exact prefix reuse, and says why
    result = tiny_engine.generate("q", MEMORIES, reuse="blend", max_new_tokens=3, encode_context=long_context)
    assert result.stats.reuse == "prefix" and "encode context" in result.stats.fallback_reason
    tiny_engine.clear_cache()
    assert result.token_ids == tiny_engine.generate("q", MEMORIES, reuse="none", max_new_tokens=3).token_ids
    assert len(tiny_engine.runner.fragments) == 0


def test_generation_does_not_mutate_cached_fragments(tiny_engine):
    tiny_engine.clear_cache()
    tiny_engine.warm(MEMORIES, "q")
    fragments = list(tiny_engine.runner.fragments.values())  # lead and ordinary fragments
    before = [tuple(t.clone() for t in f.keys + f.values) for f in fragments]
    tiny_engine.generate("q", MEMORIES, reuse="blend", recompute_ratio=0.5, max_new_tokens=4)
    for old, fragment in zip(before, fragments, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(old, fragment.keys + fragment.values, strict=True))


# ---------------------------------------------------------------- fallback


TURN = [
    {"role": "user", "content": "I have news about the trip."},
    {"role": "assistant", "content": "Tell me."},
    {"role": "user", "content": MEMORIES[0]},
]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3"])
def test_a_memory_said_in_a_turn_takes_its_fragment_from_the_turns_kv(tokenizer, family):
    """Cut from the turn, the fragment is the K/V the turn computed for the message, and its
    separator computed after it: exactly a full pass over the turn up to there."""
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS[family]()), tokenizer)
    engine.generate(TURN, reuse="prefix", max_new_tokens=1)
    assert engine.warm([MEMORIES[0]], lead_fragments=False, from_turn=TURN) == 1
    (fragment,) = engine.runner.fragments.values()
    turn_ids = engine.planner.plan(TURN, reuse="prefix").layout.token_ids
    start, n = fragment.base_position, fragment.n_tokens
    assert turn_ids.numel() - 10 < start + n < turn_ids.numel()  # the last message, not the encode context
    ids = torch.cat([turn_ids[:start], torch.tensor(fragment.token_ids)])
    cache = ShiftCache(engine.runner.num_layers, ids.numel(), engine.device)
    engine.runner.prefill_exact(cache, ids, 0, ids.numel(), logits="none")
    for (keys, values), cut_keys, cut_values in zip(
        cache.view(start, start + n), fragment.keys, fragment.values, strict=True
    ):
        assert torch.allclose(keys, cut_keys, atol=1e-5) and torch.allclose(values, cut_values, atol=1e-5)
    # placed elsewhere, it is rotated there and read like any fragment
    result = engine.generate("q", [MEMORIES[1], MEMORIES[0]], reuse="blend", recompute_ratio=0.0, max_new_tokens=2)
    assert result.stats.memory_reuse == ["missed", "shifted"]


def test_a_memory_the_turn_does_not_hold_or_no_longer_cached_is_encoded(tiny_engine):
    def base_of_warmed(memory, tenant=None) -> int:
        tiny_engine.clear_cache(prefixes=False)
        assert tiny_engine.warm([memory], lead_fragments=False, from_turn=TURN, tenant=tenant) == 1
        return next(iter(tiny_engine.runner.fragments.values())).base_position

    tiny_engine.clear_cache()
    encoded_at = base_of_warmed(MEMORIES[1])  # another text: encoded after the encode context
    layout = tiny_engine.planner.plan("q", MEMORIES[1:2], reuse="blend").layout
    assert encoded_at == layout.encoded_after(layout.fragments[0]).numel()
    tiny_engine.generate(TURN, reuse="prefix", max_new_tokens=1, tenant="alice")
    assert base_of_warmed(MEMORIES[1], "alice") == encoded_at
    assert base_of_warmed(MEMORIES[0], "alice") < encoded_at  # the turn said it
    assert base_of_warmed(MEMORIES[0], "bob") == encoded_at  # never from another tenant's turn
    tiny_engine.clear_cache(fragments=False)  # the turn is gone from the cache
    assert base_of_warmed(MEMORIES[0], "alice") == encoded_at


@pytest.mark.parametrize("turn", ["", [{"role": "tool"}], [{"role": "user", "content": None}], 7])
def test_a_malformed_turn_is_refused_and_nothing_is_warmed(tiny_engine, turn):
    tiny_engine.clear_cache()
    with pytest.raises(InvalidInputError):
        tiny_engine.warm(MEMORIES[:1], from_turn=turn)
    assert len(tiny_engine.runner.fragments) == 0


LONG_MEMORIES = [
    "Trip notes. " + "Marta books the hotel near the river and keeps every receipt for the shared folder. " * 5,
    "Work notes. " + "The quarterly report is due on Friday and Tom reviews the budget tables first. " * 5,
]
SHORT_MEMORY = "Tea, no sugar."
OTHER_SYSTEM = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "q"}]


def test_a_fragment_warmed_without_a_system_message_is_read_under_another_from_the_store(tmp_path, embedder, tokenizer):
    """What an agent stores (no system message known) serves a later prompt under any system
    message, also in a new process: the fragment is read from the store, shifted and repaired."""
    from kvshift_memory import MemoryStore

    model = tiny_model(TINY_CONFIGS["llama"]())
    with MemoryStore(tmp_path / "s", embedder=embedder) as store:
        records = [store.add(text, tenant="alice") for text in LONG_MEMORIES]
        KVShiftEngine(model, tokenizer).warm(records, tenant="alice", lead_fragments=False)
        later = KVShiftEngine(model, tokenizer)  # another process: nothing but the store holds the fragments
        stats = later.generate(OTHER_SYSTEM, records, max_new_tokens=1, tenant="alice").stats
    assert stats.memory_reuse == ["shifted", "shifted"] and stats.fragments_loaded == 2
    assert stats.encoded_tokens == 0 and partition_holds(stats)


def test_a_fragment_warmed_under_one_system_message_is_read_under_another_in_process(tiny_engine):
    tiny_engine.clear_cache()
    tiny_engine.warm(LONG_MEMORIES, [{"role": "system", "content": "You plan trips."}], lead_fragments=False)
    stats = tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, max_new_tokens=1).stats
    assert stats.memory_reuse == ["shifted", "shifted"] and stats.fragments_hit == 2
    assert stats.encoded_tokens == 0


def test_auto_shifts_a_long_memory_and_recomputes_a_short_one(tiny_engine):
    tiny_engine.clear_cache()
    memories = [SHORT_MEMORY, *LONG_MEMORIES]
    tiny_engine.warm(memories, lead_fragments=False)
    auto = tiny_engine.generate(OTHER_SYSTEM, memories, reuse="auto", max_new_tokens=1).stats
    assert auto.requested_reuse == "auto" and auto.reuse == "blend"
    assert auto.memory_reuse == ["recomputed", "shifted", "shifted"]
    assert (auto.fragments_hit, auto.fragments_recomputed) == (2, 1)
    tiny_engine.clear_cache(fragments=False)  # not the whole prompt from the prefix cache
    assert tiny_engine.generate(OTHER_SYSTEM, memories, max_new_tokens=1).stats.memory_reuse == auto.memory_reuse
    tiny_engine.clear_cache(fragments=False)
    blend = tiny_engine.generate(OTHER_SYSTEM, memories, reuse="blend", recompute_ratio=0.0, max_new_tokens=1).stats
    assert blend.memory_reuse == ["shifted", "shifted", "shifted"]  # asked for, every fragment is shifted
    # only short ones: nothing pays for shifting, so one exact pass
    tiny_engine.clear_cache(fragments=False)
    plan = tiny_engine.planner.plan(OTHER_SYSTEM, [SHORT_MEMORY, MEMORIES[0]])
    short = tiny_engine.runner.prefill(plan)
    assert short.stats.memory_reuse == ["recomputed", "recomputed"]
    assert (short.logits - first_logits(tiny_engine, OTHER_SYSTEM, [SHORT_MEMORY, MEMORIES[0]])).abs().max() < 1e-4


def test_auto_recomputes_every_memory_on_a_model_whose_blend_was_measured_to_change_answers(tokenizer):
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, auto_shifts=False)
    engine.warm(LONG_MEMORIES, lead_fragments=False)
    auto = engine.generate(OTHER_SYSTEM, LONG_MEMORIES, max_new_tokens=1).stats
    assert auto.requested_reuse == "auto" and auto.reuse == "prefix" and "shifted" not in auto.memory_reuse
    assert auto.fallback_reason is not None and "auto_shifts=False" in auto.fallback_reason
    engine.clear_cache(fragments=False)
    exact = first_logits(engine, OTHER_SYSTEM, LONG_MEMORIES, reuse=None)
    assert (exact - first_logits(engine, OTHER_SYSTEM, LONG_MEMORIES, reuse="none")).abs().max() < 1e-4
    engine.clear_cache(fragments=False)
    blend = engine.generate(OTHER_SYSTEM, LONG_MEMORIES, reuse="blend", max_new_tokens=1).stats
    assert blend.memory_reuse == ["shifted", "shifted"]  # asked for by name, the blend still shifts
    assert KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer).settings.auto_shifts is True  # unmeasured
    with pytest.raises(InvalidInputError, match="auto_shifts"):
        KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, auto_shifts="no")


def test_a_cold_miss_is_computed_with_the_question_and_encoded_after_the_answer(tiny_engine):
    tiny_engine.clear_cache()
    reference = first_logits(tiny_engine, OTHER_SYSTEM, LONG_MEMORIES)
    tiny_engine.clear_cache()
    plan = tiny_engine.planner.plan(OTHER_SYSTEM, LONG_MEMORIES)
    cold = tiny_engine.runner.prefill(plan)
    assert cold.stats.memory_reuse == ["missed", "missed"] and cold.stats.encoded_tokens == 0
    assert len(tiny_engine.runner.fragments) == 0  # nothing encoded at question time: the miss is full recompute
    assert (cold.logits - reference).abs().max() < 1e-4
    answered = tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, max_new_tokens=2).stats
    assert answered.fragments_missed == 2 and answered.encoded_tokens > 0  # after the answer, for the next call
    tiny_engine.clear_cache(fragments=False)
    again = tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, max_new_tokens=1).stats
    # the memory opening the block got its lead fragment too: it follows this very system message
    assert again.memory_reuse == ["lead", "shifted"] and again.encoded_tokens == 0


def test_memory_reuse_names_what_each_memory_got_in_every_mode(tiny_engine):
    tiny_engine.clear_cache()
    none = tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, reuse="none", max_new_tokens=1).stats
    assert none.memory_reuse == ["text", "text"]
    tiny_engine.clear_cache()
    tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, reuse="prefix", max_new_tokens=1)
    again = tiny_engine.generate(OTHER_SYSTEM, LONG_MEMORIES, reuse="prefix", max_new_tokens=1).stats
    assert again.memory_reuse == ["prefix", "prefix"]


def test_memories_a_separator_apart_are_placed_as_one_run(tiny_engine):
    """A framework joins retrieved documents with a blank line: both are shifted, the separator
    computed in the repair pass (exact when every token is recomputed)."""
    content = "Context:\n\n\nQuestion: q"
    messages = [{"role": "user", "content": content, "memories": LONG_MEMORIES, "memories_at": [9, 10]}]
    tiny_engine.clear_cache()
    reference = first_logits(tiny_engine, messages, reuse="none")
    tiny_engine.warm(LONG_MEMORIES, lead_fragments=False)
    layout = tiny_engine.planner.plan(messages).layout
    assert 0 < layout.fragments[1].start - layout.fragments[0].end <= 2
    stats = tiny_engine.generate(messages, reuse="blend", recompute_ratio=0.0, max_new_tokens=1).stats
    assert stats.memory_reuse == ["shifted", "shifted"] and partition_holds(stats)
    tiny_engine.clear_cache(fragments=False)
    exact = first_logits(tiny_engine, messages, reuse="blend", ratio=1.0)
    assert (exact - reference).abs().max() < 1e-4
    # a longer stretch of text between them: only the last memory is placed
    apart = [
        {**messages[0], "content": "Context:\n" + "and some words in between " * 4 + "\nQ", "memories_at": [9, 110]}
    ]
    tiny_engine.clear_cache(fragments=False)
    assert tiny_engine.generate(apart, reuse="blend", max_new_tokens=1).stats.memory_reuse == ["text", "shifted"]
