"""MiniLMEmbedder: unit vectors, the recent-query memo, and forgetting it."""

from __future__ import annotations

import math

from kvshift_memory import MemoryStore


def _counting_forwards(embedder) -> tuple[list[int], object]:
    """Count the encoder's forward passes from now on."""
    model, _ = embedder._load()
    calls = [0]
    hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls, hook


def test_vectors_are_unit_length_and_repeat_queries_are_not_re_embedded(embedder):
    embedder.clear_cache()
    calls, hook = _counting_forwards(embedder)
    try:
        first = embedder.embed(["Where does my sister live?"])[0]
        again = embedder.embed(["Where does my sister live?"])[0]
        assert calls[0] == 1 and again == first
        assert math.isclose(sum(x * x for x in first), 1.0, rel_tol=1e-5)
        embedder.clear_cache()
        after = embedder.embed(["Where does my sister live?"])[0]
        assert calls[0] == 2  # forgotten: embedded again
        assert max(abs(a - b) for a, b in zip(after, first, strict=False)) < 1e-5
    finally:
        hook.remove()


def test_store_clear_cache_forgets_the_query_vectors_too(tmp_path, embedder):
    with MemoryStore(tmp_path / "store", embedder=embedder) as store:
        store.add("My sister Ana lives in Porto.", tenant="alice")
        calls, hook = _counting_forwards(embedder)
        try:
            store.search("Where does Ana live?", tenant="alice")
            store.search("Where does Ana live?", tenant="alice")
            assert calls[0] == 1
            store.clear_cache()
            store.search("Where does Ana live?", tenant="alice")
            assert calls[0] == 2
        finally:
            hook.remove()


def test_an_embedder_that_is_neither_kind_is_refused(tmp_path):
    """A framework's embeddings are tested with the integrations (importing the frameworks here
    would grow this process's object graph, and its garbage collections, for every later test)."""
    import pytest

    from kvshift_memory import InvalidInputError

    for not_an_embedder in (object(), "minilm", lambda texts: texts):
        with pytest.raises(InvalidInputError, match="LangChain Embeddings"):
            MemoryStore(tmp_path / "x", embedder=not_an_embedder)
