"""Where a memory's fragment comes from: this process's pool, the memory's store, or encoding it now.

A memory record may carry a :class:`FragmentSource` (a :class:`~kvshift_memory.MemoryStore` sets
itself): the engine reads a stored fragment from it and stores the fragments it encodes there.
A fragment is an accelerator: a store that cannot be reached, or a blob that fails its checks, costs
an encode from the text, never an answer.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from ..exceptions import CorruptFragmentError, StoreError
from ..kv.codec import CodecSpec, decode_fragment, encode_fragment
from ..kv.fragment import Fragment
from .costs import CostModel
from .pool import BytePool
from .prompt import FragmentSpan, PromptLayout, digest_ids

__all__ = ["FragmentCache", "FragmentSource"]

logger = logging.getLogger("kvshift_memory.engine")

#: memories whose latest fragment (after any conditioning) the pool's index remembers
_MEMORIES_REMEMBERED = 1 << 16

#: encodes the spans' fragments after the layout's conditioning (after it alone when ``lead``)
Encode = Callable[[PromptLayout, list[FragmentSpan], bool], list[Fragment]]


@runtime_checkable
class FragmentSource(Protocol):
    """What a memory record's ``fragment_source`` offers the engine (a :class:`~kvshift_memory.MemoryStore` does).

    ``variant`` names one model + encode context + codec; a record has at most one blob per variant.
    Methods raise :class:`~kvshift_memory.StoreError` when the store cannot be reached.
    """

    codec: str
    group_size: int

    def fragment_expectations(self, record: Any) -> dict[str, str]:
        """Header fields a blob of ``record`` must carry (tenant, id, version, text digest)."""
        ...

    def load_fragment(self, record: Any, variant: str) -> bytes | None:
        """The stored blob, or ``None``."""
        ...

    def has_fragment(self, record: Any, variant: str) -> bool:
        """Whether a blob is stored (reads no blob)."""
        ...

    def save_fragment(self, record: Any, variant: str, blob: bytes) -> bool:
        """Store a blob; ``False`` when the record changed meanwhile (nothing stored)."""
        ...

    def discard_fragment(self, record: Any, variant: str, reason: str) -> None:
        """Delete a blob the engine refused."""
        ...


def source_of(span: FragmentSpan) -> FragmentSource | None:
    """The store the span's memory record came from, if any."""
    return getattr(span.record, "fragment_source", None)


