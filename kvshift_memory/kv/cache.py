"""The working KV cache of one generation: preallocated, position-addressed, never shared.

transformers' ``DynamicCache`` grows by concatenation (a copy of the whole cache per layer per step)
and assumes new tokens always go at the end. Reuse needs two other things: blocks of KV placed at
chosen positions before any forward pass (prefix, shifted fragments), and a forward pass whose
query tokens sit at scattered positions inside the cache (the blend's recompute pass), writing
their new K/V over the old ones. :class:`ShiftCache` does both. Slot ``i`` of every layer always
holds the token at position ``i``.

The forward pass in progress is described by a :class:`ForwardStep`, published through a context
variable so that the attention function sees the same description as the cache layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["ForwardStep", "ShiftCache", "current_step"]


@dataclass
class ForwardStep:
    """Where the query tokens of one forward pass live, and what they may attend to.

    :param slots: positions (= cache slots) of the query tokens, ascending.
    :param key_length: keys ``[0, key_length)`` are visible to the attention (causality is applied
        per query by position on top of that).
    :param capture: when a list, the attention function appends, for each layer, the attention
        probability mass each key received from the last ``capture_queries`` queries, summed over
        queries and heads (a ``[key_length]`` tensor).
    :param local_window: queries at slots below ``local_before`` see only the ``local_window`` slots
        up to their own, plus the anchor slots ``[0, anchor)`` (the shared prefix). The blend's
        recompute pass uses it: a fragment token's stale K/V is mostly mended by its neighbourhood,
        and attending to the whole context would cost more than the rest of the pass. Its
        selection pass too, for the question tokens before the ranking ones.
    """

    slots: torch.Tensor  # on the CPU: the engine reads them as indices; see :meth:`slots_on`
    key_length: int
    capture: list[torch.Tensor] | None = None
    capture_queries: int = 1 << 30
    local_window: int | None = None
    local_before: int = 0
    anchor: int = 0
    first_slot: int = field(init=False)
    contiguous: bool = field(init=False)
    plans: dict = field(init=False, default_factory=dict)  # the attention's per-pass chunk plans

    def __post_init__(self) -> None:
        self.first_slot = int(self.slots[0])
        last = int(self.slots[-1])
        self.contiguous = last - self.first_slot + 1 == self.slots.numel()

    @classmethod
    def span(cls, start: int, end: int) -> ForwardStep:
        """Queries at slots ``[start, end)`` appended after everything before them."""
        return cls(torch.arange(start, end, device="cpu"), key_length=end)

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """The slots on ``device`` (where the model runs), copied there once per pass."""
        if self.slots.device == device:
            return self.slots
        key = ("slots", device)
        if key not in self.plans:
            self.plans[key] = self.slots.to(device)
        return self.plans[key]


current_step: ContextVar[ForwardStep | None] = ContextVar("kvshift_current_step", default=None)


class _ShiftLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, capacity: int, device: torch.device | None) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.device = device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        device = self.device or key_states.device
        self.keys = key_states.new_empty((batch, heads, self.capacity, dim), device=device)
        self.values = value_states.new_empty((batch, heads, self.capacity, value_states.shape[-1]), device=device)
        self.device = device
        self.is_initialized = True

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers (allocated by then: the base class types them optional)."""
        assert self.keys is not None and self.values is not None, "layer used before its first write"
        return self.keys, self.values

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        end = start + keys.shape[-2]
        own_keys, own_values = self.buffers()
        own_keys[..., start:end, :].copy_(keys)
        own_values[..., start:end, :].copy_(values)
        self.length = max(self.length, end)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        step = current_step.get()
        if step is None:
            raise RuntimeError("ShiftCache used outside KVShiftEngine's forward step")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.buffers()
        if step.contiguous:
            end = step.first_slot + key_states.shape[-2]
            keys[..., step.first_slot : end, :].copy_(key_states)
            values[..., step.first_slot : end, :].copy_(value_states)
        else:
            slots = step.slots_on(keys.device)
            keys.index_copy_(2, slots, key_states)
            values.index_copy_(2, slots, value_states)
        self.length = max(self.length, int(step.slots[-1]) + 1)
        return keys[..., : step.key_length, :], values[..., : step.key_length, :]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity


class ShiftCache(Cache):
    """A cache of ``num_layers`` layers, each preallocated for ``capacity`` tokens.

    :param num_layers: the model's number of decoder layers.
    :param capacity: the most tokens it will hold (prompt + generated).
    :param device: where its buffers live (the model's device); ``None``: the device of the first
        K/V written (a fragment read from a store is on the CPU, so the engine always says).
    """

    def __init__(self, num_layers: int, capacity: int, device: torch.device | None = None) -> None:
        self._shift_layers = [_ShiftLayer(capacity, device) for _ in range(num_layers)]
        super().__init__(layers=list(self._shift_layers))
        self.capacity = capacity

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Place ``keys``/``values`` (``[1, heads, n, dim]``) of ``layer`` at slots ``[start, start + n)``."""
        self._shift_layers[layer].write(start, keys, values)

    def buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole key and value buffers (views; writing into them writes the cache)."""
        return self._shift_layers[layer].buffers()

    def reserve(self, layer: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """Allocate the layer's buffers with the head layout of the given tensors, if not done yet."""
        if not self._shift_layers[layer].is_initialized:
            self._shift_layers[layer].lazy_initialization(like_keys, like_values)

    def mark_filled(self, end: int) -> None:
        """Record that slots ``[0, end)`` of every layer now hold valid KV (after direct buffer writes)."""
        for layer in self._shift_layers:
            layer.length = max(layer.length, end)

    def view(self, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of slots ``[start, end)`` of every layer: ``[(keys, values), ...]``, each ``[1, heads, n, dim]``."""
        views = []
        for layer in self._shift_layers:
            keys, values = layer.buffers()
            views.append((keys[..., start:end, :], values[..., start:end, :]))
        return views

    @contextlib.contextmanager
    def stepping(self, step: ForwardStep) -> Iterator[ForwardStep]:
        """Publish ``step`` to the cache layers and the attention function for one forward pass."""
        if int(step.slots[-1]) >= self.capacity:
            raise RuntimeError(f"slot {int(step.slots[-1])} is past the cache capacity {self.capacity}")
        token = current_step.set(step)
        try:
            yield step
        finally:
            current_step.reset(token)
