"""The attention function the engine installs in the model (``attn_implementation="kvshift"``).

Masks are built here from the positions of the query tokens (:class:`~kvshift_memory.kv.cache.ForwardStep`)
instead of by transformers, because the blend's recompute pass has query tokens scattered through the
context: query ``i`` at position ``p_i`` sees keys ``j <= p_i`` (and ``j > p_i - window`` on
sliding-window layers). Registering a name transformers has no mask function for makes it hand us
``attention_mask=None`` and leave the masking to us.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from ..kv.cache import ForwardStep, current_step

__all__ = ["ATTENTION_NAME", "kvshift_attention"]

ATTENTION_NAME = "kvshift"

# Scattered queries (the blend's recompute pass) are processed in chunks of at most this many, and
# a chunk closes once its queries span more than a quarter of the local window: each chunk attends
# to the keys its own queries can see, so the masked-out work stays small.
_QUERY_CHUNK = 64


def _visible(slots: torch.Tensor, keys: torch.Tensor, window: int | None, step: ForwardStep | None) -> torch.Tensor:
    """``[q, k]``: may the query at each slot see the key at each key slot."""
    visible = keys[None, :] <= slots[:, None]
    if window is not None:
        visible &= keys[None, :] > slots[:, None] - window
    if step is not None and step.local_window is not None:
        local = (keys[None, :] > slots[:, None] - step.local_window) | (keys[None, :] < step.anchor)
        visible &= local | (slots[:, None] >= step.local_before)
    return visible


def _key_slots(chunk: torch.Tensor, window: int | None, step: ForwardStep | None) -> torch.Tensor:
    """The key slots a chunk of ascending query slots can see at all."""
    hi = int(chunk[-1]) + 1
    lo = max(0, int(chunk[0]) - window + 1) if window is not None else 0
    if step is None or step.local_window is None or hi > step.local_before:
        return torch.arange(lo, hi, device="cpu")
    local_lo = max(lo, int(chunk[0]) - step.local_window + 1)
    anchor_hi = min(step.anchor, local_lo)
    if lo < anchor_hi:
        return torch.cat([torch.arange(lo, anchor_hi, device="cpu"), torch.arange(local_lo, hi, device="cpu")])
    return torch.arange(local_lo, hi, device="cpu")


def _chunks(slots: torch.Tensor, step: ForwardStep | None) -> list[tuple[int, int]]:
    """Split ascending query slots into index ranges ``[start, end)``."""
    if step is None or step.contiguous:
        return [(start, min(start + _QUERY_CHUNK, slots.numel())) for start in range(0, slots.numel(), _QUERY_CHUNK)]
    span_limit = (step.local_window or step.key_length) // 4
    bounds, start = [], 0
    values = slots.tolist()
    for index in range(1, len(values) + 1):
        if (
            index == len(values)
            or index - start == _QUERY_CHUNK
            or values[index] - values[start] > span_limit
            # queries from ``local_before`` on see every key: a windowed query in their chunk would too
            or values[index - 1] < step.local_before <= values[index]
        ):
            bounds.append((start, index))
            start = index
    return bounds


def _dense_mask(slots: torch.Tensor, key_length: int, window: int | None, step: ForwardStep | None) -> torch.Tensor:
    """``_visible`` over all keys, built once per pass (kept on the step) rather than once per layer."""
    plans = step.plans if step is not None else {}
    key = ("dense", window, slots.numel())
    if key not in plans:
        plans[key] = _visible(slots, torch.arange(key_length, device=slots.device), window, step)
    return plans[key]


def _explicit_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    softcap: float | None,
    capture: list[torch.Tensor] | None,
    capture_from: int = 0,
) -> torch.Tensor:
    """Softmax attention spelt out, for when we need the probabilities or a logit soft-cap.

    With ``capture`` a list, appends the probability mass each key gets from queries ``capture_from..``.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * q_len, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(batch, kv_heads, group, q_len, -1).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if capture is not None:
        capture.append(probs[..., capture_from:, :].sum(dim=(0, 1, 2, 3)))
    out = torch.matmul(probs.to(value.dtype).view(batch, kv_heads, group * q_len, -1), value)
    return out.view(batch, q_heads, q_len, value.shape[-1])


@dataclass(frozen=True)
class _Chunk:
    """One SDPA call: queries ``[start, end)`` of the step over the keys in ``ranges`` (slot ranges).

    ``mask`` is additive (0 or -inf, in the queries' dtype): SDPA would turn a boolean one into
    that on every call, that is once per chunk per layer.
    """

    start: int
    end: int
    ranges: tuple[tuple[int, int], ...]
    mask: torch.Tensor | None


