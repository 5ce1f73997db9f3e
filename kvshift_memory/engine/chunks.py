"""A conversation's K/V in a store, so that it outlives the process: chunks.

After a call, the prompt's and the answer's K/V are cut into chunks of ``chunk_tokens`` tokens
and written to the caller's store in the background (never on the answer's path): the full ones,
and the *tail* after the last of them.
A chunk's key is a hash chain over the model's fingerprint, the tenant, the codec
and every token up to the chunk's end: a chunk serves only behind the very same tokens, for the same
model and tenant. When the in-process prefix cache misses (a new process, another worker), the
engine reads the longest run of stored chunks the prompt starts with, then, of the tails stored
after them (one per conversation that shares that run), the one sharing most with the prompt, and
prefills only the rest.

A blob read back is untrusted: it is decoded by the fragment codec (never unpickled) and must carry
its own key, tenant and model, the chunk's tokens and position; one that does not is refused and
its tokens computed. Chunks hold exact K/V, or, flagged apart under keys of their own, K/V after a
blended memory (an approximation the in-process cache also keeps): those serve only ``"blend"`` calls.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..exceptions import CorruptFragmentError, InvalidInputError, StoreError
from ..kv.cache import ShiftCache
from ..kv.codec import CodecSpec, decode_fragment, encode_fragment
from ..kv.fragment import Fragment
from ..protocols import ChunkStore
from .costs import CostModel
from .prefix_cache import Exactness, whole_spans
from .prompt import PromptLayout, common_prefix

__all__ = ["ChunkWriter", "StoredChunks"]

logger = logging.getLogger("kvshift_memory.engine")

# the tails kept after one run of full chunks (the conversations of a tenant that share it), newest first
_TAILS_PER_PLACE = 16
_TAILS_MAGIC = b"kvshift-tails/1\n"
_MAX_TAILS_BYTES = 1 << 20
# how many chunk keys per store the engine remembers as written, so that a long conversation
# does not write its early chunks again after every turn (past it, the memo starts over)
_KNOWN_KEYS = 1 << 16


@dataclass(frozen=True)
class _Identity:
    """What every key and header of one store's chunks is bound to."""

    fingerprint: str
    tenant: str
    spec: CodecSpec

    @property
    def store_tenant(self) -> str | None:
        """The tenant as the store names it (``None``: the engine's default tenant ``""``)."""
        return self.tenant or None


def _chain(identity: _Identity, ids: torch.Tensor, chunk_tokens: int, chunks: int) -> list[str]:
    """The chain digest before each of the first ``chunks`` chunks of ``ids``, and after the last one."""
    state = hashlib.blake2b(
        f"kvshift-chunk/1|{identity.fingerprint}|{identity.tenant}|{identity.spec.label}|{chunk_tokens}".encode(),
        digest_size=16,
    ).digest()
    digests = [state.hex()]
    for index in range(chunks):
        digests.append(_after(digests[-1], ids[index * chunk_tokens : (index + 1) * chunk_tokens].tolist()))
    return digests


def _after(digest: str, token_ids: Sequence[int]) -> str:
    """The chain digest after a chunk of ``token_ids`` that follows the chain ``digest``."""
    piece = torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b(bytes.fromhex(digest) + piece, digest_size=16).hexdigest()


def _key(digest: str, exact: bool, tail: bool = False) -> str:
    """A full chunk's key (``digest``: the chain after it), or a tail's (``digest``: the chain before it)."""
    kind = ("tail-" if tail else "") + ("exact" if exact else "blended")
    return hashlib.blake2b(f"{digest}|{kind}".encode(), digest_size=16).hexdigest()


def _tail_key(digest: str, exact: bool, token_ids: Sequence[int]) -> str:
    """A tail's key: the chain before it and its own tokens, so that the conversations of a tenant
    that share what comes before (every one under a chunk long: only the chain's start) keep a
    tail each. :func:`_key` of the chain alone names the list of tails stored there."""
    tokens = hashlib.blake2b(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes(), digest_size=16)
    return _key(f"{digest}|{tokens.hexdigest()}", exact, tail=True)


