"""The index on a Qdrant server: many processes and machines share one collection (``docs/store.md``).

The same log replay and fusion as :class:`~.index.MemoryIndex`; the tenant (and session) filter
is part of every query, on a payload index. Keyword IDF is counted over the whole collection (a
server's statistics), not per tenant.

Several stores may share a server, and even a collection: each point carries its store's
identity (``store`` payload, and in its point id), every query, count and scroll is filtered
on it, and the sync state is one point per store, so a store never reads, counts, replaces or
deletes (``check()``, a rebuild) another's points.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..exceptions import InvalidInputError, StoreError
from .keywords import sparse_terms
from .log_follower import IndexHit, LogFollower, LogSource, fresh_state, parse_state
from .tiers import shown_url

if TYPE_CHECKING:
    from qdrant_client import QdrantClient

__all__ = ["QdrantIndex"]

_KEYWORDS = "keywords"  # the sparse vector's name; the dense one is Qdrant's unnamed default ""
_STORE = "store"  # the payload key of a point's store identity
# what a collection whose points name their store says of itself (a server also shows the
# payload index on ``store``; Qdrant's local mode, which keeps no payload index, only this)
_LAYOUT = "per-store"
_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")


class QdrantIndex(LogFollower):
    """A collection of one point per live memory on a Qdrant server, with tenant and session payload.

    :param location: the server's ``http(s)://`` URL.
    :param dimension: the embedder's vector size; ``embedder_name`` is recorded and checked so
        vectors of two different embedders are never compared.
    :param owner: the identity of the store this index serves (its points carry it).
    :param api_key: the server's API key (default: ``QDRANT_API_KEY`` from the environment, if set).
    :param collection_prefix: the collections are ``{prefix}_memories`` and ``{prefix}_sync_state``.
    :raises InvalidInputError: a malformed prefix or key; ``StoreError``: the server cannot be
        reached, or holds vectors of another embedder.
    """

    _BATCH = 256

    def __init__(
        self,
        location: str,
        dimension: int,
        embedder_name: str,
        *,
        source: LogSource,
        lock_timeout_s: float = 30.0,
        owner: str = "",
        api_key: str | None = None,
        collection_prefix: str = "kvshift",
    ) -> None:
        super().__init__(source, lock_timeout_s)
        if not isinstance(collection_prefix, str) or not _PREFIX.fullmatch(collection_prefix):
            raise InvalidInputError(
                f"collection_prefix must be 1 to 64 letters, digits, '_' or '-', got {collection_prefix!r}"
            )
        api_key = api_key if api_key is not None else os.environ.get("QDRANT_API_KEY") or None
        if api_key is not None and (not isinstance(api_key, str) or not api_key.isprintable() or not api_key.strip()):
            raise InvalidInputError("api_key must be printable text")
        self.location = shown_url(location)  # what messages and stats show; the client gets the whole URL
        self._url = location
        self.dimension = dimension
        self.embedder_name = embedder_name
        self.owner = owner
        self.collection = f"{collection_prefix}_memories"
        self._state_collection = f"{collection_prefix}_sync_state"
        self._state_point = str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvshift-state:{owner}"))
        self._api_key = api_key
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
            client = QdrantClient(url=self._url, api_key=self._api_key)
            self._ensure_collections(client)
        except StoreError:
            raise
        except Exception as exc:  # qdrant-client raises many types for one "cannot connect"
            raise StoreError(f"cannot open the Qdrant index at {self.location}: {exc}") from exc
        self._client = client

    def _ensure_collections(self, client: QdrantClient) -> None:
        from qdrant_client import models

        collection = self.collection
        if client.collection_exists(collection):
            info = client.get_collection(collection)
            per_store = _STORE in (info.payload_schema or {}) or (info.config.metadata or {}).get("layout") == _LAYOUT
            if _KEYWORDS not in (info.config.params.sparse_vectors or {}) or not per_store:
                # an index built before the keyword path, or before points named their store: it
                # is derived, so it is rebuilt from the log (every store's index notices its
                # points are gone and replays its own log)
                client.delete_collection(collection)
        if not client.collection_exists(collection):
            client.create_collection(
                collection,
                vectors_config=models.VectorParams(size=self.dimension, distance=models.Distance.COSINE),
                sparse_vectors_config={_KEYWORDS: models.SparseVectorParams(modifier=models.Modifier.IDF)},
                metadata={"embedder": self.embedder_name, "layout": _LAYOUT},
            )
            for key in (_STORE, "tenant", "session_id"):
                client.create_payload_index(collection, key, models.PayloadSchemaType.KEYWORD)
            # new points: a kept sync state belongs to points that are gone (a wiped server)
            if client.collection_exists(self._state_collection):
                client.delete_collection(self._state_collection)
        else:
            info = client.get_collection(collection)
            vectors = info.config.params.vectors  # one unnamed vector per point, as created above
            size = vectors.size if isinstance(vectors, models.VectorParams) else None
            embedder = (info.config.metadata or {}).get("embedder")
            if size != self.dimension or (embedder is not None and embedder != self.embedder_name):
                raise StoreError(
                    f"the index at {self.location} holds {size}-d vectors of {embedder!r}; "
                    f"this store embeds with {self.embedder_name!r} ({self.dimension}-d)"
                )
        if not client.collection_exists(self._state_collection):
            client.create_collection(
                self._state_collection, vectors_config=models.VectorParams(size=1, distance=models.Distance.DOT)
            )

    def _own(self, *conditions: Any) -> Any:
        """A filter on this store's points (and ``conditions``)."""
        from qdrant_client import models

        mine = models.FieldCondition(key=_STORE, match=models.MatchValue(value=self.owner))
        return models.Filter(must=[mine, *conditions])

    def _point_id(self, tenant: str, memory_id: str) -> str:
        # two stores holding the same ids (one restored from a copy of the other) keep apart
        return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvshift:{self.owner}:{len(tenant)}:{tenant}:{memory_id}"))

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
        query_filter = self._own(*conditions)  # the store and tenant filter is part of both queries
        client = self._client
        dense = client.query_points(
            self.collection, query=list(vector), query_filter=query_filter, limit=limit, with_payload=True
        ).points
        sparse = []
        indices, values = sparse_terms(terms)
        if indices and keyword_weight > 0:
            sparse = client.query_points(
                self.collection,
                query=models.SparseVector(indices=indices, values=values),
                using=_KEYWORDS,
                query_filter=query_filter,
                limit=limit,
                with_payload=True,
            ).points
        cosine = {str(p.id): float(p.score) for p in dense}
        missing = [str(p.id) for p in sparse if str(p.id) not in cosine]
        if missing:
            for point in client.retrieve(self.collection, ids=missing, with_vectors=[""]):
                stored = point.vector[""] if isinstance(point.vector, dict) else point.vector
                cosine[str(point.id)] = _cosine(vector, stored)
        keyword = {str(p.id): float(p.score) for p in sparse}
        hits = {}
        for point in [*dense, *sparse]:
            payload = point.payload or {}
            pid = str(point.id)
            # the filter already did this; a forged point cannot pass either
            if payload.get("tenant") != tenant or payload.get(_STORE) != self.owner or pid in hits:
                continue
            score = cosine.get(pid, 0.0) + keyword_weight * keyword.get(pid, 0.0)
            hits[pid] = IndexHit(tenant, str(payload.get("memory_id")), int(payload.get("version", 0)), score)
        return sorted(hits.values(), key=lambda hit: hit.score, reverse=True)[:limit]

    def count(self) -> int:
        with self._locked():
            self._open()
            return int(self._client.count(self.collection, count_filter=self._own()).count)

    def _upsert(
        self, pid: str, vector: Sequence[float], keywords: tuple[list[int], list[float]], payload: dict
    ) -> None:
        self._writes[pid] = (list(vector), keywords, {**payload, _STORE: self.owner})
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
            self._client.upsert(self.collection, points=upserts)
        if deletes:
            self._client.delete(self.collection, points_selector=models.PointIdsList(points=deletes))

    def _clear(self) -> None:
        """Remove this store's points and sync state; other stores' points stay."""
        from qdrant_client import models

        self._writes.clear()
        self._client.delete(self.collection, points_selector=models.FilterSelector(filter=self._own()))
        self._client.delete(self._state_collection, points_selector=models.PointIdsList(points=[self._state_point]))

    def _point_ids(self) -> list[str]:
        self._flush()
        ids: list[str] = []
        offset = None
        while True:
            points, offset = self._client.scroll(
                self.collection, scroll_filter=self._own(), limit=1000, offset=offset, with_payload=False
            )
            ids.extend(str(p.id) for p in points)
            if offset is None:
                return ids

    def _read_state(self) -> dict:
        found = self._client.retrieve(self._state_collection, ids=[self._state_point], with_payload=True)
        if not found:
            return fresh_state()
        return parse_state((found[0].payload or {}).get("state"))

    def _write_state(self, state: dict, applied_now: int) -> None:
        from qdrant_client import models

        self._client.upsert(
            self._state_collection,
            points=[models.PointStruct(id=self._state_point, vector=[1.0], payload={"state": json.dumps(state)})],
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
