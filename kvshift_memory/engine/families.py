"""Which models can have their cached keys shifted exactly, and their rotary frequencies.

A family is listed here only once a test proves the shift exact on a tiny random config of it
(``tests/test_families.py``). Every other model still works, with exact prefix reuse only: the
engine reports the reason in the stats instead of shifting approximately.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kv.rope import RotaryLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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

    Sliding-window layers need nothing of their own here: the engine's attention applies each
    layer's window by prompt position, to placed fragments as to everything else.

    :param shiftable: cached keys can be moved to other positions by rotation alone.
    :param reason: why not, in words a user can act on (``None`` when shiftable).
    :param layers: the rotary frequencies of each decoder layer (empty when not shiftable).
    """

    shiftable: bool
    reason: str | None
    layers: tuple[RotaryLayer, ...]


def _rope_types(config: PretrainedConfig) -> set[str]:
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(value, dict) for value in params.values()):
        return {value.get("rope_type", "default") for value in params.values()}
    return {params.get("rope_type", "default")} if params else {"default"}


def text_decoder(model: PreTrainedModel) -> torch.nn.Module:
    """The text decoder of ``model``: its base model, or the language model inside a
    ``*ForConditionalGeneration`` (Gemma 3 4B+, Mistral 3), whose vision tower the engine never runs."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return decoder if isinstance(decoder, torch.nn.Module) else model.base_model


def _rotary_layers(model: PreTrainedModel, config: PretrainedConfig) -> tuple[RotaryLayer, ...] | None:
    """Each decoder layer's rotary frequencies, or ``None`` when the decoder has no rotary module
    where transformers puts one."""
    rotary = getattr(text_decoder(model), "rotary_emb", None)
    if rotary is None:
        return None
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    shared: dict[str, RotaryLayer] = {}  # layers of one type share one object: rotation tables are built once
    for layer_type in layer_types:
        if layer_type not in shared:
            # one table per layer type where the model has two RoPE bases (Gemma 3), else one for all
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
            if inv_freq is None:
                inv_freq = getattr(rotary, "inv_freq", None)
            if not isinstance(inv_freq, torch.Tensor):
                return None
            shared[layer_type] = RotaryLayer(inv_freq)
    return tuple(shared[layer_type] for layer_type in layer_types)


def position_scheme(model: PreTrainedModel) -> PositionScheme:
    """Inspect ``model`` and say whether, and how, its cached keys can be shifted."""
    config = model.config.get_text_config(decoder=True)
    family = config.model_type
    if family not in SHIFTABLE_FAMILIES:
        return PositionScheme(
            False,
            f"{family!r} has no position scheme kvshift can shift exactly "
            "(absolute positions or an untested rotary layout); using exact prefix reuse",
            (),
        )
    dynamic = _rope_types(config) - STATIC_ROPE_TYPES
    if dynamic:
        return PositionScheme(
            False,
            f"RoPE type {sorted(dynamic)} rescales with the sequence length, so keys cannot be shifted exactly; "
            "using exact prefix reuse",
            (),
        )
    layers = _rotary_layers(model, config)
    if layers is None:
        return PositionScheme(
            False,
            f"no rotary embedding module found in {type(model).__name__}'s text decoder; using exact prefix reuse",
            (),
        )
    return PositionScheme(True, None, layers)