def _read_tails(blob: bytes | None, chunk_tokens: int) -> list[tuple[int, ...]]:
    """The tails a list blob names (newest first); nothing for a missing or malformed one."""
    if not blob or not blob.startswith(_TAILS_MAGIC) or len(blob) > _MAX_TAILS_BYTES:
        return []
    try:
        tails = json.loads(blob[len(_TAILS_MAGIC) :])
    except (ValueError, RecursionError):  # RecursionError: a list nested thousands deep
        return []
    if not isinstance(tails, list) or len(tails) > _TAILS_PER_PLACE:
        return []
    if not all(
        isinstance(tail, list)
        and 0 < len(tail) <= chunk_tokens
        and all(type(i) is int and 0 <= i < 2**31 for i in tail)
        for tail in tails
    ):
        return []
    return [tuple(tail) for tail in tails]


def _header(identity: _Identity, key: str, exact: bool) -> dict[str, str]:
    return {
        "kind": "chunk",
        "chunk_key": key,
        "tenant": identity.tenant,
        "model_fingerprint": identity.fingerprint,
        "exact": "1" if exact else "0",
    }


@dataclass(frozen=True)
class Restored:
    """What :meth:`StoredChunks.restore` placed: slots up to ``end``, how far they are exact;
    ``rejected`` stored blobs refused."""

    end: int
    exactness: Exactness
    rejected: int


