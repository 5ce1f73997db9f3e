"""``KVShiftStore``: a LangGraph ``BaseStore`` whose items are kvshift memories.

``create_agent(..., store=KVShiftStore(memory_store))`` gives an agent's tools and middleware
(``runtime.store``) a long-term store whose items are memories: searched by the store's recall
(embedding and keyword paths), recalled into prompts with their stored K/V by
:class:`~langchain_kvshift.KVShiftMiddleware`, kept durable and isolated per tenant by the
:class:`~kvshift_memory.MemoryStore` underneath (``docs/store.md``).

Namespaces map to tenants: the label at ``tenant_at`` (default the first, as in
``("alice", "memories")``) is the tenant, so one user's items are never read, searched or listed
through another user's namespace. LangMem's layout, ``("memories", user_id)``, names the user
second: give it ``tenant_at=1`` (``docs/integrations.md``). With the default every user of that
layout shares the tenant ``"memories"``: searches still keep to the namespace asked for (the
namespace filter runs before the cut to ``limit``), but the tenant's isolation, statistics and
caches are then one for all of them.

An item's text (what is embedded, recalled and given K/V) is the first string among its value's
``text_fields``, or the fields a put's ``index`` names, or the value as JSON; ``index=False``
stores the item without embedding it (search never finds it, recall never shows it).

A namespace prefix too short to name a tenant (``search(())``, ``list_namespaces()``) is an
administrator's view: it reaches every tenant's items, as LangGraph's own stores do.
"""

from __future__ import annotations

import asyncio
import json
import operator
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
)

from kvshift_memory import InvalidInputError, MemoryStore
from kvshift_memory.adapters import Item as StoredItem
from kvshift_memory.adapters import delete_item, get_item, item_of, item_tenants, list_items, put_item

__all__ = ["KVShiftStore"]

_MAX_CANDIDATES = 1000  # the memory store's largest search


def _when(timestamp: float) -> datetime:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc)


_OPERATORS: dict[str, Callable[[Any, Any], bool]] = {
    "$eq": operator.eq,
    "$ne": operator.ne,
    "$gt": operator.gt,
    "$gte": operator.ge,
    "$lt": operator.lt,
    "$lte": operator.le,
}


def _matches(value: dict[str, Any], conditions: dict[str, Any] | None) -> bool:
    """LangGraph's filter: each key equal to its value, or an operator dict (``$eq``, ``$ne``,
    ``$gt``, ``$gte``, ``$lt``, ``$lte``).

    :raises InvalidInputError: another operator.
    """
    for field, wanted in (conditions or {}).items():
        have = value.get(field)
        if not (isinstance(wanted, dict) and wanted and all(str(op).startswith("$") for op in wanted)):
            wanted = {"$eq": wanted}
        for op, operand in wanted.items():
            if op not in _OPERATORS:
                raise InvalidInputError(f"filter operator {op!r} is not one of {' '.join(_OPERATORS)}")
            try:
                ok = _OPERATORS[op](have, operand)
            except TypeError:  # an order between values that have none (a number and a string)
                ok = False
            if not ok:
                return False
    return True


def _namespace_matches(namespace: tuple[str, ...], condition: MatchCondition) -> bool:
    path = tuple(condition.path)
    if len(path) > len(namespace):
        return False
    part = namespace[: len(path)] if condition.match_type == "prefix" else namespace[len(namespace) - len(path) :]
    return all(want == "*" or want == have for want, have in zip(path, part, strict=True))


