"""Where the store keeps bytes: one small interface, three backends.

- :class:`HotTier`: this process's memory (``memory://``); fragment blobs in it are bounded in
  bytes and evicted least recently used first, since they can be rebuilt from text; nothing else
  is ever evicted. It also sits in front of the other two as a read-through cache of blobs.
- :class:`DiskTier`: a ``diskcache`` folder, the embedded default. SQLite transactions make every
  operation below atomic across processes.
- :class:`RedisTier`: ``redis://`` for processes and machines sharing one memory, on one server or
  a Redis Cluster (found out on connecting). Every operation touches one key, so each is atomic
  on whichever node holds its slot.

Keys are ``str``, values ``bytes``. The store only needs: read, write,
compare-and-set, delete, a counter, an append-only log, a prefix scan and a clock. Every one of
them is atomic on its own, so no process holds a lock that another would wait on. The clock is the
tier's own (the server's for Redis, the operating system's for a folder that one machine shares),
so every writer judges an age by the same clock, whatever its own says.

Beside them each tier keeps *chunks*: a conversation's K/V, cut into pieces that can always be
computed again, so kept within a bound and dropped first: a byte budget, least recently used
first (RAM, and a folder of its own next to the disk tier's records), or a time to live that each
read renews (Redis). Records are never evicted.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import sqlite3
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import diskcache
import diskcache.core

from ..exceptions import CorruptRecordError, InvalidInputError, StoreBusyError, StoreError

__all__ = ["BLOB_PREFIX", "CHUNK_PREFIX", "DiskTier", "HotTier", "KVTier", "RedisTier", "open_tier"]

logger = logging.getLogger("kvshift_memory.store")

# Keys under this prefix hold fragment blobs: derived data that may be evicted and rebuilt.
BLOB_PREFIX = "f/"
# Keys of chunks (a conversation's K/V), kept apart from the records (``KVTier.set_chunk``).
CHUNK_PREFIX = "c/"
#: the chunk bounds a tier takes when none is given: 4 GiB on disk or in RAM, a week in Redis
DEFAULT_CHUNK_BYTES = 4 << 30
DEFAULT_CHUNK_TTL_S = 7 * 24 * 3600.0


def _as_bytes(value: object) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"store values are bytes, got {type(value).__name__}")
    return bytes(value)


class KVTier(Protocol):
    """What the store asks of a backend. Every method is atomic; ``url`` names the backend."""

    url: str

    def get(self, key: str) -> bytes | None: ...

    def contains(self, key: str) -> bool: ...

    def set(self, key: str, value: bytes) -> None: ...

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes | None) -> bool:
        """Replace the value if it is ``expected`` (``None``: absent); ``value`` ``None`` deletes."""

    def delete(self, key: str) -> bool: ...

    def incr(self, key: str) -> int: ...

    def append(self, log: str, value: bytes) -> int:
        """Append to a log; returns the entry's index (0, 1, 2...)."""

    def read_log(self, log: str, start: int) -> list[bytes]:
        """Entries ``start...`` of a log, in order."""

    def scan(self, prefix: str) -> Iterator[str]: ...

    def now(self) -> float:
        """The tier's clock, in Unix seconds: the one every writer of this tier shares."""

    def set_chunk(self, key: str, value: bytes) -> None:
        """Keep a chunk within the tier's chunk bound (older chunks may go to make room)."""

    def get_chunk(self, key: str) -> bytes | None:
        """A chunk, or ``None`` when it was never kept, was evicted or expired; it counts as used now."""

    def chunk_usage(self) -> tuple[int, int]:
        """How many chunks the tier holds, and their bytes."""

    def stray_files(self, older_than: float) -> list[tuple[str, int]]:
        """Files of the tier no row names, last written before ``older_than`` (the tier's clock):
        what a writer killed between writing a value's file and its row left. Their paths and
        sizes; none for a tier without a folder."""

    def remove_stray_file(self, path: str) -> None:
        """Remove a file :meth:`stray_files` named (nothing else: a path it would not name is left)."""

    def relieve_disk(self) -> int:
        """When the tier's disk has less than :data:`LOW_DISK_BYTES` free, free its chunks (a
        cache: a user's memory outranks them); the bytes freed (0 for a tier without a disk)."""

    def close(self) -> None: ...


