"""A shipped model's GGUF blocks as :class:`~.weights.QuantizedMatrix` values, without a float step.

Read once, when a shipped model is first loaded with ``weights="as-shipped"``, and kept beside its
safetensors conversion (``as-shipped-1.safetensors``: tensors and a JSON header, nothing executable). Each
block type is unpacked as gguf-py dequantizes it, so a matrix's values, ``scale * q (+ offset)``
in float32, are the very values of the float32 conversion; :func:`shipped_matrices` checks that
for every matrix against the loaded model and keeps only those that match to the bit.

========  ==================================  ===================
GGUF      value                               here
========  ==================================  ===================
Q4_1      ``d * q + m``, groups of 32         int4, groups of 32
Q4_K      ``d sc * q - dmin m``, groups of 32 int4, groups of 32
Q5_0      ``d * (q - 16)``, groups of 32      int8, groups of 32
Q8_0      ``d * q``, groups of 32             int8, groups of 32
Q6_K      ``d sc * (q - 32)``, groups of 16   int8, groups of 16
========  ==================================  ===================
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..exceptions import ModelLoadError
from .weights import QuantizedMatrix, pack_int4

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["load_matrices", "read_gguf_matrices", "save_matrices", "shipped_matrices"]

#: the file beside a shipped model's conversion that holds its blocks (named by its format's
#: version: a folder holding an older one builds this one once)
AS_SHIPPED_FILE = "as-shipped-1.safetensors"
_FORMAT = "kvshift-as-shipped-1"


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """``qs`` ``[n, ..., width]`` bytes as ``[n, ..., 2, width]`` nibbles (low ones first)."""
    return (qs[..., None, :] >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & np.uint8(0x0F)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:20], 16).reshape(n, 32)
    return q, _f16(blocks, 0), _f16(blocks, 2)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    packed = blocks[:, 4:16].reshape(n, 3, 4)
    low, high, mixed = packed[:, 0], packed[:, 1], packed[:, 2]
    sc = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1).astype(np.float32)
    q = _nibbles(blocks[:, 16:144].reshape(n, 4, 32), 32).reshape(n * 8, 32)
    # gguf-py: (d * sc) * q - (dmin * m); adding the negated product rounds the same
    return q, (d * sc).reshape(n * 8, 1), -(dmin * mins).reshape(n * 8, 1)


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    n = blocks.shape[0]
    high_bits = blocks[:, 2:6].copy().view(np.uint32).reshape(n, 1) >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    low = _nibbles(blocks[:, 6:22], 16).reshape(n, 32)
    q = (low | ((high_bits & np.uint32(1)).astype(np.uint8) << np.uint8(4))).astype(np.int8) - np.int8(16)
    return q, _f16(blocks, 0), None


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return blocks[:, 2:34].copy().view(np.int8), _f16(blocks, 0), None


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].reshape(n, 2, 64), 64).reshape(n, 8, 32)
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (ql | (qh.reshape(n, 8, 32) << np.uint8(4))).astype(np.int8) - np.int8(32)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q.reshape(n * 16, 16), (_f16(blocks, 208) * scales).reshape(n * 16, 1), None


# GGML type name: (unpacker, elements per block, bytes per block, kind, group)
_TYPES: dict[str, tuple[Any, int, int, str, int]] = {
    "Q4_1": (_q4_1, 32, 20, "int4", 32),
    "Q4_K": (_q4_k, 256, 144, "int4", 32),
    "Q5_0": (_q5_0, 32, 22, "int8", 32),
    "Q8_0": (_q8_0, 32, 34, "int8", 32),
    "Q6_K": (_q6_k, 256, 210, "int8", 16),
}


def _matrix(type_name: str, raw: np.ndarray, rows: int, cols: int, row_order: np.ndarray | None) -> QuantizedMatrix:
    unpack, block, size, kind, group = _TYPES[type_name]
    blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(rows * cols // block, size)
    q, scale, offset = unpack(blocks)
    q, scale = q.reshape(rows, cols), scale.reshape(rows, cols // group)
    if offset is not None:
        offset = offset.reshape(rows, cols // group)
    if row_order is not None:
        q, scale = q[row_order], scale[row_order]
        offset = None if offset is None else offset[row_order]
    values = torch.from_numpy(np.ascontiguousarray(q))
    data = pack_int4(values) if kind == "int4" else values
    return QuantizedMatrix(
        kind,  # type: ignore[arg-type]
        rows,
        cols,
        group,
        data,
        torch.from_numpy(np.ascontiguousarray(scale)),
        None if offset is None else torch.from_numpy(np.ascontiguousarray(offset)),
    )


def _llama_row_order(rows: int, heads: int) -> np.ndarray:
    """The rows of llama.cpp's rotary-interleaved q/k projection in transformers' order (the
    inverse of its converter's ``permute``, as transformers' GGUF loader applies it)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def read_gguf_matrices(reader: Any, model: PreTrainedModel) -> dict[str, QuantizedMatrix]:
    """The model's linear and embedding weights whose GGUF blocks are of a type above, by the
    model's parameter name (``model.layers.0.self_attn.q_proj.weight``).

    :param reader: a ``gguf.GGUFReader`` over the file the model was converted from.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    field = reader.fields["general.architecture"]
    arch_name = bytes(field.parts[field.data[0]]).decode()
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name), None)
    if arch is None:
        return {}
    config = model.config.get_text_config(decoder=True)
    name_map = get_tensor_name_map(arch, config.num_hidden_layers)
    by_gguf_name = {tensor.name: tensor for tensor in reader.tensors}
    matrices = {}
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        gguf_name = name_map.get_name(name)
        tensor = by_gguf_name.get(f"{gguf_name}.weight") if gguf_name else None
        if gguf_name is None or tensor is None or tensor.tensor_type.name not in _TYPES:
            continue
        cols, rows = (int(size) for size in tensor.shape)
        row_order = None
        if arch_name == "llama" and gguf_name.endswith(("attn_q", "attn_k")):
            heads = config.num_attention_heads if gguf_name.endswith("attn_q") else config.num_key_value_heads
            row_order = _llama_row_order(rows, heads)
        matrices[f"{name}.weight"] = _matrix(tensor.tensor_type.name, tensor.data, rows, cols, row_order)
    return matrices


def shipped_matrices(matrices: Mapping[str, QuantizedMatrix], model: PreTrainedModel) -> dict[str, QuantizedMatrix]:
    """Of ``matrices``, those whose values equal the model's float32 weight of that name exactly."""
    weights = dict(model.named_parameters(remove_duplicate=False))
    kept = {}
    for name, matrix in matrices.items():
        dense = weights.get(name)
        if dense is not None and tuple(dense.shape) == (matrix.rows, matrix.cols):
            if torch.equal(matrix.dequantize(), dense.detach().to(torch.float32)):
                kept[name] = matrix
    return kept


