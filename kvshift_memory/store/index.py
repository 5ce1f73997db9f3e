"""The vector index: derived from the records in the KV tier and kept in step through its log.

Records (with their vectors) live in the KV tier; the index only maps vectors to memory ids so a
search can find them. Each point has two vectors, searched as two paths and fused: the dense
embedding (cosine), and a sparse vector of the memory's keywords weighted by inverse document
frequency (:mod:`.keywords`); a hit's score is its cosine similarity plus ``keyword_weight``
times its keyword score. Every write to a memory first appends ``(tenant, id, nonce)`` to the
tier's change log; ``sync`` replays the log from where the index stopped, making each named
memory's point match its current state (live version: upserted; superseded version, deletion:
removed). Replaying is idempotent, so a crash anywhere leaves an index that the next sync
repairs, and an add never waits for the index. An index whose log went backwards (the tier
emptied, or restored from an older snapshot: the last entry it applied is no longer where it
was) or whose points were lost starts again from the whole log, on its own.

Two kinds, one behaviour (:func:`open_index`):

- :class:`MemoryIndex`, in this process (a folder, the embedded default, or ``":memory:"``):
  NumPy arrays searched exactly, every tenant's points apart, so a search costs the same whoever
  else is stored. With a folder it starts from the folder's snapshot, one ``safetensors`` file it
  writes (arrays as tensors, points and sync state as JSON in its header) and replaces whole by a
  rename: nothing in it is unpickled, and no lock is held across processes (each has its own copy).
- :class:`~.qdrant_index.QdrantIndex`, ``http(s)://…``: a Qdrant server shared by many processes and machines
  (``docs/store.md``), filtered by a tenant payload index.

Keyword rarity is counted among the searching tenant's own memories (Qdrant's IDF formula), so
another tenant's words never move a score (:class:`MemoryIndex`; a Qdrant server counts over
its collection).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..exceptions import InvalidInputError, StoreError
from .keywords import sparse_terms
from .log_follower import IndexedState, IndexHit, LogFollower, LogSource, fresh_state, parse_state, point_id

if TYPE_CHECKING:
    from .qdrant_index import QdrantIndex

__all__ = ["IndexHit", "IndexedState", "MemoryIndex", "open_index"]

#: the start of a Qdrant index's collection names, unless a store gives its own
DEFAULT_COLLECTION_PREFIX = "kvshift"
_SNAPSHOT = "index.safetensors"
# a sync that brings this many log entries writes the folder's snapshot again (close() always does)
_SNAPSHOT_EVERY = 1024

logger = logging.getLogger("kvshift_memory.store")


def open_index(
    location: str | os.PathLike,
    dimension: int,
    embedder_name: str,
    *,
    source: LogSource,
    lock_timeout_s: float = 30.0,
    owner: Callable[[], str] | None = None,
    api_key: str | None = None,
    collection_prefix: str = DEFAULT_COLLECTION_PREFIX,
) -> MemoryIndex | QdrantIndex:
    """The index for ``location``: ``http(s)://…`` a Qdrant server, else this process's (a folder or ``":memory:"``).

    :param source: the store whose change log the index follows (it asks for it on each search).
    :param lock_timeout_s: how long a thread waits for another's sync or search of the index.
    :param owner: the store's identity, asked for only by a Qdrant index (its points carry it).
    :param api_key: the Qdrant server's API key; ``collection_prefix``: its collections' names' start.
    :raises InvalidInputError: Qdrant options for an index that is not on a Qdrant server, or
        malformed ones; ``StoreError``: the location cannot be used, or holds vectors of another embedder.
    """
    text = os.fspath(location)
    if text.startswith(("http://", "https://")):
        from .qdrant_index import QdrantIndex

        return QdrantIndex(
            text,
            dimension,
            embedder_name,
            source=source,
            lock_timeout_s=lock_timeout_s,
            owner=owner() if owner is not None else "",
            api_key=api_key,
            collection_prefix=collection_prefix,
        )
    if api_key is not None or collection_prefix != DEFAULT_COLLECTION_PREFIX:
        raise InvalidInputError("an API key and a collection prefix are for an index on a Qdrant server (http(s)://…)")
    return MemoryIndex(text, dimension, embedder_name, source=source, lock_timeout_s=lock_timeout_s)


class MemoryIndex(LogFollower):
    """This process's index: arrays searched exactly, starting from a folder's snapshot.

    :param location: a folder (its snapshot is read on first use and written on :meth:`close`
        and after large syncs) or ``":memory:"``.
    :param dimension: the embedder's vector size; ``embedder_name`` is recorded in the snapshot
        and checked, so vectors of two different embedders are never compared.
    :raises StoreError: the folder cannot be made, or its snapshot holds another embedder's vectors.
    """

    def __init__(
        self,
        location: str | os.PathLike,
        dimension: int,
        embedder_name: str,
        *,
        source: LogSource,
        lock_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(source, lock_timeout_s)
        self.location = os.fspath(location)
        self.dimension = dimension
        self.embedder_name = embedder_name
        self._folder: str | None = None if self.location == ":memory:" else self.location
        self._loaded = False
        self._unsaved = 0  # log entries applied since the folder's snapshot was written
        self._state = fresh_state()
        self._reset_points()
        if self._folder is not None:
            try:
                os.makedirs(self._folder, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot use {self._folder!r} as an index folder: {exc}") from exc
            header = _snapshot_header(os.path.join(self._folder, _SNAPSHOT))
            if header is not None and (header.get("dimension"), header.get("embedder")) != (dimension, embedder_name):
                raise StoreError(
                    f"the index at {self.location} holds {header.get('dimension')}-d vectors of "
                    f"{header.get('embedder')!r}; this store embeds with {embedder_name!r} ({dimension}-d)"
                )

    def _reset_points(self) -> None:
        self._rows: dict[str, int] = {}  # point id -> row
        self._free: list[int] = []
        self._vectors = np.zeros((0, self.dimension), dtype=np.float32)  # unit rows; zero where free
        self._tenant_of = np.zeros(0, dtype=np.int64)  # tenant code per row, -1 where free
        self._session_of = np.zeros(0, dtype=np.int64)  # session code per row, -1 for none
        self._codes: dict[str | None, int] = {}  # tenant and session strings -> codes
        self._payloads: list[dict | None] = []
        self._terms: list[dict[int, float]] = []
        # per tenant code: term -> {row: value}, and how many points it has (the IDF corpus)
        self._postings: dict[int, dict[int, dict[int, float]]] = {}
        self._counts: dict[int, int] = {}
        # per tenant code: its rows, so a search scores only the caller's own (their array made on demand)
        self._tenant_rows: dict[int, set[int]] = {}
        self._tenant_arrays: dict[int, np.ndarray] = {}
        #: rows whose vectors searches have scored (what a search costs, whoever else is stored)
        self.scored_rows = 0

    def _code(self, text: str | None) -> int:
        return self._codes.setdefault(text, len(self._codes))

    # ---------------------------------------------------------------- search

    def _search(
        self,
        vector: Sequence[float],
        tenant: str,
        session_id: str | None,
        limit: int,
        terms: Sequence[str],
        keyword_weight: float,
    ) -> list[IndexHit]:
        tenant_code = self._codes.get(tenant)
        if tenant_code is None or not self._tenant_rows.get(tenant_code):
            return []
        candidates = self._tenant_arrays.get(tenant_code)
        if candidates is None:
            candidates = self._tenant_arrays[tenant_code] = np.fromiter(
                sorted(self._tenant_rows[tenant_code]), dtype=np.int64
            )
        if session_id is not None:
            candidates = candidates[self._session_of[candidates] == self._codes.get(session_id, -2)]
        query = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(query))
        self.scored_rows += len(candidates)
        scores = self._vectors[candidates] @ (query / norm if norm else query)
        cosine = dict(zip(candidates.tolist(), scores.tolist(), strict=True))
        dense = sorted(cosine, key=lambda row: -cosine[row])[:limit]
        keyword: dict[int, float] = {}
        indices, values = sparse_terms(terms)
        if indices and keyword_weight > 0:
            keyword = self._keyword_scores(tenant_code, indices, values, cosine)
            keyword = dict(sorted(keyword.items(), key=lambda item: -item[1])[:limit])
        hits = {}
        for row in [*dense, *keyword]:
            if row not in hits:
                payload = self._payloads[row]
                score = cosine[row] + keyword_weight * keyword.get(row, 0.0)
                hits[row] = IndexHit(tenant, payload["memory_id"], payload["version"], score)
        return sorted(hits.values(), key=lambda hit: hit.score, reverse=True)[:limit]

    def _keyword_scores(
        self, tenant_code: int, indices: list[int], values: list[float], candidates: dict[int, float]
    ) -> dict[int, float]:
        """Rows among ``candidates`` sharing a term with the query, and their IDF-weighted overlap."""
        postings, corpus = self._postings.get(tenant_code, {}), self._counts.get(tenant_code, 0)
        scores: dict[int, float] = {}
        for term, value in zip(indices, values, strict=True):
            rows = postings.get(term)
            if not rows:
                continue
            weight = value * math.log((corpus - len(rows) + 0.5) / (len(rows) + 0.5) + 1)
            for row, stored in rows.items():
                if row in candidates:
                    scores[row] = scores.get(row, 0.0) + weight * stored
        return scores

    def count(self) -> int:
        with self._locked():
            self._open()
            return len(self._rows)

    # ---------------------------------------------------------------- points

    def _upsert(
        self, pid: str, vector: Sequence[float], keywords: tuple[list[int], list[float]], payload: dict
    ) -> None:
        dense = np.asarray(vector, dtype=np.float32)
        norm = float(np.linalg.norm(dense))
        dense = dense / norm if norm else dense
        terms = dict(zip(keywords[0], keywords[1], strict=True))
        row = self._rows.get(pid)
        if row is not None:
            if (
                self._payloads[row] == payload
                and self._terms[row] == terms
                and np.array_equal(self._vectors[row], dense)
            ):
                return  # already so: a replay or check() that changes nothing costs no rewrite
            self._drop_row(row)
        else:
            row = self._free.pop() if self._free else self._grow()
        self._rows[pid] = row
        tenant_code = self._code(payload["tenant"])
        self._vectors[row] = dense
        self._tenant_of[row] = tenant_code
        self._session_of[row] = -1 if payload["session_id"] is None else self._code(payload["session_id"])
        self._payloads[row] = payload
        self._terms[row] = terms
        postings = self._postings.setdefault(tenant_code, {})
        for term, value in terms.items():
            postings.setdefault(term, {})[row] = value
        self._counts[tenant_code] = self._counts.get(tenant_code, 0) + 1
        self._tenant_rows.setdefault(tenant_code, set()).add(row)
        self._tenant_arrays.pop(tenant_code, None)

    def _grow(self) -> int:
        row = len(self._payloads)
        if row == self._vectors.shape[0]:  # doubling: an add is amortised O(1)
            capacity = max(64, 2 * row)
            self._vectors = np.resize(self._vectors, (capacity, self.dimension))
            self._vectors[row:] = 0.0
            self._tenant_of = np.concatenate([self._tenant_of[:row], np.full(capacity - row, -1)])
            self._session_of = np.concatenate([self._session_of[:row], np.full(capacity - row, -1)])
        self._payloads.append(None)
        self._terms.append({})
        return row

    def _drop_row(self, row: int) -> None:
        tenant_code = int(self._tenant_of[row])
        postings = self._postings.get(tenant_code, {})
        for term in self._terms[row]:
            rows = postings.get(term)
            if rows is not None:
                rows.pop(row, None)
                if not rows:
                    del postings[term]
        self._counts[tenant_code] -= 1
        self._tenant_rows[tenant_code].discard(row)
        self._tenant_arrays.pop(tenant_code, None)
        self._vectors[row] = 0.0
        self._tenant_of[row] = -1
        self._session_of[row] = -1
        self._payloads[row] = None
        self._terms[row] = {}

    def _delete(self, pids: Sequence[str]) -> None:
        for pid in pids:
            row = self._rows.pop(pid, None)
            if row is not None:
                self._drop_row(row)
                self._free.append(row)

    def _flush(self) -> None:
        pass  # every write is in place already

    def _clear(self) -> None:
        self._reset_points()

    def _point_ids(self) -> list[str]:
        return list(self._rows)

    def _read_state(self) -> dict:
        return self._state

    def _write_state(self, state: dict, applied_now: int) -> None:
        self._state = state
        self._unsaved += applied_now
        if self._folder is not None and self._unsaved >= _SNAPSHOT_EVERY:
            self._save_snapshot()

    def _rebuilt(self) -> None:
        if self._folder is not None:
            self._save_snapshot()

    # ---------------------------------------------------------------- the folder's snapshot

    def _open(self) -> None:
        if not self._loaded:
            self._loaded = True
            if self._folder is not None:
                self._load_snapshot()

    def _load_snapshot(self) -> None:
        """Fill the index from the folder's snapshot; a missing or unreadable one leaves it empty
        (the log is then replayed whole: the snapshot only saves time)."""
        from safetensors import SafetensorError, safe_open

        assert self._folder is not None  # only an index in a folder has a snapshot
        path = os.path.join(self._folder, _SNAPSHOT)
        header = _snapshot_header(path)
        if header is None:
            return
        try:
            points = header["points"]
            with safe_open(path, framework="numpy") as snapshot:
                arrays = {
                    name: snapshot.get_tensor(name) for name in ("vectors", "term_starts", "terms", "term_values")
                }
            vectors, starts = arrays["vectors"], arrays["term_starts"]
            if (
                vectors.dtype != np.float32
                or vectors.shape != (len(points), self.dimension)
                or starts.shape != (len(points) + 1,)
            ):
                raise ValueError("arrays of the wrong shape")
            if not np.isfinite(vectors).all():
                raise ValueError("vectors that are not finite")
            for row, (pid, tenant, memory_id, version, session_id) in enumerate(points):
                payload = {"tenant": tenant, "memory_id": memory_id, "version": version, "session_id": session_id}
                if not (isinstance(tenant, str) and isinstance(memory_id, str) and isinstance(version, int)):
                    raise ValueError("a point without tenant, memory id or version")
                if session_id is not None and not isinstance(session_id, str):
                    raise ValueError("a point whose session is not text")
                if pid != point_id(tenant, memory_id):
                    raise ValueError("a point under another memory's id")
                span = slice(int(starts[row]), int(starts[row + 1]))
                keywords = (arrays["terms"][span].tolist(), arrays["term_values"][span].tolist())
                self._upsert(pid, vectors[row], keywords, payload)
            state = parse_state(json.dumps(header["state"]))
        except (SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError, MemoryError) as exc:
            logger.warning("ignoring the index snapshot %s (%s): replaying the log", path, exc)
            self._reset_points()
            return
        self._state = state

    def _save_snapshot(self) -> None:
        """Write the folder's snapshot whole, under a new name first (a reader never sees half of one)."""
        from safetensors.numpy import save_file

        assert self._folder is not None  # only an index in a folder has a snapshot
        rows = sorted(self._rows.items(), key=lambda item: item[1])
        points: list[list] = []
        starts: list[int] = [0]
        terms: list[int] = []
        values: list[float] = []
        for pid, row in rows:
            payload = self._payloads[row]
            assert payload is not None  # a row in use has its payload
            points.append([pid, payload["tenant"], payload["memory_id"], payload["version"], payload["session_id"]])
            terms.extend(self._terms[row])
            values.extend(self._terms[row].values())
            starts.append(len(terms))
        tensors: dict[str, np.ndarray] = {
            "vectors": np.ascontiguousarray(self._vectors[[row for _, row in rows]].reshape(len(rows), self.dimension)),
            "term_starts": np.asarray(starts, dtype=np.int64),
            "terms": np.asarray(terms, dtype=np.int64),
            "term_values": np.asarray(values, dtype=np.float32),
        }
        header = {"embedder": self.embedder_name, "dimension": self.dimension, "state": self._state, "points": points}
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
        with self._locked():
            if self._folder is not None and self._unsaved:
                self._save_snapshot()


def _snapshot_header(path: str) -> dict | None:
    """The JSON header of a snapshot file, or ``None`` when there is none or it is not one of ours."""
    from safetensors import SafetensorError, safe_open

    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("ignoring the index snapshot %s: %s", path, exc)
        return None
    if not stat.S_ISREG(status.st_mode):  # a FIFO would block the reader forever; a link may lead out
        logger.warning("ignoring the index snapshot %s: not a regular file", path)
        return None
    try:
        with safe_open(path, framework="numpy") as snapshot:
            header = json.loads((snapshot.metadata() or {})["kvshift_index"])
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("ignoring the index snapshot %s: %s", path, exc)
        return None
    return header if isinstance(header, dict) else None
