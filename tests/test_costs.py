"""The cost model: learned from observed passes and fetches; decides fetch or recompute per fragment."""

from __future__ import annotations

import pytest

from conftest import partition_holds
from kvshift_memory.engine.costs import CostModel


def test_nothing_is_recomputed_before_both_costs_are_known():
    costs = CostModel()
    assert not costs.recompute_cheaper(1)
    costs.observe_pass(1, 0.09)
    assert costs.pass_token_s() is None  # one size: no slope yet
    costs.observe_pass(101, 0.19)
    assert costs.pass_token_s() == pytest.approx(0.001)
    assert not costs.recompute_cheaper(1)  # no fetch seen yet
    costs.observe_fetch(40, 0.004)
    assert costs.fetch_s(40) == pytest.approx(0.004)


def test_short_fragments_are_recomputed_and_long_ones_fetched():
    costs = CostModel()
    for tokens, seconds in [(1, 0.090), (30, 0.120), (300, 0.390)]:  # 1 ms a token past a fixed 89 ms
        costs.observe_pass(tokens, seconds)
    for tokens, seconds in [(10, 0.0030), (100, 0.0048), (1000, 0.0228)]:  # 2.8 ms + 20 us a token
        costs.observe_fetch(tokens, seconds)
    assert costs.recompute_cheaper(2)
    assert not costs.recompute_cheaper(10)
    assert not costs.recompute_cheaper(4000)


def test_old_observations_fall_out_of_the_window():
    costs = CostModel(window=4)
    for _ in range(4):
        costs.observe_pass(1, 1.0)
        costs.observe_pass(11, 2.0)  # 0.1 s a token
    for _ in range(2):
        costs.observe_pass(1, 1.0)
        costs.observe_pass(11, 1.01)
    assert costs.pass_token_s() == pytest.approx(0.001)


def test_the_engine_recomputes_a_stored_memory_the_model_finds_cheaper(bundled_engine, embedder):
    from kvshift_memory import MemoryStore

    engine = bundled_engine
    with MemoryStore(kv_url="memory://", index_url=":memory:", embedder=embedder) as store:
        short = store.add("Tea.", tenant="t")
        long = store.add(
            "The Lisbon trip budget is 50k euros for eight people, flights included; Marta books the hotel "
            "near Praça do Comércio and wants every receipt uploaded to the shared folder within a week.",
            tenant="t",
        )
        engine.warm([short, long])
        engine.clear_cache(prefixes=False)  # fragments now only in the store
        saved = engine.runner.costs
        try:
            engine.runner.costs = CostModel()
            for _ in range(20):  # 1 ms a token; many points, so the passes this call makes barely move it
                engine.runner.costs.observe_pass(1, 0.090)
                engine.runner.costs.observe_pass(30, 0.120)
            engine.runner.costs.observe_fetch(5, 0.020)  # a fetch costs what 20 tokens of a pass do
            messages = [{"role": "user", "content": "What do I drink?", "memories": [short, long]}]
            stats = engine.generate(messages, max_new_tokens=2, reuse="blend", recompute_ratio=0.0).stats
        finally:
            engine.runner.costs = saved
    assert stats.fragments_recomputed == 1 and stats.fragments_loaded == 1
    assert stats.recomputed_tokens == engine.count_tokens("Tea.\n")
    assert partition_holds(stats)


def test_clear_forgets_every_observation():
    costs = CostModel()
    for tokens in (1, 100):
        costs.observe_pass(tokens, tokens * 1e-6)
    costs.observe_fetch(50, 1.0)
    assert costs.recompute_cheaper(50)
    costs.clear()
    assert costs.pass_token_s() is None and costs.fetch_s(50) is None and not costs.recompute_cheaper(50)