def save_matrices(path: Path, matrices: Mapping[str, QuantizedMatrix]) -> None:
    """Write ``matrices`` to ``path`` (safetensors), atomically."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    header = {}
    for name, matrix in matrices.items():
        header[name] = {"kind": matrix.kind, "rows": matrix.rows, "cols": matrix.cols, "group": matrix.group}
        tensors[f"{name}:data"] = matrix.data
        tensors[f"{name}:scale"] = matrix.scale
        if matrix.offset is not None:
            tensors[f"{name}:offset"] = matrix.offset
    handle, work = tempfile.mkstemp(prefix=f"{path.name}.tmp-", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, work, metadata={"format": _FORMAT, "matrices": json.dumps(header)})
        os.replace(work, path)
        for older in path.parent.glob("as-shipped*.safetensors"):
            if older.name != path.name:
                older.unlink(missing_ok=True)
    except BaseException:
        Path(work).unlink(missing_ok=True)
        raise


def load_matrices(path: Path) -> dict[str, QuantizedMatrix]:
    """What :func:`save_matrices` wrote.

    :raises ModelLoadError: a file that is not one (its shapes and types are checked).
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            if metadata.get("format") != _FORMAT:
                raise ModelLoadError(f"{path} is not a kvshift as-shipped weights file")
            header = json.loads(metadata["matrices"])
            matrices = {}
            for name, info in header.items():
                offset = handle.get_tensor(f"{name}:offset") if f"{name}:offset" in handle.keys() else None
                matrices[name] = QuantizedMatrix(
                    info["kind"],
                    int(info["rows"]),
                    int(info["cols"]),
                    int(info["group"]),
                    handle.get_tensor(f"{name}:data"),
                    handle.get_tensor(f"{name}:scale"),
                    offset,
                )
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise ModelLoadError(f"could not read {path}: {exc}") from exc
    return matrices
