"""``KVShiftRetriever``: a LlamaIndex retriever over one user's memories, whose nodes carry markers.

RAG with reuse in LlamaIndex's own terms: ``store.add_document(...)`` cuts a long text into
memories (their fragments encoded once), the retriever returns the ones nearest a query as nodes
whose text is the memory wrapped in its span marker, and a query engine over
``llama_index.llms.kvshift.KVShiftLLM`` (given the same store and user, and ``reuse="blend"``, or
``"auto"`` on a model whose ``auto_shifts`` is true) that puts them into the user message gets their
stored K/V shifted into the prompt instead of prefilling them (``docs/how-it-works.md``). Markers
in a *system* message are read as text (a chat engine that writes its context there gets no reuse
from them).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from kvshift_memory import MemoryStore
from kvshift_memory.adapters import in_document_order, render_marker

__all__ = ["KVShiftRetriever"]


class KVShiftRetriever(BaseRetriever):
    """The ``k`` memories of ``user_id`` nearest a query, as marked nodes.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the LLM the same).
    :param user_id: whose memories are searched (the tenant); no other user's are ever returned.
    :param k: how many nodes at most.
    :param session_id: search only this session's memories (default: all of the user's).
    :param document_order: parts of one document (``add_document``) come in the document's order,
        each document where its best part ranks; ``False`` keeps the search's order.

    Each node's id is the memory's ``id@version``; its ``metadata`` holds ``id``, ``version``,
    ``session_id`` and, for a part of a document, ``document``, ``part`` and ``source``.
    """

    def __init__(
        self,
        store: MemoryStore,
        user_id: str,
        *,
        k: int = 4,
        session_id: str | None = None,
        document_order: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.store = store
        self.user_id = user_id
        self.k = k
        self.session_id = session_id
        self.document_order = document_order

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        records = self.store.search(query_bundle.query_str, tenant=self.user_id, session_id=self.session_id, k=self.k)
        if self.document_order:
            records = in_document_order(records)
        return [
            NodeWithScore(
                node=TextNode(
                    id_=f"{record.id}@{record.version}",
                    text=render_marker(record),
                    metadata=_metadata(record),
                    # the marker is the text the LLM must receive: no metadata written around it
                    excluded_llm_metadata_keys=list(_metadata(record)),
                    excluded_embed_metadata_keys=list(_metadata(record)),
                ),
                score=record.score,
            )
            for record in records
        ]


def _metadata(record: Any) -> dict[str, Any]:
    metadata = {"id": record.id, "version": record.version, "session_id": record.session_id}
    if record.document is not None:
        metadata.update(document=record.document, part=record.part, source=record.source)
    return metadata
