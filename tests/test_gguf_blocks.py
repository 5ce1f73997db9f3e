"""GGUF blocks read as weight matrices: each block type gives gguf-py's values to the bit, rows are
put in transformers' order, and the shipped models keep every projection as it ships."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvshift_memory.engine.gguf_blocks import _TYPES, _llama_row_order, _matrix
from kvshift_memory.engine.weights import QuantizedEmbedding, QuantizedLinear


def _random_blocks(type_name: str, count: int, seed: int) -> np.ndarray:
    """Random blocks of a type, with finite half-precision scales where the type keeps them."""
    _, _, size, _, _ = _TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    halves = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_0": (0,), "Q8_0": (0,), "Q6_K": (208,)}[type_name]
    for at in halves:
        blocks[:, at : at + 2] = (
            rng.uniform(-0.05, 0.05, size=count).astype(np.float16).view(np.uint8).reshape(count, 2)
        )
    return blocks


@pytest.mark.parametrize("type_name", sorted(_TYPES))
def test_each_block_type_gives_gguf_pys_values_exactly(type_name):
    import gguf

    _, block, _, kind, group = _TYPES[type_name]
    rows, cols = 6, 2 * max(block, 64)
    raw = _random_blocks(type_name, rows * cols // block, seed=len(type_name))
    expected = gguf.quants.dequantize(raw.reshape(rows, -1), gguf.GGMLQuantizationType[type_name])
    matrix = _matrix(type_name, raw, rows, cols, None)
    assert (matrix.kind, matrix.group) == (kind, group)
    assert torch.equal(matrix.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)).view(rows, cols))


def test_llama_rows_are_put_back_in_transformers_order():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48 * 2).reshape(96, 1)
    for heads in (3, 6):
        expected = LlamaTensorProcessor(config={})._reverse_permute_weights(rows, heads)[:, 0]
        assert np.array_equal(_llama_row_order(96, heads), expected)


@pytest.mark.model
@pytest.mark.parametrize(("engine_name", "layers"), [("bundled_engine", 30), ("gemma_engine", 18)])
def test_a_shipped_model_keeps_every_projection_as_its_gguf_blocks(request, engine_name, layers):
    engine = request.getfixturevalue(engine_name)
    if engine.runner.weights != "as-shipped":
        pytest.skip("not the as-shipped default here (another device, or no kernels)")
    model = engine.model
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 0
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == layers * 7 + 1
    assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
    kinds = {(m.matrix.kind, m.matrix.group) for m in model.modules() if isinstance(m, QuantizedLinear)}
    # SmolLM2's Q4_1 projections and Q8_0 embedding; Gemma's Q4_K, Q5_0, Q8_0 and Q6_K
    assert kinds == ({("int4", 32), ("int8", 32)} if layers == 30 else {("int4", 32), ("int8", 32), ("int8", 16)})
