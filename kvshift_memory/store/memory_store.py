"""``MemoryStore``: memory texts, their versions and their KV fragments, on a tier and an index.

Its keys and their encodings are in :mod:`.layout`; ``gc``, ``check`` and ``stats`` in :mod:`.maintenance`.

Every write of a version goes under a key of its own writer (a random token), data first and
head last: two writers superseding one version write to different keys, and only the one whose
compare-and-set on the head wins is ever read; the other removes what it wrote and is told
:class:`VersionConflictError` (a writer killed in between leaves data no head names, which
:meth:`MemoryStore.gc` collects). A reader that finds a head always finds its record. Nothing here
holds a lock across processes (``docs/store.md``), and nothing imports torch: the store moves bytes.
"""

from __future__ import annotations

import builtins  # the classes below have a method named `list`, which hides the type in their bodies
import contextlib
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import inputs
from ..blobs import check_codec
from ..embedding import MiniLMEmbedder, as_embedder
from ..exceptions import (
    CorruptRecordError,
    InvalidInputError,
    KVShiftError,
    MemoryNotFoundError,
    StoreBusyError,
    StoreError,
    VersionConflictError,
)
from . import maintenance
from .documents import approximate_tokens, document_row, listed_parts, split_document
from .index import IndexedState, open_index
from .items import owns
from .keywords import keywords, memory_keywords
from .layout import (
    LOG_KEY,
    STORE_ID_KEY,
    VARIANT,
    Head,
    float_or_none,
    head_bytes,
    log_entry,
    pack_embedding,
    split_key,
    tier_key,
    unpack_embedding,
)
from .maintenance import CheckReport, GCReport
from .records import MemoryRecord, text_hash
from .tiers import CHUNK_PREFIX, DEFAULT_CHUNK_BYTES, DEFAULT_CHUNK_TTL_S, HotTier, KVTier, open_tier
from .versions import Versions

__all__ = ["CheckReport", "GCReport", "MemoryStore"]

logger = logging.getLogger("kvshift_memory.store")

MAX_SEARCH_K = 1000
#: the most memories one :meth:`MemoryStore.list` call returns
MAX_LIST = 1000
# how often the store reads its tier's clock again (between reads it counts this process's monotonic time)
_CLOCK_REFRESH_S = 5.0
#: the largest session state :meth:`MemoryStore.save_session` keeps
MAX_SESSION_BYTES = 16 << 20
# chunks of a memory:// store sit in this process's RAM beside the engine's own prefix cache
_RAM_CHUNK_BYTES = 256 << 20
# fresh ids an add tries when gc fenced its write as abandoned (a writer stalled past the grace)
_ADD_ATTEMPTS = 3
# a search that found part of a document (published while it ran) is run again, at most so often
_SEARCH_ATTEMPTS = 3
#: a document's source is a name or an address, not a second text
_MAX_SOURCE_CHARS = 2048