class _BoundedBytes:
    """Values kept within a byte budget in RAM, least recently used dropped first (a value larger
    than the budget is not kept)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._values: OrderedDict[str, bytes] = OrderedDict()
        self.total = 0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: str) -> bool:
        return key in self._values

    def get(self, key: str) -> bytes | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        self.pop(key)
        if len(value) > self.capacity_bytes:
            return
        self._values[key] = value
        self.total += len(value)
        while self.total > self.capacity_bytes:
            self.total -= len(self._values.popitem(last=False)[1])

    def pop(self, key: str) -> bytes | None:
        value = self._values.pop(key, None)
        if value is not None:
            self.total -= len(value)
        return value

    def keys(self) -> list[str]:
        return list(self._values)

    def clear(self) -> None:
        self._values.clear()
        self.total = 0


class _NoDisk:
    """The upkeep of a tier with no files of its own: no stray files, no disk to relieve."""

    def stray_files(self, older_than: float) -> list[tuple[str, int]]:
        return []

    def remove_stray_file(self, path: str) -> None:
        return None

    def relieve_disk(self) -> int:
        return 0


class HotTier(_NoDisk):
    """An in-process tier; blobs (keys under :data:`BLOB_PREFIX`) are kept within ``blob_bytes``,
    chunks within ``chunk_bytes``, both least recently used dropped first.

    :param blob_bytes: bound on the bytes of blobs held; ``0`` holds none.
    :param chunk_bytes: bound on the bytes of chunks held; ``0`` holds none.
    """

    def __init__(
        self, blob_bytes: int = 1 << 30, url: str = "memory://", *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.url = url
        self._data: dict[str, bytes] = {}
        self._blobs = _BoundedBytes(blob_bytes)
        self._chunks = _BoundedBytes(chunk_bytes)
        self._logs: dict[str, list[bytes]] = {}
        self._lock = threading.RLock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(key) if key.startswith(BLOB_PREFIX) else self._data.get(key)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in (self._blobs if key.startswith(BLOB_PREFIX) else self._data)

    def set(self, key: str, value: bytes) -> None:
        value = _as_bytes(value)
        with self._lock:
            if key.startswith(BLOB_PREFIX):
                self._blobs.put(key, value)
            else:
                self._data[key] = value

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes | None) -> bool:
        with self._lock:
            if self.get(key) != expected:
                return False
            if value is None:
                self.delete(key)
            else:
                self.set(key, value)
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            if key.startswith(BLOB_PREFIX):
                return self._blobs.pop(key) is not None
            return self._data.pop(key, None) is not None

    def incr(self, key: str) -> int:
        with self._lock:
            current = self._data.get(key, b"0")
            if not current.isdigit():
                raise CorruptRecordError(f"counter {key!r} holds {current[:32]!r}, not a number")
            value = int(current) + 1
            self._data[key] = str(value).encode()
            return value

    def append(self, log: str, value: bytes) -> int:
        with self._lock:
            entries = self._logs.setdefault(log, [])
            entries.append(_as_bytes(value))
            return len(entries) - 1

    def read_log(self, log: str, start: int) -> list[bytes]:
        with self._lock:
            return list(self._logs.get(log, [])[start:])

    def scan(self, prefix: str) -> Iterator[str]:
        with self._lock:
            return iter([key for key in (*self._data, *self._blobs.keys()) if key.startswith(prefix)])

    def now(self) -> float:
        return time.time()  # one process: its clock is every writer's

    def set_chunk(self, key: str, value: bytes) -> None:
        with self._lock:
            self._chunks.put(key, _as_bytes(value))

    def get_chunk(self, key: str) -> bytes | None:
        with self._lock:
            return self._chunks.get(key)

    def chunk_usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._chunks), self._chunks.total

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._blobs.clear()
            self._chunks.clear()
            self._logs.clear()

    def close(self) -> None:
        pass


#: below this much free space on its disk, a folder tier's gc frees the chunks
LOW_DISK_BYTES = 64 << 20
_T = TypeVar("_T")


def _out_of_space(error: BaseException | None) -> bool:
    """Whether ``error`` (what SQLite or the file system raised) says the disk is full."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(error, sqlite3.Error) and "full" in str(error)


