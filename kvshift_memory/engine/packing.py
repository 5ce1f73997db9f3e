"""Linear layers whose weights are reordered once into oneDNN's blocked layout.

On CPU, ``torch.nn.Linear`` calls MKL's GEMM, which lays the weight out again for its kernels on
every call. The passes reuse leaves to the engine are short (a question of 20-40 tokens, one
token per decoding step), and there that repacking is a large share of the work
(``benchmarks/ttft.py --no-pack-weights``, ``docs/benchmarks/ttft.md``). oneDNN ships inside every CPU build of
PyTorch; its linear kernel is reached through the ``torch.ops.mkldnn`` operators that PyTorch's
own compiler uses.

Packing is checked once against ``torch.nn.functional.linear`` and skipped (the model left as
loaded) where those operators are missing, the model is not on the CPU or not in float32, or the
results disagree.

Packed weights are never written, so engines loaded from the same weight files in one process
share them (:func:`sharing`): a notebook cell that loads the model again, or a second engine with
other settings, neither packs again nor holds a second copy.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Hashable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F

from .fingerprint import tensor_digest

__all__ = ["PackedLinear", "pack_linear_layers", "sharing"]

log = logging.getLogger("kvshift_memory")

# packed and plain float32 differ only in summation order
_AGREEMENT = 1e-4

# the identity of the weight files the model being packed was loaded from (``None``: not shared)
_WEIGHTS: ContextVar[Hashable | None] = ContextVar("kvshift_packed_weights", default=None)
# packed weights by (weight files, layer name), held only while an engine uses them
_PACKED: weakref.WeakValueDictionary[tuple[Hashable, str], torch.Tensor] = weakref.WeakValueDictionary()
_PACKED_LOCK = threading.Lock()


@contextlib.contextmanager
def sharing(weights: Hashable | None) -> Iterator[None]:
    """Within this block, :func:`pack_linear_layers` shares packed weights with every live engine
    loaded from the same weight files: ``weights`` names them (folder, file sizes and times,
    dtype); ``None`` shares nothing."""
    token = _WEIGHTS.set(weights)
    try:
        yield
    finally:
        _WEIGHTS.reset(token)


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` held in oneDNN's layout (an opaque tensor: shape, no strides).

    The dense weight is not kept, so the model's ``state_dict`` no longer holds it (the bias stays
    in it); an engine whose model must be saved is built with ``EngineSettings(pack_weights=False)``.
    ``weight_digest`` keeps what :func:`~kvshift_memory.engine.fingerprint.model_fingerprint` digests
    of the dense weight.
    """

    def __init__(self, linear: torch.nn.Linear, packed: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        dense = linear.weight.detach()
        self.weight_digest = tensor_digest(dense)
        self.weight = packed if packed is not None else torch.ops.mkldnn._reorder_linear_weight(dense)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _packable(model: torch.nn.Module) -> str | None:
    """Why the model's linear layers cannot be packed, or ``None``."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    if not all(hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")):
        return "this PyTorch version lacks the oneDNN linear operators"
    parameters = list(model.parameters())
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in parameters):
        return "packing is for float32 models on the CPU"
    return None


def _agrees(linear: torch.nn.Linear, packed: PackedLinear) -> bool:
    probe = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0), device="cpu")
    expected = F.linear(probe, linear.weight, linear.bias)
    got = packed(probe)
    return bool(((got - expected).abs().max() <= _AGREEMENT * expected.abs().max().clamp_min(1.0)).item())


@torch.inference_mode()
def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` by a :class:`PackedLinear` (in place).

    :returns: how many layers were packed; 0 when packing does not apply (logged at INFO).
    """
    reason = _packable(model)
    linears = [(name, module) for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    if reason is None and linears:
        try:
            if not _agrees(linears[0][1], PackedLinear(linears[0][1])):
                reason = "packed results disagree with torch.nn.functional.linear"
        except RuntimeError as exc:  # an operator refusing this layer's shapes or this CPU
            reason = f"oneDNN refused the weights ({exc})"
    if reason is not None:
        log.info("linear layers left unpacked: %s", reason)
        return 0
    weights = _WEIGHTS.get()
    for name, linear in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with _PACKED_LOCK:
            shared = _PACKED.get((weights, name)) if weights is not None else None
        if shared is not None and tuple(shared.shape) != tuple(linear.weight.shape):
            shared = None
        packed = PackedLinear(linear, shared)
        if weights is not None and shared is None:
            with _PACKED_LOCK:
                _PACKED[(weights, name)] = packed.weight
        setattr(parent, child, packed)
    return len(linears)
