"""Stored K/V chunks: a conversation's K/V outlives the process (engine/chunks.py, the tiers' chunks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from store_worker import HashEmbedder

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import InvalidInputError, KVShiftEngine, MemoryStore
from kvshift_memory.store.tiers import DiskTier, HotTier

CHUNK = 32
LONG_TEXT = " ".join(f"Note {i}: the parcel for flat {i % 9} waits at desk {i % 4}." for i in range(40))
QUESTION = [{"role": "user", "content": LONG_TEXT + "\nWhere is the parcel for flat 3?"}]


def _store(tmp_path, name="store", **options) -> MemoryStore:
    options.setdefault("codec", "fp32")  # exact: a restored prompt must answer as a recomputed one
    return MemoryStore(tmp_path / name, embedder=HashEmbedder(), index_url=":memory:", **options)


def _engine(tokenizer, family="llama", seed=0, chunk_tokens=CHUNK) -> KVShiftEngine:
    """A fresh process's engine: same weights (same seed), nothing cached. A tiny model computes
    its tokens faster than a store reads them, so its cost model is told reading is cheaper
    (test_the_cost_model_may_prefer_computing covers the other way)."""
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS[family](), seed=seed), tokenizer, chunk_tokens=chunk_tokens)
    engine.costs.recompute_cheaper = lambda tokens: False
    return engine


def _written(engine, store, tenant="alice", messages=QUESTION):
    result = engine.generate(messages, kv_store=store, tenant=tenant, max_new_tokens=4)
    assert engine.flush_chunks(timeout_s=60)
    return result


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text", "phi3"])
def test_a_new_engine_restores_the_stored_chunks_and_answers_as_recompute(tmp_path, tokenizer, family):
    store = _store(tmp_path)
    first = _written(_engine(tokenizer, family), store)
    assert first.stats.restored_tokens == 0
    chunks = store.stats()["chunks"]
    # the answer's last token was never run (no K/V): full chunks cover the prompt and the rest, a tail the end
    filled = first.stats.prompt_tokens + len(first.token_ids) - 1
    # each full chunk and the tail, and after each chain the list of what was stored there
    assert chunks == 2 * (filled // CHUNK + 1) and filled % CHUNK

    later = _engine(tokenizer, family)
    recomputed = later.generate(QUESTION, reuse="none", tenant="alice", max_new_tokens=4)
    later.clear_cache()  # what was computed stays in the prefix cache: the next call must miss it
    restored = later.generate(QUESTION, kv_store=store, tenant="alice", max_new_tokens=4)
    n = restored.stats.prompt_tokens
    assert restored.stats.restored_tokens == restored.stats.reused_tokens == n - 1  # all but the last token
    assert restored.stats.prefilled_tokens == n - restored.stats.restored_tokens
    assert restored.token_ids == recomputed.token_ids
    _assert_restored_scores_as_recompute(later, QUESTION, restored.token_ids, store, "alice", 1e-4)


def _assert_restored_scores_as_recompute(engine, prompt, continuation, store, tenant, tolerance):
    engine.clear_cache()
    scored = engine.score(prompt, continuation=continuation, kv_store=store, tenant=tenant)
    exact = engine.score(prompt, continuation=continuation, reuse="none", tenant=tenant)
    assert scored.stats.restored_tokens > 0
    assert max(abs(a - b) for a, b in zip(scored, exact, strict=True)) < tolerance


def test_the_next_turn_restores_the_answer_too(tmp_path, tokenizer):
    store = _store(tmp_path)
    engine = _engine(tokenizer)
    first = _written(engine, store)
    said = torch.cat([engine.planner.plan(QUESTION, tenant="alice").layout.token_ids, torch.tensor(first.token_ids)])
    turn = [*QUESTION, {"role": "assistant", "content": first.text, "token_ids": first.token_ids}]
    turn.append({"role": "user", "content": "And flat 4?"})
    later = _engine(tokenizer)
    stored_until = said.numel() - 1  # full chunks and the tail; the answer's last token has no K/V yet
    assert torch.equal(later.planner.plan(turn, tenant="alice").layout.token_ids[: said.numel()], said)
    restored = later.generate(turn, kv_store=store, tenant="alice", max_new_tokens=4)
    assert restored.stats.restored_tokens == stored_until


def test_each_conversation_of_a_tenant_keeps_its_own_tail(tmp_path, tokenizer):
    """Conversations shorter than a chunk share the chain before their tails (only its start):
    each keeps its own tail there, and resuming one after the other restores all of it."""
    store = _store(tmp_path)
    engine = _engine(tokenizer, chunk_tokens=256)
    system = {"role": "system", "content": "You are a helpful assistant."}
    conversations = [
        [system, {"role": "user", "content": f"Question {n}: where did I park the car?"}] for n in range(3)
    ]
    firsts = [_written(engine, store, messages=conversation) for conversation in conversations]
    assert all(first.stats.prompt_tokens + len(first.token_ids) < 256 for first in firsts)
    later = _engine(tokenizer, chunk_tokens=256)
    for conversation, first in zip(conversations, firsts, strict=True):  # the oldest first
        said = first.stats.prompt_tokens + len(first.token_ids) - 1  # the answer's last token has no K/V yet
        turn = [*conversation, {"role": "assistant", "content": first.text, "token_ids": first.token_ids}]
        restored = later.generate([*turn, {"role": "user", "content": "And?"}], kv_store=store, tenant="alice")
        assert restored.stats.restored_tokens == said
        later.clear_cache()


def test_a_malformed_list_of_tails_restores_nothing_and_is_replaced(tmp_path, tokenizer):
    from kvshift_memory.engine.chunks import _chain, _key
    from kvshift_memory.store.layout import tier_key

    store = _store(tmp_path)
    engine = _engine(tokenizer)
    messages = [{"role": "user", "content": "Where did I park the car?"}]
    first = _written(engine, store, messages=messages)
    digest = _chain(engine.runner.chunks.identity(store, "alice"), torch.tensor([0]), CHUNK, 0)[0]
    row = tier_key("c", "alice", _key(digest, exact=True, tail=True))
    chunks = store.tier._chunks(create=False)  # noqa: SLF001
    for planted in (
        b"kvshift-tails/1\n[[1, -2]]",
        b"kvshift-tails/1\n{",
        b"\x80\x04pickle",
        b"kvshift-tails/1\n" + b"[" * 5000,
    ):
        chunks.set(row, planted)
        later = _engine(tokenizer)
        assert later.generate(messages, kv_store=store, tenant="alice", max_new_tokens=2).stats.restored_tokens == 0
        assert later.flush_chunks(timeout_s=60)  # it stores its own tail and list: the next plant goes over them
    later = _engine(tokenizer)
    _written(later, store, messages=messages)
    restored = _engine(tokenizer).generate(messages, kv_store=store, tenant="alice", max_new_tokens=2)
    assert restored.stats.restored_tokens == first.stats.prompt_tokens - 1


def _row(engine, store, tenant: str, index: int) -> str:
    """The tier key of chunk ``index`` of QUESTION's prompt for ``tenant``."""
    from kvshift_memory.engine.chunks import _chain, _key
    from kvshift_memory.store.layout import tier_key

    ids = engine.planner.plan(QUESTION, tenant=tenant).layout.token_ids
    digest = _chain(engine.runner.chunks.identity(store, tenant), ids, CHUNK, index + 1)[index + 1]  # after it
    return tier_key("c", tenant, _key(digest, exact=True))