class FragmentCache:
    """Fragments kept in this process (bounded in bytes), and what is known to be in each store.

    :param fingerprint: the model's (keys stored blobs, so no other model reads them).
    :param geometry: ``(num_layers, kv_heads, head_dim)``, which a decoded blob must match.
    :param dtype: the model's; decoded blobs are cast to it.
    :param costs: observes how long a fetch takes.
    """

    def __init__(
        self,
        capacity_bytes: int,
        fingerprint: str,
        geometry: tuple[int, int, int],
        dtype: torch.dtype,
        costs: CostModel,
    ) -> None:
        self._pool: BytePool[Fragment] = BytePool(capacity_bytes, lambda fragment: fragment.nbytes)
        # per memory (tenant, encode context, tokens), the pool key of its fragment encoded
        # most recently after any conditioning: what a prompt under another system message reads
        self._any_conditioning: OrderedDict[Hashable, Hashable] = OrderedDict()
        self._lock = threading.Lock()
        # per store, the record fragments known to be in it (weak: a closed store is forgotten)
        self._stored: weakref.WeakKeyDictionary[Any, set[tuple]] = weakref.WeakKeyDictionary()
        self._fingerprint = fingerprint
        self._geometry = geometry
        self._dtype = dtype
        self._costs = costs

    def __len__(self) -> int:
        return len(self._pool)

    def values(self) -> Iterator[Fragment]:
        """A snapshot of the pooled fragments, most recently used last."""
        return self._pool.values()

    def clear(self) -> None:
        self._pool.clear()
        self._stored.clear()
        with self._lock:
            self._any_conditioning.clear()

    def pooled(self, layout: PromptLayout, span: FragmentSpan, lead: bool = False) -> Fragment | None:
        """The span's fragment from this process's pool: encoded after the layout's conditioning,
        or else (not for a lead fragment) after any other."""
        fragment = self._pool.get(_pool_key(layout, span, lead))
        if fragment is None and not lead:
            with self._lock:
                key = self._any_conditioning.get(_memory_key(layout, span))
            fragment = None if key is None else self._pool.get(key)
        return fragment

    def available(self, layout: PromptLayout, span: FragmentSpan, lead: bool = False) -> bool:
        """Whether the span's fragment is in this process's pool or in its memory's store, after
        the layout's conditioning or the default one (loads nothing)."""
        if self.pooled(layout, span, lead) is not None:
            return True
        return source_of(span) is not None and any(
            self._known_stored(span, candidate.context_digest(span, lead)) for candidate in _lookups(layout, lead)
        )

    def find(
        self, layout: PromptLayout, spans: list[FragmentSpan], lead: bool = False
    ) -> tuple[list[Fragment | None], list[str]]:
        """The cached fragments of ``spans`` (their lead fragments when ``lead``), each from this
        process's pool or its memory's store: encoded after the layout's conditioning if there is
        one, else (not for a lead fragment) after the default conditioning.

        :returns: the fragments (``None`` where there is none), and where each came from:
            ``"pool"``, ``"store"``, ``"missed"`` or ``"rejected"`` (its stored blob was refused).
        """
        found: list[Fragment | None] = []
        origins: list[str] = []
        for span in spans:
            fragment, origin = self._find_one(layout, span, lead, rejected=False)
            if fragment is None and not lead:
                fragment = self.pooled(layout, span)  # after another system message, in this process
                if fragment is not None:
                    origin = "pool"
            default = None if fragment is not None or lead else layout.under_default()
            if default is not None:
                fragment, origin = self._find_one(default, span, lead, rejected=origin == "rejected")
            found.append(fragment)
            origins.append(origin)
        return found, origins

    def fetch(
        self, layout: PromptLayout, spans: list[FragmentSpan], encode: Encode, lead: bool = False
    ) -> tuple[list[Fragment], list[str]]:
        """Fragments for ``spans`` as :meth:`find` finds them, the missing ones from ``encode``
        (after the layout's own conditioning; then pooled and stored).

        :returns: the fragments, and where each came from: ``"pool"``, ``"store"``, ``"encoded"``
            or ``"re-encoded"`` (its stored blob was refused).
        """
        found, origins = self.find(layout, spans, lead)
        missing = [i for i, fragment in enumerate(found) if fragment is None]
        if missing:
            encoded = encode(layout, [spans[i] for i in missing], lead)
            for i, fragment in zip(missing, encoded, strict=True):
                found[i] = fragment
                self._pool_put(layout, spans[i], lead, fragment)
                self._keep_stored(spans[i], fragment)
                origins[i] = "re-encoded" if origins[i] == "rejected" else "encoded"
        return [fragment for fragment in found if fragment is not None], origins

    def _find_one(
        self, layout: PromptLayout, span: FragmentSpan, lead: bool, rejected: bool
    ) -> tuple[Fragment | None, str]:
        key = _pool_key(layout, span, lead)
        context_digest = layout.context_digest(span, lead)
        fragment = self._pool.get(key)
        if fragment is not None:
            if not self._known_stored(span, context_digest):
                self._keep_stored(span, fragment)  # this text was encoded here before its record was stored
            return fragment, "pool"
        fragment, origin = self._load_stored(span, context_digest)
        if fragment is None:
            return None, "rejected" if rejected else origin
        self._pool_put(layout, span, lead, fragment)
        return fragment, origin

    def _pool_put(self, layout: PromptLayout, span: FragmentSpan, lead: bool, fragment: Fragment) -> None:
        key = _pool_key(layout, span, lead)
        self._pool.put(key, fragment)
        if lead:
            return
        with self._lock:
            memory = _memory_key(layout, span)
            self._any_conditioning[memory] = key
            self._any_conditioning.move_to_end(memory)
            while len(self._any_conditioning) > _MEMORIES_REMEMBERED:
                self._any_conditioning.popitem(last=False)

    def _stored_identity(
        self, source: FragmentSource, record: Any, context_digest: str
    ) -> tuple[str, CodecSpec, dict[str, str]]:
        """The variant key, codec and header a record's fragment has for this model and prefix."""
        spec = CodecSpec(source.codec, source.group_size)
        variant = hashlib.blake2b(
            f"{self._fingerprint}|{context_digest}|{spec.label}".encode(), digest_size=16
        ).hexdigest()
        return variant, spec, {**source.fragment_expectations(record), "model_fingerprint": self._fingerprint}

    def _load_stored(self, span: FragmentSpan, context_digest: str) -> tuple[Fragment | None, str]:
        source = source_of(span)
        if source is None:
            return None, "missed"
        variant, _, expect = self._stored_identity(source, span.record, context_digest)
        started = time.perf_counter()
        try:
            blob = source.load_fragment(span.record, variant)
        except StoreError as exc:  # a fragment is an accelerator: without the store, encode from text
            logger.warning("cannot fetch the fragment of memory %s: %s", span.record.id, exc)
            return None, "missed"
        if blob is None:
            return None, "missed"
        num_layers, kv_heads, head_dim = self._geometry
        try:
            fragment = decode_fragment(
                blob,
                expect={**expect, "context_digest": context_digest},
                kv_heads=kv_heads,
                head_dim=head_dim,
                num_layers=num_layers,
                dtype=self._dtype,
            )
            if fragment.token_ids != span.token_ids:
                raise CorruptFragmentError("the fragment's tokens are not the memory text's")
        except CorruptFragmentError as exc:
            source.discard_fragment(span.record, variant, str(exc))
            return None, "rejected"
        self._costs.observe_fetch(len(span.token_ids), time.perf_counter() - started)
        return fragment, "store"

    def _known_stored(self, span: FragmentSpan, context_digest: str) -> bool:
        """Whether the span's record (if any) has its fragment in its store, remembering a yes."""
        source = source_of(span)
        if source is None:
            return True
        variant = self._stored_identity(source, span.record, context_digest)[0]
        known = self._stored.setdefault(source, set())
        memo = _stored_memo(span.record, variant)
        if memo in known:
            return True
        try:
            if source.has_fragment(span.record, variant):
                known.add(memo)
                return True
        except StoreError as exc:
            logger.warning("cannot reach the store of memory %s: %s", span.record.id, exc)
            return True  # nothing to do about it now; the text stays the source of truth
        return False

    def _keep_stored(self, span: FragmentSpan, fragment: Fragment) -> None:
        source = source_of(span)
        if source is None:
            return
        variant, spec, metadata = self._stored_identity(source, span.record, fragment.context_digest)
        try:
            saved = source.save_fragment(span.record, variant, encode_fragment(fragment, spec, metadata))
        except StoreError as exc:
            logger.warning("cannot store the fragment of memory %s: %s", span.record.id, exc)
            return
        if saved:
            self._stored.setdefault(source, set()).add(_stored_memo(span.record, variant))


def _lookups(layout: PromptLayout, lead: bool) -> list[PromptLayout]:
    """The layouts a stored fragment is looked up under: the layout itself, then (not for a lead
    fragment, which is only worth reading right after its own conditioning) under the default."""
    default = None if lead else layout.under_default()
    return [layout] if default is None else [layout, default]


def _memory_key(layout: PromptLayout, span: FragmentSpan) -> Hashable:
    """A memory's fragments whatever they were encoded after: its tenant, encode context and tokens."""
    return (layout.tenant, span.context, span.token_ids)


def _pool_key(layout: PromptLayout, span: FragmentSpan, lead: bool) -> Hashable:
    return (layout.tenant, layout.context_digest(span, lead), digest_ids(span.token_ids))


def _stored_memo(record: Any, variant: str) -> tuple:
    """How the engine remembers that a record's fragment (for one model and codec) is in its store."""
    return (record.tenant, record.id, record.version, variant)
