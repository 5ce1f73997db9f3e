"""Choosing which fragment tokens the blend recomputes in full context.

The question is run once over the shifted cache, and each fragment token is scored by the
attention the question's tokens pay it, normalised within each layer and averaged over layers.
The tokens the question reads are the ones whose missing cross-fragment context would change
the answer; a token nobody attends to cannot change it, however stale its K/V.
"""

from __future__ import annotations

import torch

__all__ = ["choose_recompute"]


def choose_recompute(capture: list[torch.Tensor], spans: list[tuple[int, int]], count: int) -> torch.Tensor:
    """The ``count`` fragment slots with the most attention from the question.

    :param capture: per layer, the attention mass each key slot received (``[key_length]``).
    :param spans: the fragments' slot ranges ``[start, end)``.
    :returns: the chosen slots, ascending.
    """
    candidates = torch.cat([torch.arange(start, end) for start, end in spans])
    if count <= 0:
        return candidates[:0]
    if count >= candidates.numel():
        return candidates
    mass = torch.stack([layer[candidates] for layer in capture])
    mass = mass / mass.sum(dim=1, keepdim=True).clamp_min(1e-30)
    top = mass.mean(dim=0).topk(count).indices
    return candidates[top].sort().values
