"""A memory record: the text (the source of truth) and what the store knows about it."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ..exceptions import StoreError

__all__ = ["MemoryRecord", "text_hash"]


def text_hash(text: str) -> str:
    """The ``source_text_hash`` of a memory text: a fragment is only ever used for the text it was computed from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class MemoryRecord:
    """One version of one memory.

    :param id: stable across versions; a correction keeps it and raises ``version``.
    :param version: 1 for the first text, +1 per :meth:`MemoryStore.supersede`.
    :param status: ``"live"`` for the current version, ``"superseded"`` or ``"deleted"``.
    :param score: the search similarity, on records returned by a search.
    :param access_count: ``last_access``: reads through :meth:`MemoryStore.get` and searches
        that returned it, across every version of the memory.
    :param expires_at: Unix time, by the store's tier clock, after which the memory is treated
        as deleted (``None``: never).
    :param indexed: whether the memory is embedded and found by search; ``False`` keeps it out
        of every search and recall (its text is never sent to the embedder).
    :param item: for the memory of a named item, the key of the item row that owns it; for a
        document's part, the key of the document's row: the memory is live only while that row
        names it.
    :param document: for a part of a document (:meth:`MemoryStore.add_document`), the id its
        parts share; ``part`` is its place in the document (0 first) and ``source`` what the
        caller named the document (a file name, a URL).
    """

    id: str
    version: int
    text: str
    tenant: str
    session_id: str | None
    created_at: float
    source_text_hash: str
    importance_score: float = 0.5
    semantic_keywords: tuple[str, ...] = ()
    expires_at: float | None = None
    indexed: bool = True
    item: str | None = None
    document: str | None = None
    part: int | None = None
    source: str | None = None
    status: str = "live"
    access_count: int = 0
    last_access: float | None = None
    score: float | None = None
    # The store this record came from: it lets an engine fetch and keep the record's KV
    # fragment without the caller passing the store along.
    fragment_source: Any = field(default=None, repr=False, compare=False)

    def to_json(self) -> bytes:
        """The stored form: the immutable fields only (status, access and score are derived)."""
        data = {f: getattr(self, f) for f in _STORED}
        data["semantic_keywords"] = list(self.semantic_keywords)
        return json.dumps(data, ensure_ascii=False, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, raw: bytes) -> MemoryRecord:
        """Parse and check a stored record (stored data is untrusted input).

        :raises StoreError: not a well-formed record, or its text does not match its hash.
        """
        try:
            data = json.loads(raw)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise StoreError(f"stored record is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise StoreError("stored record does not have the expected fields")
        # records written before these fields existed are indexed and no item's
        data = {"indexed": True, "item": None, "document": None, "part": None, "source": None, **data}
        if set(data) != set(_STORED):
            raise StoreError("stored record does not have the expected fields")
        checks = {
            "id": lambda v: isinstance(v, str) and v,
            "version": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "text": lambda v: isinstance(v, str) and v,
            "tenant": lambda v: isinstance(v, str) and v,
            "session_id": lambda v: v is None or isinstance(v, str),
            "created_at": _finite,
            "source_text_hash": lambda v: isinstance(v, str),
            "importance_score": _finite,
            "semantic_keywords": lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v),
            "expires_at": lambda v: v is None or _finite(v),
            "indexed": lambda v: isinstance(v, bool),
            "item": lambda v: v is None or (isinstance(v, str) and v.startswith(("i/", "d/"))),
            "document": lambda v: v is None or (isinstance(v, str) and v.isalnum()),
            "part": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
            "source": lambda v: v is None or isinstance(v, str),
        }
        for name, check in checks.items():
            if not check(data[name]):
                raise StoreError(f"stored record has an invalid {name}")
        if (data["document"] is None) != (data["part"] is None):
            raise StoreError("stored record has a document without a part, or a part without a document")
        if text_hash(data["text"]) != data["source_text_hash"]:
            raise StoreError(f"stored record {data['id']}@{data['version']} does not match its text hash")
        data["semantic_keywords"] = tuple(data["semantic_keywords"])
        return cls(**data)

    def as_dict(self) -> dict[str, Any]:
        """The record's fields as plain data (no store reference)."""
        data = asdict(replace(self, fragment_source=None))
        data.pop("fragment_source")
        return data

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


_DERIVED = {"status", "access_count", "last_access", "score", "fragment_source"}
_STORED = tuple(f.name for f in fields(MemoryRecord) if f.name not in _DERIVED)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
