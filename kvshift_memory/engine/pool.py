"""A thread-safe LRU bounded in bytes, for KV held in this process (prefixes and fragments)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["BytePool"]

V = TypeVar("V")


class BytePool(Generic[V]):
    """Keeps the most recently used values whose sizes add up to at most ``capacity_bytes``.

    A value larger than the whole capacity is not kept (it would evict everything else for one use).

    :param capacity_bytes: the bound; ``0`` keeps nothing.
    :param size_of: how many bytes a value holds.
    """

    def __init__(self, capacity_bytes: int, size_of: Callable[[V], int]) -> None:
        self.capacity_bytes = capacity_bytes
        self._size_of = size_of
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self._size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.capacity_bytes:
                return
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted

    def values(self) -> Iterator[V]:
        """A snapshot of the values, most recently used last."""
        with self._lock:
            return iter([value for value, _ in self._items.values()])

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
