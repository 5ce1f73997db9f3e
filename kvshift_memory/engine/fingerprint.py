"""What identifies a model for its fragments: a digest of config, sampled weights and vocabulary.

Fragment keys and stored blobs carry it, so that K/V computed by one model is never read by another.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["format_fingerprint", "model_fingerprint", "weight_sample"]


def weight_sample(tensor: torch.Tensor) -> torch.Tensor:
    """A strided subset of about 4096 of ``tensor``'s values, as float64 (what the fingerprint digests)."""
    flat = tensor.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // 4096)].to(torch.float64).cpu()


def model_fingerprint(model: PreTrainedModel, tokenizer: Any) -> str:
    """A digest of what decides a fragment's K/V: config, weights and tokenizer vocabulary.

    Weights are digested by sampling every tensor's name, shape, dtype and a strided subset of
    its values: a different checkpoint changes it, while digesting every byte would cost seconds.
    A layer packed for oneDNN (:class:`~kvshift_memory.engine.packing.PackedLinear`) contributes
    the sample taken from its dense weight when it was packed (its ``weight_digest``), so packing
    leaves the digest as it was.
    """
    with torch.no_grad():
        samples = {name: (tuple(t.shape), t.dtype, weight_sample(t)) for name, t in model.state_dict().items()}
        for name, module in model.named_modules():
            digest = getattr(module, "weight_digest", None)
            if digest is not None:
                samples[f"{name}.weight" if name else "weight"] = digest
    sha = hashlib.sha256()
    sha.update(model.config.to_json_string(use_diff=False).encode())
    for name, (shape, dtype, sample) in sorted(samples.items(), key=lambda item: item[0]):
        sha.update(f"{name}:{shape}:{dtype}".encode())
        sha.update(sample.numpy().tobytes())
    vocab = tokenizer.get_vocab()
    sha.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    sha.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return sha.hexdigest()[:32]


def format_fingerprint(base: str, weights: str | None) -> str:
    """``base`` (a :func:`model_fingerprint` of the float weights) for the model run in the weight
    format ``weights``: unchanged for the weights as loaded (``None``, ``"fp32"``), else a digest
    of both, so that K/V computed under one format is never read under another."""
    if weights in (None, "fp32"):
        return base
    return hashlib.sha256(f"{base}|weights={weights}".encode()).hexdigest()[:32]