class KVShiftStore(BaseStore):
    """A LangGraph store over a :class:`~kvshift_memory.MemoryStore`.

    :param store: where the items live (its folder, or its shared tier and index).
    :param tenant_at: which namespace label is the tenant (the user).
    :param text_fields: the value fields an item's text is read from, first string first.
    """

    supports_ttl = False

    def __init__(
        self, store: MemoryStore, *, tenant_at: int = 0, text_fields: Sequence[str] = ("text", "content", "memory")
    ) -> None:
        if isinstance(tenant_at, bool) or not isinstance(tenant_at, int) or not 0 <= tenant_at < 16:
            raise InvalidInputError(f"tenant_at is a namespace position in 0..15, got {tenant_at!r}")
        self.memory_store = store
        self.tenant_at = tenant_at
        self.text_fields = tuple(text_fields)

    # ---------------------------------------------------------------- BaseStore

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order.

        :raises InvalidInputError: a namespace without the tenant label, a bad key or value, an
            unknown filter operator, a TTL (not supported).
        :raises StoreError: the memory store failed.
        """
        results: list[Result] = []
        for op in ops:
            if isinstance(op, GetOp):
                results.append(self._get(op))
            elif isinstance(op, PutOp):
                self._put(op)
                results.append(None)
            elif isinstance(op, SearchOp):
                results.append(self._search(op))
            elif isinstance(op, ListNamespacesOp):
                results.append(self._list_namespaces(op))
            else:
                raise InvalidInputError(f"unknown store operation {type(op).__name__}")
        return results

    async def abatch(self, ops: Iterable[Op]) -> list[Result]:
        """:meth:`batch` in a worker thread: puts and searches embed text, which would block the loop."""
        return await asyncio.to_thread(self.batch, list(ops))

    # ---------------------------------------------------------------- operations

    def tenant_of(self, namespace: Sequence[str]) -> str:
        """The tenant a namespace belongs to.

        :raises InvalidInputError: the namespace is too short to hold one.
        """
        if not isinstance(namespace, (tuple, list)) or len(namespace) <= self.tenant_at:
            raise InvalidInputError(
                f"namespace {namespace!r} has no label at position {self.tenant_at}, the tenant (the user)"
            )
        return namespace[self.tenant_at]

    def _text(self, value: dict[str, Any], index: Sequence[str] | bool | None) -> str:
        fields = self.text_fields if index is None or index is False or index is True else tuple(index)
        for field in fields:
            text = value.get(field)
            if isinstance(text, str) and text.strip():
                return text
        return json.dumps(value, ensure_ascii=False, sort_keys=True)

    def _get(self, op: GetOp) -> Item | None:
        found = get_item(self.memory_store, self.tenant_of(op.namespace), op.namespace, op.key)
        return None if found is None else self._as_item(found)

    def _put(self, op: PutOp) -> None:
        if op.ttl is not None:
            raise InvalidInputError("KVShiftStore does not support TTLs (a memory's ttl_s is set on the MemoryStore)")
        tenant = self.tenant_of(op.namespace)
        if op.value is None:
            delete_item(self.memory_store, tenant, op.namespace, op.key)
            return
        value = dict(op.value)
        put_item(
            self.memory_store,
            tenant,
            op.namespace,
            op.key,
            value,
            self._text(value, op.index),
            index=op.index is not False,
        )

    def _search(self, op: SearchOp) -> list[SearchItem]:
        prefix = tuple(op.namespace_prefix)
        wanted = op.offset + op.limit
        if op.query:
            tenants = (
                [self.tenant_of(prefix)] if len(prefix) > self.tenant_at else sorted(item_tenants(self.memory_store))
            )
            items: dict[str, StoredItem] = {}

            def in_scope(record: Any) -> bool:
                item = item_of(self.memory_store, record)
                if item is None or item.namespace[: len(prefix)] != prefix or not _matches(item.value, op.filter):
                    return False
                items[record.id] = item
                return True

            found = [
                (items[hit.id], hit.score)
                for tenant in tenants
                for hit in self.memory_store.search(
                    op.query, tenant=tenant, k=min(_MAX_CANDIDATES, wanted), where=in_scope
                )
            ]
            found.sort(key=lambda pair: -(pair[1] or 0.0))
        else:
            owner = self.tenant_of(prefix) if len(prefix) > self.tenant_at else None
            listed = sorted(list_items(self.memory_store, owner), key=lambda item: item.updated_at, reverse=True)
            found = [(item, None) for item in listed]
        kept = [
            (item, score)
            for item, score in found
            if item.namespace[: len(prefix)] == prefix and _matches(item.value, op.filter)
        ]
        return [self._as_search_item(item, score) for item, score in kept[op.offset : wanted]]

    def _list_namespaces(self, op: ListNamespacesOp) -> list[tuple[str, ...]]:
        namespaces = {item.namespace for item in list_items(self.memory_store)}
        if op.match_conditions:
            namespaces = {ns for ns in namespaces if all(_namespace_matches(ns, c) for c in op.match_conditions)}
        if op.max_depth is not None:
            namespaces = {ns[: op.max_depth] for ns in namespaces}
        return sorted(namespaces)[op.offset : op.offset + op.limit]

    @staticmethod
    def _as_item(item: StoredItem) -> Item:
        return Item(
            value=item.value,
            key=item.key,
            namespace=item.namespace,
            created_at=_when(item.created_at),
            updated_at=_when(item.updated_at),
        )

    @staticmethod
    def _as_search_item(item: StoredItem, score: float | None) -> SearchItem:
        found = KVShiftStore._as_item(item)
        return SearchItem(found.namespace, found.key, found.value, found.created_at, found.updated_at, score)