def test_a_chunk_of_one_tenant_never_restores_for_another(tmp_path, tokenizer):
    store = _store(tmp_path)
    engine = _engine(tokenizer)
    _written(engine, store, tenant="alice")
    later = _engine(tokenizer)
    for other in ("bob", "Alice", None):
        result = later.generate(QUESTION, kv_store=store, tenant=other, max_new_tokens=2)
        assert result.stats.restored_tokens == 0 and result.stats.chunks_rejected == 0, other
    later.flush_chunks(timeout_s=60)
    # alice's first chunk copied over bob's by someone with access to the folder: refused by its header
    chunks = store.tier._chunks(create=False)  # noqa: SLF001
    bobs = _row(engine, store, "bob", 0)
    assert chunks.get(bobs) is not None
    chunks.set(bobs, chunks.get(_row(engine, store, "alice", 0)))
    result = _engine(tokenizer).generate(QUESTION, kv_store=store, tenant="bob", max_new_tokens=2)
    assert result.stats.restored_tokens == 0 and result.stats.chunks_rejected == 1


@pytest.mark.parametrize(
    "damage",
    [
        lambda blob: blob[: len(blob) // 2],  # truncated
        lambda blob: blob[:-64] + bytes(64),  # tensor bytes changed: the checksum fails
        lambda blob: b"\x80\x04\x95" + blob,  # a pickle's opening
        lambda blob: b"",
    ],
)
def test_a_damaged_chunk_is_refused_and_its_tokens_computed(tmp_path, tokenizer, damage):
    store = _store(tmp_path)
    engine = _engine(tokenizer)
    _written(engine, store)
    chunks = store.tier._chunks(create=False)  # noqa: SLF001
    second = _row(engine, store, "alice", 1)
    chunks.set(second, damage(chunks.get(second)))
    later = _engine(tokenizer)
    recomputed = later.generate(QUESTION, reuse="none", tenant="alice", max_new_tokens=4)
    later.clear_cache()
    result = later.generate(QUESTION, kv_store=store, tenant="alice", max_new_tokens=4)
    assert result.stats.chunks_rejected == 1 and result.stats.restored_tokens == CHUNK  # the first chunk only
    assert result.token_ids == recomputed.token_ids


def test_a_chunk_of_another_model_or_codec_is_never_read(tmp_path, tokenizer):
    store = _store(tmp_path)
    _written(_engine(tokenizer), store)
    other_model = _engine(tokenizer, seed=1)
    assert other_model.fingerprint != _engine(tokenizer).fingerprint
    assert other_model.generate(QUESTION, kv_store=store, tenant="alice").stats.restored_tokens == 0
    int8 = _store(tmp_path, codec="int8")  # the same folder, read with another codec
    assert _engine(tokenizer).generate(QUESTION, kv_store=int8, tenant="alice").stats.restored_tokens == 0


def _largest_gap(engine, prompt, continuation, tenant, **options) -> float:
    scored = engine.score(prompt, continuation=continuation, tenant=tenant, **options)
    exact = engine.score(prompt, continuation=continuation, reuse="none", tenant=tenant)
    return max(abs(a - b) for a, b in zip(scored, exact, strict=True))


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16"])
def test_k_v_restored_through_a_lossy_codec_is_never_served_or_stored_as_exact(tmp_path, tokenizer, codec):
    lossy = _store(tmp_path, "lossy", codec=codec)
    _written(_engine(tokenizer), lossy)
    later = _engine(tokenizer)
    restored = later.generate(QUESTION, kv_store=lossy, tenant="alice", max_new_tokens=4)
    assert restored.stats.restored_tokens > 0  # the default ("auto") takes the lossy chunks
    answer = restored.token_ids
    # an exact call after it reuses none of what was restored, from the process or from the store
    assert _largest_gap(later, QUESTION, answer, "alice", reuse="prefix") < 1e-5
    assert _largest_gap(later, QUESTION, answer, "alice", reuse="prefix", kv_store=lossy) < 1e-5
    assert (
        later.score(QUESTION, continuation=answer, reuse="prefix", kv_store=lossy, tenant="alice").stats.restored_tokens
        == 0
    )
    # nor does an exact store take it as exact: a new process's exact call restores none of it
    exact_store = _store(tmp_path, "exact")
    later.generate(QUESTION, kv_store=exact_store, tenant="alice", max_new_tokens=4)
    assert later.flush_chunks(timeout_s=60)
    fresh = _engine(tokenizer)
    assert _largest_gap(fresh, QUESTION, answer, "alice", reuse="prefix", kv_store=exact_store) < 1e-5
    # while the default still reuses the restored K/V in the process: a resumed chat stays fast
    again = later.generate(QUESTION, tenant="alice", max_new_tokens=4)
    assert again.stats.reused_tokens == restored.stats.prompt_tokens - 1


def test_the_cost_model_may_prefer_computing(tmp_path, tokenizer):
    store = _store(tmp_path)
    _written(_engine(tokenizer), store)
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, chunk_tokens=CHUNK)
    for tokens in (1, 100, 1000):
        engine.costs.observe_pass(tokens, tokens * 1e-6)
    engine.costs.observe_fetch(CHUNK, 1.0)  # a slow store: a second per chunk
    result = engine.generate(QUESTION, kv_store=store, tenant="alice", max_new_tokens=4)
    assert result.stats.restored_tokens == 0


