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


def _framework_embedders(embedder):
    """The bundled MiniLM behind a LangChain ``Embeddings`` and a LlamaIndex ``BaseEmbedding``,
    each counting its query calls (a question must be embedded as a query)."""
    from langchain_core.embeddings import Embeddings
    from llama_index.core.embeddings import BaseEmbedding

    queries: list[str] = []

    class LangChainMiniLM(Embeddings):
        model = "all-MiniLM-L6-v2"

        def embed_documents(self, texts):
            return embedder.embed(texts)

        def embed_query(self, text):
            queries.append(text)
            return embedder.embed([text])[0]

    class LlamaIndexMiniLM(BaseEmbedding):
        def _get_text_embedding(self, text):
            return embedder.embed([text])[0]

        def _get_query_embedding(self, query):
            queries.append(query)
            return embedder.embed([query])[0]

        async def _aget_query_embedding(self, query):
            return self._get_query_embedding(query)

    return [LangChainMiniLM(), LlamaIndexMiniLM(model_name="all-MiniLM-L6-v2")], queries


def test_a_langchain_or_llama_index_embedder_serves_the_store(tmp_path, embedder):
    texts = ["My sister Ana lives in Porto.", "The boiler was serviced in March.", "I am learning the cello."]
    frameworks, queries = _framework_embedders(embedder)
    names = set()
    for i, framework in enumerate(frameworks):
        with MemoryStore(tmp_path / str(i), embedder=framework) as store:
            assert store.embedder.dimension == 384
            for text in texts:
                store.add(text, tenant="alice")
            before = len(queries)
            hits = store.search("Which city is my sister in?", tenant="alice", k=1)
            assert hits[0].text == texts[0] and queries[before:] == ["Which city is my sister in?"]
            names.add(store.embedder.name)
    assert len(names) == 2 and all(name.endswith(":all-MiniLM-L6-v2") for name in names)


def test_an_embedder_that_is_neither_kind_or_answers_badly_is_refused(tmp_path):
    import pytest
    from langchain_core.embeddings import Embeddings

    from kvshift_memory import InvalidInputError, StoreError

    class Answers(Embeddings):
        def __init__(self, documents, query=(1.0, 0.0)):
            self.documents, self.query = documents, query

        def embed_documents(self, texts):
            return self.documents

        def embed_query(self, text):
            return list(self.query)

    for not_an_embedder in (object(), "minilm", lambda texts: texts):
        with pytest.raises(InvalidInputError, match="LangChain Embeddings"):
            MemoryStore(tmp_path / "x", embedder=not_an_embedder)
    for probe in ((), ("a", "b"), (float("nan"), 1.0)):
        with pytest.raises(StoreError):
            MemoryStore(tmp_path / "x", embedder=Answers([], probe))
    for documents in ([], [[1.0, 0.0], [0.0, 1.0]], [[1.0]], [[float("inf"), 0.0]], [["x", 1.0]], None):
        with MemoryStore(tmp_path / "y", embedder=Answers(documents)) as store:
            with pytest.raises(StoreError, match="embedder"):
                store.add("Ana lives in Porto.", tenant="alice")
            assert store.search("Porto", tenant="alice") == []  # nothing half-written
