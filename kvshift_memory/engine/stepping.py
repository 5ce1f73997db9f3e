"""The one-token step: a decoding step written out for the families whose layers it knows, without
transformers' forward around it.

A step of a 30-layer model through transformers calls several hundred modules, builds position
tables and masks, and goes through the cache's and the attention function's bookkeeping for one
token; on a small model that overhead is most of the step (``docs/benchmarks/decode.md``). Here
one step is, per layer: the model's own norm modules, one product for q, k and v together (when
the projections are quantized alike, :func:`~.weights.stack_projections`), the rotation, the
cache write, one attention call over the slots the layer sees, the output projection, and the
MLP with gate and up in one product. The arithmetic is transformers' own, op for op, so a step
gives the logits its forward pass would, up to the order of sums inside a kernel.

Attention runs in :mod:`.native`'s one-token kernel (float32 K/V on the CPU), else in PyTorch's
``scaled_dot_product_attention``.

Families: Llama, Mistral, Qwen2, Qwen3 (norms on q and k) and Gemma 3 (norms around attention
and MLP, two RoPE bases, sliding windows). Anything else (a logit soft-cap in attention, fused
projections, another layer layout) decodes through transformers' forward, as before; the engine
says which in ``stats.decode_step``.
"""

from __future__ import annotations

import ctypes
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .native import Layer, Model, NativeKernels, kernels
from .weights import QuantizedEmbedding, QuantizedLinear, StackedProjections, stack_projections

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..kv.cache import ShiftCache

__all__ = ["STEP_FAMILIES", "OneTokenStep", "one_token_step"]

#: ``model_type`` values whose layers :class:`OneTokenStep` runs
STEP_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})
_SANDWICH = frozenset({"gemma3_text"})  # norms after attention and around the MLP
# the activations the kernels' layer step computes, by config name
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _rms_norm_weight(norm: torch.nn.Module, gemma: bool) -> tuple[torch.Tensor, float] | None:
    """The weight an RMS norm multiplies by (Gemma's ``1 + w``, as its forward computes it) and
    its epsilon, or ``None`` for a norm the kernels do not know."""
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if not type(norm).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or eps is None:
        return None
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return None
    return ((1.0 + weight.detach()) if gemma else weight.detach()).contiguous(), float(eps)


@dataclass
class _Layer:
    """What one decoder layer's step reads, gathered once."""

    input_norm: torch.nn.Module
    attention_norm: torch.nn.Module | None  # the sandwich layouts' norm of the attention output
    mlp_norm: torch.nn.Module
    mlp_out_norm: torch.nn.Module | None
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None
    qkv: StackedProjections | None
    projections: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]
    o_proj: torch.nn.Module
    gate_up: StackedProjections | None
    gate_proj: torch.nn.Module
    up_proj: torch.nn.Module
    down_proj: torch.nn.Module
    act: Any
    scaling: float
    window: int | None
    rope_type: str
    #: the whole layer as one call of the kernels' layer step, when it can be (``None``: PyTorch)
    native: Layer | None = None
    #: tensors ``native`` points into that the model does not hold (Gemma's ``1 + w`` norm weights)
    held: tuple[torch.Tensor, ...] = ()


