"""The vector index: Qdrant, derived from the records in the KV tier and kept in step through its log.

Records (with their vectors) live in the KV tier; the index only maps vectors to memory ids so a
search can find them. Each point has two vectors, searched as two paths and fused: the dense
embedding, and a sparse vector of the memory's keywords weighted by Qdrant's IDF
(:mod:`.keywords`); a hit's score is its cosine similarity plus ``keyword_weight`` times its
keyword score. Every write to a memory first appends ``(tenant, id, nonce)`` to the tier's change
log; :meth:`QdrantIndex.sync` replays the log from where this index stopped, making each named
memory's point match its current state (live version: upserted; superseded version, deletion:
removed). Replaying is idempotent, so a crash anywhere leaves an index that the next sync repairs,
and an add never waits for the index. An index whose log went backwards (the tier emptied, or
restored from an older snapshot: the last entry it applied is no longer where it was) or whose
points were lost starts again from the whole log, on its own.

Locations:

- a folder (the embedded default): an in-process Qdrant, loaded from the folder's snapshot (one
  ``safetensors`` file this index writes: vectors as tensors, points and sync state as JSON in its
  header) and brought up to date from the log. Nothing in the folder is unpickled (Qdrant's own
  local persistence would unpickle its rows) and no lock is held across processes: each process
  has its own copy, and a snapshot is replaced whole by a rename.
- ``http(s)://…``: a Qdrant server, for many processes and machines (DESIGN §8).
- ``:memory:``: a process-local index, rebuilt from the log on first use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
_SNAPSHOT = "index.safetensors"
# a sync that brings this many log entries writes the folder's snapshot again (close() always does)
_SNAPSHOT_EVERY = 1024

logger = logging.getLogger("kvshift_memory.store")


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

    :param location: a folder (its snapshot), an ``http(s)://`` URL or ``":memory:"``.
    :param dimension: the embedder's vector size; ``embedder_name`` is recorded and checked so
        vectors of two different embedders are never compared.
    :raises StoreError: the location cannot be opened, or holds vectors of another embedder.
    """

    def __init__(self, location: str | os.PathLike, dimension: int, embedder_name: str) -> None:
        self.location = os.fspath(location)
        self.dimension = dimension
        self.embedder_name = embedder_name
        self._remote = self.location.startswith(("http://", "https://"))
        self._folder = None if self._remote or self.location == ":memory:" else self.location
        self._client = None
        self._mutex = threading.RLock()
        # the sync state of an in-process index (a server's lives in its own collection)
        self._state: dict = _fresh_state()
        self._unsaved = 0  # log entries applied since the folder's snapshot was written
        if self._folder is not None:
            try:
                os.makedirs(self._folder, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot use {self._folder!r} as an index folder: {exc}") from exc
            snapshot = os.path.join(self._folder, _SNAPSHOT)
            if os.path.exists(snapshot):
                self._check_snapshot_embedder(snapshot)

    # ---------------------------------------------------------------- sessions

    @contextlib.contextmanager
    def _session(self) -> Iterator:
        """The client for one operation; one operation at a time in this process."""
        from qdrant_client import QdrantClient

        with self._mutex:
            if self._client is None:
                try:
                    client = QdrantClient(url=self.location) if self._remote else QdrantClient(":memory:")
                except Exception as exc:  # qdrant-client raises many types for one "cannot connect"
                    raise StoreError(f"cannot open the Qdrant index at {self.location}: {exc}") from exc
                self._ensure_collections(client)
                if self._folder is not None:
                    self._load_snapshot(client)
                self._client = client
            yield self._client

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
            if self._remote:  # local mode filters without payload indexes (and warns about them)
                client.create_payload_index(COLLECTION, "tenant", models.PayloadSchemaType.KEYWORD)
                client.create_payload_index(COLLECTION, "session_id", models.PayloadSchemaType.KEYWORD)
            # new points: whatever state was kept belongs to points that are gone (a wiped server)
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
        if self._remote and not client.collection_exists(_STATE_COLLECTION):
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
            if self._folder is not None:
                self._save_snapshot(client)
            return len(stray)

    def count(self) -> int:
        with self._session() as client:
            return int(client.count(COLLECTION).count)

    def _sync(self, client, read_log, state_of, also: Sequence[tuple[str, str]] = ()) -> set[tuple[str, str]]:
        """Reconcile the memories the log names since the last sync, the pending ones, and ``also``;
        returns them all. A log that no longer holds the last entry applied, where it was, is
        replayed whole into an emptied index."""
        state = self._read_state(client)
        entries = self._entries_since(state, read_log)
        if entries is None:
            logger.warning("the store's log went backwards (tier emptied or restored): rebuilding the index at %s", self.location)
            self._clear_points(client)
            state = _fresh_state()
            entries = read_log(0)
        todo = [(entry["tenant"], entry["id"], entry.get("at", 0.0)) for entry in state["pending"]]
        todo.extend((tenant, memory_id, time.time()) for tenant, memory_id in also)
        last = state["last"]
        for raw in entries:
            try:
                entry = json.loads(raw)
                todo.append((str(entry["tenant"]), str(entry["id"]), time.time()))
                last = entry.get("n") if isinstance(entry.get("n"), str) else None
            except (ValueError, KeyError, TypeError, AttributeError):
                last = None
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
            self._write_state(client, {"applied": state["applied"] + len(entries), "last": last, "pending": pending})
            self._unsaved += len(entries)
            if self._folder is not None and self._unsaved >= _SNAPSHOT_EVERY:
                self._save_snapshot(client)
        return set(first_seen)

    @staticmethod
    def _entries_since(state: dict, read_log) -> list[bytes] | None:
        """The log's entries past the last one applied; ``None`` when that entry is not where it was."""
        if state["applied"] == 0:
            return read_log(0)
        entries = read_log(state["applied"] - 1)
        if not entries:
            return None
        if state["last"] is not None:
            try:
                if json.loads(entries[0]).get("n") != state["last"]:
                    return None
            except (ValueError, AttributeError):
                return None
        return entries[1:]

    def _clear_points(self, client) -> None:
        client.delete_collection(COLLECTION)
        self._ensure_collections(client)

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
            payload = {"tenant": tenant, "memory_id": memory_id, "version": state.version, "session_id": state.session_id}
            indices, values = sparse_terms(state.keywords)
            batch.upsert(pid, list(state.vector), (indices, values), payload)
        return True

    def _read_state(self, client) -> dict:
        if not self._remote:
            return self._state
        found = client.retrieve(_STATE_COLLECTION, ids=[_STATE_POINT], with_payload=True)
        if not found:
            return _fresh_state()
        return _parse_state(found[0].payload.get("state") if found[0].payload else None)

    def _write_state(self, client, state: dict) -> None:
        if not self._remote:
            self._state = state
            return
        from qdrant_client import models

        client.upsert(
            _STATE_COLLECTION,
            points=[models.PointStruct(id=_STATE_POINT, vector=[1.0], payload={"state": json.dumps(state)})],
        )

    # ---------------------------------------------------------------- the folder's snapshot

    def _check_snapshot_embedder(self, path: str) -> None:
        header = _snapshot_header(path)
        if header is not None and (header.get("dimension"), header.get("embedder")) != (self.dimension, self.embedder_name):
            raise StoreError(
                f"the index at {self.location} holds {header.get('dimension')}-d vectors of "
                f"{header.get('embedder')!r}; this store embeds with {self.embedder_name!r} ({self.dimension}-d)"
            )

    def _load_snapshot(self, client) -> None:
        """Fill ``client`` from the folder's snapshot; a missing or unreadable one leaves it empty
        (the log is then replayed whole: the snapshot only saves time)."""
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self._folder, _SNAPSHOT)
        header = _snapshot_header(path)
        if header is None:
            return
        try:
            points = header["points"]
            with safe_open(path, framework="numpy") as snapshot:
                vectors = snapshot.get_tensor("vectors") if points else None
            if vectors is not None and (vectors.dtype.name != "float32" or vectors.shape != (len(points), self.dimension)):
                raise ValueError(f"vectors of shape {vectors.shape}")
            with _Batch(client) as batch:
                for row, (pid, payload, indices, values) in enumerate(points):
                    payload = {k: payload[k] for k in ("tenant", "memory_id", "version", "session_id")}
                    if not (isinstance(payload["tenant"], str) and isinstance(payload["memory_id"], str)):
                        raise ValueError("a point without tenant or memory id")
                    if str(uuid.UUID(pid)) != pid or pid != point_id(payload["tenant"], payload["memory_id"]):
                        raise ValueError("a point under another memory's id")
                    batch.upsert(pid, vectors[row].tolist(), ([int(i) for i in indices], [float(v) for v in values]), payload)
            state = _parse_state(json.dumps(header["state"]))
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the index snapshot %s (%s): replaying the log", path, exc)
            self._clear_points(client)
            return
        self._state = state

    def _save_snapshot(self, client) -> None:
        """Write the folder's snapshot whole, under a new name first (a reader never sees half of one)."""
        import numpy as np
        from safetensors.numpy import save_file

        points, vectors, offset = [], [], None
        while True:
            batch, offset = client.scroll(COLLECTION, limit=1000, offset=offset, with_payload=True, with_vectors=True)
            for point in batch:
                sparse = point.vector[_KEYWORDS]
                points.append([str(point.id), point.payload, list(sparse.indices), list(sparse.values)])
                vectors.append(point.vector[""])
            if offset is None:
                break
        header = {"embedder": self.embedder_name, "dimension": self.dimension, "state": self._state, "points": points}
        tensors = {"vectors": np.asarray(vectors, dtype=np.float32).reshape(len(vectors), self.dimension)}
        temporary = os.path.join(self._folder, f".{_SNAPSHOT}.{uuid.uuid4().hex}")
        try:
            save_file(tensors, temporary, metadata={"kvshift_index": json.dumps(header)})
            os.replace(temporary, os.path.join(self._folder, _SNAPSHOT))
        except OSError as exc:  # a snapshot only saves time: the log stays the source
            logger.warning("cannot write the index snapshot in %s: %s", self._folder, exc)
            with contextlib.suppress(OSError):
                os.remove(temporary)
            return
        self._unsaved = 0

    def close(self) -> None:
        with self._mutex:
            if self._client is not None:
                if self._folder is not None and self._unsaved:
                    self._save_snapshot(self._client)
                self._client.close()
                self._client = None


