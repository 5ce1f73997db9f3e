"""A LangChain ``Embeddings`` as the memory store's embedder: documents vs queries, bad answers refused."""

from __future__ import annotations

import pytest
from langchain_core.embeddings import Embeddings

from kvshift_memory import MemoryStore, StoreError
from kvshift_memory.embedding import MiniLMEmbedder

TEXTS = ["My sister Ana lives in Porto.", "The boiler was serviced in March.", "I am learning the cello."]


class _MiniLM(Embeddings):
    """The bundled MiniLM behind LangChain's interface, keeping the queries it was asked to embed."""

    model = "all-MiniLM-L6-v2"

    def __init__(self) -> None:
        self.minilm = MiniLMEmbedder()
        self.queries: list[str] = []

    def embed_documents(self, texts):
        return self.minilm.embed(texts)

    def embed_query(self, text):
        self.queries.append(text)
        return self.minilm.embed([text])[0]


def test_a_langchain_embeddings_serves_the_store(tmp_path):
    embeddings = _MiniLM()
    with MemoryStore(tmp_path / "store", embedder=embeddings) as store:
        assert store.embedder.dimension == 384
        assert store.embedder.name.startswith("langchain:") and store.embedder.name.endswith(":all-MiniLM-L6-v2")
        for text in TEXTS:
            store.add(text, tenant="alice")
        before = len(embeddings.queries)
        hits = store.search("Which city is my sister in?", tenant="alice", k=1)
        assert hits[0].text == TEXTS[0] and embeddings.queries[before:] == ["Which city is my sister in?"]


class _Answers(Embeddings):
    def __init__(self, documents, query=(1.0, 0.0)):
        self.documents, self.query = documents, query

    def embed_documents(self, texts):
        return self.documents

    def embed_query(self, text):
        return list(self.query)


def test_an_embeddings_that_answers_badly_is_refused_and_nothing_is_written(tmp_path):
    for probe in ((), ("a", "b"), (float("nan"), 1.0)):
        with pytest.raises(StoreError):
            MemoryStore(tmp_path / "x", embedder=_Answers([], probe))
    for documents in ([], [[1.0, 0.0], [0.0, 1.0]], [[1.0]], [[float("inf"), 0.0]], [["x", 1.0]], None):
        with MemoryStore(tmp_path / "y", embedder=_Answers(documents)) as store:
            with pytest.raises(StoreError, match="embedder"):
                store.add("Ana lives in Porto.", tenant="alice")
            assert store.search("Porto", tenant="alice") == []
