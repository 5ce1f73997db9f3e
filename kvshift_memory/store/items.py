"""Items: memories a caller names by a namespace and a key, with a JSON value beside the text.

A key-value store's contract (LangGraph's ``BaseStore``: put, get, search, delete) over the
memory store. Each item is a memory (its text indexed, recalled and given KV fragments like any
other) plus an *item row* under ``i/<tenant>/<digest of namespace and key>`` that holds the
namespace, key, value and the memory's id; ``ir/<tenant>/<memory id>`` leads from a search hit
back to its row. Memory ids are never reused, so a key put again after a delete gets a new
memory. A put is published by a compare-and-set of the item row: of two writers of one key, the
last to publish wins, and a writer that loses removes the memory it made. A delete replaces the
row by a tombstone without the value, so a deleted value is not kept.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import inputs
from ..exceptions import InvalidInputError, StoreBusyError, VersionConflictError
from .layout import split_key, tier_key
from .records import MemoryRecord

if TYPE_CHECKING:
    from .memory_store import MemoryStore

__all__ = ["Item", "delete_item", "get_item", "item_of", "list_items", "put_item"]

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
    if len(encoded) > MAX_VALUE_BYTES:
        raise InvalidInputError(f"an item's value is {len(encoded):,} bytes as JSON, over {MAX_VALUE_BYTES:,}")
    return encoded


def _row_key(tenant: str, namespace: tuple[str, ...], key: str) -> str:
    digest = hashlib.sha256(json.dumps([list(namespace), key], ensure_ascii=False).encode("utf-8")).hexdigest()
    return tier_key("i", tenant, digest[:40])


def _parse_row(raw: bytes | None) -> dict[str, Any] | None:
    """A live item row, or ``None`` (none, a tombstone, or a row that fails its checks: rows are untrusted)."""
    if not raw:
        return None
    try:
        row = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
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
    )
    return row if good else None


def _memory(store: MemoryStore, tenant: str, row: dict[str, Any] | None) -> MemoryRecord | None:
    """The live memory a row names (``None`` also for an id or tenant that is no identifier: rows are untrusted)."""
    if row is None:
        return None
    try:
        return store.get(row["id"], tenant=tenant)
    except InvalidInputError:
        return None


def _item(tenant: str, row: dict[str, Any], memory: MemoryRecord) -> Item:
    return Item(tenant, tuple(row["namespace"]), row["key"], row["value"], row["created_at"], row["updated_at"], memory)


def put_item(
    store: MemoryStore,
    tenant: str,
    namespace: Sequence[str],
    key: str,
    value: Mapping[str, Any],
    text: str,
    *,
    session_id: str | None = None,
    ttl_s: float | None = None,
) -> Item:
    """Create or replace the item ``key`` of ``namespace``: ``text`` becomes its memory's text
    (a new version when it changed), ``value`` its value.

    :raises InvalidInputError: a bad tenant, namespace, key, text or value.
    :raises StoreBusyError: other writers of the same key kept publishing first.
    :raises StoreError: the tier refused a write.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    encoded_value = _check_value(value)
    text = inputs.check_text(text, "text")
    row_key = _row_key(tenant, labels, key)
    for _ in range(_ATTEMPTS):
        raw = store.tier.get(row_key)
        row = _parse_row(raw)
        current = _memory(store, tenant, row)
        now = time.time()
        try:
            if current is None:
                memory = store.add(text, tenant=tenant, session_id=session_id, ttl_s=ttl_s)
                store.tier.set(tier_key("ir", tenant, memory.id), row_key.encode())
            elif current.text != text:
                memory = store.supersede(current.id, text, tenant=tenant, expected_version=current.version)
            else:
                memory = current
        except VersionConflictError:
            continue  # another writer of this key moved the memory: read the row again
        published = {
            "id": memory.id,
            "namespace": list(labels),
            "key": key,
            "value": json.loads(encoded_value),
            "created_at": row["created_at"] if row is not None and current is not None else now,
            "updated_at": now,
        }
        if store.tier.compare_and_set(row_key, raw, json.dumps(published, ensure_ascii=False).encode("utf-8")):
            return _item(tenant, published, memory)
        if current is None:  # the memory made for this write is nobody's: remove it
            store.delete(memory.id, tenant=tenant)
    raise StoreBusyError(f"item {key!r} of {labels!r}: other writers kept publishing first; try again")


def get_item(store: MemoryStore, tenant: str, namespace: Sequence[str], key: str) -> Item | None:
    """The item, or ``None`` (none, deleted, expired, or another tenant's).

    :raises InvalidInputError: a bad tenant, namespace or key.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    row = _parse_row(store.tier.get(_row_key(tenant, labels, key)))
    if row is None or tuple(row["namespace"]) != labels or row["key"] != key:
        return None
    memory = _memory(store, tenant, row)
    return None if row is None or memory is None else _item(tenant, row, memory)


def delete_item(store: MemoryStore, tenant: str, namespace: Sequence[str], key: str) -> bool:
    """Delete the item and its memory; its value is not kept.

    :returns: whether there was a live item.
    :raises InvalidInputError: a bad tenant, namespace or key.
    :raises StoreBusyError: other writers of the same key kept publishing first.
    """
    tenant = inputs.check_identifier(tenant, "tenant")
    labels, key = _check_name(namespace, key)
    row_key = _row_key(tenant, labels, key)
    for _ in range(_ATTEMPTS):
        raw = store.tier.get(row_key)
        row = _parse_row(raw)
        if row is None:
            return False
        if store.tier.compare_and_set(row_key, raw, json.dumps({"deleted": True}).encode()):
            try:
                return store.delete(row["id"], tenant=tenant)
            except InvalidInputError:  # a row naming no valid memory id: the tombstone is all there was
                return True
    raise StoreBusyError(f"item {key!r} of {labels!r}: other writers kept publishing first; try again")


def item_of(store: MemoryStore, record: MemoryRecord) -> Item | None:
    """The item whose memory ``record`` is (a search hit), or ``None`` for a memory that is no item's."""
    pointer = store.tier.get(tier_key("ir", record.tenant, record.id))
    row_key = pointer.decode("utf-8", "replace") if pointer else ""
    if not row_key.startswith(tier_key("i", record.tenant) + "/"):  # rows are untrusted: never another tenant's
        return None
    row = _parse_row(store.tier.get(row_key))
    if row is None or row["id"] != record.id:
        return None
    return _item(record.tenant, row, record)


def list_items(store: MemoryStore, tenant: str | None = None) -> Iterator[Item]:
    """Every live item (of ``tenant``, when given), in no particular order."""
    prefix = tier_key("i", inputs.check_identifier(tenant, "tenant")) + "/" if tenant is not None else "i/"
    for row_key in list(store.tier.scan(prefix)):
        parts = split_key(row_key)
        row = _parse_row(store.tier.get(row_key)) if len(parts) == 3 else None
        memory = _memory(store, parts[1], row) if len(parts) == 3 else None
        if row is not None and memory is not None:
            yield _item(parts[1], row, memory)
