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

An item's text (what is embedded, recalled and given K/V) is read from the fields a put's
``index`` names, else from the store's ``index={"fields": [...]}``, both JSON paths as LangGraph
writes them (``"content"``, ``"facts[*].text"``, ``"$"`` for the whole value; the texts found are
joined, one per line); with neither, the first string among its value's ``text_fields``, or the
value as JSON. An item whose fields hold no text, or put with ``index=False``, is stored without
embedding it (search never finds it, recall never shows it).

``index={"dims", "embed"}`` chooses the embedder as LangGraph's stores do (a LangChain
``Embeddings``, an embedding function, or a provider string for ``init_embeddings``) when this
store builds its :class:`~kvshift_memory.MemoryStore` (from a folder, or in memory); a
``MemoryStore`` passed in already embeds with its own.

Items expire as in LangGraph's stores: ``put(..., ttl=minutes)`` (default ``ttl={"default_ttl"}``),
a read restarts the time to live unless ``refresh_ttl=False`` (default
``ttl={"refresh_on_read"}``), ages judged by the memory store's clock (the one its writers
share). An expired item is gone for every read at once; :meth:`KVShiftStore.sweep_ttl` (or
:meth:`~KVShiftStore.start_ttl_sweeper`, or the memory store's ``gc``) frees its space.

A namespace prefix too short to name a tenant (``search(())``, ``list_namespaces()``) is an
administrator's view: it reaches every tenant's items, as LangGraph's own stores do.
"""

from __future__ import annotations

import asyncio
import json
import logging
import operator
import os
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from datetime import datetime, timezone
from typing import Any

from langgraph.store.base import (
    BaseStore,
    GetOp,
    IndexConfig,
    Item,
    ListNamespacesOp,
    MatchCondition,
    Op,
    PutOp,
    Result,
    SearchItem,
    SearchOp,
    TTLConfig,
)
from langgraph.store.base.embed import ensure_embeddings, get_text_at_path, tokenize_path

from kvshift_memory import InvalidInputError, KVShiftError, MemoryStore, inputs
from kvshift_memory.adapters import Item as StoredItem
from kvshift_memory.adapters import (
    delete_item,
    get_item,
    item_of,
    item_tenants,
    list_items,
    put_item,
    refresh_item,
    sweep_items,
)

__all__ = ["KVShiftStore"]

_MAX_CANDIDATES = 1000  # the memory store's largest search
_INDEX_KEYS = frozenset({"dims", "embed", "fields"})
_TTL_KEYS = frozenset({"default_ttl", "refresh_on_read", "sweep_interval_minutes"})
_DEFAULT_SWEEP_MINUTES = 5
_INDEX_TOKEN = re.compile(r"\[(\*|-?\d+)\]")
_MAX_TTL_MINUTES = 1e9

logger = logging.getLogger(__name__)


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


def _check_minutes(value: Any, name: str) -> float | None:
    return (
        None if value is None else inputs.check_number(value, name, 0, _MAX_TTL_MINUTES, low_open=True, unit="minutes")
    )


def _check_fields(fields: Any, name: str) -> tuple[str, ...]:
    """JSON paths as LangGraph's ``index`` fields are written.

    :raises InvalidInputError: not a list of paths, or a path that does not parse.
    """
    if isinstance(fields, str) or not isinstance(fields, (list, tuple)) or not fields:
        raise InvalidInputError(f"{name} is a non-empty list of JSON paths, got {fields!r}")
    for path in fields:
        if not isinstance(path, str) or not path.strip() or len(path) > 1000:
            raise InvalidInputError(f"{name}: a JSON path is a non-empty string, got {path!r}")
        if path != "$" and not all(map(_is_path_token, tokenize_path(path))):
            raise InvalidInputError(f"{name}: {path!r} is not a JSON path (fields, [index], [*], {{a,b}})")
    return tuple(fields)


def _is_path_token(token: str) -> bool:
    """A token of a LangGraph field path: a name, ``[n]``/``[*]``, or ``{a,b.c}`` (its parser
    accepts anything; a stray bracket is the caller's typo, which would embed nothing)."""
    if token.startswith("["):
        return _INDEX_TOKEN.fullmatch(token) is not None
    if token.startswith("{"):
        return token.endswith("}") and all(part.strip() for part in token[1:-1].split(","))
    return bool(token) and not any(mark in token for mark in "[]{}")


def _check_ttl_config(ttl: Any) -> TTLConfig | None:
    if ttl is None:
        return None
    if not isinstance(ttl, dict) or not set(ttl) <= _TTL_KEYS:
        raise InvalidInputError(f"ttl is a dict with keys among {sorted(_TTL_KEYS)}, got {ttl!r}")
    if not isinstance(ttl.get("refresh_on_read", True), bool):
        raise InvalidInputError(f"ttl['refresh_on_read'] is True or False, got {ttl['refresh_on_read']!r}")
    _check_minutes(ttl.get("default_ttl"), "ttl['default_ttl']")
    _check_minutes(ttl.get("sweep_interval_minutes"), "ttl['sweep_interval_minutes']")
    return TTLConfig(**ttl)


def _memory_store(store: Any, index: Any) -> tuple[MemoryStore, tuple[str, ...] | None]:
    """The memory store the items live in, and the index's fields (``None``: the default rule).

    :raises InvalidInputError: a malformed ``index``, an embedder for a store that has its own,
        or ``dims`` that are not the embedder's.
    """
    if index is not None and (not isinstance(index, dict) or not set(index) <= _INDEX_KEYS):
        raise InvalidInputError(f"index is a dict with keys among {sorted(_INDEX_KEYS)}, got {index!r}")
    index = index or {}
    fields = _check_fields(index["fields"], "index['fields']") if index.get("fields") is not None else None
    dims = index.get("dims")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int) or not 0 < dims <= 65536):
        raise InvalidInputError(f"index['dims'] is the embedding's dimension (a positive int), got {dims!r}")
    if isinstance(store, MemoryStore):
        if index.get("embed") is not None and index["embed"] is not store.embedder:
            raise InvalidInputError(
                "this MemoryStore embeds with its own embedder: build it with MemoryStore(path, embedder=...), "
                "or give KVShiftStore a folder and index['embed']"
            )
        memory_store = store
    elif store is None or isinstance(store, (str, os.PathLike)):
        embedder = ensure_embeddings(index["embed"]) if index.get("embed") is not None else None
        memory_store = (
            MemoryStore(store, embedder=embedder)
            if store is not None
            else MemoryStore(kv_url="memory://", embedder=embedder)
        )
    else:
        raise InvalidInputError(f"store is a MemoryStore, a folder or None (in memory), got {type(store).__name__}")
    if dims is not None and dims != memory_store.embedder.dimension:
        raise InvalidInputError(
            f"index['dims'] is {dims} but the embedder gives vectors of {memory_store.embedder.dimension}"
        )
    return memory_store, fields