def _fresh_state() -> dict:
    return {"applied": 0, "last": None, "pending": []}


def _parse_state(raw: object) -> dict:
    """A sync state read back; anything malformed is the fresh state (replaying the whole log is always correct)."""
    try:
        state = json.loads(raw)  # type: ignore[arg-type]
        last = state.get("last")
        pending = [
            {"tenant": str(p["tenant"]), "id": str(p["id"]), "at": float(p.get("at", 0.0))} for p in state["pending"]
        ]
        return {"applied": max(0, int(state["applied"])), "last": last if isinstance(last, str) else None, "pending": pending}
    except (ValueError, KeyError, TypeError, AttributeError):
        return _fresh_state()


def _snapshot_header(path: str) -> dict | None:
    """The JSON header of a snapshot file, or ``None`` when there is none or it is not one of ours."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="numpy") as snapshot:
            header = json.loads((snapshot.metadata() or {})["kvshift_index"])
    except FileNotFoundError:
        return None
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the index snapshot %s: %s", path, exc)
        return None
    return header if isinstance(header, dict) else None


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

    def upsert(self, pid: str, vector: list[float], keywords: tuple[list[int], list[float]], payload: dict) -> None:
        self._writes[pid] = (vector, keywords, payload)
        if len(self._writes) >= self._SIZE:
            self.flush()

    def delete(self, pid: str) -> None:
        self._writes[pid] = None
        if len(self._writes) >= self._SIZE:
            self.flush()

    def flush(self) -> None:
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
