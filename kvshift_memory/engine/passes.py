"""The model runner as the blend and the token loop see it: a small protocol, so that neither
holds the engine (:class:`~.runner.ModelRunner` is what implements it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol, overload

if TYPE_CHECKING:
    import torch

    from ..kv.cache import ForwardStep, ShiftCache
    from ..kv.fragment import Fragment
    from .costs import CostModel
    from .fragments import FragmentCache
    from .planning import PreparedPrompt, PromptPlan
    from .prefix_cache import Exactness
    from .prompt import FragmentSpan, PromptLayout
    from .settings import EngineSettings

__all__ = ["Logits", "ModelPasses"]

#: what a forward pass returns: the last position's logits, every position's, or none (decoder only)
Logits = Literal["last", "all", "none"]


class ModelPasses(Protocol):
    """Forward passes over a :class:`ShiftCache`, and what a finished answer leaves behind."""

    settings: EngineSettings
    num_layers: int
    #: the weight format the model runs in
    weights: str
    eos_token_ids: frozenset[int]
    #: what a pass and a fragment fetch cost, learned from the runner's own calls
    costs: CostModel
    #: memories' fragments held in this process, and what each memory's store holds
    fragments: FragmentCache

    @overload
    def forward(
        self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Literal["last", "all"] = "last"
    ) -> torch.Tensor: ...

    @overload
    def forward(self, cache: ShiftCache, ids: torch.Tensor, step: ForwardStep, logits: Literal["none"]) -> None: ...

    @overload
    def prefill_exact(
        self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: Literal["last", "all"] = "last"
    ) -> torch.Tensor: ...

    @overload
    def prefill_exact(
        self, cache: ShiftCache, ids: torch.Tensor, start: int, end: int, logits: Literal["none"]
    ) -> None: ...

    def decode_one(self, cache: ShiftCache, token: int, slot: int) -> torch.Tensor:
        """The logits after ``token`` at ``slot``, its K/V written to ``cache``."""

    @property
    def kv_dtype(self) -> str:
        """The dtype K/V is held in."""

    @property
    def decode_path(self) -> str:
        """What runs a decoding step: ``"native"``, ``"torch"`` or ``"transformers"``."""

    def place(self, cache: ShiftCache, spans: list[FragmentSpan], fragments: list[Fragment]) -> None:
        """Copy the fragments into their spans, RoPE-shifted to where they land."""

    def prefill(self, plan: PromptPlan) -> PreparedPrompt:
        """The K/V of ``plan``'s prompt, reusing what ``plan.reuse`` allows."""

    def decode_text(self, token_ids: list[int]) -> str:
        """The answer's text so far (special tokens left out)."""

    def answered(self, layout: PromptLayout, text: str, token_ids: list[int], unencoded: list[FragmentSpan]) -> int:
        """Record an answer: its ids read back as its text, the missed memories' fragments encoded.

        :returns: the fragment tokens encoded.
        """

    def keep(
        self, plan: PromptPlan, cache: ShiftCache, token_ids: torch.Tensor, filled: int, exactness: Exactness
    ) -> None:
        """Remember a finished call's K/V for prefix reuse (and its store's chunks, when it has one)."""
