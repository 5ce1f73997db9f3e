"""``MemoryStore``: memory texts, their versions and their KV fragments, on a tier and an index.

Layout in the KV tier (every key component percent-encoded; ``t`` tenant, ``m`` memory id):

===================  ====================================================================
``h/t/m``            the head: current version ``v``, its writer ``w``, whether deleted
``r/t/m/v/w``        version ``v``'s record as writer ``w`` wrote it (JSON; immutable)
``e/t/m/v/w``        its embedding (the text's SHA-256, then float32, little-endian)
``p/t/m/v``          the writer whose version ``v`` was published (for every ``v`` below the head's)
``f/t/m/v/variant``  a KV fragment blob of version ``v`` (one per model and codec: ``variant``)
``x/t/hash``         the memory id of a text hash (the design's second path: text -> fragment)
``ac/t/m``           access count; ``al/t/m``: last access time
``log``              the change log the index replays
===================  ====================================================================

Every write of a version goes under a key of its own writer (a random token), data first and
head last: two writers superseding one version write to different keys, and only the one whose
compare-and-set on the head wins is ever read; the other removes what it wrote and is told
:class:`VersionConflictError` (a writer killed in between leaves data no head names, which
:meth:`MemoryStore.gc` collects). A reader that finds a head always finds its record. Nothing here
holds a lock across processes (DESIGN §8), and nothing imports torch: the store moves bytes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from .. import inputs
from ..blobs import check_codec, codec_label, read_header, verify_blob
from ..exceptions import (
    CorruptFragmentError,
    CorruptRecordError,
    InvalidInputError,
    MemoryNotFoundError,
    StoreError,
    VersionConflictError,
)
from .index import IndexedState, open_index
from .keywords import keywords
from .records import MemoryRecord, text_hash
from .tiers import BLOB_PREFIX, HotTier, KVTier, open_tier

__all__ = ["CheckReport", "GCReport", "MemoryStore"]

logger = logging.getLogger("kvshift_memory.store")

_LOG = "log"
_VARIANT = re.compile(r"[0-9a-f]{8,64}")
_WRITER = re.compile(r"[0-9a-f]{32}")
# Data without a head younger than this may be an add in progress in another process.
_ORPHAN_GRACE_S = 60.0
MAX_SEARCH_K = 1000


@dataclass
class CheckReport:
    """What :meth:`MemoryStore.check` found.

    :param ok: no problem left unrepaired.
    :param problems: every problem found, repaired or not.
    :param repaired: the problems that were repaired (corrupt fragments dropped to be re-encoded
        from text, index points rebuilt).
    """

    ok: bool
    memories: int
    fragments: int
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)


@dataclass
class GCReport:
    """What :meth:`MemoryStore.gc` freed."""

    erased_memories: int = 0
    freed_fragments: int = 0
    freed_bytes: int = 0
    freed_keys: int = 0


def _k(*parts: Any) -> str:
    return "/".join(quote(str(p), safe="") for p in parts)


def _split(key: str) -> list[str]:
    return [unquote(p) for p in key.split("/")]


class MemoryStore:
    """Memories of many tenants: texts, versions, an index to find them, and their KV fragments.

    ``MemoryStore(path)`` keeps everything in one folder (a ``diskcache`` tier, and the snapshot
    each process's in-memory Qdrant index starts from). ``MemoryStore(kv_url="redis://…",
    index_url="http://…")`` shares one memory between processes and machines; without
    ``index_url`` the index is rebuilt in each process from the tier's log.

    What the store reads from its folder or tier is untrusted input: nothing is unpickled, no
    path leads out of the folder, and a record, embedding or blob that fails its checks is
    refused or rebuilt (``docs/security.md``).

    :param path: folder of the embedded store (``path/kv`` and ``path/index``).
    :param kv_url: ``memory://``, ``redis://…``, a folder or ``file://…`` (default ``path/kv``).
    :param index_url: a folder, ``http(s)://…`` or ``":memory:"`` (default ``path/index``).
    :param embedder: text -> vector (default: the bundled all-MiniLM-L6-v2, loaded on first use).
    :param codec: how fragments are stored: ``int8`` (default, see the README's store benchmark),
        ``int4``, ``fp16`` or ``fp32``; ``group_size`` is int4's.
    :param hot_bytes: bound on the fragment blobs this process keeps in RAM in front of the tier.
    :param lock_timeout_s: how long a write waits for the folder's lock while another process
        writes, and a search for the index while another thread replays it; past it,
        :class:`StoreBusyError` (nothing written).
    :param keyword_weight: how much the keyword path adds to a hit's score (a hit's ``score`` is
        its cosine similarity plus this times its IDF-weighted keyword overlap); ``0`` searches by
        embedding alone. The default comes from ``benchmarks/locomo.py`` (see the README).
    :raises InvalidInputError: bad arguments; ``StoreError``: a backend cannot be opened.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        kv_url: str | None = None,
        index_url: str | None = None,
        embedder: Any = None,
        codec: str = "int8",
        group_size: int = 32,
        hot_bytes: int = 256 << 20,
        lock_timeout_s: float = 30.0,
        keyword_weight: float = 0.05,
    ) -> None:
        if path is None and kv_url is None:
            raise InvalidInputError("give a folder (MemoryStore(path)) or a kv_url")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidInputError(f"path must be a folder path, got {type(path).__name__}")
        check_codec(codec, group_size)
        inputs.check_non_negative_int(hot_bytes, "hot_bytes")
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) or not 0 < lock_timeout_s <= 3600:
            raise InvalidInputError(f"lock_timeout_s must be a number of seconds in (0, 3600], got {lock_timeout_s!r}")
        if isinstance(keyword_weight, bool) or not isinstance(keyword_weight, (int, float)) or not 0 <= keyword_weight <= 10:
            raise InvalidInputError(f"keyword_weight must be a number in [0, 10], got {keyword_weight!r}")
        self.keyword_weight = float(keyword_weight)
        self.codec, self.group_size = codec, group_size
        if path is not None:
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot use {os.fspath(path)!r} as a store folder: {exc}") from exc
        self.tier: KVTier = open_tier(kv_url if kv_url is not None else Path(path) / "kv", lock_timeout_s=float(lock_timeout_s))
        self._hot = HotTier(hot_bytes)
        if embedder is None:
            from ..embedding import MiniLMEmbedder  # torch-backed, so only when no embedder is given

            embedder = MiniLMEmbedder()
        self.embedder = embedder
        location = index_url if index_url is not None else (Path(path) / "index" if path is not None else ":memory:")
        self.index = open_index(location, int(embedder.dimension), str(embedder.name), lock_timeout_s=float(lock_timeout_s))
        self.corrupt_fragments = 0

    # ---------------------------------------------------------------- public API

    def add(
        self,
        text: str,
        *,
        tenant: str,
        session_id: str | None = None,
        importance_score: float = 0.5,
        semantic_keywords: Sequence[str] = (),
        ttl_s: float | None = None,
    ) -> MemoryRecord:
        """Store a new memory (version 1). When this returns, the memory is durable.

        :raises InvalidInputError: empty or over-long text, invalid Unicode, bad ids or scores.
        :raises StoreError: the tier refused the write.
        """
        tenant, session_id = self._ids(tenant, session_id)
        text = inputs.check_text(text, "text")
        importance_score = inputs.check_ratio(importance_score, "importance_score")
        keywords = _check_keywords(semantic_keywords)
        now = time.time()
        record = MemoryRecord(
            id=uuid.uuid4().hex,
            version=1,
            text=text,
            tenant=tenant,
            session_id=session_id,
            created_at=now,
            source_text_hash=text_hash(text),
            importance_score=importance_score,
            semantic_keywords=keywords,
            expires_at=_expiry(ttl_s, now),
        )
        self._write_version(record, None, None)
        return replace(record, fragment_source=self)

    def get(self, memory_id: str, *, tenant: str) -> MemoryRecord | None:
        """The live version of a memory of ``tenant``, or ``None`` (also for another tenant's id).

        :raises InvalidInputError: ids that are not valid identifiers.
        """
        tenant, _ = self._ids(tenant, None)
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        record = self._live(tenant, memory_id)
        if record is None:
            return None
        return self._touch(record)

    def search(self, query: str, *, tenant: str, session_id: str | None = None, k: int = 4) -> list[MemoryRecord]:
        """The ``k`` live memories of ``tenant`` (and ``session_id``, when given) nearest ``query``.

        :returns: records, best first, each with ``score`` (cosine similarity, plus the keyword
            path's share: see ``keyword_weight``).
        :raises InvalidInputError: empty query, bad ids, ``k`` outside 1..1000.
        """
        tenant, session_id = self._ids(tenant, session_id)
        query = inputs.check_text(query, "query")
        k = inputs.check_positive_int(k, "k")
        if k > MAX_SEARCH_K:
            raise InvalidInputError(f"k must be at most {MAX_SEARCH_K}, got {k}")
        vector = self.embedder.embed([query])[0]
        # a few extra candidates: expired memories stay indexed until gc() and are skipped here
        hits = self.index.search(
            vector,
            tenant,
            session_id,
            k + 16,
            self._read_log,
            self._index_state,
            terms=keywords(query),
            keyword_weight=self.keyword_weight,
        )
        found = []
        for hit in hits:
            record = self._live(tenant, hit.memory_id)
            if record is None or (session_id is not None and record.session_id != session_id):
                continue
            found.append(replace(self._touch(record), score=hit.score))
            if len(found) == k:
                break
        return found

    def supersede(
        self, memory_id: str, new_text: str, *, tenant: str, expected_version: int | None = None
    ) -> MemoryRecord:
        """Replace a memory's text by a new version; the old one stays in :meth:`history`.

        Of writers superseding the same version at once, exactly one succeeds; every other one is
        told :class:`VersionConflictError` and leaves nothing behind.

        :param expected_version: the version the caller read; when given and no longer live, the
            call is refused, so a correction never lands on a text its author did not see.
        :returns: the new record: same id, version + 1.
        :raises MemoryNotFoundError: no live memory with that id for ``tenant``.
        :raises VersionConflictError: another writer changed it first, or ``expected_version`` is stale.
        :raises InvalidInputError: bad text, ids or ``expected_version``.
        """
        tenant, _ = self._ids(tenant, None)
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        new_text = inputs.check_text(new_text, "new_text")
        if expected_version is not None:
            expected_version = inputs.check_positive_int(expected_version, "expected_version")
        raw_head, head = self._read_head(tenant, memory_id)
        old = self._live_at(tenant, memory_id, head)
        if old is None or head is None:
            raise MemoryNotFoundError(f"no live memory {memory_id!r} for tenant {tenant!r}")
        if expected_version is not None and old.version != expected_version:
            raise VersionConflictError(
                f"memory {memory_id!r} is at version {old.version}, not {expected_version}; read it again"
            )
        record = replace(
            old,
            version=old.version + 1,
            text=new_text,
            source_text_hash=text_hash(new_text),
            created_at=time.time(),
            status="live",
            score=None,
            fragment_source=None,
        )
        self._write_version(record, raw_head, head)
        return replace(record, fragment_source=self)

    def delete(self, memory_id: str, *, tenant: str) -> bool:
        """Delete a memory (every version): it is never returned again, and :meth:`gc` erases its data.

        :returns: ``False`` when there was no live memory with that id for ``tenant``.
        :raises VersionConflictError: another writer changed it at the same moment.
        """
        tenant, _ = self._ids(tenant, None)
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        raw, head = self._read_head(tenant, memory_id)
        if head is None or head["deleted"]:
            return False
        self.tier.append(_LOG, _log_entry(tenant, memory_id))
        if not self.tier.compare_and_set(_k("h", tenant, memory_id), raw, _head(head["v"], head["w"], deleted=True)):
            raise VersionConflictError(f"memory {memory_id!r} changed while being deleted; try again")
        return True

    def history(self, memory_id: str, *, tenant: str) -> list[MemoryRecord]:
        """Every version of a memory, oldest first: the last one is live, or, for a deleted memory
        whose data :meth:`gc` has not erased yet, its tombstone (``status="deleted"``).

        :raises MemoryNotFoundError: no memory with that id for ``tenant``, or its data was erased.
        """
        tenant, _ = self._ids(tenant, None)
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        _, head = self._read_head(tenant, memory_id)
        last = self._live_at(tenant, memory_id, head)
        if last is None and head is not None and head["deleted"] and not head.get("erased"):
            deleted = self._read_record(tenant, memory_id, head["v"], head["w"])
            last = None if deleted is None else replace(deleted, status="deleted", fragment_source=self)
        if last is None or head is None:
            raise MemoryNotFoundError(f"no memory {memory_id!r} for tenant {tenant!r}")
        versions = []
        for version in range(1, last.version):
            writer = self._published_writer(tenant, memory_id, version)
            record = self._read_record(tenant, memory_id, version, writer) if writer else None
            if record is not None:
                versions.append(replace(record, status="superseded", fragment_source=self))
        return [*versions, self._with_access(last)]

    def find_by_hash(self, source_text_hash: str, *, tenant: str) -> MemoryRecord | None:
        """The live memory of ``tenant`` whose text has this hash (the path text -> fragment), or ``None``."""
        tenant, _ = self._ids(tenant, None)
        if not isinstance(source_text_hash, str) or not re.fullmatch(r"[0-9a-f]{64}", source_text_hash):
            raise InvalidInputError("source_text_hash must be 64 lowercase hex characters")
        raw = self._get_row(_k("x", tenant, source_text_hash))
        if raw is None:
            return None
        record = self._live(tenant, raw.decode("utf-8", "replace"))
        if record is None or record.source_text_hash != source_text_hash:
            return None
        return self._with_access(record)

    def gc(self, *, keep_model_fingerprint: str | None = None) -> GCReport:
        """Free what no live memory uses.

        Erases deleted and expired memories (text, vectors, fragments), fragments and vectors of
        superseded versions (their text stays, for :meth:`history`), data that writers killed
        mid-write left behind, and, when ``keep_model_fingerprint`` is given, fragments of other
        models (stale: they would never be used again).

        :raises StoreError: the tier failed.
        """
        report = GCReport()
        now = time.time()
        heads: dict[tuple[str, str], dict | None] = {}
        for key in list(self.tier.scan("h/")):
            parts = _split(key)
            if len(parts) == 3:
                heads[(parts[1], parts[2])] = _parse_head(self._get_row(key))
        for (tenant, memory_id), head in heads.items():
            if head is None or head.get("erased"):
                continue
            live = None if head["deleted"] else self._read_record(tenant, memory_id, head["v"], head["w"])
            if head["deleted"] or (live is not None and live.is_expired(now)):
                heads[(tenant, memory_id)] = self._erase(tenant, memory_id, head, report)
        for prefix in ("r/", "e/", "p/", BLOB_PREFIX):
            for key in list(self.tier.scan(prefix)):
                parts = _split(key)
                if len(parts) != (4 if prefix == "p/" else 5) or not parts[3].isdigit():
                    continue  # not a key this layout writes (an earlier one's: check() moves those)
                # the heads were read before this scan; a memory written since is judged by its head now
                if not self._in_use(prefix, parts, heads.get((parts[1], parts[2])), now) and not self._in_use(
                    prefix, parts, self._read_head(parts[1], parts[2])[1], now
                ):
                    self._free(key, report)
                elif prefix == BLOB_PREFIX and keep_model_fingerprint is not None:
                    raw = self._get_row(key)
                    if raw is not None and _blob_fingerprint(raw) != keep_model_fingerprint:
                        self._free(key, report)
        return report

    def _in_use(self, prefix: str, parts: list[str], head: dict | None, now: float) -> bool:
        """Whether gc keeps the data under a key (split into ``parts``) of a memory whose head is ``head``."""
        tenant, memory_id, version = parts[1], parts[2], int(parts[3])
        if head is not None and head["deleted"]:
            return False
        if prefix == "p/":
            # a publication pointer is never wrong (a version has one writer), and the head read at
            # the start of gc may already be behind one a supersede just wrote: keep while the memory lives
            return head is not None
        if prefix == BLOB_PREFIX:
            return head is not None and version == head["v"]
        writer = parts[4]
        if head is not None and version <= head["v"]:
            published = head["w"] if version == head["v"] else self._published_writer(tenant, memory_id, version)
            # superseded versions keep their text (history), not their embedding
            return writer == published and (prefix == "r/" or version == head["v"])
        # no head names it yet: a write in flight (the first version, or the next one), or abandoned
        in_flight = version == (head["v"] + 1 if head is not None else 1)
        return in_flight and not self._abandoned(tenant, memory_id, version, writer, now)

    def check(self) -> CheckReport:
        """Verify every live memory and fragment, repair what can be rebuilt, and say what was found.

        Corrupt fragment blobs are dropped (they are re-encoded from text on next use), an
        embedding that is missing, damaged or another text's is computed again, and the index is
        reconciled with the records. A live memory whose record is missing or damaged cannot be
        rebuilt and makes ``ok`` false.

        :raises StoreError: the tier failed.
        """
        report = CheckReport(ok=True, memories=0, fragments=0)
        states: dict[tuple[str, str], IndexedState] = {}  # what each memory's index point must be
        for key in list(self.tier.scan("h/")):
            parts = _split(key)
            raw_head = self._get_or_report(key, report)
            head = _parse_head(raw_head)
            if len(parts) == 3 and head is None and _is_earlier_head(raw_head):
                head = self._move_to_writer_keys(parts[1], parts[2], raw_head, report)
            if len(parts) != 3 or head is None:
                report.problems.append(f"unreadable head {key!r}")
                report.ok = False
                continue
            tenant, memory_id = parts[1], parts[2]
            states[(tenant, memory_id)] = IndexedState(head["v"], None, None)
            if head["deleted"]:
                continue
            report.memories += 1
            try:
                record = MemoryRecord.from_json(self.tier.get(_k("r", tenant, memory_id, head["v"], head["w"])) or b"")
            except StoreError as exc:
                report.problems.append(f"memory {memory_id} of {tenant!r}: {exc}")
                report.ok = False
                continue
            if record.id != memory_id or record.tenant != tenant or record.version != head["v"]:
                report.problems.append(f"memory {memory_id} of {tenant!r}: record names {record.tenant}/{record.id}")
                report.ok = False
                continue
            embedding_key = _k("e", tenant, memory_id, head["v"], head["w"])
            embedding = _unpack_embedding(self._get_or_report(embedding_key, report), self.index.dimension)
            if embedding is None or embedding[0] != record.source_text_hash:
                state = "missing or damaged" if embedding is None else "computed from another text"
                problem = f"memory {memory_id} of {tenant!r}: embedding {state}"
                report.problems.append(problem)
                embedding = (record.source_text_hash, self.embedder.embed([record.text])[0])
                self.tier.set(embedding_key, _pack_embedding(*embedding))
                report.repaired.append(f"{problem} (embedded again)")
            states[(tenant, memory_id)] = IndexedState(head["v"], record.session_id, embedding[1], memory_keywords(record))
        for key in list(self.tier.scan(BLOB_PREFIX)):
            parts = _split(key)
            report.fragments += 1
            try:
                metadata = verify_blob(self.tier.get(key) or b"")
                if len(parts) != 5 or (metadata.get("tenant"), metadata.get("memory_id"), metadata.get("version")) != (
                    parts[1],
                    parts[2],
                    parts[3],
                ):
                    raise CorruptFragmentError("blob is stored under another memory's key")
            except StoreError as exc:  # a corrupt blob, or a row the tier refuses to read
                problem = f"fragment {key!r}: {exc}"
                report.problems.append(problem)
                self.tier.delete(key)
                self._hot.delete(key)
                report.repaired.append(f"{problem} (dropped; re-encoded from text on next use)")
        strays = self.index.rebuild(states, self._read_log, self._index_state)
        if strays:
            report.problems.append(f"index held {strays} points of no memory")
            report.repaired.append(f"removed {strays} stray index points")
        return report

    def _move_to_writer_keys(self, tenant: str, memory_id: str, raw_head: bytes, report: CheckReport) -> dict | None:
        """A memory an earlier build wrote (versions under ``r/t/m/v``, no writer in its head),
        copied to this layout and published by compare-and-set; the old keys are then removed.

        :returns: its new head, or ``None`` when its live version's record is missing.
        """
        earlier = json.loads(raw_head)
        version, deleted = earlier["v"], bool(earlier.get("deleted"))
        writers = {}
        for old_version in range(1, version + 1):
            raw = self._get_row(_k("r", tenant, memory_id, old_version))
            if raw is not None:
                writers[old_version] = uuid.uuid4().hex
                self.tier.set(_k("r", tenant, memory_id, old_version, writers[old_version]), raw)
                if old_version < version:
                    self.tier.set(_k("p", tenant, memory_id, old_version), writers[old_version].encode())
        live = self._read_record(tenant, memory_id, version, writers[version]) if version in writers else None
        if live is None:
            return None
        vector = self.embedder.embed([live.text])[0]
        self.tier.set(_k("e", tenant, memory_id, version, writers[version]), _pack_embedding(live.source_text_hash, vector))
        self.tier.append(_LOG, _log_entry(tenant, memory_id))
        new_head = _head(version, writers[version], deleted=deleted)
        if not self.tier.compare_and_set(_k("h", tenant, memory_id), raw_head, new_head):
            return _parse_head(self._get_row(_k("h", tenant, memory_id)))  # another check() moved it first
        for old_version in range(1, version + 1):
            for kind in ("r", "e"):
                self.tier.delete(_k(kind, tenant, memory_id, old_version))
        report.repaired.append(f"memory {memory_id} of {tenant!r}: moved from an earlier build's layout")
        return _parse_head(new_head)

    def _get_or_report(self, key: str, report: CheckReport) -> bytes | None:
        """A key's value, or ``None`` (the problem noted) when the tier refuses to read its row."""
        try:
            return self.tier.get(key)
        except CorruptRecordError as exc:
            report.problems.append(f"{key!r}: {exc}")
            return None

    def stats(self, *, model_fingerprint: str | None = None) -> dict[str, Any]:
        """Counts and sizes: memories (live, superseded versions, deleted), fragments and their
        bytes per codec, and with ``model_fingerprint`` how many fragments are stale (another model's)."""
        out: dict[str, Any] = {
            "kv_url": self.tier.url,
            "index": self.index.location,
            "codec": codec_label(self.codec, self.group_size),
            "memories": 0,
            "deleted": 0,
            "versions": 0,
            "fragments": 0,
            "fragment_bytes": 0,
            "fragments_by_codec": {},
            "corrupt_fragments_seen": self.corrupt_fragments,
        }
        for key in self.tier.scan("h/"):
            head = _parse_head(self._get_row(key))
            if head is None:
                continue
            out["deleted" if head["deleted"] else "memories"] += 1
            out["versions"] += head["v"]
        if model_fingerprint is not None:
            out["stale_fragments"] = 0
        for key in self.tier.scan(BLOB_PREFIX):
            raw = self._get_row(key)
            if raw is None:
                continue
            out["fragments"] += 1
            out["fragment_bytes"] += len(raw)
            try:
                metadata = read_header(raw)[1]  # counting needs the header only; check() verifies
            except CorruptFragmentError:
                continue
            codec = metadata.get("codec", "?")
            out["fragments_by_codec"][codec] = out["fragments_by_codec"].get(codec, 0) + 1
            if model_fingerprint is not None and metadata.get("model_fingerprint") != model_fingerprint:
                out["stale_fragments"] += 1
        return out

    def clear_cache(self) -> None:
        """Forget the fragment blobs held in this process's RAM, and the embedder's recent query
        vectors when it keeps any (measurements start cold with this)."""
        self._hot.clear()
        forget_queries = getattr(self.embedder, "clear_cache", None)
        if callable(forget_queries):
            forget_queries()

    def close(self) -> None:
        self.index.close()
        self.tier.close()

    def __enter__(self) -> MemoryStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- fragments (used by the engine)

    def fragment_expectations(self, record: MemoryRecord) -> dict[str, str]:
        """Metadata a fragment blob of ``record`` must carry (the engine adds the model's)."""
        return {
            "tenant": record.tenant,
            "memory_id": record.id,
            "version": str(record.version),
            "source_text_hash": record.source_text_hash,
        }

    def load_fragment(self, record: MemoryRecord, variant: str) -> bytes | None:
        """The stored fragment blob of ``record`` for ``variant`` (a model + codec), or ``None``.

        Served only for a record that is live in this store under its tenant and whose text
        matches the stored text: a record object made up by a caller gets nothing.
        """
        key = self._fragment_key(record, variant)
        if key is None:
            return None
        blob = self._hot.get(key)
        if blob is None:
            blob = self.tier.get(key)
            if blob is not None:
                self._hot.set(key, blob)
        return blob

    def has_fragment(self, record: MemoryRecord, variant: str) -> bool:
        """Whether a blob of ``record`` for ``variant`` is stored (without reading it)."""
        key = self._fragment_key(record, variant)
        return key is not None and (self._hot.contains(key) or self.tier.contains(key))

    def save_fragment(self, record: MemoryRecord, variant: str, blob: bytes) -> bool:
        """Keep a fragment blob for ``record``; ``False`` (nothing written) unless the record is live here."""
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError(f"a fragment blob is bytes, got {type(blob).__name__}")
        key = self._fragment_key(record, variant)
        if key is None:
            return False
        self.tier.set(key, bytes(blob))
        self._hot.set(key, bytes(blob))
        return True

    def discard_fragment(self, record: MemoryRecord, variant: str, reason: str) -> None:
        """Drop a blob that failed its checks; it is re-encoded from text by whoever needs it next."""
        key = self._fragment_key(record, variant)
        if key is None:
            return
        self.corrupt_fragments += 1
        logger.warning("dropping corrupt fragment %s: %s", key, reason)
        self._hot.delete(key)
        self.tier.delete(key)

    def _fragment_key(self, record: Any, variant: str) -> str | None:
        if not isinstance(record, MemoryRecord) or not isinstance(variant, str) or not _VARIANT.fullmatch(variant):
            return None
        live = self._live(record.tenant, record.id)
        if live is None or live.version != record.version or live.source_text_hash != text_hash(record.text):
            return None
        return _k("f", record.tenant, record.id, record.version, variant)

    # ---------------------------------------------------------------- internals

    @staticmethod
    def _ids(tenant: Any, session_id: Any) -> tuple[str, str | None]:
        tenant = inputs.check_identifier(tenant, "tenant")
        if session_id is not None:
            session_id = inputs.check_identifier(session_id, "session_id")
        return tenant, session_id

    def _write_version(self, record: MemoryRecord, expected_raw: bytes | None, previous: dict | None) -> None:
        """Data under this writer's own keys first, head last by compare-and-set; a refused
        writer removes its data again, so no version ever holds a text whose writer was refused.

        :param expected_raw: the head as read (``None``: the memory must not exist yet).
        :param previous: that head, parsed (``None`` for a new memory).
        """
        tenant, memory_id, version = record.tenant, record.id, record.version
        writer = uuid.uuid4().hex
        vector = self.embedder.embed([record.text])[0]
        if len(vector) != self.index.dimension:
            raise StoreError(f"the embedder returned {len(vector)} dimensions, not {self.index.dimension}")
        # the record first: gc tells a write in flight from an abandoned one by its record's age
        data_keys = (_k("r", tenant, memory_id, version, writer), _k("e", tenant, memory_id, version, writer))
        self.tier.set(data_keys[0], record.to_json())
        self.tier.set(data_keys[1], _pack_embedding(record.source_text_hash, vector))
        if previous is not None:
            # every writer past ``previous`` writes the same value: idempotent, and set before the head moves
            self.tier.set(_k("p", tenant, memory_id, previous["v"]), previous["w"].encode())
        self.tier.append(_LOG, _log_entry(tenant, memory_id))
        if not self.tier.compare_and_set(_k("h", tenant, memory_id), expected_raw, _head(version, writer)):
            for key in data_keys:
                self.tier.delete(key)
            raise VersionConflictError(f"memory {memory_id!r} changed while being written; read it again")
        # after the head: a refused writer must not point a text at this memory (find_by_hash checks anyway)
        self.tier.set(_k("x", tenant, record.source_text_hash), memory_id.encode())

    def _get_row(self, key: str) -> bytes | None:
        """A row's value; ``None`` for a row the tier refuses (logged; ``check()`` reports it)."""
        try:
            return self.tier.get(key)
        except CorruptRecordError as exc:
            logger.warning("refusing %r: %s", key, exc)
            return None

    def _read_record(self, tenant: str, memory_id: str, version: int, writer: str) -> MemoryRecord | None:
        raw = self._get_row(_k("r", tenant, memory_id, version, writer))
        if raw is None:
            return None
        try:
            record = MemoryRecord.from_json(raw)
        except StoreError as exc:
            logger.warning("unreadable record %s@%s of %r: %s", memory_id, version, tenant, exc)
            return None
        if (record.tenant, record.id, record.version) != (tenant, memory_id, version):
            logger.warning("record under %s@%s of %r names another memory", memory_id, version, tenant)
            return None
        return record

    def _published_writer(self, tenant: str, memory_id: str, version: int) -> str | None:
        """The writer whose version ``version`` (below the head's) was published."""
        raw = self._get_row(_k("p", tenant, memory_id, version))
        writer = raw.decode("ascii", "replace") if raw else ""
        return writer if _WRITER.fullmatch(writer) else None

    def _read_head(self, tenant: str, memory_id: str) -> tuple[bytes | None, dict | None]:
        raw = self._get_row(_k("h", tenant, memory_id))
        return raw, _parse_head(raw)

    def _live(self, tenant: str, memory_id: str) -> MemoryRecord | None:
        return self._live_at(tenant, memory_id, self._read_head(tenant, memory_id)[1])

    def _live_at(self, tenant: str, memory_id: str, head: dict | None) -> MemoryRecord | None:
        if head is None or head["deleted"]:
            return None
        record = self._read_record(tenant, memory_id, head["v"], head["w"])
        if record is None or record.is_expired(time.time()):
            return None
        return replace(record, fragment_source=self)

    def _with_access(self, record: MemoryRecord) -> MemoryRecord:
        """``record`` with its access count and last access, read but not counted as an access."""
        count = self._get_row(_k("ac", record.tenant, record.id))
        last = self._get_row(_k("al", record.tenant, record.id))
        return replace(record, access_count=int(count) if count and count.isdigit() else 0, last_access=_float_or_none(last))

    def _touch(self, record: MemoryRecord) -> MemoryRecord:
        now = time.time()
        count = self.tier.incr(_k("ac", record.tenant, record.id))
        self.tier.set(_k("al", record.tenant, record.id), repr(now).encode())
        return replace(record, access_count=count, last_access=now)

    def _read_log(self, start: int) -> list[bytes]:
        return self.tier.read_log(_LOG, start)

    def _index_state(self, tenant: str, memory_id: str) -> IndexedState | None:
        head = self._read_head(tenant, memory_id)[1]
        if head is None:
            return None
        if head["deleted"]:
            return IndexedState(head["v"], None, None)
        record = self._read_record(tenant, memory_id, head["v"], head["w"])
        embedding = _unpack_embedding(self._get_row(_k("e", tenant, memory_id, head["v"], head["w"])), self.index.dimension)
        # an embedding of another text is never indexed: check() re-embeds it
        if record is None or embedding is None or embedding[0] != record.source_text_hash:
            return IndexedState(head["v"], None, None)
        return IndexedState(head["v"], record.session_id, embedding[1], memory_keywords(record))

    def _erase(self, tenant: str, memory_id: str, head: dict, report: GCReport) -> dict:
        """Tombstone a memory and return its new head; gc's one scan of records, vectors and blobs
        then frees the rest of its data (and frees it on the next gc, if this one is interrupted)."""
        for key in (_k("ac", tenant, memory_id), _k("al", tenant, memory_id)):
            self._free(key, report)
        self.tier.append(_LOG, _log_entry(tenant, memory_id))
        # the tombstone stays: it tells every index to drop the point, and ids are never reused
        self.tier.set(_k("h", tenant, memory_id), _head(head["v"], head["w"], deleted=True, erased=True))
        report.erased_memories += 1
        return {**head, "deleted": True, "erased": True}

    def _free(self, key: str, report: GCReport) -> None:
        raw = self._get_row(key) if key.startswith(BLOB_PREFIX) else None
        if self.tier.delete(key):
            report.freed_keys += 1
            if raw is not None:
                report.freed_fragments += 1
                report.freed_bytes += len(raw)
        self._hot.delete(key)

    def _abandoned(self, tenant: str, memory_id: str, version: int, writer: str, now: float) -> bool:
        """Whether a write no head names is over (its writer was killed, or refused and killed
        before it cleaned up), rather than in flight in another process."""
        record = self._read_record(tenant, memory_id, version, writer)
        return record is None or now - record.created_at > _ORPHAN_GRACE_S


