"""Which models can have their cached keys shifted exactly, and their rotary frequencies.

A family is listed here only once a test proves the shift exact on a tiny random config of it
(``tests/test_families.py``). Every other model still works, with exact prefix reuse only: the
engine reports the reason in the stats instead of shifting approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..kv.rope import RotaryLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["PositionScheme", "SHIFTABLE_FAMILIES", "STATIC_ROPE_TYPES", "position_scheme"]

#: ``config.model_type`` values whose attention caches keys after a rotate-half RoPE.
SHIFTABLE_FAMILIES: frozenset[str] = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "gpt_neox"}
)

#: RoPE variants whose frequencies do not depend on the sequence length (dynamic NTK and LongRoPE
#: re-scale them once the context passes a threshold, so a key cached at one length is not a
#: rotation of the key at another).
STATIC_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "yarn", "llama3"})


@dataclass(frozen=True)
class PositionScheme:
    """How positions are encoded in a loaded model.

    :param shiftable: cached keys can be moved to other positions by rotation alone.
    :param reason: why not, in words a user can act on (``None`` when shiftable).
    :param layers: the rotary frequencies of each decoder layer (empty when not shiftable).
    :param min_sliding_window: the smallest attention window of any layer (``None``: no window);
        past it, a fragment's keys would have been computed with context the prompt does not give.
    """

    shiftable: bool
    reason: str | None
    layers: tuple[RotaryLayer, ...]
    min_sliding_window: int | None

    def blocks_shift(self, total_tokens: int) -> str | None:
        """The reason a prompt of ``total_tokens`` (with its answer) cannot use shifted fragments."""
        if not self.shiftable:
            return self.reason
        if self.min_sliding_window is not None and total_tokens > self.min_sliding_window:
            return (
                f"the prompt ({total_tokens} tokens) passes the model's sliding attention window "
                f"({self.min_sliding_window}); fragments are recomputed"
            )
        return None


def _rope_types(config) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        return {value.get("rope_type", "default") for value in params.values()}
    return {params.get("rope_type", "default")} if params else {"default"}


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    modules: list[Any] = [
        m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")
    ]
    return sorted(modules, key=lambda m: int(m.layer_idx))


def _min_window(model: PreTrainedModel, config) -> int | None:
    windows = []
    for module in _attention_modules(model):
        window = getattr(module, "sliding_window", getattr(config, "sliding_window", None))
        if window:
            windows.append(int(window))
    return min(windows) if windows else None


def _rotary_layers(model: PreTrainedModel, config) -> tuple[RotaryLayer, ...]:
    rotary = getattr(model.base_model, "rotary_emb", None)
    if rotary is None:
        raise LookupError("no rotary embedding module")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    shared: dict[str, RotaryLayer] = {}  # layers of one type share one object: rotation tables are built once
    for layer_type in layer_types:
        if layer_type not in shared:
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
            shared[layer_type] = RotaryLayer(rotary.inv_freq if inv_freq is None else inv_freq)
    return tuple(shared[layer_type] for layer_type in layer_types)


def position_scheme(model: PreTrainedModel) -> PositionScheme:
    """Inspect ``model`` and say whether, and how, its cached keys can be shifted."""
    config = model.config.get_text_config(decoder=True)
    family = config.model_type
    window = _min_window(model, config)
    if family not in SHIFTABLE_FAMILIES:
        return PositionScheme(
            False,
            f"{family!r} has no position scheme kvshift can shift exactly "
            "(absolute positions or an untested rotary layout); using exact prefix reuse",
            (),
            window,
        )
    dynamic = _rope_types(config) - STATIC_ROPE_TYPES
    if dynamic:
        return PositionScheme(
            False,
            f"RoPE type {sorted(dynamic)} rescales with the sequence length, so keys cannot be shifted exactly; "
            "using exact prefix reuse",
            (),
            window,
        )
    return PositionScheme(True, None, _rotary_layers(model, config), window)
