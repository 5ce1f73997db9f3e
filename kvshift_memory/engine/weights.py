"""Weight formats: how a model's linear layers hold their weights, and the products that read them.

``EngineSettings.weights`` names one:

- ``"as-shipped"``: a shipped model keeps its GGUF blocks' values. Q4_1 and Q4_K blocks are affine
  per group of 32 (``scale * q + offset``) and become int4 groups; Q5_0, Q8_0 (groups of 32) and
  Q6_K (groups of 16) are symmetric (``scale * q``) and become int8 groups. Every value is the
  float32 value the conversion to safetensors holds (:mod:`.gguf_blocks` checks it), so the model is
  the same; only the order of the sums differs.
- ``"int4"`` / ``"int8"``: any float model's linear layers quantized here, int4 affine or int8
  symmetric, per group of 32 along the input.
- ``"fp32"``: the float32 weights (packed for oneDNN, :mod:`.packing`); ``"bf16"``: the model in
  bfloat16.

A :class:`QuantizedMatrix` is the weights of one layer; :class:`QuantizedLinear` and
:class:`QuantizedEmbedding` stand in for ``nn.Linear`` and ``nn.Embedding`` in the model, so
transformers' own forward runs over them. A product of one row, or a few (decoding, a question),
runs in :mod:`.native`'s kernels; a long prefill dequantizes a block of rows at a time for the
float32 GEMM, which is then most of the cost. Without the kernels (no compiler, another device),
PyTorch's operators dequantize and multiply.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from ..exceptions import InvalidInputError, ModelLoadError
from .native import Matrix, kernels

__all__ = [
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedMatrix",
    "StackedProjections",
    "WEIGHT_FORMATS",
    "WeightFormat",
    "apply_weight_format",
    "check_weight_format",
    "dtype_name",
    "pack_int4",
    "quantize",
    "quantize_model",
    "resident_bytes",
    "stack_projections",
]

WeightFormat = Literal["as-shipped", "fp32", "bf16", "int8", "int4"]
WEIGHT_FORMATS: tuple[str, ...] = ("as-shipped", "fp32", "bf16", "int8", "int4")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

QuantKind = Literal["int4", "int8"]

# products with at most this many rows run in the kernels (each weight row dequantized once, dotted
# with every input row); longer ones dequantize blocks of weight rows for the float32 GEMM
_KERNEL_ROWS = 16
# rows dequantized at once for a long product (a 262k-row output head is never whole in float32)
_DEQUANTIZED_BLOCK_ROWS = 8192


def check_weight_format(value: object) -> str | None:
    """``value`` if it names a weight format (or is ``None``: the engine chooses).

    :raises InvalidInputError: anything else.
    """
    if value is None or (isinstance(value, str) and value in WEIGHT_FORMATS):
        return value
    raise InvalidInputError(f"weights must be one of {', '.join(WEIGHT_FORMATS)} (or None), not {value!r}")


def _int4_row_bytes(cols: int) -> int:
    return math.ceil(cols / 64) * 32


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Int4 values (``uint8`` 0..15, ``[rows, cols]``) in the kernels' layout: units of 64
    elements, 32 bytes each, whose 32-bit lane ``l`` holds element ``8 i + l`` in bits ``4i``."""
    rows, cols = values.shape
    units = math.ceil(cols / 64)
    padded = torch.zeros(rows, units * 64, dtype=torch.uint8)
    padded[:, :cols] = values
    by_lane = padded.view(rows, units, 8, 8)  # [.., i, lane]
    nibbles = by_lane[:, :, 0::2, :] | (by_lane[:, :, 1::2, :] << 4)  # [.., byte, lane]
    return nibbles.permute(0, 1, 3, 2).contiguous().view(rows, units * 32)


def _unpack_int4(data: torch.Tensor, cols: int) -> torch.Tensor:
    rows = data.shape[0]
    nibbles = data.view(rows, -1, 8, 4).permute(0, 1, 3, 2)  # [.., byte, lane]
    values = torch.stack([nibbles & 15, nibbles >> 4], dim=3)  # [.., byte, low/high, lane]
    return values.reshape(rows, -1)[:, :cols]


