"""The index on a Qdrant server: many processes and machines share one collection (``docs/store.md``).

The same log replay and fusion as :class:`~.index.MemoryIndex`; the tenant (and session) filter
is part of every query, on a payload index. Keyword IDF is counted over the whole collection (a
server's statistics), not per tenant.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any

from ..exceptions import StoreError
from .keywords import sparse_terms
from .log_follower import IndexHit, LogFollower, fresh_state, parse_state

__all__ = ["QdrantIndex"]

COLLECTION = "kvshift_memories"
_KEYWORDS = "keywords"  # the sparse vector's name; the dense one is Qdrant's unnamed default ""
_STATE_COLLECTION = "kvshift_sync_state"
_STATE_POINT = str(uuid.UUID(int=1))


class QdrantIndex(LogFollower):
    """A collection of one point per live memory on a Qdrant server, with tenant and session payload.

    :param location: the server's ``http(s)://`` URL.
    :param dimension: the embedder's vector size; ``embedder_name`` is recorded and checked so
        vectors of two different embedders are never compared.
    :raises StoreError: the server cannot be reached, or holds vectors of another embedder.
    """

    _BATCH = 256

    def __init__(self, location: str, dimension: int, embedder_name: str, *, lock_timeout_s: float = 30.0) -> None:
        super().__init__(lock_timeout_s)
        self.location = location
        self.dimension = dimension
        self.embedder_name = embedder_name
        # a QdrantClient once opened; typed loosely: qdrant-client is an optional dependency
        self._client: Any = None
        self._writes: dict[str, tuple | None] = {}

    def _open(self) -> None:
        if self._client is not None:
            return
        try:
            from qdrant_client import QdrantClient
        except ImportError:
            raise StoreError(
                "an index on a Qdrant server needs qdrant-client: pip install 'kvshift-memory[qdrant]'"
            ) from None
        try:
            client = QdrantClient(url=self.location)
            self._ensure_collections(client)
        except StoreError:
            raise
        except Exception as exc:  # qdrant-client raises many types for one "cannot connect"
            raise StoreError(f"cannot open the Qdrant index at {self.location}: {exc}") from exc
        self._client = client

    def _ensure_collections(self, client) -> None:
        from qdrant_client import models

        if client.collection_exists(COLLECTION) and _KEYWORDS not in (
            client.get_collection(COLLECTION).config.params.sparse_vectors or {}
        ):
            # an index built before the keyword path: it is derived, so rebuild it from the log
            client.delete_collection(COLLECTION)
        if not client.collection_exists(COLLECTION):
            client.create_collection(
                COLLECTION,
                vectors_config=models.VectorParams(size=self.dimension, distance=models.Distance.COSINE),
                sparse_vectors_config={_KEYWORDS: models.SparseVectorParams(modifier=models.Modifier.IDF)},
                metadata={"embedder": self.embedder_name},
            )
            client.create_payload_index(COLLECTION, "tenant", models.PayloadSchemaType.KEYWORD)
            client.create_payload_index(COLLECTION, "session_id", models.PayloadSchemaType.KEYWORD)
            # new points: a kept sync state belongs to points that are gone (a wiped server)
            if client.collection_exists(_STATE_COLLECTION):
                client.delete_collection(_STATE_COLLECTION)
        else:
            info = client.get_collection(COLLECTION)
            size = info.config.params.vectors.size
            embedder = (info.config.metadata or {}).get("embedder")
            if size != self.dimension or (embedder is not None and embedder != self.embedder_name):
                raise StoreError(
                    f"the index at {self.location} holds {size}-d vectors of {embedder!r}; "
                    f"this store embeds with {self.embedder_name!r} ({self.dimension}-d)"
                )
        if not client.collection_exists(_STATE_COLLECTION):
            client.create_collection(
                _STATE_COLLECTION, vectors_config=models.VectorParams(size=1, distance=models.Distance.DOT)
            )

    def _search(
        self,
        vector: Sequence[float],
        tenant: str,
        session_id: str | None,
        limit: int,
        terms: Sequence[str],
        keyword_weight: float,
    ) -> list[IndexHit]:
        from qdrant_client import models

        conditions: list[Any] = [models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))]
        if session_id is not None:
            conditions.append(models.FieldCondition(key="session_id", match=models.MatchValue(value=session_id)))
        query_filter = models.Filter(must=conditions)  # the tenant filter is part of both queries
        client = self._client
        dense = client.query_points(
            COLLECTION, query=list(vector), query_filter=query_filter, limit=limit, with_payload=True
        ).points
        sparse = []
        indices, values = sparse_terms(terms)
        if indices and keyword_weight > 0:
            sparse = client.query_points(
                COLLECTION,
                query=models.SparseVector(indices=indices, values=values),
                using=_KEYWORDS,
                query_filter=query_filter,
                limit=limit,
                with_payload=True,
            ).points
        cosine = {str(p.id): float(p.score) for p in dense}
        missing = [str(p.id) for p in sparse if str(p.id) not in cosine]
        if missing:
            for point in client.retrieve(COLLECTION, ids=missing, with_vectors=[""]):
                stored = point.vector[""] if isinstance(point.vector, dict) else point.vector
                cosine[str(point.id)] = _cosine(vector, stored)
        keyword = {str(p.id): float(p.score) for p in sparse}
        hits = {}
        for point in [*dense, *sparse]:
            payload = point.payload or {}
            pid = str(point.id)
            if (
                payload.get("tenant") != tenant or pid in hits
            ):  # the filter already did this; a forged point cannot pass either
                continue
            score = cosine.get(pid, 0.0) + keyword_weight * keyword.get(pid, 0.0)
            hits[pid] = IndexHit(tenant, str(payload.get("memory_id")), int(payload.get("version", 0)), score)
        return sorted(hits.values(), key=lambda hit: hit.score, reverse=True)[:limit]

    def count(self) -> int:
        with self._locked():
            self._open()
            return int(self._client.count(COLLECTION).count)

    def _upsert(
        self, pid: str, vector: Sequence[float], keywords: tuple[list[int], list[float]], payload: dict
    ) -> None:
        self._writes[pid] = (list(vector), keywords, payload)
        if len(self._writes) >= self._BATCH:
            self._flush()

    def _delete(self, pids: Sequence[str]) -> None:
        for pid in pids:
            self._writes[pid] = None
        if len(self._writes) >= self._BATCH:
            self._flush()

    def _flush(self) -> None:
        """Send the gathered writes (a point written twice ends as its last write said)."""
        from qdrant_client import models

        upserts = [
            models.PointStruct(
                id=pid,
                vector={"": w[0], _KEYWORDS: models.SparseVector(indices=w[1][0], values=w[1][1])},
                payload=w[2],
            )
            for pid, w in self._writes.items()
            if w
        ]
        deletes: list[Any] = [pid for pid, write in self._writes.items() if write is None]
        self._writes.clear()
        if upserts:
            self._client.upsert(COLLECTION, points=upserts)
        if deletes:
            self._client.delete(COLLECTION, points_selector=models.PointIdsList(points=deletes))

    def _clear(self) -> None:
        self._writes.clear()
        self._client.delete_collection(COLLECTION)
        self._ensure_collections(self._client)

    def _point_ids(self) -> list[str]:
        self._flush()
        ids: list[str] = []
        offset = None
        while True:
            points, offset = self._client.scroll(COLLECTION, limit=1000, offset=offset, with_payload=False)
            ids.extend(str(p.id) for p in points)
            if offset is None:
                return ids

    def _read_state(self) -> dict:
        found = self._client.retrieve(_STATE_COLLECTION, ids=[_STATE_POINT], with_payload=True)
        if not found:
            return fresh_state()
        return parse_state((found[0].payload or {}).get("state"))

    def _write_state(self, state: dict, applied_now: int) -> None:
        from qdrant_client import models

        self._client.upsert(
            _STATE_COLLECTION,
            points=[models.PointStruct(id=_STATE_POINT, vector=[1.0], payload={"state": json.dumps(state)})],
        )

    def _rebuilt(self) -> None:
        self._flush()

    def close(self) -> None:
        with self._locked():
            if self._client is not None:
                self._client.close()
                self._client = None


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0