# ---------------------------------------------------------------- small encodings


def _head(version: int, writer: str, deleted: bool = False, erased: bool = False) -> bytes:
    data: dict[str, Any] = {"v": version, "w": writer, "deleted": deleted}
    if erased:
        data["erased"] = True
    return json.dumps(data, sort_keys=True).encode()


def _parse_head(raw: bytes | None) -> dict | None:
    if raw is None:
        return None
    try:
        head = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(head, dict) or not isinstance(head.get("v"), int) or head["v"] < 1:
        return None
    if not isinstance(head.get("w"), str) or not _WRITER.fullmatch(head["w"]):
        return None
    head["deleted"] = bool(head.get("deleted"))
    return head


def _is_earlier_head(raw: bytes | None) -> bool:
    """A head as builds before writer keys wrote it: a version and a deleted flag, no writer."""
    try:
        head = json.loads(raw) if raw is not None else None
    except (UnicodeDecodeError, ValueError):
        return False
    return isinstance(head, dict) and "w" not in head and isinstance(head.get("v"), int) and head["v"] >= 1


def _log_entry(tenant: str, memory_id: str) -> bytes:
    # the nonce makes every entry unique, so an index can tell a log that went backwards (a tier
    # restored from an older snapshot) from one that only grew
    return json.dumps({"tenant": tenant, "id": memory_id, "n": uuid.uuid4().hex}).encode()