@dataclass(frozen=True, eq=False)
class QuantizedMatrix:
    """One weight matrix ``[rows, cols]`` (``y = x W^T``) in groups of ``group`` along ``cols``.

    :param kind: ``"int4"``: ``data`` is :func:`pack_int4`'s bytes, value = ``scale * q + offset``;
        ``"int8"``: ``data`` is ``int8 [rows, cols]``, value = ``scale * q`` (``offset`` ``None``).
    :param scale: ``float32 [rows, cols / group]``.
    :raises ModelLoadError: tensors that do not make such a matrix (they may come from a file).
    """

    kind: QuantKind
    rows: int
    cols: int
    group: int
    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        groups = self.cols // self.group if self.group else 0
        expected_data = (
            ((self.rows, _int4_row_bytes(self.cols)), torch.uint8)
            if self.kind == "int4"
            else ((self.rows, self.cols), torch.int8)
        )
        problems = []
        if self.kind not in ("int4", "int8") or self.group not in ((32,) if self.kind == "int4" else (16, 32)):
            problems.append(f"kind {self.kind!r} with groups of {self.group}")
        if self.rows <= 0 or self.cols <= 0 or (self.group and self.cols % self.group):
            problems.append(f"shape {self.rows}x{self.cols}")
        if (tuple(self.data.shape), self.data.dtype) != expected_data:
            problems.append(f"data {tuple(self.data.shape)} {self.data.dtype}")
        if (tuple(self.scale.shape), self.scale.dtype) != ((self.rows, groups), torch.float32):
            problems.append(f"scale {tuple(self.scale.shape)} {self.scale.dtype}")
        offset = None if self.offset is None else (tuple(self.offset.shape), self.offset.dtype)
        if offset != (((self.rows, groups), torch.float32) if self.kind == "int4" else None):
            problems.append(f"offset {offset}")
        if problems:
            raise ModelLoadError(f"not a {self.kind} weight matrix: {', '.join(problems)}")
        if not all(t.is_contiguous() for t in self.tensors()):
            raise ModelLoadError("a quantized weight matrix's tensors must be contiguous")

    def __getstate__(self) -> dict:
        # the kernels' view points into these tensors: a copy builds its own
        return {key: value for key, value in self.__dict__.items() if key != "native"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @functools.cached_property
    def native(self) -> Matrix:
        """The matrix as :mod:`.native`'s kernels read it (pointers into this matrix's tensors)."""
        return Matrix(
            4 if self.kind == "int4" else 8,
            self.rows,
            self.cols,
            self.group,
            self.data.data_ptr(),
            self.scale.data_ptr(),
            None if self.offset is None else self.offset.data_ptr(),
        )

    def tensors(self) -> Iterator[torch.Tensor]:
        yield self.data
        yield self.scale
        if self.offset is not None:
            yield self.offset

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.data.device

    def rows_slice(self, start: int, stop: int) -> QuantizedMatrix:
        """Rows ``[start, stop)``, sharing this matrix's memory."""
        return QuantizedMatrix(
            self.kind,
            stop - start,
            self.cols,
            self.group,
            self.data[start:stop],
            self.scale[start:stop],
            None if self.offset is None else self.offset[start:stop],
        )

    @classmethod
    def stacked(cls, parts: list[QuantizedMatrix]) -> QuantizedMatrix:
        """The rows of ``parts`` one after another (same kind, group and columns), in new memory."""
        first = parts[0]
        return cls(
            first.kind,
            sum(p.rows for p in parts),
            first.cols,
            first.group,
            torch.cat([p.data for p in parts]),
            torch.cat([p.scale for p in parts]),
            None if first.offset is None else torch.cat([p.offset for p in parts if p.offset is not None]),
        )

    def stacks_with(self, other: QuantizedMatrix) -> bool:
        return (self.kind, self.cols, self.group, self.device) == (other.kind, other.cols, other.group, other.device)

    def dequantize(self, rows: torch.Tensor | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Float32 values of the rows ``rows`` (int64 ids), else of rows ``[start, stop)``."""
        if rows is None:
            part = self if (start, stop) in ((0, None), (0, self.rows)) else self.rows_slice(start, stop or self.rows)
            return part._dequantize_rows(None)
        return self._dequantize_rows(rows)

    def _dequantize_rows(self, rows: torch.Tensor | None) -> torch.Tensor:
        count = self.rows if rows is None else rows.numel()
        native = kernels() if self.device.type == "cpu" else None
        if native is not None:
            out = torch.empty(count, self.cols, dtype=torch.float32)
            native.dequantize(self.native, None if rows is None else rows.to(torch.int64).contiguous(), out)
            return out
        data, scale = (self.data, self.scale) if rows is None else (self.data[rows], self.scale[rows])
        if self.kind == "int4":
            assert self.offset is not None
            offset = self.offset if rows is None else self.offset[rows]
            values = _unpack_int4(data, self.cols).to(torch.float32).view(count, -1, self.group)
            return (values * scale[..., None] + offset[..., None]).view(count, self.cols)
        values = data.to(torch.float32).view(count, -1, self.group)
        return (values * scale[..., None]).view(count, self.cols)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` for float32 ``x`` ``[m, cols]``: ``[m, rows]``."""
        m = x.shape[0]
        native = kernels() if self.device.type == "cpu" else None
        if native is not None and m <= _KERNEL_ROWS:
            out = torch.empty(m, self.rows, dtype=torch.float32)
            native.matmul(self.native, x.contiguous(), out)
            return out
        if self.rows <= _DEQUANTIZED_BLOCK_ROWS:
            return F.linear(x, self.dequantize())
        out = torch.empty(m, self.rows, dtype=x.dtype, device=x.device)
        for start in range(0, self.rows, _DEQUANTIZED_BLOCK_ROWS):
            stop = min(start + _DEQUANTIZED_BLOCK_ROWS, self.rows)
            out[:, start:stop] = F.linear(x, self.dequantize(start=start, stop=stop))
        return out


def quantize(weight: torch.Tensor, kind: QuantKind) -> QuantizedMatrix:
    """A float weight ``[rows, cols]`` quantized per group of 32: int4 affine (the group's minimum
    and range over 15 steps) or int8 symmetric (its largest magnitude over 127).

    :raises InvalidInputError: ``cols`` not a multiple of 32.
    """
    rows, cols = weight.shape
    if cols % 32:
        raise InvalidInputError(f"a {rows}x{cols} weight does not split into groups of 32 columns")
    grouped = weight.detach().to(torch.float32, copy=True).view(rows, cols // 32, 32)
    if kind == "int4":
        low, high = grouped.amin(-1), grouped.amax(-1)
        scale = (high - low) / 15
        step = torch.where(scale > 0, scale, torch.ones_like(scale))
        values = ((grouped - low[..., None]) / step[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        return QuantizedMatrix("int4", rows, cols, 32, pack_int4(values.view(rows, cols)), scale, low.contiguous())
    scale = grouped.abs().amax(-1) / 127
    step = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (grouped / step[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return QuantizedMatrix("int8", rows, cols, 32, values.view(rows, cols).contiguous(), scale.contiguous())


class QuantizedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` a :class:`QuantizedMatrix` (in float32 activations)."""

    bias: torch.Tensor | None

    def __init__(self, matrix: QuantizedMatrix, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = matrix.cols
        self.out_features = matrix.rows
        self.matrix = matrix
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        out = self.matrix.matmul(flat)
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        m = self.matrix
        return (
            f"in_features={m.cols}, out_features={m.rows}, {m.kind} groups of {m.group}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table held as a :class:`QuantizedMatrix` (shared with a tied output head).

    :param scale: what the model multiplies each embedding by (Gemma's ``sqrt(hidden_size)``,
        which its embedding module applies in its own forward), ``None`` for nothing.
    """

    embed_scale: torch.Tensor | None

    def __init__(self, matrix: QuantizedMatrix, padding_idx: int | None, scale: torch.Tensor | None) -> None:
        super().__init__()
        self.num_embeddings = matrix.rows
        self.embedding_dim = matrix.cols
        self.padding_idx = padding_idx
        self.matrix = matrix
        self.register_buffer(
            "embed_scale", None if scale is None else scale.detach().to(torch.float32), persistent=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = self.matrix.dequantize(flat.cpu() if self.matrix.device.type == "cpu" else flat)
        if self.embed_scale is not None:
            out = out * self.embed_scale
        return out.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.matrix.kind} groups of {self.matrix.group}"


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights in memory: parameters, buffers and quantized matrices, each
    storage counted once (a tied head, a fused projection's slices)."""
    seen: dict[int, int] = {}

    def count(tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            if tensor.is_mkldnn:  # oneDNN's packed layout has no storage to share
                seen[id(tensor)] = tensor.numel() * tensor.element_size()
                continue
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())

    count(model.parameters())
    count(buffer for buffer in model.buffers() if buffer is not None)
    for module in model.modules():
        matrix = getattr(module, "matrix", None)
        if isinstance(matrix, QuantizedMatrix):
            count(matrix.tensors())
        packed = getattr(module, "weight", None)
        if isinstance(packed, torch.Tensor) and packed.is_mkldnn:
            count([packed])
    return sum(seen.values())


def _parent(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    parent_name, _, child = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), child


def quantize_model(
    model: Any,
    decoder: torch.nn.Module,
    weights: str,
    shipped: Mapping[str, QuantizedMatrix] | None = None,
) -> int:
    """Put ``decoder``'s linear layers, the input embedding and the output head of ``model`` in
    ``weights``' format, in place (``"int4"``, ``"int8"``, or ``"as-shipped"`` from ``shipped``, by
    parameter name). A layer the format cannot hold (columns not in groups of 32, a tensor the GGUF
    file kept in float) stays as it is. Under ``"int4"`` the embedding table and output head are
    int8, as GGUF's 4-bit mixes keep them: the head is read in full for every token and its
    rounding moves every logit.

    :returns: how many weight matrices it quantized (a tied embedding and head count once).
    """
    names = {id(module): name for name, module in model.named_modules()}

    def matrix_for(name: str, weight: torch.Tensor, table: bool) -> QuantizedMatrix | None:
        if weights == "as-shipped":
            return (shipped or {}).get(f"{name}.weight")
        if weight.dim() != 2 or weight.shape[1] % 32:
            return None
        return quantize(weight, "int8" if table or weights == "int8" else "int4")

    converted = 0
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    table_matrix = None
    if type(embeddings) is not QuantizedEmbedding and isinstance(embeddings, torch.nn.Embedding):
        table_matrix = matrix_for(names[id(embeddings)], embeddings.weight, table=True)
        if table_matrix is not None:
            scale = getattr(embeddings, "embed_scale", None)
            replacement = QuantizedEmbedding(table_matrix, embeddings.padding_idx, scale)
            model.set_input_embeddings(replacement)
            converted += 1
    if type(head) is torch.nn.Linear:
        tied = isinstance(embeddings, torch.nn.Embedding) and head.weight.data_ptr() == embeddings.weight.data_ptr()
        matrix = table_matrix if tied else matrix_for(names[id(head)], head.weight, table=True)
        if matrix is not None:
            model.set_output_embeddings(QuantizedLinear(matrix, head.bias))
            converted += 0 if tied else 1
    for module in list(decoder.modules()):
        if type(module) is torch.nn.Linear:
            full_name = names[id(module)]
            matrix = matrix_for(full_name, module.weight, table=False)
            if matrix is not None:
                parent, child = _parent(model, full_name)
                setattr(parent, child, QuantizedLinear(matrix, module.bias))
                converted += 1
    return converted


@dataclass(frozen=True, eq=False)
class StackedProjections:
    """Several projections of one input in one matrix (:func:`stack_projections`), with their
    biases one after another (``None`` when none has one)."""

    matrix: QuantizedMatrix
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matrix.matmul(x)
        return out if self.bias is None else out + self.bias


def stack_projections(layers: list[torch.nn.Module]) -> StackedProjections | None:
    """One matrix holding the rows of several :class:`QuantizedLinear` that read the same input
    (a layer's q, k and v), which then keep views into it: one kernel call computes all of them,
    in no more memory. ``None`` (nothing changed) when they cannot share one (another kind, group
    or width, a layer not quantized)."""
    linears = [layer for layer in layers if type(layer) is QuantizedLinear]
    if not linears or len(linears) != len(layers):
        return None
    matrices = [layer.matrix for layer in linears]
    if not all(matrices[0].stacks_with(matrix) for matrix in matrices[1:]):
        return None
    stacked = QuantizedMatrix.stacked(matrices)
    start = 0
    for layer, matrix in zip(linears, matrices, strict=True):
        layer.matrix = stacked.rows_slice(start, start + matrix.rows)
        start += matrix.rows
    biases = [layer.bias for layer in linears]
    if all(bias is None for bias in biases):
        return StackedProjections(stacked, None)
    filled = [torch.zeros(m.rows) if bias is None else bias for bias, m in zip(biases, matrices, strict=True)]
    return StackedProjections(stacked, torch.cat(filled).contiguous())


def apply_weight_format(model: torch.nn.Module, decoder: torch.nn.Module, weights: str | None) -> str:
    """Put ``model`` in the format ``weights`` names, in place (``"as-shipped"`` is applied when a
    shipped model is loaded, and only checked here).

    :returns: the format it runs in: ``weights``, or for ``None`` its float dtype's name
        (``"fp32"``, ``"bf16"``, ``"fp16"``) or ``"quantized"``.
    :raises InvalidInputError: ``"as-shipped"`` for a model that was not loaded so.
    """
    quantized = any(isinstance(module, QuantizedLinear) for module in model.modules())
    if weights == "as-shipped" and not quantized:
        raise InvalidInputError(
            "weights='as-shipped' keeps a shipped model's GGUF blocks: load one by name with "
            "KVShiftEngine.from_pretrained; for another model ask for 'int4' or 'int8'"
        )
    if weights in ("int4", "int8"):
        if quantized:
            raise InvalidInputError(f"the model's weights are already quantized; it cannot be put in {weights!r}")
        quantize_model(model, decoder, weights)
    elif weights in ("fp32", "bf16"):
        if quantized:
            raise InvalidInputError(f"the model's weights are quantized; load it again for {weights!r}")
        model.to(torch.float32 if weights == "fp32" else torch.bfloat16)
    if weights is not None:
        return weights
    if quantized:
        return "quantized"
    return dtype_name(next(model.parameters()).dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """A float dtype as the weight formats name it (``"fp32"``, ``"bf16"``, ``"fp16"``); any other
    by PyTorch's name without its prefix."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