#: the largest value file the disk tier reads: no record, fragment or chunk the store writes comes
#: near it, so a larger one (a sparse file planted in the folder) is refused, not read into memory
MAX_VALUE_FILE_BYTES = 1 << 30

# the only file names diskcache gives values it keeps in files (``Disk.filename``)
_VALUE_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{28}\.val")


class _BytesOnlyDisk(diskcache.Disk):
    """diskcache storage limited to str keys and bytes or int values, both ways: a tampered row can
    never make it deserialise an object (diskcache would otherwise unpickle rows marked so), nor
    read or delete a file outside the folder (a row names its value's file)."""

    def put(self, key: Any) -> tuple[Any, bool]:
        if not isinstance(key, str):
            raise InvalidInputError(f"store keys are str, got {type(key).__name__}")
        return super().put(key)

    def get(self, key: Any, raw: bool) -> Any:
        if not raw:
            raise CorruptRecordError("refusing a pickled key in the disk tier")
        return super().get(key, raw)

    def store(self, value: Any, read: bool, key: Any = diskcache.core.UNKNOWN) -> tuple[int, int, str | None, Any]:
        if not isinstance(value, (bytes, int)):
            raise InvalidInputError(f"store values are bytes, got {type(value).__name__}")
        return super().store(value, read, key=key)

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> Any:
        if mode == diskcache.core.MODE_PICKLE:
            raise CorruptRecordError("refusing a pickled value in the disk tier")
        if filename is None:
            return super().fetch(mode, filename, value, read)
        if not self._inside(filename):
            raise CorruptRecordError(
                f"refusing a disk tier row whose value file {filename!r} is not one of the folder's"
            )
        if mode != diskcache.core.MODE_BINARY or read:
            raise CorruptRecordError(f"refusing a disk tier row of mode {mode} (values are bytes)")
        return _value_file(os.path.join(self._directory, filename))

    def remove(self, file_path: str) -> None:
        if self._inside(file_path):
            super().remove(file_path)
        else:  # the row goes (that heals the tier); a file it names outside the folder stays untouched
            logger.warning("not removing %r: not a value file of the disk tier", file_path)

    def _inside(self, filename: object) -> bool:
        """Whether ``filename`` is a value file diskcache could have made here (links not followed out)."""
        if not isinstance(filename, str) or not _VALUE_FILE.fullmatch(filename.replace(os.sep, "/")):
            return False
        folder = os.path.realpath(self._directory)
        return os.path.realpath(os.path.join(folder, filename)).startswith(folder + os.sep)