def _plan(slots: torch.Tensor, window: int | None, step: ForwardStep | None, dtype: torch.dtype) -> list[_Chunk]:
    """The chunks of a pass; every layer of one attention kind shares them, so they are built once."""
    plans = step.plans if step is not None else {}
    key = ("chunks", window, slots.numel(), dtype)  # the capture pass plans only its leading queries here
    if key in plans:
        return plans[key]
    chunks = []
    for start, end in _chunks(slots, step):
        chunk = slots[start:end]
        key_slots = _key_slots(chunk, window, step)
        lo, hi = int(key_slots[0]), int(key_slots[-1]) + 1
        if hi - lo == key_slots.numel():
            ranges: tuple[tuple[int, int], ...] = ((lo, hi),)
        else:  # the anchor slots, then a local range
            split = int((key_slots[1:] - key_slots[:-1] > 1).nonzero()[0]) + 1
            ranges = ((lo, int(key_slots[split - 1]) + 1), (int(key_slots[split]), hi))
        visible = _visible(chunk, key_slots.to(chunk.device), window, step)
        mask = None
        if not (chunk.numel() == 1 and bool(visible.all())):  # else a decoding step: the one query sees every key given
            mask = torch.zeros(visible.shape, dtype=dtype, device=chunk.device).masked_fill_(~visible, float("-inf"))
        chunks.append(_Chunk(start, end, ranges, mask))
    plans[key] = chunks
    return chunks


def _sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    window: int | None,
    step: ForwardStep | None,
    scaling: float,
) -> torch.Tensor:
    """Attention through ``scaled_dot_product_attention``, chunk by chunk of query slots."""
    q_len, key_length = query.shape[2], key.shape[2]
    if window is None and q_len == key_length and (step is None or step.contiguous):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    outs = []
    for chunk in _plan(slots, window, step, query.dtype):
        if len(chunk.ranges) == 1:
            ((lo, hi),) = chunk.ranges
            chunk_keys, chunk_values = key[:, :, lo:hi], value[:, :, lo:hi]
        else:  # two slices are cheaper to join than a gather
            chunk_keys = torch.cat([key[:, :, a:b] for a, b in chunk.ranges], dim=2)
            chunk_values = torch.cat([value[:, :, a:b] for a, b in chunk.ranges], dim=2)
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, chunk.start : chunk.end],
                chunk_keys,
                chunk_values,
                attn_mask=chunk.mask,
                scale=scaling,
                enable_gqa=True,
            )
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def kvshift_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` (``[1, q_heads, q, dim]``) over ``key``/``value`` (``[1, kv_heads, n, dim]``).

    :raises NotImplementedError: for features a supported model never uses here (training-time
        dropout, attention sinks, padding masks).
    """
    if dropout and module.training:
        raise NotImplementedError("kvshift attention is for inference; call model.eval()")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported")
    if attention_mask is not None:
        raise NotImplementedError("kvshift attention builds its own masks; padded batches are not supported")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q_len, key_length = query.shape[2], key.shape[2]
    step = current_step.get()
    if step is None:  # a plain forward pass outside the engine: queries are the last q_len tokens
        slots = torch.arange(key_length - q_len, key_length, device=query.device)
    else:
        slots = step.slots_on(query.device)
    window = sliding_window if sliding_window and sliding_window < key_length else None

    if softcap is not None:
        capture, capture_from = (step.capture, max(0, q_len - step.capture_queries)) if step is not None else (None, 0)
        visible = _dense_mask(slots, key_length, window, step)
        out = _explicit_attention(query, key, value, visible, scaling, softcap, capture, capture_from)
    elif step is not None and step.capture is not None:
        # Only the last queries' attention is recorded (the ones that lead into the answer); the
        # others go through the fast kernel.
        split = max(0, q_len - step.capture_queries)
        visible = _dense_mask(slots[split:], key_length, window, step)
        tail = _explicit_attention(query[:, :, split:], key, value, visible, scaling, None, step.capture)
        if split:
            head = _sdpa_attention(query[:, :, :split], key, value, slots[:split], window, step, scaling)
            tail = torch.cat([head, tail], dim=2)
        out = tail
    else:
        out = _sdpa_attention(query, key, value, slots, window, step, scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, kvshift_attention)