def test_prefix_reuse_off_means_no_restore(tmp_path, tokenizer):
    store = _store(tmp_path)
    _written(_engine(tokenizer), store)
    result = _engine(tokenizer).generate(QUESTION, kv_store=store, tenant="alice", reuse="none")
    assert result.stats.restored_tokens == 0


def test_the_disk_budget_evicts_least_recently_used_chunks(tmp_path):
    tier = DiskTier(tmp_path / "kv", chunk_bytes=1_000_000)
    size = 50_000  # above diskcache's inline limit, as real chunks are: a file each

    def key(i: int) -> str:
        return f"c/alice/{i:032x}"

    for i in range(60):
        tier.set_chunk(key(i), bytes([i]) * size)
        assert tier.get_chunk(key(0)) == bytes([0]) * size  # read after every write: never the oldest
    count, used = tier.chunk_usage()
    assert used <= 1_000_000 and count < 20
    assert tier.get_chunk(key(1)) is None and tier.get_chunk(key(59)) is not None
    tier.set_chunk(key(99), b"x" * 1_500_000)  # larger than the whole budget: not kept
    assert tier.get_chunk(key(99)) is None
    tier.set("h/alice/m", b"record" * 20_000)  # records are never evicted
    for i in range(100, 160):
        tier.set_chunk(key(i), b"y" * size)
    assert tier.get("h/alice/m") == b"record" * 20_000
    tier.close()


