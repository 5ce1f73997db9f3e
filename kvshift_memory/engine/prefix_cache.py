"""The K/V of earlier prompts, kept per tenant for exact prefix reuse (and for cut-out windows).

A new prompt starts with the longest cached prompt prefix of its tenant it shares. In
``"blend"`` mode a prompt that is a cached one with a stretch cut out (a working window whose
oldest turns were evicted) also reuses what follows the cut, RoPE-shifted to its new positions:
the approximation StreamingLLM makes, with the shared prefix as attention sink.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv.cache import ShiftCache
from .pool import BytePool
from .prompt import PromptLayout, common_prefix

__all__ = ["Exactness", "PrefixCache", "PrefixEntry", "whole_spans"]

# A cut-out stretch is reused only when what follows it runs this long: shorter runs save little,
# and short token matches are as likely to be chance.
_MIN_SHIFTED_RUN = 16
_MATCH_PROBE = 8

#: moves the keys in slots ``[start, start + len(deltas))`` of a cache by ``deltas`` positions
Rotate = Callable[[ShiftCache, int, torch.Tensor], None]


@dataclass(frozen=True)
class Exactness:
    """How far a cache's slots can be trusted: before ``exact_until`` they hold what full
    recompute would; before ``unblended_until`` they are that or K/V restored through a store's
    lossy codec (int8, int4, fp16): close, but never served as exact (never to a ``"prefix"``
    call, never written to a store as exact); from there on a blend placed them."""

    exact_until: int
    unblended_until: int

    @classmethod
    def whole(cls, length: int) -> Exactness:
        return cls(length, length)

    def blended_from(self, slot: int) -> Exactness:
        return Exactness(min(self.exact_until, slot), min(self.unblended_until, slot))

    def lossy_from(self, slot: int) -> Exactness:
        return Exactness(min(self.exact_until, slot), self.unblended_until)

    def join(self, other: Exactness) -> Exactness:
        return Exactness(min(self.exact_until, other.exact_until), min(self.unblended_until, other.unblended_until))


@dataclass(eq=False)
class PrefixEntry:
    """One cached prompt: its ids, K/V views of its slots, how many of them are exact, and how
    many are exact or restored through a store's lossy codec (never blended)."""

    tenant: str
    token_ids: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    exact_length: int
    unblended_length: int
    nbytes: int