def _namespace_matches(namespace: tuple[str, ...], condition: MatchCondition) -> bool:
    path = tuple(condition.path)
    if len(path) > len(namespace):
        return False
    part = namespace[: len(path)] if condition.match_type == "prefix" else namespace[len(namespace) - len(path) :]
    return all(want == "*" or want == have for want, have in zip(path, part, strict=True))


class KVShiftStore(BaseStore):
    """A LangGraph store over a :class:`~kvshift_memory.MemoryStore`.

    :param store: where the items live: a ``MemoryStore`` (its folder, or its shared tier and
        index), a folder to open one in, or ``None`` for one in this process's memory.
    :param index: LangGraph's index settings: ``dims`` and ``embed`` choose the embedder of a
        store built here (default the bundled all-MiniLM-L6-v2), ``fields`` the JSON paths an
        item's text is read from.
    :param ttl: LangGraph's TTL settings: ``default_ttl`` (minutes) for a put that names none,
        ``refresh_on_read`` (default ``True``), ``sweep_interval_minutes`` for
        :meth:`start_ttl_sweeper`.
    :param tenant_at: which namespace label is the tenant (the user).
    :param text_fields: without ``fields``, the value fields an item's text is read from, first
        string first.
    :raises InvalidInputError: a malformed setting, or ``index`` that does not fit ``store``.
    """

    supports_ttl = True

    def __init__(
        self,
        store: MemoryStore | str | os.PathLike[str] | None = None,
        *,
        index: IndexConfig | None = None,
        ttl: TTLConfig | None = None,
        tenant_at: int = 0,
        text_fields: Sequence[str] = ("text", "content", "memory"),
    ) -> None:
        if isinstance(tenant_at, bool) or not isinstance(tenant_at, int) or not 0 <= tenant_at < 16:
            raise InvalidInputError(f"tenant_at is a namespace position in 0..15, got {tenant_at!r}")
        self.ttl_config = _check_ttl_config(ttl)
        self.memory_store, self.index_fields = _memory_store(store, index)
        self.tenant_at = tenant_at
        self.text_fields = tuple(text_fields)
        self._sweeper_lock = threading.Lock()
        self._sweeper: tuple[Future[None], threading.Event] | None = None

    # ---------------------------------------------------------------- BaseStore

    def batch(self, ops: Iterable[Op]) -> list[Result]:
        """Run ``ops`` in order.

        :raises InvalidInputError: a namespace without the tenant label, a bad key, value, TTL
            or index field, an unknown filter operator.
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

    # ---------------------------------------------------------------- TTL

    def sweep_ttl(self) -> int:
        """Remove every expired item now (reads never show one; this frees its space).

        :returns: how many were removed.
        :raises StoreError: the memory store failed.
        """
        return sweep_items(self.memory_store)

    async def asweep_ttl(self) -> int:
        """:meth:`sweep_ttl` in a worker thread."""
        return await asyncio.to_thread(self.sweep_ttl)

    def start_ttl_sweeper(self, sweep_interval_minutes: float | None = None) -> Future[None]:
        """Sweep expired items every ``sweep_interval_minutes`` (default ``ttl``'s, else 5) in a
        daemon thread until :meth:`stop_ttl_sweeper`; a sweep that fails is logged and tried at
        the next interval. Started twice, the running sweeper is returned.

        :returns: a future that completes when the sweeper stops.
        :raises InvalidInputError: a bad interval.
        """
        minutes = _check_minutes(
            sweep_interval_minutes or (self.ttl_config or {}).get("sweep_interval_minutes") or _DEFAULT_SWEEP_MINUTES,
            "sweep_interval_minutes",
        )
        assert minutes is not None  # a default was given
        with self._sweeper_lock:
            if self._sweeper is not None and not self._sweeper[0].done():
                return self._sweeper[0]
            done: Future[None] = Future()
            stop = threading.Event()

            def sweep_until_stopped() -> None:
                while not stop.wait(minutes * 60):
                    try:
                        self.sweep_ttl()
                    except KVShiftError:
                        logger.warning("TTL sweep failed; trying again in %g minutes", minutes, exc_info=True)
                done.set_result(None)

            threading.Thread(target=sweep_until_stopped, name="kvshift-ttl-sweeper", daemon=True).start()
            self._sweeper = (done, stop)
            return done

    def stop_ttl_sweeper(self, timeout: float | None = None) -> bool:
        """Stop the sweeper :meth:`start_ttl_sweeper` started.

        :returns: whether it stopped within ``timeout`` seconds (``True`` when none ran).
        """
        with self._sweeper_lock:
            running, self._sweeper = self._sweeper, None
        if running is None:
            return True
        running[1].set()
        try:
            running[0].result(timeout=timeout)
        except TimeoutError:
            return False
        return True

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

    def _text(self, value: dict[str, Any], index: Sequence[str] | bool | None) -> tuple[str, bool]:
        """An item's text, and whether it is embedded (``False`` when its fields hold none)."""
        if index is False:
            return json.dumps(value, ensure_ascii=False, sort_keys=True), False
        if index is not None and not isinstance(index, (list, tuple)):
            raise InvalidInputError(f"a put's index is False, None or a list of JSON paths, got {index!r}")
        fields = _check_fields(index, "index") if index is not None else self.index_fields
        if fields is None:
            for field in self.text_fields:
                text = value.get(field)
                if isinstance(text, str) and text.strip():
                    return text, True
            return json.dumps(value, ensure_ascii=False, sort_keys=True), True
        texts = [text for path in fields for text in get_text_at_path(value, path) if text.strip()]
        if not texts:
            return json.dumps(value, ensure_ascii=False, sort_keys=True), False
        return "\n".join(texts), True

    def _get(self, op: GetOp) -> Item | None:
        found = get_item(self.memory_store, self.tenant_of(op.namespace), op.namespace, op.key, refresh=op.refresh_ttl)
        return None if found is None else self._as_item(found)

    def _put(self, op: PutOp) -> None:
        tenant = self.tenant_of(op.namespace)
        if op.value is None:
            delete_item(self.memory_store, tenant, op.namespace, op.key)
            return
        minutes = _check_minutes(op.ttl, "ttl")
        if not isinstance(op.value, dict):
            raise InvalidInputError(f"an item's value is a dict, got {type(op.value).__name__}")
        value = dict(op.value)
        text, embedded = self._text(value, op.index)
        put_item(
            self.memory_store,
            tenant,
            op.namespace,
            op.key,
            value,
            text,
            ttl_s=None if minutes is None else minutes * 60,
            index=embedded,
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
        page = kept[op.offset : wanted]
        if op.refresh_ttl:
            page = [(refresh_item(self.memory_store, item), score) for item, score in page]
        return [self._as_search_item(item, score) for item, score in page]

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
