"""A LlamaIndex ``BaseEmbedding`` as the memory store's embedder: memories as texts, searches as queries."""

from __future__ import annotations

import pytest
from llama_index.core.embeddings import BaseEmbedding

from kvshift_memory import MemoryStore
from kvshift_memory.embedding import MiniLMEmbedder

pytestmark = pytest.mark.model  # the bundled MiniLM

TEXTS = ["My sister Ana lives in Porto.", "The boiler was serviced in March.", "I am learning the cello."]
QUERIES: list[str] = []
MINILM = MiniLMEmbedder()


class _MiniLM(BaseEmbedding):
    """The bundled MiniLM behind LlamaIndex's interface, keeping the queries it was asked to embed."""

    def _get_text_embedding(self, text):
        return MINILM.embed([text])[0]

    def _get_query_embedding(self, query):
        QUERIES.append(query)
        return MINILM.embed([query])[0]

    async def _aget_query_embedding(self, query):
        return self._get_query_embedding(query)


def test_a_llama_index_embedding_serves_the_store(tmp_path):
    with MemoryStore(tmp_path / "store", embedder=_MiniLM(model_name="all-MiniLM-L6-v2")) as store:
        assert store.embedder.dimension == 384
        assert store.embedder.name.startswith("llama_index:") and store.embedder.name.endswith(":all-MiniLM-L6-v2")
        for text in TEXTS:
            store.add(text, tenant="alice")
        before = len(QUERIES)
        hits = store.search("Which city is my sister in?", tenant="alice", k=1)
        assert hits[0].text == TEXTS[0] and QUERIES[before:] == ["Which city is my sister in?"]