class PrefixCache:
    """Cached prompts, bounded in bytes (least recently used evicted first).

    :param capacity_bytes: the bound; ``0`` keeps nothing.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._pool: BytePool[PrefixEntry] = BytePool(capacity_bytes, lambda entry: entry.nbytes)

    def __len__(self) -> int:
        return len(self._pool)

    def clear(self) -> None:
        self._pool.clear()

    def lookup(self, tenant: str, ids: torch.Tensor) -> tuple[PrefixEntry | None, int]:
        """The cached prompt of ``tenant`` sharing the longest prefix with ``ids``, and that length."""
        best, best_len = None, 0
        for entry in self._pool.values():
            if entry.tenant != tenant:
                continue
            common = common_prefix(entry.token_ids, ids)
            if common > best_len:
                best, best_len = entry, common
        if best is not None:
            self._pool.get(id(best))  # mark as recently used
        return best, best_len

    def remember(self, tenant: str, cache: ShiftCache, ids: torch.Tensor, filled: int, exactness: Exactness) -> None:
        """Keep slots ``[0, filled)`` of ``cache`` for ``tenant`` (views, no copy: nothing writes there again)."""
        if filled == 0 or self._pool.capacity_bytes <= 0:
            return
        exact, unblended = min(exactness.exact_until, filled), min(exactness.unblended_until, filled)
        known, common = self.lookup(tenant, ids[:filled])
        if (
            known is not None
            and common == filled
            and known.exact_length >= exact
            and known.unblended_length >= unblended
        ):
            return  # already cached (every fragment encode re-reads the same prefix): keep one copy
        kv = cache.view(0, filled)
        nbytes = sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in kv)
        entry = PrefixEntry(tenant, ids[:filled].clone(), kv, exact, unblended, nbytes)
        self._pool.put(id(entry), entry)

    def reuse(
        self,
        cache: ShiftCache,
        layout: PromptLayout,
        mode: str,
        rotate: Rotate,
        shift_cuts: bool = True,
        lossy: bool = False,
    ) -> tuple[int, Exactness, int]:
        """Copy the longest usable cached prefix of ``layout`` into ``cache``.

        :param mode: ``"prefix"`` (exact slots only) or ``"blend"`` (also slots an earlier blend
            placed, and with ``shift_cuts`` a prompt's stretch after a cut, shifted with ``rotate``).
        :param lossy: under ``"prefix"``, also slots restored through a store's lossy codec.
        :returns: (tokens reused, how far the cache is exact, of the reused those shifted from a later position).
        """
        ids, n = layout.token_ids, layout.length
        entry, common = self.lookup(layout.tenant, ids)
        if entry is None:
            return 0, Exactness.whole(n), 0
        if mode == "prefix":
            common = min(common, entry.unblended_length if lossy else entry.exact_length)
        elif entry.exact_length < min(common, layout.anchor_length):
            # Fragments are encoded against the prefix, so the prefix itself must be exact.
            common = min(common, entry.exact_length)
        reused = whole_spans(layout, min(common, n - 1))  # the last prompt token is always run, for its logits
        if reused <= 0:
            return 0, Exactness.whole(n), 0
        with torch.inference_mode():
            for layer, (keys, values) in enumerate(entry.kv):
                cache.write(layer, 0, keys[..., :reused, :], values[..., :reused, :])
        exactness = Exactness(
            n if reused <= entry.exact_length else entry.exact_length,
            n if reused <= entry.unblended_length else entry.unblended_length,
        )
        shifted = 0
        if mode == "blend" and shift_cuts:  # from ``reused``, not ``common``: a cut may fall inside a memory's span
            donor, source, run = self._cut_out_run(layout.tenant, ids, reused)
            shifted = whole_spans(layout, reused + min(run, n - 1 - reused)) - reused
            if donor is not None and shifted >= _MIN_SHIFTED_RUN:
                with torch.inference_mode():
                    for layer, (keys, values) in enumerate(donor.kv):
                        stretch = slice(source, source + shifted)
                        cache.write(layer, reused, keys[..., stretch, :], values[..., stretch, :])
                    rotate(cache, reused, torch.full((shifted,), reused - source, device="cpu"))
                exactness = exactness.blended_from(reused)
                reused += shifted
            else:
                shifted = 0
        return reused, exactness, shifted

    def _cut_out_run(self, tenant: str, ids: torch.Tensor, start: int) -> tuple[PrefixEntry | None, int, int]:
        """Where ``ids[start:]`` continues in a cached prompt of ``tenant`` that shares ``ids[:start]`` after a cut.

        :returns: (cached prompt, its slot where the run starts, run length); length 0 when none.
        """
        probe = ids[start : start + _MATCH_PROBE]
        best: tuple[PrefixEntry | None, int, int] = (None, 0, 0)
        if probe.numel() < _MATCH_PROBE:
            return best
        for entry in self._pool.values():
            cached = entry.token_ids
            if (
                entry.tenant != tenant
                or cached.numel() < start + 1 + _MATCH_PROBE
                or common_prefix(cached, ids) < start
            ):
                continue
            windows = cached[start + 1 :].unfold(0, _MATCH_PROBE, 1)
            for offset in (windows == probe).all(dim=1).nonzero()[:, 0].tolist():
                source = start + 1 + offset
                length = common_prefix(cached[source:], ids[start:])
                if length > best[2]:
                    best = (entry, source, length)
        return best


def whole_spans(layout: PromptLayout, end: int) -> int:
    """``end``, moved back to a memory's start when it falls inside it (a memory is placed whole)."""
    for span in layout.fragments:
        if span.start < end < span.end:
            return span.start
    return end
