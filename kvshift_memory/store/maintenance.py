"""A memory store's upkeep: garbage collection, verification with repair, and statistics.

:meth:`MemoryStore.gc`, :meth:`MemoryStore.check` and :meth:`MemoryStore.stats` call these.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..blobs import codec_label, read_header, verify_blob
from ..exceptions import CorruptFragmentError, CorruptRecordError, StoreError
from .index import IndexedState
from .items import fence_row, owns, sweep_items
from .keywords import memory_keywords
from .layout import (
    LOG_KEY,
    ORPHAN_GRACE_S,
    Head,
    blob_fingerprint,
    head_bytes,
    is_earlier_head,
    log_entry,
    pack_embedding,
    parse_head,
    split_key,
    tier_key,
    unpack_embedding,
)
from .records import MemoryRecord
from .tiers import BLOB_PREFIX

if TYPE_CHECKING:
    from .parts import StoreParts

__all__ = ["CheckReport", "GCReport", "check_store", "collect_garbage", "store_stats"]


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
    expired_items: int = 0
    freed_fragments: int = 0
    freed_bytes: int = 0
    freed_keys: int = 0
    #: files a writer killed mid-write left in a folder tier (no row names them)
    stray_files: int = 0
    #: bytes of K/V chunks freed because the disk was short of space (memories outrank a cache)
    freed_chunk_bytes: int = 0


def collect_garbage(store: StoreParts, *, keep_model_fingerprint: str | None = None) -> GCReport:
    """Free what no live memory uses.

    Removes expired items (:func:`~.items.sweep_items`), erases deleted and expired memories
    (text, vectors, fragments), fragments and vectors of
    superseded versions (their text stays, for :meth:`history`), data that writers killed
    mid-write left behind, memories of items that no item row names, and, when
    ``keep_model_fingerprint`` is given, fragments of other models (stale: they would never be
    used again). A folder tier's files no row names (a writer killed between a value's file
    and its row) go once older than the grace; on a disk short of space, the K/V chunks go first.

    Ages are judged by the tier's clock. A write no head names yet is freed only once older than
    :data:`ORPHAN_GRACE_S` and only after gc has *fenced* the head it would be published on (made
    its bytes new): a writer stalled past the grace then fails its compare-and-set and writes
    again, so nothing gc frees is ever acknowledged.

    :raises StoreError: the tier failed.
    """
    report = GCReport(freed_chunk_bytes=store.tier.relieve_disk())  # first: what follows may need space
    report.expired_items = sweep_items(store)
    now = store.tier.now()
    for path, size in store.tier.stray_files(now - ORPHAN_GRACE_S):
        store.tier.remove_stray_file(path)
        report.stray_files += 1
        report.freed_bytes += size
    heads: dict[tuple[str, str], Head | None] = {}
    for key in list(store.tier.scan("h/")):
        parts = split_key(key)
        if len(parts) == 3:
            heads[(parts[1], parts[2])] = parse_head(store.versions.get_row(key))
    for (tenant, memory_id), head in heads.items():
        if head is None or head.erased:
            continue
        live = None if head.deleted else store.versions.read_record(tenant, memory_id, head.version, head.writer)
        if live is not None and not head.deleted and _unowned_item(store, live, now, report):
            heads[(tenant, memory_id)] = parse_head(store.versions.get_row(tier_key("h", tenant, memory_id)))
            head = heads[(tenant, memory_id)]
            if head is None or head.erased:
                continue
        if head.deleted or (live is not None and live.is_expired(now)):
            heads[(tenant, memory_id)] = _erase(store, tenant, memory_id, head, report)
    for prefix in ("r/", "e/", "p/", BLOB_PREFIX):
        for key in list(store.tier.scan(prefix)):
            parts = split_key(key)
            if len(parts) != (4 if prefix == "p/" else 5) or not parts[3].isdigit():
                continue  # not a key this layout writes (an earlier one's: check() moves those)
            # the heads were read before this scan; a memory written since is judged by its head now
            if _verdict(store, prefix, parts, heads.get((parts[1], parts[2])), now) != "keep":
                raw_head, head = store.versions.read_head(parts[1], parts[2])
                verdict = _verdict(store, prefix, parts, head, now)
                if verdict == "free" or (verdict == "fence" and _fence(store, parts, raw_head, head)):
                    _free(store, key, report)
            elif prefix == BLOB_PREFIX and keep_model_fingerprint is not None:
                raw = store.versions.get_row(key)
                if raw is not None and blob_fingerprint(raw) != keep_model_fingerprint:
                    _free(store, key, report)
    return report


def _unowned_item(store: StoreParts, record: MemoryRecord, now: float, report: GCReport | CheckReport) -> bool:
    """Delete ``record``, an item's memory or a document's part, when no row names it and it is
    older than the grace a write in flight gets (the row fenced first, so that write can no
    longer name it).

    :returns: whether it was deleted.
    """
    if record.item is None or owns(store.tier, record, now) or now - record.created_at <= ORPHAN_GRACE_S:
        return False
    raw_row = store.versions.get_row(record.item)
    if owns(store.tier, record, now) or not fence_row(store.tier, record.item, raw_row, now):
        return False  # named meanwhile, or the row moved under us: judged again next time
    try:
        store.delete(record.id, tenant=record.tenant)
    except StoreError:
        return False  # changed meanwhile: judged again next time
    owner = "document" if record.item.startswith("d/") else "item"
    message = f"memory {record.id} of {record.tenant!r}: no {owner} row names it (a writer died mid-write)"
    if isinstance(report, CheckReport):
        report.problems.append(message)
        report.repaired.append(f"{message} (deleted)")
    return True


def check_store(store: StoreParts) -> CheckReport:
    """Verify every live memory and fragment, repair what can be rebuilt, and say what was found.

    Corrupt fragment blobs are dropped (they are re-encoded from text on next use), an
    embedding that is missing, damaged or another text's is computed again, and the index is
    reconciled with the records. A live memory whose record is missing or damaged cannot be
    rebuilt and makes ``ok`` false.

    :raises StoreError: the tier failed.
    """
    report = CheckReport(ok=True, memories=0, fragments=0)
    now = store.tier.now()
    for path, size in store.tier.stray_files(now - ORPHAN_GRACE_S):
        store.tier.remove_stray_file(path)
        message = f"a file no row names ({size} bytes, left by a writer killed mid-write): {path}"
        report.problems.append(message)
        report.repaired.append(f"{message} (removed)")
    states: dict[tuple[str, str], IndexedState] = {}  # what each memory's index point must be
    for key in list(store.tier.scan("h/")):
        parts = split_key(key)
        raw_head = _get_or_report(store, key, report)
        head = parse_head(raw_head)
        if len(parts) == 3 and head is None and raw_head is not None and is_earlier_head(raw_head):
            head = _move_to_writer_keys(store, parts[1], parts[2], raw_head, report)
        if len(parts) != 3 or head is None:
            report.problems.append(f"unreadable head {key!r}")
            report.ok = False
            continue
        tenant, memory_id = parts[1], parts[2]
        states[(tenant, memory_id)] = IndexedState(head.version, None, None)
        if head.deleted:
            continue
        report.memories += 1
        try:
            record = MemoryRecord.from_json(
                store.tier.get(tier_key("r", tenant, memory_id, head.version, head.writer)) or b""
            )
        except StoreError as exc:
            report.problems.append(f"memory {memory_id} of {tenant!r}: {exc}")
            report.ok = False
            continue
        if record.id != memory_id or record.tenant != tenant or record.version != head.version:
            report.problems.append(f"memory {memory_id} of {tenant!r}: record names {record.tenant}/{record.id}")
            report.ok = False
            continue
        if _unowned_item(store, record, now, report):
            report.memories -= 1
            continue
        if not record.indexed:
            continue  # never embedded: it has no point
        embedding_key = tier_key("e", tenant, memory_id, head.version, head.writer)
        embedding = unpack_embedding(_get_or_report(store, embedding_key, report), store.index.dimension)
        if embedding is None or embedding[0] != record.source_text_hash:
            state = "missing or damaged" if embedding is None else "computed from another text"
            problem = f"memory {memory_id} of {tenant!r}: embedding {state}"
            report.problems.append(problem)
            embedding = (record.source_text_hash, store.embedder.embed([record.text])[0])
            store.tier.set(embedding_key, pack_embedding(*embedding))
            report.repaired.append(f"{problem} (embedded again)")
        states[(tenant, memory_id)] = IndexedState(
            head.version, record.session_id, embedding[1], memory_keywords(record)
        )
    for key in list(store.tier.scan(BLOB_PREFIX)):
        parts = split_key(key)
        report.fragments += 1
        try:
            metadata = verify_blob(store.tier.get(key) or b"")
            if len(parts) != 5 or (metadata.get("tenant"), metadata.get("memory_id"), metadata.get("version")) != (
                parts[1],
                parts[2],
                parts[3],
            ):
                raise CorruptFragmentError("blob is stored under another memory's key")
        except StoreError as exc:  # a corrupt blob, or a row the tier refuses to read
            problem = f"fragment {key!r}: {exc}"
            report.problems.append(problem)
            store.tier.delete(key)
            store.hot.delete(key)
            report.repaired.append(f"{problem} (dropped; re-encoded from text on next use)")
    for key in list(store.tier.scan("ac/")):
        raw = _get_or_report(store, key, report)
        if raw is not None and not raw.isdigit():
            problem = f"access counter {key!r} holds {raw[:32]!r}, not a count"
            report.problems.append(problem)
            store.tier.delete(key)
            report.repaired.append(f"{problem} (reset)")
    strays = store.index.rebuild(states)
    if strays:
        report.problems.append(f"index held {strays} points of no memory")
        report.repaired.append(f"removed {strays} stray index points")
    return report


def store_stats(store: StoreParts, *, model_fingerprint: str | None = None) -> dict[str, Any]:
    """Counts and sizes: memories (live, superseded versions, deleted), fragments and their
    bytes per codec, and with ``model_fingerprint`` how many fragments are stale (another model's)."""
    out: dict[str, Any] = {
        "kv_url": store.tier.url,
        "index": store.index.location,
        "codec": codec_label(store.codec, store.group_size),
        "memories": 0,
        "deleted": 0,
        "versions": 0,
        "fragments": 0,
        "fragment_bytes": 0,
        "fragments_by_codec": {},
        "corrupt_fragments_seen": store.corrupt_fragments,
        "chunk_budget_bytes": store.chunk_bytes,
        "chunk_ttl_s": store.chunk_ttl_s,
    }
    out["chunks"], out["chunk_bytes"] = store.tier.chunk_usage()
    for key in store.tier.scan("h/"):
        head = parse_head(store.versions.get_row(key))
        if head is None:
            continue
        out["deleted" if head.deleted else "memories"] += 1
        out["versions"] += head.version
    if model_fingerprint is not None:
        out["stale_fragments"] = 0
    for key in store.tier.scan(BLOB_PREFIX):
        raw = store.versions.get_row(key)
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


def _verdict(store: StoreParts, prefix: str, parts: list[str], head: Head | None, now: float) -> str:
    """What gc does with the data under a key (split into ``parts``) of a memory whose head is
    ``head``: ``"keep"`` it, ``"free"`` it (no writer can ever publish it), or ``"fence"`` the
    head and then free it (an abandoned write that a stalled writer could still publish)."""
    tenant, memory_id, version = parts[1], parts[2], int(parts[3])
    if head is not None and head.deleted:
        return "free"
    if prefix == "p/":
        # a publication pointer is never wrong (a version has one writer), and the head read at
        # the start of gc may already be behind one a supersede just wrote: keep while the memory lives
        return "keep" if head is not None else "free"
    if prefix == BLOB_PREFIX:
        return "keep" if head is not None and version == head.version else "free"
    writer = parts[4]
    if head is not None and version <= head.version:
        published = (
            head.writer if version == head.version else store.versions.published_writer(tenant, memory_id, version)
        )
        # superseded versions keep their text (history), not their embedding
        return "keep" if writer == published and (prefix == "r/" or version == head.version) else "free"
    # no head names it yet: a write in flight (the first version, or the next one), or abandoned
    if version != (head.version + 1 if head is not None else 1):
        return "free"
    return "fence" if _abandoned(store, tenant, memory_id, version, writer, now) else "keep"


def _fence(store: StoreParts, parts: list[str], raw_head: bytes | None, head: Head | None) -> bool:
    """Change the head an abandoned write would be published on, if it is still ``raw_head``, so
    its writer's compare-and-set (against the head it read before writing) can never succeed.
    A first version gets a tombstone (its id is then never used: the writer adds under a new one).

    :returns: whether the head was still ``raw_head`` (the write can no longer be published).
    """
    tenant, memory_id, writer = parts[1], parts[2], parts[4]
    if head is None and raw_head is not None:
        return False  # an unreadable head: check() reports it; nothing is freed on a guess
    if head is None:
        fenced = head_bytes(1, writer, deleted=True, erased=True)
    else:
        fenced = head.to_bytes(fence=uuid.uuid4().hex)
    return store.tier.compare_and_set(tier_key("h", tenant, memory_id), raw_head, fenced)


def _move_to_writer_keys(
    store: StoreParts, tenant: str, memory_id: str, raw_head: bytes, report: CheckReport
) -> Head | None:
    """A memory an earlier build wrote (versions under ``r/t/m/v``, no writer in its head),
    copied to this layout and published by compare-and-set; the old keys are then removed.

    :returns: its new head, or ``None`` when its live version's record is missing.
    """
    earlier = json.loads(raw_head)
    version, deleted = earlier["v"], bool(earlier.get("deleted"))
    writers = {}
    for old_version in range(1, version + 1):
        raw = store.versions.get_row(tier_key("r", tenant, memory_id, old_version))
        if raw is not None:
            writers[old_version] = uuid.uuid4().hex
            store.tier.set(tier_key("r", tenant, memory_id, old_version, writers[old_version]), raw)
            if old_version < version:
                store.tier.set(tier_key("p", tenant, memory_id, old_version), writers[old_version].encode())
    live = store.versions.read_record(tenant, memory_id, version, writers[version]) if version in writers else None
    if live is None:
        return None
    vector = store.embedder.embed([live.text])[0]
    store.tier.set(
        tier_key("e", tenant, memory_id, version, writers[version]), pack_embedding(live.source_text_hash, vector)
    )
    store.tier.append(LOG_KEY, log_entry(tenant, memory_id))
    new_head = head_bytes(version, writers[version], deleted=deleted)
    if not store.tier.compare_and_set(tier_key("h", tenant, memory_id), raw_head, new_head):
        return parse_head(store.versions.get_row(tier_key("h", tenant, memory_id)))  # another check() moved it first
    for old_version in range(1, version + 1):
        for kind in ("r", "e"):
            store.tier.delete(tier_key(kind, tenant, memory_id, old_version))
    report.repaired.append(f"memory {memory_id} of {tenant!r}: moved from an earlier build's layout")
    return parse_head(new_head)


def _get_or_report(store: StoreParts, key: str, report: CheckReport) -> bytes | None:
    """A key's value, or ``None`` (the problem noted) when the tier refuses to read its row."""
    try:
        return store.tier.get(key)
    except CorruptRecordError as exc:
        report.problems.append(f"{key!r}: {exc}")
        return None


def _erase(store: StoreParts, tenant: str, memory_id: str, head: Head, report: GCReport) -> Head:
    """Tombstone a memory and return its new head; gc's one scan of records, vectors and blobs
    then frees the rest of its data (and frees it on the next gc, if this one is interrupted)."""
    for key in (tier_key("ac", tenant, memory_id), tier_key("al", tenant, memory_id)):
        _free(store, key, report)
    store.tier.append(LOG_KEY, log_entry(tenant, memory_id))
    # the tombstone stays: it tells every index to drop the point, and ids are never reused
    erased = replace(head, deleted=True, erased=True)
    store.tier.set(tier_key("h", tenant, memory_id), erased.to_bytes())
    report.erased_memories += 1
    return erased


def _free(store: StoreParts, key: str, report: GCReport) -> None:
    raw = store.versions.get_row(key) if key.startswith(BLOB_PREFIX) else None
    if store.tier.delete(key):
        report.freed_keys += 1
        if raw is not None:
            report.freed_fragments += 1
            report.freed_bytes += len(raw)
    store.hot.delete(key)


def _abandoned(store: StoreParts, tenant: str, memory_id: str, version: int, writer: str, now: float) -> bool:
    """Whether a write no head names is over (its writer was killed, or refused and killed
    before it cleaned up), rather than in flight in another process."""
    record = store.versions.read_record(tenant, memory_id, version, writer)
    return record is None or now - record.created_at > ORPHAN_GRACE_S
