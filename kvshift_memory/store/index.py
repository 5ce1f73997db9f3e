"""The vector index: Qdrant, derived from the records in the KV tier and kept in step through its log.

Records (with their vectors) live in the KV tier; the index only maps vectors to memory ids so a
search can find them. Each point has two vectors, searched as two paths and fused: the dense
embedding, and a sparse vector of the memory's keywords weighted by Qdrant's IDF
(:mod:`.keywords`); a hit's score is its cosine similarity plus ``keyword_weight`` times its
keyword score. Every write to a memory first appends ``(tenant, id)`` to the tier's change
log; :meth:`QdrantIndex.sync` replays the log from where this index stopped, making each named
memory's point match its current state (live version: upserted; superseded version, deletion:
removed). Replaying is idempotent, so a crash anywhere leaves an index that the next sync repairs,
and an add never waits for the index.

Locations:

- a folder (the embedded default): ``QdrantClient(path=...)``. Qdrant's local mode lets one
  client at a time open a folder, so this index opens it under an inter-process file lock, keeps
  it for ``hold_s`` after the last operation (a burst of searches pays for one open) and then
  closes it; processes sharing a store folder take turns.
- ``http(s)://…``: a Qdrant server, for many processes and machines (DESIGN §8).
- ``:memory:``: a process-local index, rebuilt from the log on first use.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from filelock import FileLock

from ..exceptions import StoreError
from .keywords import sparse_terms

__all__ = ["IndexHit", "QdrantIndex"]

COLLECTION = "kvshift_memories"
_KEYWORDS = "keywords"  # the sparse vector's name; the dense one is Qdrant's unnamed default ""
_STATE_COLLECTION = "kvshift_sync_state"
_STATE_POINT = str(uuid.UUID(int=1))
# An entry whose memory has no head yet is an add in flight (intent logged, head not written);
# after this long it is an add that was killed, and nothing was stored.
_PENDING_GRACE_S = 60.0


@dataclass(frozen=True)
class IndexHit:
    tenant: str
    memory_id: str
    version: int
    score: float


@dataclass(frozen=True)
class IndexedState:
    """What a memory's point should be after a sync: ``None`` vector means "no point"."""

    version: int
    session_id: str | None
    vector: Sequence[float] | None
    keywords: Sequence[str] = ()