class MemoryStore:
    """Memories of many tenants: texts, versions, an index to find them, and their KV fragments.

    ``MemoryStore(path)`` keeps everything in one folder (a ``diskcache`` tier, and the snapshot
    each process's in-memory vector index starts from). ``MemoryStore(kv_url="redis://…",
    index_url="http://…")`` shares one memory between processes and machines; without
    ``index_url`` the index is rebuilt in each process from the tier's log.

    What the store reads from its folder or tier is untrusted input: nothing is unpickled, no
    path leads out of the folder, and a record, embedding or blob that fails its checks is
    refused or rebuilt (``docs/security.md``).

    :param path: folder of the embedded store (``path/kv`` and ``path/index``).
    :param kv_url: ``memory://``, ``redis://…``, a folder or ``file://…`` (default ``path/kv``).
    :param index_url: a folder, ``http(s)://…`` or ``":memory:"`` (default ``path/index``).
    :param embedder: text -> vector: an object with ``name``, ``dimension`` and ``embed(texts)``,
        or a LangChain ``Embeddings`` / LlamaIndex ``BaseEmbedding`` (memories embedded as
        documents, searches as queries); default the bundled all-MiniLM-L6-v2, loaded on first use.
    :param codec: how fragments are stored: ``int8`` (default, ``docs/benchmarks/store.md``),
        ``int4``, ``fp16`` or ``fp32``; ``group_size`` is int4's.
    :param hot_bytes: bound on the fragment blobs this process keeps in RAM in front of the tier.
    :param lock_timeout_s: how long a write waits for the folder's lock while another process
        writes, and a search for the index while another thread replays it; past it,
        :class:`StoreBusyError` (nothing written).
    :param index_api_key: the Qdrant server's API key (default: the ``QDRANT_API_KEY``
        environment variable, when set); only with an ``http(s)://`` ``index_url``.
    :param index_collection_prefix: the Qdrant collections' names start with it (default
        ``kvshift``): stores that should not share a collection on one server take different
        ones. Stores that share one still keep apart: each point carries its store's identity
        (kept in the tier), every query and :meth:`check` see only this store's points.
    :param chunk_bytes: the byte budget of the conversation K/V chunks an engine keeps here (in
        ``path/kv/chunks`` for a folder, default 4 GiB; in RAM for ``memory://``, default 256 MiB),
        least recently used evicted first; ``0`` keeps none. Chunks can always be computed again:
        records are never evicted.
    :param chunk_ttl_s: how long a chunk stays in Redis after it was last written or read.
    :param keyword_weight: how much the keyword path adds to a hit's score (a hit's ``score`` is
        its cosine similarity plus this times its IDF-weighted keyword overlap); ``0`` searches by
        embedding alone. The default comes from ``benchmarks/recall.py`` (``docs/benchmarks/locomo.md``).
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
        index_api_key: str | None = None,
        index_collection_prefix: str = "kvshift",
        chunk_bytes: int | None = None,
        chunk_ttl_s: float = DEFAULT_CHUNK_TTL_S,
    ) -> None:
        if path is None and kv_url is None:
            raise InvalidInputError("give a folder (MemoryStore(path)) or a kv_url")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise InvalidInputError(f"path must be a folder path, got {type(path).__name__}")
        check_codec(codec, group_size)
        inputs.check_non_negative_int(hot_bytes, "hot_bytes")
        if chunk_bytes is None:
            in_ram = kv_url is not None and str(kv_url).startswith("memory://")
            chunk_bytes = _RAM_CHUNK_BYTES if in_ram else DEFAULT_CHUNK_BYTES
        inputs.check_non_negative_int(chunk_bytes, "chunk_bytes")
        inputs.check_number(chunk_ttl_s, "chunk_ttl_s", 1, 1e9, unit="seconds")
        inputs.check_number(lock_timeout_s, "lock_timeout_s", 0, 3600, low_open=True, unit="seconds")
        inputs.check_number(keyword_weight, "keyword_weight", 0, 10)
        self.keyword_weight = float(keyword_weight)
        self.codec, self.group_size = codec, group_size
        if path is not None:
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot use {os.fspath(path)!r} as a store folder: {exc}") from exc
        tier_location = kv_url if kv_url is not None else Path(path or ".") / "kv"  # one of the two was given
        self.chunk_bytes, self.chunk_ttl_s = chunk_bytes, float(chunk_ttl_s)
        self.tier: KVTier = open_tier(
            tier_location, lock_timeout_s=float(lock_timeout_s), chunk_bytes=chunk_bytes, chunk_ttl_s=float(chunk_ttl_s)
        )
        #: the fragment blobs this process keeps in RAM in front of the tier
        self.hot = HotTier(hot_bytes)
        #: the tier's version rows, read defensively (also by gc and check)
        self.versions = Versions(self.tier)
        if embedder is None:
            embedder = MiniLMEmbedder()  # loads its weights (and torch) only when it first embeds
        self.embedder = as_embedder(embedder)
        location = index_url if index_url is not None else (Path(path) / "index" if path is not None else ":memory:")
        self.index = open_index(
            location,
            int(self.embedder.dimension),
            str(self.embedder.name),
            source=self,
            lock_timeout_s=float(lock_timeout_s),
            owner=self._store_id,
            api_key=index_api_key,
            collection_prefix=index_collection_prefix,
        )
        self.corrupt_fragments = 0
        self._clock_lock = threading.Lock()
        self._clock_anchor: tuple[float, float] | None = None  # (tier time, monotonic time) when read

    # ---------------------------------------------------------------- public API

    def now(self) -> float:
        """The store's clock, in Unix seconds: its tier's (Redis's, the folder's machine's), the
        one every writer shares. Creation times, TTLs and gc's grace are judged by it, never by a
        writer's own clock. Read from the tier every few seconds, advanced in between by this
        process's monotonic clock.

        :raises StoreError: the tier failed.
        """
        with self._clock_lock:
            ticks = time.monotonic()
            if self._clock_anchor is None or ticks - self._clock_anchor[1] > _CLOCK_REFRESH_S:
                self._clock_anchor = (self.tier.now(), time.monotonic())
            tier_time, at = self._clock_anchor
            return tier_time + (time.monotonic() - at)

    def add(
        self,
        text: str,
        *,
        tenant: str,
        session_id: str | None = None,
        importance_score: float = 0.5,
        semantic_keywords: Sequence[str] = (),
        ttl_s: float | None = None,
        index: bool = True,
    ) -> MemoryRecord:
        """Store a new memory (version 1). When this returns, the memory is durable.

        :param index: ``False`` stores the memory without embedding it (its text never reaches
            the embedder): :meth:`get` returns it, no search or recall ever does.
        :raises InvalidInputError: empty or over-long text, invalid Unicode, bad ids or scores.
        :raises StoreError: the tier refused the write; :class:`StoreBusyError` when gc judged
            every attempt abandoned (a writer stalled past gc's grace, again and again).
        """
        return self.add_owned(
            text,
            tenant=tenant,
            session_id=session_id,
            importance_score=importance_score,
            semantic_keywords=semantic_keywords,
            ttl_s=ttl_s,
            index=index,
            item=None,
        )

    def add_document(
        self,
        text: str,
        *,
        tenant: str,
        source: str | None = None,
        session_id: str | None = None,
        max_tokens: int = 200,
        count_tokens: Callable[[str], int] | None = None,
        importance_score: float = 0.5,
        ttl_s: float | None = None,
        index: bool = True,
    ) -> builtins.list[MemoryRecord]:
        """Store a long text as memories of at most ``max_tokens`` tokens each, in order.

        The parts share a ``document`` id and carry their ``part`` number and ``source``, so
        whoever recalls some of them can put them back in the document's order and say where they
        came from; each is a memory like any other (searched, recalled, its fragment encoded once
        and shifted in wherever it is recalled). Cuts fall at paragraph, line, sentence or word
        boundaries (:func:`~kvshift_memory.store.documents.split_document`).

        :param source: what to call the document (a file name, a URL); stored as given.
        :param max_tokens: the most tokens per part; keep parts within what the embedder reads
            (the bundled MiniLM reads 256 word pieces).
        :param count_tokens: the tokens of a text; pass ``engine.count_tokens`` to cut by the
            model's tokens (default: words and punctuation, a little under a subword count).
        The parts are visible together or not at all: each is live only once a document row that
        lists every part is published (one compare-and-set, after the last part is written); a
        writer killed before leaves invisible parts that :meth:`gc` and :meth:`check` remove.

        :returns: the parts' records, in document order. When this returns, all are durable.
        :raises InvalidInputError: empty or over-long text, a bad source, ``max_tokens`` or
            ``count_tokens``, or any argument :meth:`add` refuses.
        :raises StoreError: the tier refused a write (the parts written before it are deleted
            again); :class:`StoreBusyError` when gc judged the document abandoned first.
        """
        text = inputs.check_text(text, "text")
        if source is not None:
            source = inputs.check_text(source, "source")
            if len(source) > _MAX_SOURCE_CHARS:
                raise InvalidInputError(f"source has {len(source)} characters; at most {_MAX_SOURCE_CHARS}")
        max_tokens = inputs.check_positive_int(max_tokens, "max_tokens")
        if count_tokens is not None and not callable(count_tokens):
            raise InvalidInputError("count_tokens must be a function of a text")
        parts = split_document(text, max_tokens, count_tokens or approximate_tokens)
        tenant, _ = self._ids(tenant, session_id)
        document = uuid.uuid4().hex
        row_key = tier_key("d", tenant, document)
        added: builtins.list[MemoryRecord] = []
        try:
            for number, part in enumerate(parts):
                added.append(
                    self.add_owned(
                        part,
                        tenant=tenant,
                        session_id=session_id,
                        importance_score=importance_score,
                        semantic_keywords=(),
                        ttl_s=ttl_s,
                        index=index,
                        item=row_key,  # invisible until the document row lists it
                        document=(document, number, source),
                    )
                )
            # all parts at once: a reader sees none before this, all after; gc fences a row a
            # writer stalled past the grace would still publish, and then this fails
            if not self.tier.compare_and_set(row_key, None, document_row([record.id for record in added])):
                raise StoreBusyError("the document's parts were judged abandoned by gc before it was published")
        except BaseException:
            for record in added:  # invisible already; deleted now rather than by gc
                with contextlib.suppress(KVShiftError):
                    self.delete(record.id, tenant=record.tenant)
            raise
        return added

    def add_owned(
        self,
        text: str,
        *,
        tenant: str,
        session_id: str | None,
        importance_score: float,
        semantic_keywords: Sequence[str],
        ttl_s: float | None,
        index: bool,
        item: str | None,
        document: tuple[str, int, str | None] | None = None,
    ) -> MemoryRecord:
        """:meth:`add`, for a memory that the item row ``item`` owns (:mod:`.items` calls it), or
        that is part ``document[1]`` of document ``document[0]`` from source ``document[2]``
        (:meth:`add_document` calls it). An owned memory goes with its owner: gc deletes a memory
        whose item row no longer names it.

        :raises InvalidInputError: as :meth:`add`.
        :raises StoreError: as :meth:`add`.
        """
        tenant, session_id = self._ids(tenant, session_id)
        text = inputs.check_text(text, "text")
        importance_score = inputs.check_ratio(importance_score, "importance_score")
        keywords = _check_keywords(semantic_keywords)
        ttl = inputs.check_ttl(ttl_s)
        if not isinstance(index, bool):
            raise InvalidInputError(f"index must be True or False, got {index!r}")
        for _ in range(_ADD_ATTEMPTS):
            now = self.now()
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
                expires_at=None if ttl is None else now + ttl,
                indexed=index,
                item=item,
            )
            if document is not None:
                record = replace(record, document=document[0], part=document[1], source=document[2])
            try:
                self._write_version(record, None, None)
            except VersionConflictError:
                continue  # a new id has no other writer: gc fenced this write as abandoned; write it again
            return replace(record, fragment_source=self)
        raise StoreBusyError("every attempt to add the memory was judged abandoned by gc; try again")

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

    def search(
        self,
        query: str,
        *,
        tenant: str,
        session_id: str | None = None,
        k: int = 4,
        where: Callable[[MemoryRecord], bool] | None = None,
    ) -> builtins.list[MemoryRecord]:
        """The ``k`` live memories of ``tenant`` (and ``session_id``, when given) nearest ``query``.

        Memories that cannot be returned (expired ones gc has not erased yet, a deleted item's,
        those ``where`` refuses) never take a place among the ``k``: the search reaches further
        down the ranking until it has ``k`` or has seen every memory of ``tenant``.

        :param where: keep only the records for which it returns true (applied before the cut to ``k``).
        :returns: records, best first, each with ``score`` (cosine similarity, plus the keyword
            path's share: see ``keyword_weight``).
        :raises InvalidInputError: empty query, bad ids, ``k`` outside 1..1000.
        """
        tenant, session_id = self._ids(tenant, session_id)
        query = inputs.check_text(query, "query")
        k = inputs.check_positive_int(k, "k")
        if k > MAX_SEARCH_K:
            raise InvalidInputError(f"k must be at most {MAX_SEARCH_K}, got {k}")
        if where is not None and not callable(where):
            raise InvalidInputError("where must be a function of a MemoryRecord")
        embed_query = getattr(self.embedder, "embed_query", None)
        vector = embed_query(query) if callable(embed_query) else self.embedder.embed([query])[0]
        terms = keywords(query)
        for attempt in range(_SEARCH_ATTEMPTS):
            # each owner row (an item's, a document's) read once per search, so a document is judged
            # as of one read; one published after the index caught up with the log may lack parts
            # there: searched again, or, should writers keep racing it, left out (as if read before)
            owners: dict[str, bytes | None] = {}
            found = self._ranked(vector, terms, tenant, session_id, k, where, owners)
            lagging = set() if len(found) == k else self._lagging(found, owners, tenant, session_id, where)
            if not lagging:
                break
            if attempt == _SEARCH_ATTEMPTS - 1:
                found = [record for record in found if record.item not in lagging]
        return [self._touch(record) for record in found]

    def _lagging(
        self,
        found: builtins.list[MemoryRecord],
        owners: dict[str, bytes | None],
        tenant: str,
        session_id: str | None,
        where: Callable[[MemoryRecord], bool] | None,
    ) -> set[str]:
        """The rows of the documents ``found`` holds only part of, though the missing parts are
        live and pass the search's filters (the index had not seen them yet)."""
        shown = {record.id for record in found}
        rows = {record.item for record in found if record.item is not None and record.item.startswith("d/")}
        lagging = set()
        for row_key in rows:
            for part_id in listed_parts(owners.get(row_key)) - shown:
                part = self._live(tenant, part_id, owners)
                if part is None or (session_id is not None and part.session_id != session_id):
                    continue
                if where is None or where(part):
                    lagging.add(row_key)
                    break
        return lagging

    def _ranked(
        self,
        vector: Any,
        terms: Any,
        tenant: str,
        session_id: str | None,
        k: int,
        where: Callable[[MemoryRecord], bool] | None,
        owners: dict[str, bytes | None],
    ) -> builtins.list[MemoryRecord]:
        """The search's first ``k`` live records, with their scores (not yet counted as accessed)."""
        found: builtins.list[MemoryRecord] = []
        seen: set[str] = set()
        limit = k + 16
        while True:
            hits = self.index.search(
                vector,
                tenant,
                session_id,
                limit,
                terms=terms,
                keyword_weight=self.keyword_weight,
            )
            for hit in hits:
                if hit.memory_id in seen:
                    continue
                seen.add(hit.memory_id)
                record = self._live(tenant, hit.memory_id, owners)
                if record is None or (session_id is not None and record.session_id != session_id):
                    continue
                if where is not None and not where(record):
                    continue
                found.append(replace(record, score=hit.score))
                if len(found) == k:
                    return found
            if len(hits) < limit:  # the index has no more memories of this tenant
                return found
            limit *= 4

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
        raw_head, head = self.versions.read_head(tenant, memory_id)
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
            created_at=self.now(),
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
        raw, head = self.versions.read_head(tenant, memory_id)
        if head is None or head.deleted:
            return False
        self.tier.append(LOG_KEY, log_entry(tenant, memory_id))
        if not self.tier.compare_and_set(
            tier_key("h", tenant, memory_id), raw, head_bytes(head.version, head.writer, deleted=True)
        ):
            raise VersionConflictError(f"memory {memory_id!r} changed while being deleted; try again")
        return True

    def history(self, memory_id: str, *, tenant: str) -> builtins.list[MemoryRecord]:
        """Every version of a memory, oldest first: the last one is live, or, for a deleted memory
        whose data :meth:`gc` has not erased yet, its tombstone (``status="deleted"``).

        :raises MemoryNotFoundError: no memory with that id for ``tenant``, or its data was erased.
        """
        tenant, _ = self._ids(tenant, None)
        memory_id = inputs.check_identifier(memory_id, "memory_id")
        _, head = self.versions.read_head(tenant, memory_id)
        last = self._live_at(tenant, memory_id, head)
        if last is None and head is not None and head.deleted and not head.erased:
            deleted = self.versions.read_record(tenant, memory_id, head.version, head.writer)
            last = None if deleted is None else replace(deleted, status="deleted", fragment_source=self)
        if last is None or head is None:
            raise MemoryNotFoundError(f"no memory {memory_id!r} for tenant {tenant!r}")
        versions = []
        for version in range(1, last.version):
            writer = self.versions.published_writer(tenant, memory_id, version)
            record = self.versions.read_record(tenant, memory_id, version, writer) if writer else None
            if record is not None:
                versions.append(replace(record, status="superseded", fragment_source=self))
        return [*versions, self._with_access(last)]

    def list(
        self,
        tenant: str,
        *,
        session_id: str | None = None,
        include_superseded: bool = False,
        limit: int = 100,
        offset: int = 0,
    ) -> builtins.list[MemoryRecord]:
        """The memories of ``tenant``, newest first (by when each version was written): the live
        version of each, and with ``include_superseded`` the versions a correction replaced too
        (``status="superseded"``); only ``session_id``'s with it. Reading them is not an access
        (their counts stay as they were). Each call reads every memory head of the tenant.

        :param limit: at most this many (1 to :data:`MAX_LIST`), after the first ``offset``.
        :raises InvalidInputError: a bad tenant, session, flag, limit or offset.
        :raises StoreError: the tier failed.
        """
        tenant, session_id = self._ids(tenant, session_id)
        if not isinstance(include_superseded, bool):
            raise InvalidInputError(f"include_superseded must be True or False, got {include_superseded!r}")
        limit = inputs.check_positive_int(limit, "limit")
        if limit > MAX_LIST:
            raise InvalidInputError(f"limit must be at most {MAX_LIST}, got {limit}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidInputError(f"offset must be a whole number of at least 0, got {offset!r}")
        found: builtins.list[MemoryRecord] = []
        for key in list(self.tier.scan(tier_key("h", tenant, ""))):
            parts = split_key(key)
            if len(parts) != 3 or not parts[2]:
                continue
            _, head = self.versions.read_head(tenant, parts[2])
            live = self._live_at(tenant, parts[2], head)
            if live is None:
                continue
            versions = self.history(live.id, tenant=tenant)[:-1] if include_superseded else []
            found.extend(v for v in [*versions, self._with_access(live)] if session_id in (None, v.session_id))
        found.sort(key=lambda record: (record.created_at, record.version), reverse=True)
        return found[offset : offset + limit]

    def find_by_hash(self, source_text_hash: str, *, tenant: str) -> MemoryRecord | None:
        """The live memory of ``tenant`` whose text has this hash (the path text -> fragment), or ``None``."""
        tenant, _ = self._ids(tenant, None)
        if not isinstance(source_text_hash, str) or not re.fullmatch(r"[0-9a-f]{64}", source_text_hash):
            raise InvalidInputError("source_text_hash must be 64 lowercase hex characters")
        raw = self.versions.get_row(tier_key("x", tenant, source_text_hash))
        if raw is None:
            return None
        record = self._live(tenant, raw.decode("utf-8", "replace"))
        if record is None or record.source_text_hash != source_text_hash:
            return None
        return self._with_access(record)

    def claim_once(self, token: str, *, tenant: str) -> bool:
        """Claim ``token`` (a caller's name for something to be done once: a request carried out)
        for ``tenant``, by compare-and-set in the tier.

        :returns: ``True`` for the first claim from any process of this store, ``False`` ever after.
        :raises InvalidInputError: a bad tenant, or a token that is not non-empty text.
        :raises StoreError: the tier failed.
        """
        tenant, _ = self._ids(tenant, None)
        if not isinstance(token, str) or not token:
            raise InvalidInputError("a token is non-empty text")
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
        return self.tier.compare_and_set(tier_key("o", tenant, digest), None, b"1")

    def gc(self, *, keep_model_fingerprint: str | None = None) -> GCReport:
        """Free what no live memory uses.

        Erases deleted and expired memories (text, vectors, fragments), fragments and vectors of
        superseded versions (their text stays, for :meth:`history`), data that writers killed
        mid-write left behind, and, when ``keep_model_fingerprint`` is given, fragments of other
        models (stale: they would never be used again).

        :raises StoreError: the tier failed.
        """
        return maintenance.collect_garbage(self, keep_model_fingerprint=keep_model_fingerprint)

    def check(self) -> CheckReport:
        """Verify every live memory and fragment, repair what can be rebuilt, and say what was found.

        Corrupt fragment blobs are dropped (they are re-encoded from text on next use), an
        embedding that is missing, damaged or another text's is computed again, and the index is
        reconciled with the records. A live memory whose record is missing or damaged cannot be
        rebuilt and makes ``ok`` false.

        :raises StoreError: the tier failed.
        """
        return maintenance.check_store(self)

    def stats(self, *, model_fingerprint: str | None = None) -> dict[str, Any]:
        """Counts and sizes: memories (live, superseded versions, deleted), fragments and their
        bytes per codec, and with ``model_fingerprint`` how many fragments are stale (another model's)."""
        return maintenance.store_stats(self, model_fingerprint=model_fingerprint)

    def clear_cache(self) -> None:
        """Forget the fragment blobs held in this process's RAM, and the embedder's recent query
        vectors when it keeps any (measurements start cold with this)."""
        self.hot.clear()
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
        blob = self.hot.get(key)
        if blob is None:
            blob = self.tier.get(key)
            if blob is not None:
                self.hot.set(key, blob)
        return blob

    def has_fragment(self, record: MemoryRecord, variant: str) -> bool:
        """Whether a blob of ``record`` for ``variant`` is stored (without reading it)."""
        key = self._fragment_key(record, variant)
        return key is not None and (self.hot.contains(key) or self.tier.contains(key))

    def save_fragment(self, record: MemoryRecord, variant: str, blob: bytes) -> bool:
        """Keep a fragment blob for ``record``; ``False`` (nothing written) unless the record is live here."""
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError(f"a fragment blob is bytes, got {type(blob).__name__}")
        key = self._fragment_key(record, variant)
        if key is None:
            return False
        self.tier.set(key, bytes(blob))
        self.hot.set(key, bytes(blob))
        return True

    def discard_fragment(self, record: MemoryRecord, variant: str, reason: str) -> None:
        """Drop a blob that failed its checks; it is re-encoded from text by whoever needs it next."""
        key = self._fragment_key(record, variant)
        if key is None:
            return
        self.corrupt_fragments += 1
        logger.warning("dropping corrupt fragment %s: %s", key, reason)
        self.hot.delete(key)
        self.tier.delete(key)

    def _fragment_key(self, record: Any, variant: str) -> str | None:
        if not isinstance(record, MemoryRecord) or not isinstance(variant, str) or not VARIANT.fullmatch(variant):
            return None
        live = self._live(record.tenant, record.id)
        if live is None or live.version != record.version or live.source_text_hash != text_hash(record.text):
            return None
        return tier_key("f", record.tenant, record.id, record.version, variant)

    # ---------------------------------------------------------------- sessions (used by the agent)

    def load_session(self, session_id: str, *, tenant: str) -> bytes | None:
        """The state an agent saved for this session of ``tenant`` (its working window), or ``None``.

        What comes back is untrusted: the agent parses and checks it.

        :raises InvalidInputError: a malformed tenant or session id.
        :raises StoreError: the tier failed.
        """
        return self.tier.get(self._session_key(session_id, tenant))

    def save_session(self, session_id: str, state: bytes, *, tenant: str, expected: bytes | None) -> bool:
        """Replace the session's state if it is still ``expected`` (``None``: none saved yet).

        :returns: ``False`` (nothing written) when another process saved it first: read it again.
        :raises InvalidInputError: a malformed tenant or session id, or a state that is not bytes
            or is over 16 MiB.
        :raises StoreError: the tier failed.
        """
        key = self._session_key(session_id, tenant)
        if not isinstance(state, (bytes, bytearray)) or len(state) > MAX_SESSION_BYTES:
            raise InvalidInputError("a session state is bytes, at most 16 MiB")
        return self.tier.compare_and_set(key, expected, bytes(state))

    def load_core(self, *, tenant: str) -> bytes | None:
        """The core block an agent saved for ``tenant`` (:mod:`~kvshift_memory.agent.core`), or
        ``None``. What comes back is untrusted: the agent parses and checks it.

        :raises InvalidInputError: a malformed tenant.
        :raises StoreError: the tier failed.
        """
        return self.tier.get(tier_key("k", inputs.check_identifier(tenant, "tenant")))

    def save_core(self, state: bytes, *, tenant: str, expected: bytes | None) -> bool:
        """Replace ``tenant``'s core block if it is still ``expected`` (``None``: none saved yet).

        :returns: ``False`` (nothing written) when another process saved it first: read it again.
        :raises InvalidInputError: a malformed tenant, or a state that is not bytes or is over 16 MiB.
        :raises StoreError: the tier failed.
        """
        if not isinstance(state, (bytes, bytearray)) or len(state) > MAX_SESSION_BYTES:
            raise InvalidInputError("a core block is bytes, at most 16 MiB")
        key = tier_key("k", inputs.check_identifier(tenant, "tenant"))
        return self.tier.compare_and_set(key, expected, bytes(state))

    def _session_key(self, session_id: Any, tenant: Any) -> str:
        return tier_key(
            "s", inputs.check_identifier(tenant, "tenant"), inputs.check_identifier(session_id, "session_id")
        )

    # ---------------------------------------------------------------- chunks (used by the engine)

    def load_chunk(self, key: str, *, tenant: str | None) -> bytes | None:
        """The chunk stored under ``key`` for ``tenant`` (``None``: an engine's default tenant), or
        ``None``. What comes back is untrusted: the engine checks it before use.

        :raises InvalidInputError: a malformed key or tenant.
        :raises StoreError: the tier failed.
        """
        return self.tier.get_chunk(self._chunk_key(key, tenant))

    def save_chunk(self, key: str, blob: bytes, *, tenant: str | None) -> None:
        """Keep a chunk (within ``chunk_bytes`` or ``chunk_ttl_s``: older chunks may go).

        :raises InvalidInputError: a malformed key or tenant, or a blob that is not bytes.
        :raises StoreError: the tier failed.
        """
        if not isinstance(blob, (bytes, bytearray)):
            raise InvalidInputError(f"a chunk is bytes, got {type(blob).__name__}")
        self.tier.set_chunk(self._chunk_key(key, tenant), bytes(blob))

    def _chunk_key(self, key: Any, tenant: Any) -> str:
        if not isinstance(key, str) or not VARIANT.fullmatch(key):
            raise InvalidInputError(f"a chunk key is 8 to 64 lowercase hex digits, got {key!r}"[:200])
        return tier_key(CHUNK_PREFIX.rstrip("/"), "" if tenant is None else self._ids(tenant, None)[0], key)

    # ---------------------------------------------------------------- internals

    def _store_id(self) -> str:
        """This store's identity: made by the first process to ask, kept in the tier, so every
        process of the store shares it.

        :raises CorruptRecordError: the tier holds a malformed identity (nothing is guessed: a
            wrong one would make this store's points another's).
        """
        self.tier.compare_and_set(STORE_ID_KEY, None, uuid.uuid4().hex.encode())
        raw = self.tier.get(STORE_ID_KEY) or b""
        if not re.fullmatch(rb"[0-9a-f]{32}", raw):
            raise CorruptRecordError(f"the store's identity ({STORE_ID_KEY!r} in its tier) is damaged: {raw[:64]!r}")
        return raw.decode("ascii")

    @staticmethod
    def _ids(tenant: Any, session_id: Any) -> tuple[str, str | None]:
        tenant = inputs.check_identifier(tenant, "tenant")
        if session_id is not None:
            session_id = inputs.check_identifier(session_id, "session_id")
        return tenant, session_id

    def _write_version(self, record: MemoryRecord, expected_raw: bytes | None, previous: Head | None) -> None:
        """Data under this writer's own keys first, head last by compare-and-set; a refused
        writer removes its data again, so no version ever holds a text whose writer was refused.

        :param expected_raw: the head as read (``None``: the memory must not exist yet).
        :param previous: that head, parsed (``None`` for a new memory).
        """
        tenant, memory_id, version = record.tenant, record.id, record.version
        writer = uuid.uuid4().hex
        vector = self.embedder.embed([record.text])[0] if record.indexed else None
        if vector is not None and len(vector) != self.index.dimension:
            raise StoreError(f"the embedder returned {len(vector)} dimensions, not {self.index.dimension}")
        # the record first: gc tells a write in flight from an abandoned one by its record's age
        # (the tier's clock), and fences the head before it frees one (maintenance.py)
        data_keys = (
            tier_key("r", tenant, memory_id, version, writer),
            tier_key("e", tenant, memory_id, version, writer),
        )
        self.tier.set(data_keys[0], record.to_json())
        if vector is not None:
            self.tier.set(data_keys[1], pack_embedding(record.source_text_hash, vector))
        if previous is not None:
            # every writer past ``previous`` writes the same value: idempotent, and set before the head moves
            self.tier.set(tier_key("p", tenant, memory_id, previous.version), previous.writer.encode())
        self.tier.append(LOG_KEY, log_entry(tenant, memory_id))
        if not self.tier.compare_and_set(tier_key("h", tenant, memory_id), expected_raw, head_bytes(version, writer)):
            for key in data_keys:
                self.tier.delete(key)
            raise VersionConflictError(f"memory {memory_id!r} changed while being written; read it again")
        # after the head: a refused writer must not point a text at this memory (find_by_hash checks anyway)
        self.tier.set(tier_key("x", tenant, record.source_text_hash), memory_id.encode())

    def _live(self, tenant: str, memory_id: str, owners: dict[str, bytes | None] | None = None) -> MemoryRecord | None:
        return self._live_at(tenant, memory_id, self.versions.read_head(tenant, memory_id)[1], owners)

    def _live_at(
        self, tenant: str, memory_id: str, head: Head | None, owners: dict[str, bytes | None] | None = None
    ) -> MemoryRecord | None:
        if head is None or head.deleted:
            return None
        record = self.versions.read_record(tenant, memory_id, head.version, head.writer)
        if record is None or record.is_expired(self.now()):
            return None
        if record.item is not None and not owns(self.tier, record, self.now(), owners):
            return None  # an item's memory lives only while its row names it: the row is the truth
        return replace(record, fragment_source=self)

    def _with_access(self, record: MemoryRecord) -> MemoryRecord:
        """``record`` with its access count and last access, read but not counted as an access."""
        count = self.versions.get_row(tier_key("ac", record.tenant, record.id))
        last = self.versions.get_row(tier_key("al", record.tenant, record.id))
        return replace(
            record, access_count=int(count) if count and count.isdigit() else 0, last_access=float_or_none(last)
        )

    def _touch(self, record: MemoryRecord) -> MemoryRecord:
        now = self.now()
        try:
            count = self.tier.incr(tier_key("ac", record.tenant, record.id))
        except CorruptRecordError as exc:  # a tampered counter costs the count, never the read; check() reports it
            logger.warning("memory %s of %r: %s", record.id, record.tenant, exc)
            count = 0
        self.tier.set(tier_key("al", record.tenant, record.id), repr(now).encode())
        return replace(record, access_count=count, last_access=now)

    def read_log(self, start: int) -> builtins.list[bytes]:
        """The store's change log from entry ``start`` on (what an index replays to catch up).

        :raises StoreError: the tier failed.
        """
        return self.tier.read_log(LOG_KEY, start)

    def index_state(self, tenant: str, memory_id: str) -> IndexedState | None:
        """What the index should hold for a memory, read from its head: its version, session,
        vector and keywords; no vector for a deleted, unindexed or unreadable one; ``None`` for
        a memory with no head.

        :raises StoreError: the tier failed.
        """
        head = self.versions.read_head(tenant, memory_id)[1]
        if head is None:
            return None
        if head.deleted:
            return IndexedState(head.version, None, None)
        record = self.versions.read_record(tenant, memory_id, head.version, head.writer)
        if record is not None and not record.indexed:
            return IndexedState(head.version, None, None)
        embedding = unpack_embedding(
            self.versions.get_row(tier_key("e", tenant, memory_id, head.version, head.writer)), self.index.dimension
        )
        # an embedding of another text is never indexed: check() re-embeds it
        if record is None or embedding is None or embedding[0] != record.source_text_hash:
            return IndexedState(head.version, None, None)
        return IndexedState(head.version, record.session_id, embedding[1], memory_keywords(record))


def _check_keywords(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise InvalidInputError("semantic_keywords must be a list of strings")
    return tuple(inputs.check_text(word, "semantic keyword") for word in value)