def _value_file(path: str) -> bytes:
    """The bytes of a value file, read only when it is a regular file (not a link, a FIFO that
    would block the reader forever, or a device) of at most :data:`MAX_VALUE_FILE_BYTES`.

    :raises CorruptRecordError: anything else.
    :raises FileNotFoundError: it was deleted meanwhile (diskcache answers the key as missing).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CorruptRecordError(f"refusing the disk tier's value file {path!r}: {exc}") from None
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(file.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise CorruptRecordError(f"refusing the disk tier's value file {path!r}: not a regular file")
        if status.st_size > MAX_VALUE_FILE_BYTES:
            raise CorruptRecordError(
                f"refusing the disk tier's value file {path!r}: {status.st_size} bytes, over {MAX_VALUE_FILE_BYTES}"
            )
        return file.read(MAX_VALUE_FILE_BYTES + 1)


def _value_files(folder: str) -> Iterator[tuple[str, os.stat_result]]:
    """The value files in a diskcache folder (``ab/cd/<28 hex>.val``, regular files only), with
    their status; links and anything else are not listed."""
    hex_pair = re.compile(r"[0-9a-f]{2}")
    for first in sorted(os.listdir(folder)):
        if not hex_pair.fullmatch(first) or not os.path.isdir(os.path.join(folder, first)):
            continue
        for second in sorted(os.listdir(os.path.join(folder, first))):
            inner = os.path.join(folder, first, second)
            if not hex_pair.fullmatch(second) or os.path.islink(inner) or not os.path.isdir(inner):
                continue
            for name in sorted(os.listdir(inner)):
                relative = os.path.join(first, second, name)
                status = os.lstat(os.path.join(inner, name))
                if _VALUE_FILE.fullmatch(relative.replace(os.sep, "/")) and stat.S_ISREG(status.st_mode):
                    yield relative, status


class DiskTier:
    """A ``diskcache`` folder shared safely by the processes of one machine.

    Every operation is one SQLite statement or transaction; a writer waits at most ``lock_timeout_s``
    for another process's transaction to end. Chunks live in a ``diskcache`` folder of their own
    (``path/chunks``, made on the first chunk written), the only one diskcache may evict from.

    :param path: the folder (created when missing).
    :param lock_timeout_s: how long a write waits for the folder's lock.
    :param chunk_bytes: the chunks' byte budget (least recently used evicted first); ``0`` keeps none.
    :raises StoreError: the folder cannot be opened or its database is damaged.
    """

    def __init__(
        self, path: str | os.PathLike, lock_timeout_s: float = 30.0, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        self.url = f"file://{os.path.abspath(path)}"
        self.lock_timeout_s = lock_timeout_s
        self.chunk_bytes = chunk_bytes
        self._chunk_folder = os.path.join(os.fspath(path), "chunks")
        self._chunk_cache: diskcache.Cache | None = None
        self._chunk_lock = threading.Lock()
        with self._errors("open"):
            # no size limit: diskcache would otherwise evict records, and a memory never loses what it was told
            self._cache = diskcache.Cache(
                os.fspath(path), disk=_BytesOnlyDisk, timeout=lock_timeout_s, size_limit=2**62, eviction_policy="none"
            )

    @contextlib.contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        """diskcache's and SQLite's errors as the store's: busy past the timeout, or damaged."""
        try:
            yield
        except diskcache.Timeout:
            raise StoreBusyError(
                f"the disk tier at {self.url} stayed locked for {self.lock_timeout_s} s ({operation})"
            ) from None
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                raise StoreBusyError(f"the disk tier at {self.url} is locked ({operation}): {exc}") from None
            raise StoreError(f"the disk tier at {self.url} failed ({operation}): {exc}") from None
        except (sqlite3.DatabaseError, OSError) as exc:
            raise StoreError(f"the disk tier at {self.url} is damaged or unreadable ({operation}): {exc}") from None

    def get(self, key: str) -> bytes | None:
        with self._errors("get"):
            return self._stored(self._cache.get(key, default=None))

    def contains(self, key: str) -> bool:
        with self._errors("contains"):
            return key in self._cache

    @staticmethod
    def _stored(value: object) -> bytes | None:
        if value is None or isinstance(value, bytes):
            return value
        if isinstance(value, int):  # counters
            return str(value).encode()
        raise CorruptRecordError(f"the disk tier holds a {type(value).__name__} where bytes were written")

    def set(self, key: str, value: bytes) -> None:
        value = _as_bytes(value)
        if len(value) > MAX_VALUE_FILE_BYTES:  # it could never be read back
            raise StoreError(f"a value of {len(value)} bytes is over the disk tier's {MAX_VALUE_FILE_BYTES}")
        self._write("set", lambda: self._cache.set(key, value))

    def _write(self, operation: str, write: Callable[[], _T]) -> _T:
        """``write()``; when the disk is full, the chunks freed (a cache: a user's memory outranks
        every one of them) and ``write()`` run once more.

        :raises StoreError: it failed (again)."""
        try:
            with self._errors(operation):
                return write()
        except StoreError as exc:
            if not _out_of_space(exc.__context__) or not self.free_chunks():
                raise
        logger.warning("the disk of %s was full: its K/V chunks were freed for a write (%s)", self.url, operation)
        with self._errors(operation):
            return write()

    def free_chunks(self) -> int:
        """Remove every chunk, the files first (removing them needs no space, a row's deletion
        may); the bytes freed."""
        chunks = self._chunks(create=False)
        if chunks is None:
            return 0
        freed = 0
        with self._errors("free chunks"):
            for name, status in list(_value_files(chunks.directory)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(chunks.directory, name))
                    freed += status.st_size
        with contextlib.suppress(diskcache.Timeout, sqlite3.Error, OSError):  # rows of files now gone: read as missing
            chunks.clear()
        return freed

    def relieve_disk(self) -> int:
        free = shutil.disk_usage(self._cache.directory).free
        return self.free_chunks() if free < LOW_DISK_BYTES else 0

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes | None) -> bool:
        def swap() -> bool:
            with self._cache.transact():
                if self._stored(self._cache.get(key, default=None)) != expected:
                    return False
                if value is None:
                    self._cache.delete(key)
                else:
                    self._cache.set(key, _as_bytes(value))
                return True

        return self._write("compare-and-set", swap)

    def delete(self, key: str) -> bool:
        return self._write("delete", lambda: self._cache.delete(key))

    def incr(self, key: str) -> int:
        def count() -> int:
            try:
                return self._cache.incr(key)
            except TypeError:  # diskcache adds 1 to what the row holds: bytes where a count was
                raise CorruptRecordError(f"counter {key!r} of the disk tier does not hold a number") from None

        return self._write("incr", count)

    def now(self) -> float:
        # SQLite reads the operating system's clock, which every process on this machine shares;
        # a process's own time.time() may be patched, skewed or paused
        with self._errors("now"):
            ((seconds,),) = self._cache._sql("SELECT (julianday('now') - 2440587.5) * 86400.0").fetchall()  # noqa: SLF001
        return float(seconds)

    def append(self, log: str, value: bytes) -> int:
        value = _as_bytes(value)

        def add() -> int:
            with self._cache.transact():
                index = self._cache.incr(f"{log}#") - 1
                self._cache.set(f"{log}@{index:012d}", value)
                return index

        return self._write("append", add)

    def read_log(self, log: str, start: int) -> list[bytes]:
        with self._errors("read_log"):
            length = self._cache.get(f"{log}#", default=0)
            entries = []
            for index in range(start, length):
                value = self._cache.get(f"{log}@{index:012d}")
                entry = self._stored(value)
                if entry is None:  # written in one transaction with the count, so only a damaged folder lacks it
                    raise StoreError(f"log {log!r} lacks entry {index}")
                entries.append(entry)
            return entries

    def _chunks(self, create: bool) -> diskcache.Cache | None:
        """The chunks' folder, opened on first use (``None`` when it does not exist and ``create`` is false)."""
        with self._chunk_lock:
            if self._chunk_cache is None and (create or os.path.isdir(self._chunk_folder)):
                with self._errors("open chunks"):
                    self._chunk_cache = diskcache.Cache(
                        self._chunk_folder,
                        disk=_BytesOnlyDisk,
                        timeout=self.lock_timeout_s,
                        size_limit=self.chunk_bytes,
                        eviction_policy="least-recently-used",
                    )
            return self._chunk_cache

    def set_chunk(self, key: str, value: bytes) -> None:
        value = _as_bytes(value)
        if len(value) > min(self.chunk_bytes, MAX_VALUE_FILE_BYTES):
            return
        chunks = self._chunks(create=True)
        assert chunks is not None  # made when missing
        with self._errors("set chunk"):
            chunks.set(key, value)  # diskcache culls the least recently used past size_limit

    def get_chunk(self, key: str) -> bytes | None:
        chunks = self._chunks(create=False)
        if chunks is None:
            return None
        with self._errors("get chunk"):
            value = chunks.get(key, default=None)
        return value if isinstance(value, bytes) else None

    def chunk_usage(self) -> tuple[int, int]:
        chunks = self._chunks(create=False)
        if chunks is None:
            return 0, 0
        with self._errors("chunk usage"):
            return len(chunks), int(chunks.volume())

    def stray_files(self, older_than: float) -> list[tuple[str, int]]:
        found = []
        for cache in (self._cache, self._chunks(create=False)):
            if cache is None:
                continue
            # the files first: one written after this listing is not judged (its row may come next)
            with self._errors("list value files"):
                files = list(_value_files(cache.directory))
                rows = cache._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL").fetchall()  # noqa: SLF001
            named = {os.path.normpath(name) for (name,) in rows if isinstance(name, str)}
            for name, status in files:
                if os.path.normpath(name) not in named and status.st_mtime < older_than:
                    found.append((os.path.join(cache.directory, name), status.st_size))
        return found

    def remove_stray_file(self, path: str) -> None:
        folder = os.path.realpath(os.fspath(self._cache.directory))
        inside = os.path.realpath(os.path.dirname(path)).startswith(folder + os.sep)
        if inside and _VALUE_FILE.search(path.replace(os.sep, "/")) and stat.S_ISREG(os.lstat(path).st_mode):
            with contextlib.suppress(FileNotFoundError):  # another gc was first
                os.remove(path)

    def scan(self, prefix: str) -> Iterator[str]:
        # one range query over str keys: rows of other key types (a pickled key planted by hand)
        # are never read, and a scan does not walk every other key of the folder
        query = "SELECT key FROM Cache WHERE raw = 1 AND typeof(key) = 'text'"
        bounds: tuple[str, ...] = ()
        if prefix:
            query += " AND key >= ? AND key < ?"
            bounds = (prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))
        with self._errors("scan"):
            keys = [row[0] for row in self._cache._sql(query + " ORDER BY key", bounds)]  # noqa: SLF001
        return iter(keys)

    def close(self) -> None:
        self._cache.close()
        if self._chunk_cache is not None:
            self._chunk_cache.close()