def point_id(tenant: str, memory_id: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvshift:{len(tenant)}:{tenant}:{memory_id}"))


class QdrantIndex:
    """A Qdrant collection of one vector per live memory, with tenant and session payload.

    :param location: a folder, an ``http(s)://`` URL or ``":memory:"``.
    :param dimension: the embedder's vector size; ``embedder_name`` is recorded and checked so
        vectors of two different embedders are never compared.
    :param hold_s: how long a folder stays open (and locked to this process) after an operation.
    :raises StoreError: the location cannot be opened, or holds vectors of another embedder.
    """

    def __init__(self, location: str | os.PathLike, dimension: int, embedder_name: str, *, hold_s: float = 1.0) -> None:
        self.location = os.fspath(location)
        self.dimension = dimension
        self.embedder_name = embedder_name
        self._remote = self.location.startswith(("http://", "https://"))
        self._client = None  # a server's or an in-process index's client
        self._lease: _FolderLease | None = None
        self._mutex = threading.RLock()
        self._verified = None  # the client this index last checked its collections in
        if not (self._remote or self.location == ":memory:"):
            self._lease = _FolderLease.of(self.location, hold_s)

    # ---------------------------------------------------------------- sessions

    @contextlib.contextmanager
    def _session(self) -> Iterator:
        """The client for one operation (for a folder, lent by the folder's lease)."""
        if self._lease is not None:
            with self._lease.client() as client:
                self._verify(client)
                yield client
            return
        from qdrant_client import QdrantClient

        with self._mutex:
            if self._client is None:
                try:
                    self._client = QdrantClient(url=self.location) if self._remote else QdrantClient(":memory:")
                except Exception as exc:  # qdrant-client raises many types for one "cannot connect"
                    raise StoreError(f"cannot open the Qdrant index at {self.location}: {exc}") from exc
            self._verify(self._client)
            yield self._client

    def _verify(self, client) -> None:
        if self._verified is not client:
            self._ensure_collections(client)
            self._verified = client

    def _ensure_collections(self, client) -> None:
        from qdrant_client import models

        if client.collection_exists(COLLECTION) and _KEYWORDS not in (
            client.get_collection(COLLECTION).config.params.sparse_vectors or {}
        ):
            # an index built before the keyword path: it is derived, so rebuild it from the log
            client.delete_collection(COLLECTION)
            client.delete_collection(_STATE_COLLECTION)
        if not client.collection_exists(COLLECTION):
            client.create_collection(
                COLLECTION,
                vectors_config=models.VectorParams(size=self.dimension, distance=models.Distance.COSINE),
                sparse_vectors_config={_KEYWORDS: models.SparseVectorParams(modifier=models.Modifier.IDF)},
                metadata={"embedder": self.embedder_name},
            )
            if self._remote:  # local mode filters without payload indexes (and warns about them)
                client.create_payload_index(COLLECTION, "tenant", models.PayloadSchemaType.KEYWORD)
                client.create_payload_index(COLLECTION, "session_id", models.PayloadSchemaType.KEYWORD)
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

    # ---------------------------------------------------------------- sync and search

    def search(
        self,
        vector: Sequence[float],
        tenant: str,
        session_id: str | None,
        limit: int,
        read_log: Callable[[int], list[bytes]],
        state_of: Callable[[str, str], IndexedState | None],
        *,
        terms: Sequence[str] = (),
        keyword_weight: float = 0.0,
    ) -> list[IndexHit]:
        """Bring the index up to date with the log, then the ``limit`` best memories of ``tenant``.

        Both paths fetch ``limit`` candidates; a candidate found by one path only gets the other
        path's score too (its stored vector is read back; a keyword score absent from a list
        shorter than ``limit`` is zero, and at most the list's lowest otherwise, taken as zero).
        The tenant (and session, when given) filter is part of both queries: another tenant's
        points are never candidates.
        """
        from qdrant_client import models

        conditions = [models.FieldCondition(key="tenant", match=models.MatchValue(value=tenant))]
        if session_id is not None:
            conditions.append(models.FieldCondition(key="session_id", match=models.MatchValue(value=session_id)))
        query_filter = models.Filter(must=conditions)
        with self._session() as client:
            self._sync(client, read_log, state_of)
            dense = client.query_points(COLLECTION, query=list(vector), query_filter=query_filter, limit=limit, with_payload=True).points
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
            if payload.get("tenant") != tenant or pid in hits:  # the filter already did this; a forged point cannot pass either
                continue
            score = cosine.get(pid, 0.0) + keyword_weight * keyword.get(pid, 0.0)
            hits[pid] = IndexHit(tenant, str(payload.get("memory_id")), int(payload.get("version", 0)), score)
        return sorted(hits.values(), key=lambda hit: hit.score, reverse=True)[:limit]

    def sync(self, read_log: Callable[[int], list[bytes]], state_of: Callable[[str, str], IndexedState | None]) -> int:
        """Replay the log; returns how many memories were reconciled."""
        with self._session() as client:
            return len(self._sync(client, read_log, state_of))

    def rebuild(
        self,
        memories: Iterator[tuple[str, str]],
        read_log: Callable[[int], list[bytes]],
        state_of: Callable[[str, str], IndexedState | None],
    ) -> int:
        """Replay the log and reconcile every given memory in one pass, then drop points of memories
        neither names (``check()``); returns how many points were dropped."""
        from qdrant_client import models

        memories = list(memories)
        with self._session() as client:
            # a memory added while check() ran is in the log, not in ``memories``: it is no stray
            named = self._sync(client, read_log, state_of, also=memories)
            wanted = {point_id(tenant, memory_id) for tenant, memory_id in named}
            stray, offset = [], None
            while True:
                points, offset = client.scroll(COLLECTION, limit=1000, offset=offset, with_payload=False)
                stray.extend(str(p.id) for p in points if str(p.id) not in wanted)
                if offset is None:
                    break
            if stray:
                client.delete(COLLECTION, points_selector=models.PointIdsList(points=stray))
            return len(stray)

    def count(self) -> int:
        with self._session() as client:
            return int(client.count(COLLECTION).count)

    def _sync(self, client, read_log, state_of, also: Sequence[tuple[str, str]] = ()) -> set[tuple[str, str]]:
        """Reconcile the memories the log names since the last sync, the pending ones, and ``also``;
        returns them all."""
        from qdrant_client import models

        state = self._read_state(client)
        entries = read_log(state["applied"])
        todo = [(entry["tenant"], entry["id"], entry.get("at", 0.0)) for entry in state["pending"]]
        todo.extend((tenant, memory_id, time.time()) for tenant, memory_id in also)
        for raw in entries:
            try:
                entry = json.loads(raw)
                todo.append((str(entry["tenant"]), str(entry["id"]), time.time()))
            except (ValueError, KeyError, TypeError):
                continue  # a damaged log entry names nothing; check() rebuilds from the records
        first_seen: dict[tuple[str, str], float] = {}
        for tenant, memory_id, seen_at in todo:
            first_seen.setdefault((tenant, memory_id), seen_at)
        pending = []
        with _Batch(client) as batch:
            for (tenant, memory_id), seen_at in first_seen.items():
                if not self._reconcile(batch, tenant, memory_id, state_of) and time.time() - seen_at < _PENDING_GRACE_S:
                    pending.append({"tenant": tenant, "id": memory_id, "at": seen_at})
        if entries or pending != state["pending"]:
            new_state = {"applied": state["applied"] + len(entries), "pending": pending}
            client.upsert(
                _STATE_COLLECTION,
                points=[models.PointStruct(id=_STATE_POINT, vector=[1.0], payload={"state": json.dumps(new_state)})],
            )
        return set(first_seen)

    @staticmethod
    def _reconcile(batch: _Batch, tenant: str, memory_id: str, state_of) -> bool:
        """Make this memory's point match its state; ``False`` when it has no state yet (add in flight)."""
        state = state_of(tenant, memory_id)
        if state is None:
            return False
        pid = point_id(tenant, memory_id)
        if state.vector is None:
            batch.delete(pid)
        else:
            from qdrant_client import models

            payload = {"tenant": tenant, "memory_id": memory_id, "version": state.version, "session_id": state.session_id}
            indices, values = sparse_terms(state.keywords)
            vectors = {"": list(state.vector), _KEYWORDS: models.SparseVector(indices=indices, values=values)}
            batch.upsert(pid, vectors, payload)
        return True

    @staticmethod
    def _read_state(client) -> dict:
        found = client.retrieve(_STATE_COLLECTION, ids=[_STATE_POINT], with_payload=True)
        if not found:
            return {"applied": 0, "pending": []}
        try:
            state = json.loads(found[0].payload["state"])
            return {"applied": int(state["applied"]), "pending": list(state["pending"])}
        except (ValueError, KeyError, TypeError):
            return {"applied": 0, "pending": []}  # replaying the whole log is always correct

    def close(self) -> None:
        if self._lease is not None:
            self._lease.release()
        with self._mutex:
            if self._client is not None:
                self._client.close()
                self._client = None


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5
    return dot / norm if norm else 0.0


class _Batch:
    """Point writes gathered and sent a few hundred at a time (one call per point is slow in local mode).

    A point both deleted and upserted in one batch ends as the last write said: each write
    replaces the pending one of its point.
    """

    _SIZE = 256

    def __init__(self, client) -> None:
        self._client = client
        self._writes: dict[str, tuple | None] = {}

    def upsert(self, pid: str, vector: dict, payload: dict) -> None:
        self._writes[pid] = (vector, payload)
        if len(self._writes) >= self._SIZE:
            self.flush()

    def delete(self, pid: str) -> None:
        self._writes[pid] = None
        if len(self._writes) >= self._SIZE:
            self.flush()

    def flush(self) -> None:
        from qdrant_client import models

        upserts = [models.PointStruct(id=pid, vector=w[0], payload=w[1]) for pid, w in self._writes.items() if w]
        deletes = [pid for pid, write in self._writes.items() if write is None]
        if upserts:
            self._client.upsert(COLLECTION, points=upserts)
        if deletes:
            self._client.delete(COLLECTION, points_selector=models.PointIdsList(points=deletes))
        self._writes.clear()

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.flush()


class _FolderLease:
    """This process's turn at one local Qdrant folder, shared by every index opened on it here.

    Qdrant's local mode admits one client per folder, across processes (a file lock) and within
    one (a thread lock). The folder stays open for ``hold_s`` after the last operation, so a burst
    of searches opens it once; then it is closed and another process may take it.
    """

    _leases: weakref.WeakValueDictionary[str, _FolderLease] = weakref.WeakValueDictionary()
    _registry_lock = threading.Lock()

    @classmethod
    def of(cls, folder: str, hold_s: float) -> _FolderLease:
        path = os.path.realpath(folder)
        with cls._registry_lock:
            lease = cls._leases.get(path)
            if lease is None:
                lease = cls._leases[path] = cls(path, hold_s)
            return lease

    def __init__(self, path: str, hold_s: float) -> None:
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.hold_s = hold_s
        # released by a timer thread, so not a per-thread lock
        self._file_lock = FileLock(os.path.join(path, ".kvshift.lock"), thread_local=False)
        self._mutex = threading.RLock()
        self._client = None
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def client(self) -> Iterator:
        from qdrant_client import QdrantClient

        with self._mutex:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._client is None:
                self._file_lock.acquire()
                try:
                    self._client = QdrantClient(path=self.path)
                except Exception as exc:  # qdrant-client raises many types for one "cannot open"
                    self._file_lock.release()
                    raise StoreError(f"cannot open the Qdrant index folder {self.path}: {exc}") from exc
            try:
                yield self._client
            finally:
                if self.hold_s > 0:
                    self._timer = threading.Timer(self.hold_s, self.release)
                    self._timer.daemon = True
                    self._timer.start()
                else:
                    self.release()

    def release(self) -> None:
        """Close the folder now and let other processes have it."""
        with self._mutex:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._client is not None:
                self._client.close()
                self._client = None
                self._file_lock.release()