def test_the_ram_tier_bounds_its_chunks_apart_from_its_records():
    tier = HotTier(chunk_bytes=10_000)
    tier.set("h/alice/m", b"r" * 50_000)
    for i in range(10):
        tier.set_chunk(f"c/alice/{i:032x}", b"c" * 3_000)
    assert tier.chunk_usage() == (3, 9_000)
    assert tier.get("h/alice/m") == b"r" * 50_000
    assert list(tier.scan("c/")) == []  # chunks are not records: a scan of records never meets one


def test_redis_chunks_take_a_time_to_live_that_a_read_renews(redis_url):
    import redis

    from kvshift_memory.store.tiers import RedisTier

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    tier = RedisTier(redis_url, chunk_ttl_s=100)
    tier.set_chunk("c/alice/" + "a" * 32, b"kv")
    assert 0 < client.pttl("c/alice/" + "a" * 32) <= 100_000
    client.pexpire("c/alice/" + "a" * 32, 5_000)
    assert tier.get_chunk("c/alice/" + "a" * 32) == b"kv"
    assert client.pttl("c/alice/" + "a" * 32) > 50_000
    assert tier.chunk_usage() == (1, 2)
    tier.close()


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
def test_a_redis_store_restores_across_engines(backend, request, tokenizer):
    from conftest import empty_redis

    redis_url = empty_redis(backend, request)
    store = MemoryStore(kv_url=redis_url, index_url=":memory:", embedder=HashEmbedder(), codec="fp32")
    first = _written(_engine(tokenizer), store)
    again = MemoryStore(kv_url=redis_url, index_url=":memory:", embedder=HashEmbedder(), codec="fp32")
    result = _engine(tokenizer).generate(QUESTION, kv_store=again, tenant="alice", max_new_tokens=4)
    assert result.stats.restored_tokens == result.stats.prompt_tokens - 1
    assert result.token_ids == first.token_ids
    assert again.stats()["chunks"] == store.stats()["chunks"] > 0


