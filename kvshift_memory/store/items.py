"""Items: memories a caller names by a namespace and a key, with a JSON value beside the text.

A key-value store's contract (LangGraph's ``BaseStore``: put, get, search, delete) over the
memory store. Each item is an *item row* under ``i/<tenant>/<digest of namespace and key>`` that
holds the namespace, key, value and the id of the memory that holds its text (embedded, recalled
and given KV fragments like any other memory). The row is the one truth: the memory records the
row that owns it (``MemoryRecord.item``) and is live only while that row names it, so a put or a
delete changes an item in one compare-and-set, of the row, and no reader ever sees half of one.

- A put whose text is new writes a new memory first (owned by the row, so nothing sees it yet),
  then publishes the row naming it by compare-and-set, then deletes the memory the row named
  before. Of two writers of one key the last to publish wins; the one refused deletes what it
  made and tries again.
- A delete replaces the row by a tombstone without the value (the item is gone at that moment),
  then deletes the memory.
- A writer killed anywhere leaves at most a memory no row names: invisible to every read and
  search, and removed by :meth:`MemoryStore.gc` and :meth:`MemoryStore.check` once older than
  the grace a write in flight gets (by the tier's clock; they fence the row first, so a put
  stalled past the grace is refused and writes again).

An item put with a time to live (``ttl_s``) carries its expiry in its row: past it (by the
store's clock, :meth:`MemoryStore.now`, the one every writer shares) the item is gone for every
read and search, and its memory with it. A read may push the expiry on (:func:`refresh_item`);
:func:`sweep_items` (and gc) replace expired rows by tombstones and delete their memories.

Memory ids are never reused, so a key put again after a delete gets a new memory.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .. import inputs
from ..exceptions import InvalidInputError, StoreBusyError, VersionConflictError
from .documents import listed_parts
from .layout import split_key, tier_key
from .records import MemoryRecord

if TYPE_CHECKING:
    from .parts import StoreParts
    from .tiers import KVTier

__all__ = [
    "Item",
    "delete_item",
    "fence_row",
    "get_item",
    "item_of",
    "item_tenants",
    "list_items",
    "owns",
    "put_item",
    "refresh_item",
    "sweep_items",
]

#: bound on an item's value as JSON (a value is read back whole on every get)
MAX_VALUE_BYTES = 1 << 20
MAX_NAMESPACE_DEPTH = 16
# writers of one key that keep beating each other: past this many tries, StoreBusyError
_ATTEMPTS = 16


@dataclass(frozen=True)
class Item:
    """A named memory: where it is, its value, and the memory that holds its text."""

    tenant: str
    namespace: tuple[str, ...]
    key: str
    value: dict[str, Any]
    created_at: float
    updated_at: float
    memory: MemoryRecord
    #: when the item expires (store clock, Unix seconds), and the time to live a refresh restarts
    expires_at: float | None = None
    ttl_s: float | None = None


def _check_name(namespace: Any, key: Any) -> tuple[tuple[str, ...], str]:
    if not isinstance(namespace, (tuple, list)) or not 0 < len(namespace) <= MAX_NAMESPACE_DEPTH:
        raise InvalidInputError(f"a namespace is a tuple of 1 to {MAX_NAMESPACE_DEPTH} labels, got {namespace!r}")
    labels = tuple(inputs.check_identifier(label, "namespace label") for label in namespace)
    return labels, inputs.check_identifier(key, "key")


def _check_value(value: Any) -> bytes:
    if not isinstance(value, Mapping):
        raise InvalidInputError(f"an item's value is a dict, got {type(value).__name__}")
    try:
        encoded = json.dumps(dict(value), ensure_ascii=False, sort_keys=True, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"an item's value must be JSON (str keys; no NaN, no objects): {exc}") from None
    except RecursionError:
        raise InvalidInputError("an item's value is nested too deeply to store as JSON") from None
    if len(encoded) > MAX_VALUE_BYTES:
        raise InvalidInputError(f"an item's value is {len(encoded):,} bytes as JSON, over {MAX_VALUE_BYTES:,}")
    return encoded


def _row_key(tenant: str, namespace: tuple[str, ...], key: str) -> str:
    digest = hashlib.sha256(json.dumps([list(namespace), key], ensure_ascii=False).encode("utf-8")).hexdigest()
    return tier_key("i", tenant, digest[:40])


def _parse_row(raw: bytes | None, now: float | None) -> dict[str, Any] | None:
    """A live item row, or ``None`` (none, a tombstone, expired at ``now``, or a row that fails its
    checks: rows are untrusted). ``now=None`` reads an expired row as live (what it says, not
    whether it still holds)."""
    if not raw:
        return None
    try:
        row = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(row, dict) or row.get("deleted"):
        return None
    good = (
        isinstance(row.get("id"), str)
        and isinstance(row.get("namespace"), list)
        and all(isinstance(label, str) for label in row["namespace"])
        and isinstance(row.get("key"), str)
        and isinstance(row.get("value"), dict)
        and all(isinstance(row.get(t), (int, float)) and math.isfinite(row[t]) for t in ("created_at", "updated_at"))
        and all(_is_seconds(row.get(t)) for t in ("expires_at", "ttl_s"))
    )
    if not good:
        return None
    return None if now is not None and row.get("expires_at") is not None and row["expires_at"] <= now else row


def _is_seconds(value: Any) -> bool:
    return value is None or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    )


def _memory(store: StoreParts, tenant: str, row: dict[str, Any] | None) -> MemoryRecord | None:
    """The live memory a row names (``None`` also for an id or tenant that is no identifier: rows are untrusted)."""
    if row is None:
        return None
    try:
        return store.get(row["id"], tenant=tenant)
    except InvalidInputError:
        return None


def _item(tenant: str, row: dict[str, Any], memory: MemoryRecord) -> Item:
    return Item(
        tenant,
        tuple(row["namespace"]),
        row["key"],
        row["value"],
        row["created_at"],
        row["updated_at"],
        memory,
        row.get("expires_at"),
        row.get("ttl_s"),
    )


def owns(tier: KVTier, record: MemoryRecord, now: float, rows: dict[str, bytes | None] | None = None) -> bool:
    """Whether the row ``record.item`` names ``record``: an item row that has not expired at
    ``now``, or a document row that lists it (only then is an item's memory, or a document's
    part, live). ``rows``: the rows read so far by a caller that judges many records as of one
    read of each row (a search); the row is read and kept there when missing."""
    row_key = record.item or ""
    mine = row_key.startswith((tier_key("d", record.tenant) + "/", tier_key("i", record.tenant) + "/"))
    if not mine:  # records are untrusted: never another tenant's row
        return False
    if rows is not None and row_key in rows:
        raw = rows[row_key]
    else:
        raw = tier.get(row_key)
        if rows is not None:
            rows[row_key] = raw
    if row_key.startswith("d/"):  # a document's part: live once the document is
        return record.id in listed_parts(raw)
    row = _parse_row(raw, now)
    return row is not None and row["id"] == record.id


def fence_row(tier: KVTier, row_key: str, raw: bytes | None, now: float) -> bool:
    """Make the row's bytes new, keeping what it says, if they are still ``raw``: a put that read
    ``raw`` can then no longer publish. gc does this before it removes a memory the row does not
    name (a put stalled past the grace may be about to name it). A row expired at ``now`` becomes
    a tombstone.

    :returns: whether the row was still ``raw`` (and is now fenced).
    """
    try:
        row = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        row = None
    if not isinstance(row, dict) or (_parse_row(raw, now) is None and not listed_parts(raw)):
        row = {"deleted": True}  # nothing readable, or expired: what it says is "no item" (no document)
    row["fence"] = uuid.uuid4().hex
    return tier.compare_and_set(row_key, raw, json.dumps(row, ensure_ascii=False).encode("utf-8"))


def _retire(store: StoreParts, tenant: str, memory_id: Any) -> None:
    """Delete a memory no row names any more (it is invisible already: this frees it sooner than gc)."""
    for _ in range(_ATTEMPTS):
        try:
            store.delete(memory_id, tenant=tenant)
            return
        except VersionConflictError:
            continue  # gc tombstoned or fenced it meanwhile: read it again
        except InvalidInputError:
            return  # a row naming no valid memory id: nothing to delete


def put_item(
    store: StoreParts,
    tenant: str,
    namespace: Sequence[str],
    key: str,
    value: Mapping[str, Any],
    text: str,
    *,
    session_id: str | None = None,
    ttl_s: float | None = None,
    index: bool = True,
) -> Item:
    """Create or replace the item ``key`` of ``namespace``: ``text`` becomes its memory's text
    (a new memory when it changed), ``value`` its value.

    :param ttl_s: the item expires this many seconds after this put (or after the last
        :func:`refresh_item`), by the store's clock; ``None`` keeps it until it is deleted.
    :param index: ``False``: the item's text is not embedded or indexed (search never finds it,
        recall never shows it); ``get`` still returns it.
    :raises InvalidInputError: a bad tenant, namespace, key, text, value or TTL.
    :raises StoreBusyError: other writers of the same key kept publishing first.
    :raises StoreError: the tier refused a write.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    encoded_value = _check_value(value)
    text = inputs.check_text(text, "text")
    ttl = inputs.check_ttl(ttl_s)
    if not isinstance(index, bool):
        raise InvalidInputError(f"index must be True or False, got {index!r}")
    row_key = _row_key(tenant, labels, key)
    for _ in range(_ATTEMPTS):
        raw = store.tier.get(row_key)
        now = store.now()
        said = _parse_row(raw, None)  # an expired row's memory is retired once this put wins
        row = _parse_row(raw, now)
        current = _memory(store, tenant, row)
        made = None
        if current is None or current.text != text or current.indexed != index:
            made = store.add_owned(
                text,
                tenant=tenant,
                session_id=session_id,
                importance_score=0.5,
                semantic_keywords=(),
                ttl_s=None,  # the row carries the item's expiry: a refresh moves it without a new memory
                index=index,
                item=row_key,
            )
        memory = made or current
        assert memory is not None  # one of the two, by the branch above
        published = {
            "id": memory.id,
            "namespace": list(labels),
            "key": key,
            "value": json.loads(encoded_value),
            "created_at": row["created_at"] if row is not None and current is not None else now,
            "updated_at": now,
            "expires_at": None if ttl is None else now + ttl,
            "ttl_s": ttl,
        }
        if store.tier.compare_and_set(row_key, raw, json.dumps(published, ensure_ascii=False).encode("utf-8")):
            if said is not None and said["id"] != memory.id:
                _retire(store, tenant, said["id"])
            return _item(tenant, published, memory)
        if made is not None:  # refused: the memory made for this write is nobody's
            _retire(store, tenant, made.id)
    raise StoreBusyError(f"item {key!r} of {labels!r}: other writers kept publishing first; try again")