def _pack_embedding(source_text_hash: str, vector: Sequence[float]) -> bytes:
    """The text's hash, then the vector: an embedding names the text it was computed from."""
    return bytes.fromhex(source_text_hash) + struct.pack(f"<{len(vector)}f", *vector)


def _unpack_embedding(raw: bytes | None, dimension: int) -> tuple[str, list[float]] | None:
    """(text hash, vector), or ``None`` for a missing or damaged embedding."""
    if raw is None or len(raw) != 32 + 4 * dimension:
        return None
    vector = list(struct.unpack(f"<{dimension}f", raw[32:]))
    return (raw[:32].hex(), vector) if all(math.isfinite(x) for x in vector) else None


def _float_or_none(raw: bytes | None) -> float | None:
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def _blob_fingerprint(raw: bytes) -> str | None:
    try:
        return read_header(raw)[1].get("model_fingerprint")
    except CorruptFragmentError:
        return None


def _check_keywords(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidInputError("semantic_keywords must be a list of strings")
    return tuple(inputs.check_text(word, "semantic keyword") for word in value)


def _expiry(ttl_s: Any, now: float) -> float | None:
    if ttl_s is None:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < 1e11:
        raise InvalidInputError(f"ttl_s must be a positive number of seconds or None, got {ttl_s!r}")
    return now + float(ttl_s)


def memory_keywords(record: MemoryRecord) -> list[str]:
    """What the keyword path indexes for a memory: its text's keywords and its ``semantic_keywords``."""
    return keywords(" ".join([record.text, *record.semantic_keywords]))