def test_stats_and_inspect_show_the_chunk_bounds(tmp_path, tokenizer):
    store = _store(tmp_path, chunk_bytes=1 << 20, chunk_ttl_s=60)
    _written(_engine(tokenizer), store)
    stats = store.stats()
    assert stats["chunk_budget_bytes"] == 1 << 20 and stats["chunk_ttl_s"] == 60
    assert 0 < stats["chunk_bytes"] <= 1 << 20 and stats["chunks"] > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"chunk_bytes": -1}, "chunk_bytes"),
        ({"chunk_bytes": 1.5}, "chunk_bytes"),
        ({"chunk_ttl_s": 0}, "chunk_ttl_s"),
        ({"chunk_ttl_s": float("nan")}, "chunk_ttl_s"),
        ({"chunk_ttl_s": True}, "chunk_ttl_s"),
    ],
)
def test_bad_chunk_bounds_are_refused(tmp_path, options, message):
    with pytest.raises(InvalidInputError, match=message):
        _store(tmp_path, **options)


@pytest.mark.parametrize("key", ["", "../../etc/passwd", "A" * 32, "0" * 65, None, 7, "g" * 32, "0" * 31 + "\n"])
def test_malformed_chunk_keys_and_tenants_are_refused(tmp_path, key):
    store = _store(tmp_path)
    with pytest.raises(InvalidInputError):
        store.save_chunk(key, b"blob", tenant="alice")
    with pytest.raises(InvalidInputError):
        store.load_chunk(key, tenant="alice")
    for tenant in ("", " alice", "a\x00b", "x" * 300, 5):
        with pytest.raises(InvalidInputError):
            store.load_chunk("0" * 32, tenant=tenant)
    with pytest.raises(InvalidInputError):
        store.save_chunk("0" * 32, "not bytes", tenant="alice")  # type: ignore[arg-type]
    assert store.stats()["chunks"] == 0


def test_the_engine_refuses_what_is_not_a_chunk_store(tokenizer):
    engine = _engine(tokenizer)
    for bad in ("redis://localhost", object(), 5, {"codec": "int8"}):
        with pytest.raises(InvalidInputError, match="kv_store"):
            engine.generate("Hi", kv_store=bad)
    with pytest.raises(InvalidInputError, match="chunk_tokens"):
        KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), engine.tokenizer, chunk_tokens=0)


