"""``KVShiftRetriever``: a LangChain retriever over one user's memories, whose documents carry markers.

RAG with reuse in LangChain's own terms: ``store.add_document(...)`` cuts a long text into
memories (their fragments encoded once), the retriever returns the ones nearest a query as
``Document`` objects whose ``page_content`` is the memory's text wrapped in its span marker, and a
chain that puts those documents into a human message for :class:`~langchain_kvshift.ChatKVShift`
(given the same store and user, and ``reuse="blend"``, or ``"auto"`` on a model whose
``auto_shifts`` is true) gets their stored K/V shifted into the prompt instead of prefilling them
(``docs/how-it-works.md``). Any other model sees the markers as text: strip them
with :func:`kvshift_memory.adapters.strip_markers` when the documents go elsewhere.
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from kvshift_memory import MemoryStore
from kvshift_memory.adapters import in_document_order, render_marker

__all__ = ["KVShiftRetriever"]


class KVShiftRetriever(BaseRetriever):
    """The ``k`` memories of ``user_id`` nearest a query, as marked documents.

    :param store: the user's :class:`~kvshift_memory.MemoryStore` (give the chat model the same).
    :param user_id: whose memories are searched (the tenant); no other user's are ever returned.
    :param k: how many documents at most.
    :param session_id: search only this session's memories (default: all of the user's).
    :param document_order: parts of one document (``add_document``) come in the document's order,
        each document where its best part ranks; ``False`` keeps the search's order.

    Each document's ``metadata`` holds ``id``, ``version``, ``score``, ``session_id`` and, for a
    part of a document, ``document``, ``part`` and ``source``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    store: MemoryStore = Field(exclude=True)
    user_id: str
    k: int = 4
    session_id: str | None = None
    document_order: bool = True

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        records = self.store.search(query, tenant=self.user_id, session_id=self.session_id, k=self.k)
        if self.document_order:
            records = in_document_order(records)
        return [Document(page_content=render_marker(record), metadata=_metadata(record)) for record in records]


def _metadata(record: Any) -> dict[str, Any]:
    metadata = {"id": record.id, "version": record.version, "score": record.score, "session_id": record.session_id}
    if record.document is not None:
        metadata.update(document=record.document, part=record.part, source=record.source)
    return metadata