def get_item(
    store: StoreParts, tenant: str, namespace: Sequence[str], key: str, *, refresh: bool = False
) -> Item | None:
    """The item, or ``None`` (none, deleted, expired, or another tenant's).

    :param refresh: restart the item's time to live (:func:`refresh_item`), when it has one.
    :raises InvalidInputError: a bad tenant, namespace or key.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    row_key = _row_key(tenant, labels, key)
    raw = store.tier.get(row_key)
    now = store.now()  # one instant for the read and its refresh: an item live at it is refreshed from it
    row = _parse_row(raw, now)
    if row is None or tuple(row["namespace"]) != labels or row["key"] != key:
        return None
    if refresh:  # before its memory is read: that read judges the row's expiry again, a moment later
        row = _refreshed_row(store, row_key, raw, row, now)
    memory = _memory(store, tenant, row)
    if memory is None:
        return None
    return _item(tenant, row, memory)


def refresh_item(store: StoreParts, item: Item) -> Item:
    """Restart ``item``'s time to live from now (what a read does in LangGraph's stores): it then
    expires ``ttl_s`` after this call. An item with no TTL, or one another writer changed since
    it was read (that writer's put set its expiry), is returned as it was.

    :raises StoreError: the tier failed.
    """
    row_key = _row_key(item.tenant, item.namespace, item.key)
    raw, now = store.tier.get(row_key), store.now()
    row = _parse_row(raw, now)
    if item.ttl_s is None or row is None or row["id"] != item.memory.id:
        return item
    row = _refreshed_row(store, row_key, raw, row, now)
    return item if row is None or row["id"] != item.memory.id else replace(item, expires_at=row["expires_at"])


def _refreshed_row(store: StoreParts, row_key: str, raw: bytes | None, row: dict[str, Any], now: float) -> Any:
    """The live ``row`` (read as ``raw``) with its expiry restarted at ``now`` (unchanged without a
    TTL); when another writer changed it first, the row as that writer left it: a put's (its
    expiry stands), or ``None`` after a sweep or a delete."""
    if row.get("ttl_s") is None:
        return row
    refreshed = {**row, "expires_at": now + row["ttl_s"]}
    if store.tier.compare_and_set(row_key, raw, json.dumps(refreshed).encode("utf-8")):
        return refreshed
    return _parse_row(store.tier.get(row_key), now)


def delete_item(store: StoreParts, tenant: str, namespace: Sequence[str], key: str) -> bool:
    """Delete the item and its memory; its value is not kept. The item is gone when the row's
    tombstone is written; its memory is deleted next (or, if this writer dies first, by gc).

    :returns: whether there was a live item (an expired one is removed too, and counts as none).
    :raises InvalidInputError: a bad tenant, namespace or key.
    :raises StoreBusyError: other writers of the same key kept publishing first.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    row_key = _row_key(tenant, labels, key)
    for _ in range(_ATTEMPTS):
        raw = store.tier.get(row_key)
        said = _parse_row(raw, None)
        if said is None:
            return False
        live = _parse_row(raw, store.now()) is not None
        if store.tier.compare_and_set(row_key, raw, json.dumps({"deleted": True}).encode()):
            _retire(store, tenant, said["id"])
            return live
    raise StoreBusyError(f"item {key!r} of {labels!r}: other writers kept publishing first; try again")