def test_an_unreachable_store_costs_a_prefill_not_an_answer(tmp_path, tokenizer):
    from kvshift_memory.exceptions import StoreError

    class Down:
        codec, group_size = "int8", 32

        def load_chunk(self, key, *, tenant):
            raise StoreError("down")

        def save_chunk(self, key, blob, *, tenant):
            raise StoreError("down")

    engine = _engine(tokenizer)
    result = engine.generate(QUESTION, kv_store=Down(), tenant="alice", max_new_tokens=2)
    assert engine.flush_chunks(timeout_s=60) and result.stats.restored_tokens == 0 and result.text is not None


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path[:0] = [{tests!r}]
    from conftest import TINY_CONFIGS, tiny_model
    from store_worker import HashEmbedder
    from transformers import AutoTokenizer
    from kvshift_memory import KVShiftEngine, MemoryStore
    from kvshift_memory.engine.loading import bundled_gguf_path

    gguf = bundled_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    store = MemoryStore({folder!r}, embedder=HashEmbedder(), index_url=":memory:", codec="fp32")
    engine = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, chunk_tokens={chunk})
    record = store.add("The spare key is under the blue pot.", tenant="alice")
    print("added", record.id, flush=True)
    text = {text!r}
    for turn in range(1000):
        # from turn 3 on every chunk is new (a round number leads the text): the kill lands mid-write
        lead = f"Round {{turn}}. " if turn > 2 else ""
        engine.generate(lead + text + f" Turn {{turn}}?", kv_store=store, tenant="alice", max_new_tokens=2)
        if turn == 2:
            # the first turns' chunks are acknowledged (written) before the kill, so some must restore
            print("writing" if engine.flush_chunks(timeout_s=120) else "not flushed", flush=True)
    """
)


def test_kill_9_while_chunks_are_written_loses_no_memory_and_restores_nothing_wrong(tmp_path, tokenizer):
    folder = tmp_path / "store"
    tests = os.path.dirname(__file__)
    script = _KILLED_WRITER.format(tests=tests, folder=str(folder), chunk=CHUNK, text=LONG_TEXT)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for _ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
        added = writer.stdout.readline().split()
        assert added[0] == "added"
        assert writer.stdout.readline().strip() == "writing"
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        store = _store(tmp_path)
        assert store.get(added[1], tenant="alice") is not None
        assert store.check().ok
        engine = _engine(tokenizer)
        for turn in (0, 1, 2, 3):
            messages = LONG_TEXT + f" Turn {turn}?"
            restored = engine.generate(messages, kv_store=store, tenant="alice", max_new_tokens=2)
            recomputed = engine.generate(messages, reuse="none", tenant="alice", max_new_tokens=2)
            engine.clear_cache()
            assert restored.token_ids == recomputed.token_ids
            assert restored.stats.restored_tokens > 0
        engine.flush_chunks(timeout_s=60)
        store.close()


@pytest.mark.model
@pytest.mark.parametrize("engine_name", ["bundled_engine", "gemma_engine"])
def test_restored_chunks_answer_as_recompute_in_a_shipped_models_default_weights(request, tmp_path, engine_name):
    """The shipped models' default: GGUF blocks through the kernels' step (on the CPU)."""
    engine = request.getfixturevalue(engine_name)
    store = _store(tmp_path)  # fp32 chunks: exact
    messages = [{"role": "user", "content": "Summarise our plans for the trip to Lisbon in two sentences. " * 40}]
    engine.clear_cache()
    engine.generate(messages, kv_store=store, tenant="restore-test", max_new_tokens=8)
    assert engine.flush_chunks(timeout_s=60)
    recomputed = engine.generate(messages, reuse="none", tenant="restore-test", max_new_tokens=16)
    engine.clear_cache()  # a new process: only the store holds the K/V
    restored = engine.generate(messages, kv_store=store, tenant="restore-test", max_new_tokens=16)
    assert restored.stats.restored_tokens >= engine.settings.chunk_tokens
    assert restored.token_ids == recomputed.token_ids
    _assert_restored_scores_as_recompute(engine, messages, recomputed.token_ids, store, "restore-test", 1e-3)


_KILLED_MID_CHUNK = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from store_worker import HashEmbedder
    from kvshift_memory import MemoryStore
    from kvshift_memory.store import tiers

    store = MemoryStore({folder!r}, embedder=HashEmbedder(), index_url=":memory:", chunk_bytes={budget})
    store_value = tiers._BytesOnlyDisk.store

    def store_then_die(self, value, read, key=None):
        stored = store_value(self, value, read, key=key)
        if stored[2] is not None:  # the value's file is written, its row is not: the worst moment to die
            os.kill(os.getpid(), signal.SIGKILL)
        return stored

    tiers._BytesOnlyDisk.store = store_then_die
    store.save_chunk(os.urandom(16).hex(), os.urandom({size}), tenant="alice")
    """
)


def _value_bytes(folder) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*.val"))


def test_kill_9_mid_chunk_write_leaves_no_bytes_past_the_budget_after_check_or_gc(tmp_path):
    folder, budget, size = tmp_path / "store", 4 << 20, 2 << 20
    script = _KILLED_MID_CHUNK.format(tests=os.path.dirname(__file__), folder=str(folder), budget=budget, size=size)

    def crash(times: int) -> None:
        for _ in range(times):
            done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "HF_HUB_OFFLINE": "1"})
            assert done.returncode == -signal.SIGKILL

    def later(store, seconds: float) -> None:  # the tier's clock, which gc's grace is judged by
        real_now = type(store.tier).now
        store.tier.now = lambda: real_now(store.tier) + seconds

    crash(3)
    chunks = folder / "kv" / "chunks"
    assert _value_bytes(chunks) == 3 * size > budget
    store = _store(tmp_path, chunk_bytes=budget)
    assert store.check().problems == [] and store.gc().stray_files == 0  # within the grace: a writer may be mid-write
    later(store, 120)
    report = store.check()
    assert report.ok and len(report.repaired) == 3 and all("no row names" in problem for problem in report.problems)
    assert _value_bytes(chunks) == 0
    crash(3)
    store.save_chunk("ab" * 16, b"k" * 100_000, tenant="alice")  # a live chunk beside the debris: kept
    freed = store.gc()
    assert freed.stray_files == 3 and freed.freed_bytes >= 3 * size
    assert _value_bytes(chunks) <= budget and store.load_chunk("ab" * 16, tenant="alice") == b"k" * 100_000
    store.close()