class RedisTier(_NoDisk):
    """A Redis database shared by every process and machine that opens the same URL.

    :param url: ``redis://host:port/db`` (``rediss://`` for TLS); a node of a Redis Cluster is
        recognised and the whole cluster used (keys spread over its nodes by slot).
    :param chunk_ttl_s: how long a chunk is kept after it was last written or read.
    :raises StoreError: the server cannot be reached.
    """

    # Compare-and-set in one server-side step: no client holds a lock another would wait on.
    _CAS = """
    local current = redis.call('GET', KEYS[1])
    if ARGV[1] == '1' then
        if current then return 0 end
    elseif current ~= ARGV[2] then
        return 0
    end
    if ARGV[3] == '1' then redis.call('DEL', KEYS[1]) else redis.call('SET', KEYS[1], ARGV[4]) end
    return 1
    """

    def __init__(self, url: str, *, chunk_ttl_s: float = DEFAULT_CHUNK_TTL_S) -> None:
        try:
            import redis  # only this tier needs it: an optional dependency
        except ImportError:
            raise StoreError("the Redis tier needs the redis package: pip install 'kvshift-memory[redis]'") from None

        self.url = shown_url(url)
        self.chunk_ttl_ms = max(1, round(chunk_ttl_s * 1000))
        self._errors = (redis.RedisError,)
        options = {"socket_connect_timeout": 5, "socket_timeout": 30}
        try:
            self._client: Any = redis.Redis.from_url(url, **options)  # or a RedisCluster, below
            if self._client.info("cluster").get("cluster_enabled"):
                from redis.cluster import RedisCluster

                self._client.close()
                self._client = RedisCluster.from_url(url, **options)
            self._client.ping()
        except redis.RedisError as exc:
            raise StoreError(f"cannot reach Redis at {self.url}: {exc}") from exc
        self._cas = self._client.register_script(self._CAS)

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, method)(*args, **kwargs)
        except self._errors as exc:
            raise StoreError(f"Redis at {self.url} failed on {method}: {exc}") from exc

    def get(self, key: str) -> bytes | None:
        return self._call("get", key)

    def contains(self, key: str) -> bool:
        return bool(self._call("exists", key))

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, _as_bytes(value))

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes | None) -> bool:
        args = ["1" if expected is None else "0", expected or b"", "1" if value is None else "0", value or b""]
        try:
            return bool(self._cas(keys=[key], args=args))
        except self._errors as exc:
            raise StoreError(f"Redis at {self.url} failed on compare-and-set: {exc}") from exc

    def delete(self, key: str) -> bool:
        return bool(self._call("delete", key))

    def incr(self, key: str) -> int:
        try:
            return int(self._call("incr", key))
        except StoreError as exc:
            if "not an integer" in str(exc):
                raise CorruptRecordError(f"counter {key!r} in Redis does not hold a number") from None
            raise

    def now(self) -> float:
        answer = self._call("time")
        if isinstance(answer, dict):  # a cluster may answer per node: any node's clock is the servers'
            answer = next(iter(answer.values()))
        seconds, microseconds = answer
        return float(seconds) + float(microseconds) / 1e6

    def set_chunk(self, key: str, value: bytes) -> None:
        self._call("set", key, _as_bytes(value), px=self.chunk_ttl_ms)

    def get_chunk(self, key: str) -> bytes | None:
        return self._call("getex", key, px=self.chunk_ttl_ms)  # a chunk in use stays

    def chunk_usage(self) -> tuple[int, int]:
        pipeline = self._client.pipeline()  # one round trip (per node in a cluster)
        for key in self.scan(CHUNK_PREFIX):
            pipeline.strlen(key)
        try:
            sizes = [int(size) for size in pipeline.execute()]
        except self._errors as exc:
            raise StoreError(f"Redis at {self.url} failed on chunk usage: {exc}") from exc
        return len(sizes), sum(sizes)

    def append(self, log: str, value: bytes) -> int:
        return int(self._call("rpush", log, _as_bytes(value))) - 1

    def read_log(self, log: str, start: int) -> list[bytes]:
        return list(self._call("lrange", log, start, -1))

    def scan(self, prefix: str) -> Iterator[str]:
        pattern = "".join(f"[{c}]" if c in "*?[]\\" else c for c in prefix) + "*"
        return self._decoded(self._call("scan_iter", match=pattern, count=1000))

    def _decoded(self, keys: Iterator[bytes]) -> Iterator[str]:
        """Keys as text; one that is not UTF-8 was written by no store (a planted or foreign key) and is skipped."""
        for key in keys:
            try:
                yield key.decode("utf-8")
            except UnicodeDecodeError:
                logger.warning("skipping a Redis key that is not UTF-8: %r", key[:64])

    def close(self) -> None:
        self._client.close()


