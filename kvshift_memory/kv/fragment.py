"""A fragment: the K/V the model computed for one memory text, and what it was computed against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Fragment"]


@dataclass(frozen=True, eq=False)
class Fragment:
    """The cached K/V of one memory text.

    :param token_ids: the text's tokens, as placed in prompts.
    :param keys: one tensor per decoder layer, ``[1, kv_heads, n, head_dim]``, post-RoPE at
        positions ``base_position ...``.
    :param values: same layout as ``keys``.
    :param base_position: the position of the first token when the fragment was encoded.
    :param context_digest: digest of the tokens it was encoded after (the shared prefix): the
        fragment's first tokens attended to them, so it is only reused after the same prefix.
    """

    token_ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    base_position: int
    context_digest: str

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))