class StoredChunks:
    """Reads chunks into a prompt's cache, and hands the K/V of finished calls to a writer.

    A conversation is stored as full chunks, and its *tail* (what follows the last full chunk)
    under a key of the chain before it: the next turn restores it too, up to where its tokens
    and the new prompt's part (any prefix of a chunk's K/V is the K/V of that prefix).

    K/V read through a lossy codec (``int8``, ``int4``; ``fp16`` for a model that does not run in
    it) is close to what was stored, not equal: it is never counted as exact, so an exact call
    (``reuse="prefix"``) reads none of it, and what follows it is never stored as exact in a store
    whose codec would hand it back as such.

    :param fingerprint: the model's; ``geometry``: ``(num_layers, kv_heads, head_dim)``; ``dtype``: the model's.
    :param chunk_tokens: tokens per chunk.
    :param costs: the engine's cost model (a read is skipped when computing the tokens is cheaper).
    """

    def __init__(
        self,
        fingerprint: str,
        geometry: tuple[int, int, int],
        dtype: torch.dtype,
        chunk_tokens: int,
        costs: CostModel,
    ) -> None:
        self.fingerprint = fingerprint
        self.geometry = geometry
        self.dtype = dtype
        self.chunk_tokens = chunk_tokens
        self.costs = costs
        self.writer = ChunkWriter()
        # per store, the (tenant, key) of full chunks known to be there (weak: a closed store is forgotten)
        self._known: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
        self._known_lock = threading.Lock()

    def identity(self, store: ChunkStore, tenant: str) -> _Identity:
        return _Identity(self.fingerprint, tenant, CodecSpec(store.codec, store.group_size))

    def lossless(self, store: ChunkStore) -> bool:
        """Whether ``store``'s codec hands this model's K/V back bit for bit."""
        return store.codec == "fp32" or (store.codec == "fp16" and self.dtype == torch.float16)

    def restore(
        self, store: ChunkStore, cache: ShiftCache, layout: PromptLayout, start: int, blend: bool, lossy: bool
    ) -> Restored:
        """Read the stored chunks that continue slots ``[0, start)`` of ``layout``'s prompt into ``cache``.

        Full chunks are read in order while each is stored, checks out and is cheaper to read than
        to compute, then the tail stored after the last of them; blended K/V only when ``blend``
        and past the prompt's anchor; from a store with a lossy codec only when ``lossy``. An end
        inside a memory moves back to its start (a memory is placed whole); the last prompt token
        is always left to run, for its logits.

        :returns: where the restored K/V ends (``start`` when nothing was), and how far it is exact.
        """
        ids, n, size = layout.token_ids, layout.length, self.chunk_tokens
        lossless = self.lossless(store)
        if not lossless and not lossy:
            return Restored(start, Exactness.whole(n), 0)
        chunks = (n - 1) // size  # the full chunks before the last prompt token
        identity = self.identity(store, layout.tenant)
        digests = _chain(identity, ids, size, chunks)
        loaded: list[Fragment] = []
        exactness, rejected = Exactness.whole(n), 0
        index = start // size
        while not self.costs.recompute_cheaper(size):
            tail = index >= chunks
            fragment, exact, bad = self._read_either(store, identity, ids, digests, index, tail, blend, layout)
            if fragment is None and not tail and not bad:  # the tail stored at a missing chunk's place
                tail = True
                fragment, exact, bad = self._read_either(store, identity, ids, digests, index, tail, blend, layout)
            rejected += bad
            if fragment is None:
                break
            if not exact:
                exactness = exactness.blended_from(index * size)
            elif not lossless:
                exactness = exactness.lossy_from(index * size)
            loaded.append(fragment)
            if tail:
                break
            index += 1
        reached = loaded[-1].base_position + loaded[-1].n_tokens if loaded else start
        end = whole_spans(layout, min(reached, n - 1))
        if end <= start:
            return Restored(start, Exactness.whole(n), rejected)
        with torch.inference_mode():
            for fragment in loaded:
                low, high = max(fragment.base_position, start), min(fragment.base_position + fragment.n_tokens, end)
                if low >= high:
                    continue
                window = slice(low - fragment.base_position, high - fragment.base_position)
                for layer, (keys, values) in enumerate(zip(fragment.keys, fragment.values, strict=True)):
                    cache.write(layer, low, keys[..., window, :], values[..., window, :])
        # a bound at or past ``end`` falls in what the call computes itself
        exact_end, unblended_end = (
            bound if bound < end else n for bound in (exactness.exact_until, exactness.unblended_until)
        )
        return Restored(end, Exactness(exact_end, unblended_end), rejected)

    def stored_length(self, store: ChunkStore, layout: PromptLayout) -> int:
        """How many of the prompt's leading tokens ``store`` holds as this model's K/V chunks (exact
        or through its codec), read and checked as :meth:`restore` reads them, whatever reading costs."""
        ids, size = layout.token_ids, self.chunk_tokens
        chunks = (layout.length - 1) // size
        identity = self.identity(store, layout.tenant)
        digests = _chain(identity, ids, size, chunks)
        reached = 0
        for index in range(chunks + 1):
            tail = index >= chunks
            fragment, _, _ = self._read_either(store, identity, ids, digests, index, tail, False, layout)
            if fragment is None and not tail:
                tail = True
                fragment, _, _ = self._read_either(store, identity, ids, digests, index, tail, False, layout)
            if fragment is None:
                break
            reached = fragment.base_position + fragment.n_tokens
            if tail:
                break
        return reached

    def _read_either(
        self,
        store: ChunkStore,
        identity: _Identity,
        ids: torch.Tensor,
        digests: list[str],
        index: int,
        tail: bool,
        blend: bool,
        layout: PromptLayout,
    ) -> tuple[Fragment | None, bool, int]:
        """Chunk ``index`` (or the tail stored there): exact, else blended where allowed.

        :returns: the chunk or ``None``, whether it is exact, and how many stored blobs were refused.
        """
        digest = digests[index] if tail else digests[index + 1]
        fragment, bad = self._read(store, identity, digest, ids, index, exact=True, tail=tail)
        if fragment is not None or bad or not blend or index * self.chunk_tokens < layout.anchor_length:
            return fragment, True, bad
        fragment, bad = self._read(store, identity, digest, ids, index, exact=False, tail=tail)
        return fragment, False, bad

    def _read(
        self,
        store: ChunkStore,
        identity: _Identity,
        digest: str,
        ids: torch.Tensor,
        index: int,
        exact: bool,
        tail: bool,
    ) -> tuple[Fragment | None, int]:
        """The chunk (of a tail, the part the prompt shares) or ``None``, and 1 when a stored blob was refused."""
        size = self.chunk_tokens
        started = time.perf_counter()
        try:
            if tail:  # of the tails stored here, the one sharing the most with the prompt
                tails = _read_tails(store.load_chunk(_key(digest, exact, tail), tenant=identity.store_tenant), size)
                here = ids[index * size :]
                shared, best = max(((common_prefix(torch.tensor(t), here), t) for t in tails), default=(0, ()))
                if shared == 0:
                    return None, 0
                # a full chunk another conversation stored here serves the part this prompt shares
                key = _key(_after(digest, best), exact) if len(best) == size else _tail_key(digest, exact, best)
            else:
                key = _key(digest, exact)
            blob = store.load_chunk(key, tenant=identity.store_tenant)
        except (StoreError, InvalidInputError) as exc:  # an accelerator: without the store, compute
            logger.warning("cannot read a K/V chunk: %s", exc)
            return None, 0
        if blob is None:
            return None, 0
        num_layers, kv_heads, head_dim = self.geometry
        try:
            fragment = decode_fragment(
                blob,
                expect=_header(identity, key, exact),
                kv_heads=kv_heads,
                head_dim=head_dim,
                num_layers=num_layers,
                dtype=self.dtype,
            )
            if (
                fragment.base_position != index * size
                or fragment.n_tokens > size
                or (not tail and fragment.n_tokens != size)
            ):
                raise CorruptFragmentError("the chunk's position or length is not its key's")
        except CorruptFragmentError as exc:
            logger.warning("refusing a stored K/V chunk: %s", exc)
            return None, 1
        self.costs.observe_fetch(fragment.n_tokens, time.perf_counter() - started)
        shared = common_prefix(torch.tensor(fragment.token_ids), ids[index * size :])
        if not tail and shared != size:
            logger.warning("refusing a stored K/V chunk: its tokens are not the prompt's")
            return None, 1
        if shared == 0:
            return None, 0  # a tail another turn of this conversation wrote: it parted before its first token
        if not tail:
            self._remember(store, identity.tenant, key)
        return _prefix(fragment, shared), 0

    def save_later(
        self, store: ChunkStore, tenant: str, cache: ShiftCache, ids: torch.Tensor, filled: int, exactness: Exactness
    ) -> None:
        """Queue the K/V of slots ``[0, filled)`` for writing to ``store``: the full chunks not yet
        known to be there, and the tail after them.

        A chunk is stored as exact when its slots are, or, in a store whose codec is lossy anyway
        (whatever it hands back is served as approximate), when they were restored through a
        lossy codec; else as blended.
        ``cache``'s slots are kept as views (nothing writes there again); the writer encodes them.
        """
        size = self.chunk_tokens
        chunks = filled // size
        identity = self.identity(store, tenant)
        digests = _chain(identity, ids, size, chunks)
        exact_until = exactness.exact_until if self.lossless(store) else exactness.unblended_until
        jobs = []
        for index in range(chunks + 1):
            end = min((index + 1) * size, filled)
            if end <= index * size:
                break
            tail, exact = end - index * size < size, end <= exact_until
            token_ids = ids[index * size : end].tolist()
            key = _tail_key(digests[index], exact, token_ids) if tail else _key(digests[index + 1], exact)
            if not tail and self._is_known(store, tenant, key):
                continue
            kv = cache.view(index * size, end)
            fragment = Fragment(
                token_ids=tuple(token_ids),
                keys=tuple(k for k, _ in kv),
                values=tuple(v for _, v in kv),
                base_position=index * size,
                context_digest=digests[index],
            )
            jobs.append((key, fragment, _header(identity, key, exact), not tail))
        if jobs:
            self.writer.submit(lambda: self._write(store, identity, jobs))

    def _write(
        self, store: ChunkStore, identity: _Identity, jobs: list[tuple[str, Fragment, dict[str, str], bool]]
    ) -> None:
        for key, fragment, header, full in jobs:
            try:
                store.save_chunk(key, encode_fragment(fragment, identity.spec, header), tenant=identity.store_tenant)
            except StoreError as exc:
                logger.warning("cannot store a K/V chunk: %s", exc)
                return
            if full:  # a tail is written again after every turn: what follows it changes
                self._remember(store, identity.tenant, key)
            # listed after the chain before it, a full chunk too: a conversation that shares only
            # its start (the system message and the core block, then another question) reads that part
            self._list(store, identity, fragment, header["exact"] == "1")

    def _list(self, store: ChunkStore, identity: _Identity, chunk: Fragment, exact: bool) -> None:
        """Name ``chunk`` (a tail or a full chunk) first in the list of those stored after its chain
        (an earlier tail of the same conversation, which it continues, leaves the list; past
        :data:`_TAILS_PER_PLACE` the oldest goes). The list is a cache: two writers at once may each
        drop the other's entry, which costs that conversation a prefill, never a wrong restore (a
        chunk is checked on read)."""
        key = _key(chunk.context_digest, exact, tail=True)
        try:
            listed = _read_tails(store.load_chunk(key, tenant=identity.store_tenant), self.chunk_tokens)
            tails = [chunk.token_ids, *(t for t in listed if t != chunk.token_ids[: len(t)])][:_TAILS_PER_PLACE]
            store.save_chunk(key, _TAILS_MAGIC + json.dumps(tails).encode(), tenant=identity.store_tenant)
        except StoreError as exc:
            logger.warning("cannot store a K/V chunk: %s", exc)

    def _is_known(self, store: ChunkStore, tenant: str, key: str) -> bool:
        with self._known_lock:
            return (tenant, key) in self._known.get(store, ())

    def _remember(self, store: ChunkStore, tenant: str, key: str) -> None:
        with self._known_lock:
            known = self._known.setdefault(store, set())
            if len(known) >= _KNOWN_KEYS:
                known.clear()
            known.add((tenant, key))

    def forget_known(self) -> None:
        """Forget which chunks were written (the next calls check the store again)."""
        with self._known_lock:
            self._known.clear()


def _prefix(fragment: Fragment, tokens: int) -> Fragment:
    """The K/V of the first ``tokens`` tokens of ``fragment`` (causal: they depend on nothing after)."""
    if tokens == fragment.n_tokens:
        return fragment
    return Fragment(
        token_ids=fragment.token_ids[:tokens],
        keys=tuple(k[..., :tokens, :] for k in fragment.keys),
        values=tuple(v[..., :tokens, :] for v in fragment.values),
        base_position=fragment.base_position,
        context_digest=fragment.context_digest,
    )


class ChunkWriter:
    """One background thread that writes chunks in the order they were handed over.

    Started on first use; a daemon, so a process may end without it, and :meth:`flush` (also run at
    exit) waits for what was queued. A write that fails is logged and dropped: chunks are an
    accelerator, computed again when missing.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvshift-chunk-writer", daemon=True)
                self._thread.start()
                atexit.register(self.flush, 60.0)
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - a failed write must not end the writer; the K/V is computed again
                logger.exception("writing K/V chunks failed")
            finally:
                self._jobs.task_done()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk handed over so far is written; ``False`` when ``timeout_s`` ran out first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._jobs.all_tasks_done:
            while self._jobs.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._jobs.all_tasks_done.wait(remaining)
        return True