class OneTokenStep:
    """Decode one token over a :class:`ShiftCache` for a supported model (:func:`one_token_step`)."""

    def __init__(self, model: PreTrainedModel, decoder: Any) -> None:
        config = model.config.get_text_config(decoder=True)
        self.family: str = config.model_type
        self.device = next(model.parameters()).device
        self.q_heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.q_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.q_heads)
        self.embed: Any = model.get_input_embeddings()
        self.norm: Any = decoder.norm
        self.head: Any = model.get_output_embeddings()
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.rotary: Any = decoder.rotary_emb
        self._typed_rotary = "layer_type" in inspect.signature(self.rotary.forward).parameters
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.layers = [
            self._layer(layer, config, kind) for layer, kind in zip(decoder.layers, layer_types, strict=False)
        ]
        self.rope_types = sorted({layer.rope_type for layer in self.layers})
        self._native_layers: ctypes.Array[Layer] | None = None
        #: the whole token runs as one call of the kernels' model step (``None``: in PyTorch)
        self.native_model: Model | None = self._native_model(config) if self.device.type == "cpu" else None

    def _layer(self, layer: Any, config: Any, layer_type: str) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        sandwich = self.family in _SANDWICH
        window = getattr(attn, "sliding_window", None)
        if self.family == "mistral":
            window = getattr(config, "sliding_window", None)
        built = _Layer(
            input_norm=layer.input_layernorm,
            attention_norm=layer.post_attention_layernorm if sandwich else None,
            mlp_norm=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
            mlp_out_norm=layer.post_feedforward_layernorm if sandwich else None,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            qkv=stack_projections([attn.q_proj, attn.k_proj, attn.v_proj]),
            projections=(attn.q_proj, attn.k_proj, attn.v_proj),
            o_proj=attn.o_proj,
            gate_up=stack_projections([mlp.gate_proj, mlp.up_proj]),
            gate_proj=mlp.gate_proj,
            up_proj=mlp.up_proj,
            down_proj=mlp.down_proj,
            act=mlp.act_fn,
            scaling=float(attn.scaling),
            window=int(window) if window else None,
            rope_type=layer_type if self._typed_rotary else "default",
        )
        activation_name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "")
        activation = _ACTIVATIONS.get(str(activation_name))
        if kernels() is not None and activation is not None:
            self._native_layer(built, config, activation)
        return built

    def _native_model(self, config: Any) -> Model | None:
        """The model as the kernels' step reads it, where every part fits it: each layer (see
        :meth:`_native_layer`), a quantized embedding, an RMS final norm, a quantized head without bias."""
        natives = [layer.native for layer in self.layers if layer.native is not None]
        if len(natives) != len(self.layers):
            return None
        embed, head = self.embed, self.head
        if type(embed) is not QuantizedEmbedding or type(head) is not QuantizedLinear or head.bias is not None:
            return None
        found = _rms_norm_weight(self.norm, gemma=self.family in _SANDWICH)
        if found is None:
            return None
        final_norm, eps = found
        scale = 1.0 if embed.embed_scale is None else float(embed.embed_scale)
        self._native_layers = (Layer * len(natives))(*natives)
        self._final_norm = final_norm
        self.vocab = head.out_features
        return Model(
            len(self.layers),
            int(config.hidden_size),
            head.out_features,
            eps,
            scale,
            self._native_layers,
            embed.matrix.native,
            head.matrix.native,
            final_norm.data_ptr(),
        )

    def _native_layer(self, layer: _Layer, config: Any, activation: int) -> None:
        """Fill ``layer.native`` where the whole layer fits the kernels' layer step: quantized
        projections (q, k, v and gate, up stacked), RMS norms of one epsilon."""
        sandwich = self.family in _SANDWICH
        o_proj, down_proj = layer.o_proj, layer.down_proj
        if layer.qkv is None or layer.gate_up is None:
            return
        if not (type(o_proj) is QuantizedLinear and type(down_proj) is QuantizedLinear):
            return
        norms = [layer.input_norm, layer.attention_norm, layer.mlp_norm, layer.mlp_out_norm, layer.q_norm, layer.k_norm]
        weights: list[torch.Tensor | None] = []
        epsilons = set()
        for norm in norms:
            if norm is None:
                weights.append(None)
                continue
            found = _rms_norm_weight(norm, gemma=sandwich)
            if found is None:
                return
            weights.append(found[0])
            epsilons.add(found[1])
        if len(epsilons) != 1 or (layer.q_norm is None) != (layer.k_norm is None):
            return
        held = tuple(weight for weight in weights if weight is not None)
        pointers = [None if weight is None else weight.data_ptr() for weight in weights]
        layer.native = Layer(
            int(config.hidden_size),
            self.q_heads,
            self.kv_heads,
            self.head_dim,
            layer.gate_up.matrix.rows // 2,
            layer.window or 0,
            activation,
            int(sandwich),
            epsilons.pop(),
            layer.scaling,
            *pointers,
            *(_pointer(bias) for bias in (layer.qkv.bias, o_proj.bias, layer.gate_up.bias, down_proj.bias)),
            layer.qkv.matrix.native,
            o_proj.matrix.native,
            layer.gate_up.matrix.native,
            down_proj.matrix.native,
        )
        layer.held = held

    def _rotations(self, dtype: torch.dtype, slot: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE type, ``cos`` and the signed ``sin`` that turn ``q * cos + rotate_half(q) * sin``
        into ``q * cos + roll(q) * signed_sin`` (the same products: ``-(a * b) == a * -b``)."""
        positions = torch.tensor([[slot]], device=self.device)
        like = torch.empty(1, 1, 1, dtype=dtype, device=self.device)  # the rotary module reads its dtype and device
        tables = {}
        for rope_type in self.rope_types:
            args = (like, positions, rope_type) if self._typed_rotary else (like, positions)
            cos, sin = self.rotary(*args)
            cos, sin = cos.reshape(-1), sin.reshape(-1)
            half = sin.numel() // 2
            tables[rope_type] = (cos.contiguous(), torch.cat([-sin[:half], sin[half:]]))
        return tables

    def _attend(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lo: int, hi: int, scaling: float
    ) -> torch.Tensor:
        native = kernels() if keys.device.type == "cpu" and keys.dtype == torch.float32 else None
        if native is not None:
            out = torch.empty_like(query)
            native.attend_one(query, keys, values, lo, hi, scaling, out)
            return out
        out = F.scaled_dot_product_attention(
            query[None, :, None], keys[:, :, lo:hi], values[:, :, lo:hi], scale=scaling, enable_gqa=True
        )
        return out[0, :, 0]

    @torch.inference_mode()
    def __call__(self, cache: ShiftCache, token: int, slot: int) -> torch.Tensor:
        """The logits after ``token`` at ``slot`` (float32 ``[vocab]``); its K/V is written to ``cache``."""
        native = kernels() if self.native_model is not None else None
        keys, _ = cache.buffer(0)
        if native is not None and keys.dtype == torch.float32 and keys.is_contiguous():
            logits = self._native_step(native, cache, token, slot)
        else:
            hidden = self.embed(torch.tensor([[token]], device=self.device))[0]
            hidden = self._layers_in_torch(cache, hidden, self._rotations(hidden.dtype, slot), slot)
            logits = self.head(self.norm(hidden))[0].float()
        cache.mark_filled(slot + 1)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _native_step(self, native: NativeKernels, cache: ShiftCache, token: int, slot: int) -> torch.Tensor:
        assert self.native_model is not None
        if not 0 <= token < self.native_model.embed.rows:
            raise IndexError(f"token id {token} outside the vocabulary of {self.native_model.embed.rows}")
        tables = self._rotations(torch.float32, slot)
        count = len(self.layers)
        buffers = [cache.buffer(index) for index in range(count)]
        pointers = ctypes.c_void_p * count
        keys = pointers(*(k.data_ptr() for k, _ in buffers))
        values = pointers(*(v.data_ptr() for _, v in buffers))
        cos = pointers(*(tables[layer.rope_type][0].data_ptr() for layer in self.layers))
        signed_sin = pointers(*(tables[layer.rope_type][1].data_ptr() for layer in self.layers))
        logits = torch.empty(self.vocab, dtype=torch.float32)
        native.model_step(self.native_model, token, slot, keys, values, buffers[0][0].shape[2], cos, signed_sin, logits)
        return logits

    def _layers_in_torch(
        self, cache: ShiftCache, hidden: torch.Tensor, tables: dict[str, tuple[torch.Tensor, torch.Tensor]], slot: int
    ) -> torch.Tensor:
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        for index, layer in enumerate(self.layers):
            normed = layer.input_norm(hidden)
            if layer.qkv is not None:
                qkv = layer.qkv(normed)
                q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
            else:
                q, k, v = (projection(normed) for projection in layer.projections)
            q, k, v = (
                q.view(self.q_heads, self.head_dim),
                k.view(self.kv_heads, self.head_dim),
                v.view(self.kv_heads, self.head_dim),
            )
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            cos, signed_sin = tables[layer.rope_type]
            half = self.head_dim // 2
            q = q * cos + q.roll(half, -1) * signed_sin
            k = k * cos + k.roll(half, -1) * signed_sin
            keys, values = cache.buffer(index)
            keys[0, :, slot].copy_(k)
            values[0, :, slot].copy_(v)
            lo = max(0, slot + 1 - layer.window) if layer.window else 0
            attended = self._attend(q.contiguous(), keys, values, lo, slot + 1, layer.scaling)
            out = layer.o_proj(attended.view(1, -1))
            if layer.attention_norm is not None:
                out = layer.attention_norm(out)
            hidden = hidden + out
            normed = layer.mlp_norm(hidden)
            if layer.gate_up is not None:
                gate_up = layer.gate_up(normed)
                gate, up = gate_up[:, : gate_up.shape[1] // 2], gate_up[:, gate_up.shape[1] // 2 :]
            else:
                gate, up = layer.gate_proj(normed), layer.up_proj(normed)
            out = layer.down_proj(layer.act(gate) * up)
            if layer.mlp_out_norm is not None:
                out = layer.mlp_out_norm(out)
            hidden = hidden + out
        return hidden


def one_token_step(model: PreTrainedModel, decoder: torch.nn.Module) -> OneTokenStep | str:
    """The step for ``model``, or why it decodes through transformers' forward instead."""
    config = model.config.get_text_config(decoder=True)
    if config.model_type not in STEP_FAMILIES:
        return f"no one-token step for {config.model_type!r}"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if next(model.parameters()).dtype != torch.float32:
        return "the one-token step runs float32 models"
    required = ("input_layernorm", "self_attn", "mlp")
    for layer in getattr(decoder, "layers", ()):
        if not all(hasattr(layer, name) for name in required):
            return f"an unexpected layer layout in {type(layer).__name__}"
        if not all(hasattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"an unexpected attention layout in {type(layer.self_attn).__name__}"
        if not all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            return f"an unexpected MLP layout in {type(layer.mlp).__name__}"
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "norm"):
        return f"an unexpected decoder layout in {type(decoder).__name__}"
    return OneTokenStep(model, decoder)
