"""What identifies a model for its fragments: a digest of config, every weight and the vocabulary.

Fragment keys and stored blobs carry it, so that K/V computed by one model is never read by another.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["format_fingerprint", "model_fingerprint", "model_weights_digest", "tensor_digest"]


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """The SHA-256 of every byte of ``tensor``'s values, with its shape and dtype."""
    data = tensor.detach().contiguous().cpu().reshape(-1)
    sha = hashlib.sha256(f"{tuple(tensor.shape)}:{tensor.dtype}".encode())
    sha.update(data.view(torch.uint8).numpy().data)
    return sha.digest()


def model_fingerprint(model: PreTrainedModel, tokenizer: Any, *, weights_digest: bytes | None = None) -> str:
    """A digest of what decides a fragment's K/V: config, weights and tokenizer vocabulary.

    Every byte of every tensor is digested (a fine-tune that changed one row of one matrix, a
    merged LoRA, has a fingerprint of its own); a tensor two names share (a tied embedding) is
    read once. A layer packed for oneDNN (:class:`~kvshift_memory.engine.packing.PackedLinear`)
    contributes the digest of its dense weight taken when it was packed (its ``weight_digest``),
    so packing leaves the fingerprint as it was.

    :param weights_digest: :func:`model_weights_digest` of ``model``, when the caller already has it
        (:func:`~kvshift_memory.engine.loading.load_model` keeps it per weight file).
    """
    sha = hashlib.sha256()
    sha.update(model.config.to_json_string(use_diff=False).encode())
    sha.update(weights_digest if weights_digest is not None else model_weights_digest(model))
    vocab = tokenizer.get_vocab()
    sha.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    sha.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return sha.hexdigest()[:32]


def model_weights_digest(model: torch.nn.Module) -> bytes:
    """The SHA-256 over every tensor of ``model``'s state (name and :func:`tensor_digest`)."""
    digests: dict[str, bytes] = {}
    seen: dict[tuple, bytes] = {}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            storage = tensor.untyped_storage().data_ptr()
            same = (tensor.device, storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype)
            if same not in seen:
                seen[same] = tensor_digest(tensor)
            digests[name] = seen[same]
        for name, module in model.named_modules():
            digest = getattr(module, "weight_digest", None)
            if digest is not None:
                digests[f"{name}.weight" if name else "weight"] = digest
    sha = hashlib.sha256()
    for name, digest in sorted(digests.items()):
        sha.update(f"{name}:".encode())
        sha.update(digest)
    return sha.digest()


def format_fingerprint(base: str, weights: str | None) -> str:
    """``base`` (a :func:`model_fingerprint` of the float weights) for the model run in the weight
    format ``weights``: unchanged for the weights as loaded (``None``, ``"fp32"``), else a digest
    of both, so that K/V computed under one format is never read under another."""
    if weights in (None, "fp32"):
        return base
    return hashlib.sha256(f"{base}|weights={weights}".encode()).hexdigest()[:32]
