"""Re-encoding the positions of cached keys (rotary position embeddings).

A key cached after RoPE at position ``p0`` is ``R(p0) k``; the same key at ``p1`` is
``R(p1) k = R(p1 - p0) R(p0) k``. Shifting a fragment therefore rotates its cached keys by the
offset alone, without the pre-rotation key. Values carry no position and are never touched.

Only the "rotate-half" layout is handled (the first ``rotary_dim`` channels form two halves that are
rotated against each other), which is the layout every supported family uses in transformers.
"""

from __future__ import annotations

import torch

__all__ = ["RotaryLayer", "rotate_", "shift_keys"]


class RotaryLayer:
    """The rotary frequencies of one attention layer.

    :param inv_freq: the layer's inverse frequencies, one per rotated channel pair
        (``rotary_dim / 2`` of them; fewer than ``head_dim / 2`` for partial rotary models).
    """

    __slots__ = ("inv_freq", "rotary_dim")

    def __init__(self, inv_freq: torch.Tensor) -> None:
        # float64: the shift angle is delta * inv_freq; rounding it in fp32 would add an error
        # that grows with delta, on top of the error the model itself made at encode time.
        self.inv_freq = inv_freq.detach().to(torch.float64).cpu()
        self.rotary_dim = 2 * self.inv_freq.numel()

    def cos_sin(
        self, deltas: int | torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine and sine of rotations by ``deltas`` positions (an int, or one per token: ``[n, half]``)."""
        angles = torch.as_tensor(deltas, dtype=torch.float64, device="cpu")[..., None] * self.inv_freq
        return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def shift_keys(keys: torch.Tensor, layer: RotaryLayer, delta: int) -> torch.Tensor:
    """Post-RoPE ``keys`` (``[..., seq, head_dim]``) rotated by ``delta`` positions, as a new tensor."""
    shifted = keys.clone()
    if delta:
        rotate_(shifted, *layer.cos_sin(delta, keys.dtype, keys.device), layer.rotary_dim)
    return shifted


def rotate_(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate ``keys`` (``[..., seq, head_dim]``) in place by the angles whose ``cos``/``sin`` are given.

    :param cos: ``[half]`` (one rotation for every token) or ``[seq, half]`` (one per token), with
        ``half = rotary_dim / 2``; channels past ``rotary_dim`` are left alone.
    """
    half = rotary_dim // 2
    k1, k2 = keys[..., :half], keys[..., half:rotary_dim]
    # rotate_half(k) = cat(-k2, k1), so k * cos + rotate_half(k) * sin is, half by half:
    #   k1' = k1 cos - k2 sin,   k2' = k2 cos + k1 sin
    k1_sin = k1 * sin
    k1.mul_(cos).addcmul_(k2, sin, value=-1.0)
    k2.mul_(cos).add_(k1_sin)
    return keys
