"""Weight formats: int4/int8 matrices and their kernels against PyTorch, the model conversion, the
fingerprint per format, and hostile matrices and files."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import EngineSettings, KVShiftEngine
from kvshift_memory.engine import weights as weights_module
from kvshift_memory.engine.gguf_blocks import load_matrices, save_matrices
from kvshift_memory.engine.native import kernels
from kvshift_memory.engine.weights import (
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedMatrix,
    check_weight_format,
    pack_int4,
    quantize,
    resident_bytes,
)
from kvshift_memory.exceptions import InvalidInputError, ModelLoadError

MESSAGES = [{"role": "user", "content": "Where does Ana live, and what does she do?"}]
MEMORIES = ["My sister Ana lives in Porto.", "Ana works as a nurse at the city hospital."]


def _random_matrix(kind: str, rows: int, cols: int, group: int = 32, seed: int = 0) -> QuantizedMatrix:
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, cols // group, generator=generator) * 0.05
    if kind == "int4":
        values = torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=generator)
        offset = -torch.rand(rows, cols // group, generator=generator) * 0.3
        return QuantizedMatrix("int4", rows, cols, group, pack_int4(values), scale, offset)
    values = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=generator)
    return QuantizedMatrix("int8", rows, cols, group, values, scale)


def _reference(matrix: QuantizedMatrix) -> torch.Tensor:
    """The matrix's values from its definition, in float64, without the package's unpacking."""
    groups = matrix.cols // matrix.group
    if matrix.kind == "int8":
        values = matrix.data.to(torch.float64)
    else:  # unit u, lane l, nibble i holds element 64 u + 8 i + l
        lanes = matrix.data.view(torch.int32).view(matrix.rows, -1, 8).to(torch.int64) & 0xFFFFFFFF
        values = torch.stack([(lanes >> (4 * i)) & 15 for i in range(8)], dim=2).reshape(matrix.rows, -1)
        values = values[:, : matrix.cols].to(torch.float64)
    values = values.view(matrix.rows, groups, matrix.group) * matrix.scale.to(torch.float64)[..., None]
    if matrix.offset is not None:
        values = values + matrix.offset.to(torch.float64)[..., None]
    return values.view(matrix.rows, matrix.cols)


def _without_kernels(monkeypatch):
    monkeypatch.setattr(weights_module, "kernels", lambda: None)


# ---------------------------------------------------------------- matrices and kernels


@pytest.mark.parametrize(
    ("kind", "group", "cols"), [("int4", 32, 96), ("int4", 32, 576), ("int8", 32, 640), ("int8", 16, 96)]
)
@pytest.mark.parametrize("native", [True, False])
def test_products_and_values_match_the_definition(kind, group, cols, native, monkeypatch):
    if native and kernels() is None:
        pytest.skip("no C compiler here: the kernels are not built")
    if not native:
        _without_kernels(monkeypatch)
    matrix = _random_matrix(kind, 37, cols, group)  # 37 rows: blocks of four and a tail
    reference = _reference(matrix)
    assert torch.allclose(matrix.dequantize().double(), reference, rtol=0, atol=1e-6)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(matrix.dequantize(rows), matrix.dequantize()[rows])
    for m in (1, 3, 16, 17, 40):  # one row, the kernels' several rows, and the dequantized GEMM
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
        got = matrix.matmul(x).double()
        expected = x.double() @ reference.T
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (kind, m)


@pytest.mark.skipif(kernels() is None, reason="no C compiler here: the kernels are not built")
def test_a_dequantized_value_is_rounded_as_gguf_computes_it():
    """``scale * q + offset`` in float32, two roundings: what the float32 conversion holds."""
    matrix = _random_matrix("int4", 8, 64)
    data = _reference(matrix)  # float64, exact
    expected = torch.round((data.view(8, 2, 32) - matrix.offset.double()[..., None]) / matrix.scale.double()[..., None])
    expected = (expected.float() * matrix.scale[..., None] + matrix.offset[..., None]).view(8, 64)
    assert torch.equal(matrix.dequantize(), expected)


def test_quantizing_keeps_each_value_within_half_a_step():
    weight = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    weight[0, :32] = 0.25  # a flat group: no step, every value exact
    for kind in ("int4", "int8"):
        matrix = quantize(weight, kind)
        error = (matrix.dequantize() - weight).abs().view(48, 2, 32)
        assert (error <= matrix.scale[..., None] / 2 + 1e-6).all(), kind
        assert torch.equal(matrix.dequantize()[0, :32], weight[0, :32])
    with pytest.raises(InvalidInputError, match="groups of 32"):
        quantize(torch.zeros(4, 40), "int4")


def test_stacked_matrices_are_views_of_one_and_give_the_same_products():
    parts = [_random_matrix("int4", rows, 64, seed=rows) for rows in (8, 4, 4)]
    layers = [QuantizedLinear(part, None) for part in parts]
    x = torch.randn(1, 64)
    before = [layer(x) for layer in layers]
    stacked = weights_module.stack_projections(layers)
    assert stacked is not None and stacked.matrix.rows == 16 and stacked.bias is None
    storage = stacked.matrix.data.untyped_storage().data_ptr()
    assert all(layer.matrix.data.untyped_storage().data_ptr() == storage for layer in layers)
    assert all(torch.allclose(layer(x), b) for layer, b in zip(layers, before, strict=True))
    assert torch.allclose(stacked(x), torch.cat(before, dim=1))
    mixed = [QuantizedLinear(_random_matrix("int8", 4, 64), None), QuantizedLinear(_random_matrix("int4", 4, 64), None)]
    assert weights_module.stack_projections(mixed) is None


# ---------------------------------------------------------------- hostile matrices and files


@pytest.mark.parametrize(
    "change",
    [
        {"rows": 0},
        {"cols": 48},
        {"group": 8},
        {"kind": "int2"},
        {"data": torch.zeros(4, 10, dtype=torch.uint8)},
        {"data": torch.zeros(4, 32, dtype=torch.int8)},
        {"scale": torch.zeros(4, 2, dtype=torch.float64)},
        {"scale": torch.zeros(5, 2)},
        {"offset": None},
        {"data": torch.zeros(4, 64, dtype=torch.uint8)[:, ::2]},
    ],
)
def test_a_matrix_that_does_not_hold_together_is_refused(change):
    fields = dict(kind="int4", rows=4, cols=64, group=32, data=torch.zeros(4, 32, dtype=torch.uint8))
    fields.update(scale=torch.zeros(4, 2), offset=torch.zeros(4, 2))
    fields.update(change)
    with pytest.raises(ModelLoadError):
        QuantizedMatrix(**fields)


def test_weight_files_round_trip_and_damaged_ones_are_refused(tmp_path):
    matrices = {"a.weight": _random_matrix("int4", 8, 64), "b.weight": _random_matrix("int8", 4, 32, group=16)}
    path = tmp_path / "as-shipped-1.safetensors"
    save_matrices(path, matrices)
    loaded = load_matrices(path)
    assert set(loaded) == set(matrices)
    assert all(torch.equal(loaded[name].dequantize(), matrices[name].dequantize()) for name in matrices)
    assert list(tmp_path.iterdir()) == [path]  # nothing left of the temporary file

    from safetensors.torch import save_file

    (tmp_path / "garbage").write_bytes(b"\x00" * 100)
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign"), metadata={"format": "other"})
    lying = {"a.weight:data": torch.zeros(8, 32, dtype=torch.uint8), "a.weight:scale": torch.zeros(8, 2)}
    header = '{"a.weight": {"kind": "int4", "rows": 8000, "cols": 64, "group": 32}}'
    save_file(lying, str(tmp_path / "lying"), metadata={"format": "kvshift-as-shipped-1", "matrices": header})
    for name in ("garbage", "foreign", "lying", "missing"):
        with pytest.raises(ModelLoadError):
            load_matrices(tmp_path / name)


@pytest.mark.parametrize("value", ["int3", "", "FP32", 4, object(), ["int4"]])
def test_an_unknown_weight_format_is_refused(value):
    with pytest.raises(InvalidInputError, match="weights must be one of"):
        check_weight_format(value)
    with pytest.raises(InvalidInputError):
        EngineSettings(weights=value)


def test_an_embedding_row_outside_the_table_is_an_error_not_a_read():
    embedding = QuantizedEmbedding(_random_matrix("int8", 10, 32), None, None)
    assert embedding(torch.tensor([[9, 0]])).shape == (1, 2, 32)
    for ids in ([[10]], [[-1]]):
        with pytest.raises(IndexError):
            embedding(torch.tensor(ids))


# ---------------------------------------------------------------- a model in each format


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_quantized_engine_answers_close_to_the_float_one(tokenizer, weights):
    model = tiny_model(TINY_CONFIGS["llama"]())
    plain = KVShiftEngine(copy.deepcopy(model), tokenizer)
    quantized = KVShiftEngine(model, tokenizer, weights=weights)
    linears = sum(isinstance(m, QuantizedLinear) for m in quantized.model.modules())
    assert linears == 2 * 7 + 1  # and the head
    assert isinstance(quantized.model.get_input_embeddings(), QuantizedEmbedding)
    tied = quantized.model.get_output_embeddings().matrix is quantized.model.get_input_embeddings().matrix
    assert tied == model.config.tie_word_embeddings
    assert quantized.runner.weights == weights and quantized.fingerprint != plain.fingerprint
    assert resident_bytes(quantized.model) < resident_bytes(plain.model) / 2.5
    a = plain.score(MESSAGES, MEMORIES, " Porto, as a nurse.", reuse="none")
    b = quantized.score(MESSAGES, MEMORIES, " Porto, as a nurse.", reuse="none")
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=0.05 if weights == "int4" else 0.01)
    exact = quantized.score(MESSAGES, MEMORIES, " Porto, as a nurse.", reuse="blend", recompute_ratio=1.0)
    assert torch.allclose(torch.tensor(exact.logprobs), torch.tensor(b.logprobs), atol=1e-4)


def test_formats_that_do_not_apply_are_refused(tokenizer):
    with pytest.raises(InvalidInputError, match="as-shipped"):
        KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, weights="as-shipped")
    quantized = KVShiftEngine(tiny_model(TINY_CONFIGS["llama"]()), tokenizer, weights="int4")
    for again in ("int8", "fp32"):
        with pytest.raises(InvalidInputError, match="quantized"):
            KVShiftEngine(quantized.model, tokenizer, weights=again)


def test_bf16_runs_the_model_in_bfloat16_under_its_own_fingerprint(tokenizer):
    model = tiny_model(TINY_CONFIGS["llama"]())
    plain = KVShiftEngine(copy.deepcopy(model), tokenizer)
    half = KVShiftEngine(model, tokenizer, weights="bf16")
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.runner.weights == "bf16"
    assert half.fingerprint != plain.fingerprint
    assert half.generate(MESSAGES, max_new_tokens=4).stats.generated_tokens == 4


@pytest.mark.model
def test_the_default_model_runs_its_gguf_blocks_and_answers_as_its_float32_conversion(bundled_engine):
    if bundled_engine.device.type != "cpu" or kernels() is None:
        pytest.skip("as-shipped is the default on the CPU where the kernels build")
    model = bundled_engine.model
    assert bundled_engine.runner.weights == "as-shipped"
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 30 * 7 + 1  # every projection, and the head (tied to the embedding)
    assert resident_bytes(model) < 150e6  # float32: 540 MB
    fp32 = KVShiftEngine.from_pretrained(weights="fp32")
    assert fp32.runner.weights == "fp32" and fp32.fingerprint != bundled_engine.fingerprint
    for question in ("What is the capital of France?", "Name three fruits.", "Write a haiku about rain."):
        a = bundled_engine.generate(question, reuse="none", max_new_tokens=16)
        b = fp32.generate(question, reuse="none", max_new_tokens=16)
        assert a.token_ids == b.token_ids, question


def test_without_a_compiler_the_kernels_are_not_built_and_pytorch_runs(tmp_path):
    """Run apart: the library is built or refused once per process."""
    script = (
        "import torch; from kvshift_memory.engine.native import kernels, native_status;"
        "from kvshift_memory.engine.weights import quantize;"
        "assert kernels() is None, native_status(); print(native_status());"
        "m = quantize(torch.randn(8, 64), 'int4'); x = torch.randn(1, 64);"
        "assert torch.allclose(m.matmul(x), x @ m.dequantize().T, atol=1e-5)"
    )
    env = {**os.environ, "KVSHIFT_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-compiler")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "could not build" in done.stdout
    assert not list((tmp_path / "kernels").glob("*.so"))
    env = {**os.environ, "KVSHIFT_HOME": str(tmp_path), "KVSHIFT_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "KVSHIFT_NATIVE=0" in done.stdout, done.stderr


@pytest.mark.skipif(kernels() is None, reason="no C compiler here: the kernels are not built")
def test_the_kernels_are_built_once_and_found_by_the_next_process(tmp_path):
    script = "from kvshift_memory.engine.native import kernels; print(kernels().path)"
    env = {**os.environ, "KVSHIFT_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    built = sorted((tmp_path / "kernels").iterdir())
    assert [p.suffix for p in built] == [".so"]  # no temporary file left
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert second.stdout == first.stdout and sorted((tmp_path / "kernels").iterdir()) == built
    assert built[0].stat().st_mtime_ns == (tmp_path / "kernels" / built[0].name).stat().st_mtime_ns