def item_of(store: StoreParts, record: MemoryRecord) -> Item | None:
    """The item whose memory ``record`` is (a search hit), or ``None`` for a memory that is no item's."""
    row_key = record.item
    if row_key is None:  # an item a build before ``MemoryRecord.item`` wrote: its memory points to its row
        pointer = store.tier.get(tier_key("ir", record.tenant, record.id))
        row_key = pointer.decode("utf-8", "replace") if pointer else ""
    if not row_key.startswith(tier_key("i", record.tenant) + "/"):  # rows are untrusted: never another tenant's
        return None
    row = _parse_row(store.tier.get(row_key), store.now())
    if row is None or row["id"] != record.id:
        return None
    return _item(record.tenant, row, record)


def list_items(store: StoreParts, tenant: str | None = None) -> Iterator[Item]:
    """Every live item (of ``tenant``, when given), in no particular order."""
    prefix = tier_key("i", inputs.check_identifier(tenant, "tenant")) + "/" if tenant is not None else "i/"
    now = store.now()
    for row_key in list(store.tier.scan(prefix)):
        parts = split_key(row_key)
        row = _parse_row(store.tier.get(row_key), now) if len(parts) == 3 else None
        memory = _memory(store, parts[1], row) if len(parts) == 3 else None
        if row is not None and memory is not None:
            yield _item(parts[1], row, memory)


def item_tenants(store: StoreParts) -> set[str]:
    """The tenants that have item rows (live or deleted), read from the rows' keys alone."""
    return {parts[1] for parts in map(split_key, store.tier.scan("i/")) if len(parts) == 3 and parts[1]}


def sweep_items(store: StoreParts) -> int:
    """Remove every expired item: its row becomes a tombstone (by compare-and-set, so a put that
    renewed it meanwhile wins) and its memory is deleted. Reads never show an expired item, swept
    or not: this frees its space.

    :returns: how many expired items were removed.
    :raises StoreError: the tier failed.
    """
    removed = 0
    now = store.now()
    for row_key in list(store.tier.scan("i/")):
        parts = split_key(row_key)
        if len(parts) != 3:
            continue
        raw = store.tier.get(row_key)
        said = _parse_row(raw, None)
        if said is None or _parse_row(raw, now) is not None:
            continue
        if store.tier.compare_and_set(row_key, raw, json.dumps({"deleted": True}).encode()):
            _retire(store, parts[1], said["id"])
            removed += 1
    return removed
