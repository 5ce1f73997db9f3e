"""Following the tier's change log: what every kind of index shares (see :mod:`.index`).

Every write to a memory first appends ``(tenant, id, nonce)`` to the tier's log; an index replays
the log from where it stopped, making each named memory's point match its current state.
Replaying is idempotent, and a log that went backwards is replayed whole.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..exceptions import StoreBusyError
from .keywords import sparse_terms

__all__ = [
    "IndexHit",
    "IndexedState",
    "LogFollower",
    "LogSource",
    "PENDING_GRACE_S",
    "entries_since",
    "fresh_state",
    "parse_state",
    "point_id",
]

# An entry whose memory has no head yet is an add in flight (intent logged, head not written);
# after this long it is an add that was killed, and nothing was stored.
PENDING_GRACE_S = 60.0

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


class LogSource(Protocol):
    """Where an index learns what to hold: the memory store, handed to the index once, when it opens."""

    def read_log(self, start: int) -> list[bytes]:
        """The change log from entry ``start`` on."""
        ...

    def index_state(self, tenant: str, memory_id: str) -> IndexedState | None:
        """What the index should hold for a memory; ``None`` for a memory with no head (yet)."""
        ...


def point_id(tenant: str, memory_id: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvshift:{len(tenant)}:{tenant}:{memory_id}"))


class LogFollower(ABC):
    """What both kinds share: replaying the tier's log into points, with the sync state kept aside.

    A subclass stores points (``_upsert``, ``_delete``, ``_clear``, ``_point_ids``) and the sync
    state (``_read_state``, ``_write_state``); every method runs under :meth:`_locked`.

    :param source: the store whose log this index follows.
    :param lock_timeout_s: how long a thread waits while another syncs or searches this index.
    """

    location: str
    dimension: int

    def __init__(self, source: LogSource, lock_timeout_s: float) -> None:
        self.source = source
        self._mutex = threading.RLock()
        self.lock_timeout_s = lock_timeout_s

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """This index to one thread at a time, waiting at most ``lock_timeout_s``.

        :raises StoreBusyError: another thread held it longer (a long first replay, say).
        """
        if not self._mutex.acquire(timeout=self.lock_timeout_s):
            raise StoreBusyError(f"the index at {self.location} stayed busy for {self.lock_timeout_s} s")
        try:
            yield
        finally:
            self._mutex.release()

    def sync(self) -> int:
        """Replay the log; returns how many memories were reconciled.

        :raises StoreError: the tier or the server failed.
        """
        with self._locked():
            self._open()
            return len(self._sync())

    def rebuild(self, states: dict[tuple[str, str], IndexedState]) -> int:
        """Make every given memory's point match its state, replay the log, and drop points of
        memories neither names (``check()``); returns how many points were dropped.

        :param states: every memory's state as the caller just read it (``check()`` reads them
            all anyway); a point that already matches is left alone.
        """
        with self._locked():
            self._open()
            for (tenant, memory_id), state in states.items():
                self._apply(tenant, memory_id, state)
            # a memory added or changed while check() ran is in the log: it wins, and is no stray
            named = self._sync() | set(states)
            wanted = {self._point_id(tenant, memory_id) for tenant, memory_id in named}
            stray = [pid for pid in self._point_ids() if pid not in wanted]
            self._delete(stray)
            self._rebuilt()
            return len(stray)

    def search(
        self,
        vector: Sequence[float],
        tenant: str,
        session_id: str | None,
        limit: int,
        *,
        terms: Sequence[str] = (),
        keyword_weight: float = 0.0,
    ) -> list[IndexHit]:
        """Bring the index up to date with the log, then the ``limit`` best memories of ``tenant``.

        Both paths take their ``limit`` best candidates; a candidate found by one path only gets
        the other path's score too (its cosine; a keyword score absent from the keyword path's
        list is zero). Only ``tenant``'s points (and ``session_id``'s, when given) are ever
        candidates.

        :raises StoreError: the tier (or the server) failed; :class:`StoreBusyError`: another
            thread held the index past ``lock_timeout_s``.
        """
        with self._locked():
            self._open()
            self._sync()
            return self._search(vector, tenant, session_id, limit, terms, keyword_weight)

    def _sync(self) -> set[tuple[str, str]]:
        """Reconcile the memories the log names since the last sync, and the pending ones;
        returns them all. A log that no longer holds the last entry applied, where it was, is
        replayed whole into an emptied index."""
        state = self._read_state()
        entries = entries_since(state, self.source.read_log)
        if entries is None:
            logger.warning(
                "the store's log went backwards (tier emptied or restored): rebuilding the index at %s", self.location
            )
            self._clear()
            state = fresh_state()
            entries = self.source.read_log(0)
        todo = [(entry["tenant"], entry["id"], entry.get("at", 0.0)) for entry in state["pending"]]
        last = state["last"]
        now = time.time()
        for raw in entries:
            try:
                entry = json.loads(raw)
                todo.append((str(entry["tenant"]), str(entry["id"]), now))
                last = entry.get("n") if isinstance(entry.get("n"), str) else None
            except (ValueError, KeyError, TypeError, AttributeError):
                last = None
                continue  # a damaged log entry names nothing; check() rebuilds from the records
        first_seen: dict[tuple[str, str], float] = {}
        for tenant, memory_id, seen_at in todo:
            first_seen.setdefault((tenant, memory_id), seen_at)
        pending = []
        for (tenant, memory_id), seen_at in first_seen.items():
            memory_state = self.source.index_state(tenant, memory_id)
            if memory_state is not None:
                self._apply(tenant, memory_id, memory_state)
            elif time.time() - seen_at < PENDING_GRACE_S:  # an add in flight: its head is not written yet
                pending.append({"tenant": tenant, "id": memory_id, "at": seen_at})
        self._flush()
        if entries or pending != state["pending"]:
            self._write_state(
                {"applied": state["applied"] + len(entries), "last": last, "pending": pending}, len(entries)
            )
        return set(first_seen)

    def _point_id(self, tenant: str, memory_id: str) -> str:
        """The point of a memory in this index (an index shared by many stores names the store too)."""
        return point_id(tenant, memory_id)

    def _apply(self, tenant: str, memory_id: str, state: IndexedState) -> None:
        pid = self._point_id(tenant, memory_id)
        if state.vector is None:
            self._delete([pid])
        else:
            payload = {
                "tenant": tenant,
                "memory_id": memory_id,
                "version": state.version,
                "session_id": state.session_id,
            }
            self._upsert(pid, state.vector, sparse_terms(state.keywords), payload)

    # what a kind provides
    @abstractmethod
    def _open(self) -> None: ...

    @abstractmethod
    def _search(
        self,
        vector: Sequence[float],
        tenant: str,
        session_id: str | None,
        limit: int,
        terms: Sequence[str],
        keyword_weight: float,
    ) -> list[IndexHit]: ...

    @abstractmethod
    def _upsert(
        self, pid: str, vector: Sequence[float], keywords: tuple[list[int], list[float]], payload: dict
    ) -> None: ...

    @abstractmethod
    def _delete(self, pids: Sequence[str]) -> None: ...

    @abstractmethod
    def _flush(self) -> None: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _point_ids(self) -> list[str]: ...

    @abstractmethod
    def _read_state(self) -> dict: ...

    @abstractmethod
    def _write_state(self, state: dict, applied_now: int) -> None: ...

    @abstractmethod
    def _rebuilt(self) -> None: ...


def entries_since(state: dict, read_log: Callable[[int], list[bytes]]) -> list[bytes] | None:
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


def fresh_state() -> dict:
    return {"applied": 0, "last": None, "pending": []}


def parse_state(raw: object) -> dict:
    """A sync state read back; anything malformed is the fresh state (replaying the whole log is always correct)."""
    try:
        state = json.loads(raw)  # type: ignore[arg-type]
        last = state.get("last")
        pending = [
            {"tenant": str(p["tenant"]), "id": str(p["id"]), "at": float(p.get("at", 0.0))} for p in state["pending"]
        ]
        return {
            "applied": max(0, int(state["applied"])),
            "last": last if isinstance(last, str) else None,
            "pending": pending,
        }
    except (ValueError, KeyError, TypeError, AttributeError):
        return fresh_state()