_SECRET_PARAMETERS = frozenset({"password", "pass", "passwd", "token", "api_key", "apikey", "secret"})


def shown_url(url: str) -> str:
    """``url`` as messages, logs and reports show it: a password (``redis://user:pw@host``) or a
    secret query parameter (``?password=…``) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            credentials, host = netloc.rsplit("@", 1)
            user = credentials.split(":", 1)[0]
            netloc = f"{user}:***@{host}" if ":" in credentials else f"***@{host}" if not user else f"{user}@{host}"
        query = urlencode(
            [
                (k, "***" if k.lower() in _SECRET_PARAMETERS else v)
                for k, v in parse_qsl(parts.query, keep_blank_values=True)
            ],
            safe="*",
        )
        return (
            f"{parts.scheme}://{netloc}{parts.path}"
            + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else "")
        )
    except ValueError:  # not a URL one can take apart: show none of it
        return "<an unreadable URL>"


def open_tier(
    url: str | os.PathLike,
    *,
    lock_timeout_s: float = 30.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    chunk_ttl_s: float = DEFAULT_CHUNK_TTL_S,
) -> KVTier:
    """A tier for ``url``: ``memory://``, ``redis://…``/``rediss://…``, ``file://PATH`` or a folder path.

    :param lock_timeout_s: how long a folder's writer waits for another's lock (:class:`DiskTier`).
    :param chunk_bytes: the chunks' byte budget in RAM or a folder; ``chunk_ttl_s``: their time to live in Redis.

    :raises InvalidInputError: an unknown scheme.
    :raises StoreError: the backend cannot be opened.
    """
    text = os.fspath(url)
    scheme = urlsplit(text).scheme if "://" in text else ""
    if scheme == "memory":
        return HotTier(chunk_bytes=chunk_bytes)
    if scheme in ("redis", "rediss", "unix"):
        return RedisTier(text, chunk_ttl_s=chunk_ttl_s)
    if scheme:
        if scheme != "file":
            raise InvalidInputError(
                f"unknown store URL scheme {scheme!r}: use a folder, file://, memory:// or redis://"
            )
        text = text[len("file://") :]
    return DiskTier(text, lock_timeout_s, chunk_bytes=chunk_bytes)
