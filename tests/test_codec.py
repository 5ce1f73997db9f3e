"""The fragment codec and its integrity envelope: round trips, sizes, and hostile blobs."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from kvshift_memory.blobs import CHECKSUM_KEY, blob_checksum, read_header, verify_blob
from kvshift_memory.exceptions import CorruptFragmentError, InvalidInputError
from kvshift_memory.kv.codec import CODECS, CodecSpec, decode_fragment, encode_fragment
from kvshift_memory.kv.fragment import Fragment

# the bundled SmolLM2-135M's shapes: 30 layers, 3 KV heads of 64 dims
LAYERS, HEADS, DIM = 30, 3, 64
FP32_BYTES_PER_TOKEN = LAYERS * HEADS * DIM * 2 * 4


def fragment(n: int, layers: int = LAYERS, seed: int = 0, base_position: int = 700) -> Fragment:
    generator = torch.Generator().manual_seed(seed)
    # keys with outlier channels, as RoPE'd keys have; values without
    channel_scale = torch.linspace(0.2, 6.0, DIM)
    keys = tuple(torch.randn(1, HEADS, n, DIM, generator=generator) * channel_scale for _ in range(layers))
    values = tuple(torch.randn(1, HEADS, n, DIM, generator=generator) for _ in range(layers))
    return Fragment(tuple(range(n)), keys, values, base_position=base_position, context_digest="digest")


def relative_error(a: Fragment, b: Fragment) -> float:
    pairs = zip((*a.keys, *a.values), (*b.keys, *b.values), strict=True)
    return max(float((x - y).abs().max() / x.abs().max()) for x, y in pairs)


@pytest.mark.parametrize("codec,bound", [("fp32", 0.0), ("fp16", 1e-3), ("int8", 8e-3), ("int4", 0.15)])
@pytest.mark.parametrize("n", [1, 37, 130])
def test_round_trip_error_is_bounded(codec, bound, n):
    original = fragment(n, layers=4)
    spec = CodecSpec(codec, group_size=32)
    decoded = decode_fragment(encode_fragment(original, spec), kv_heads=HEADS, head_dim=DIM, num_layers=4)
    assert decoded.token_ids == original.token_ids
    assert decoded.base_position == 700 and decoded.context_digest == "digest"
    assert [k.shape for k in decoded.keys] == [k.shape for k in original.keys]
    assert relative_error(original, decoded) <= bound


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 2, 40])
def test_a_sequences_first_token_is_stored_exactly_whatever_the_codec(codec, n):
    """The attention sink at position 0 is kept unquantised; the tokens after it are quantised as ever."""
    original = fragment(n, layers=3, base_position=0)
    blob = encode_fragment(original, CodecSpec(codec))
    decoded = decode_fragment(blob, kv_heads=HEADS, head_dim=DIM, num_layers=3)
    assert decoded.base_position == 0 and decoded.token_ids == original.token_ids
    quantised = codec in ("int8", "int4")
    lead = 1 if quantised and n > 1 else 0  # a lone token stays quantised: a blob always has some
    assert read_header(blob)[1]["exact_lead"] == str(lead)
    assert ("k_lead" in load_safetensors(blob)) == bool(lead)
    for exact, restored in zip((*original.keys, *original.values), (*decoded.keys, *decoded.values), strict=True):
        assert restored.shape == exact.shape
        if lead:
            assert torch.equal(restored[:, :, :1], exact[:, :, :1])
    if quantised and n > 2:  # the rest is quantised: not exact
        assert not torch.equal(decoded.keys[0][:, :, 1:], original.keys[0][:, :, 1:])
    elsewhere = encode_fragment(fragment(n, layers=3), CodecSpec(codec))  # at position 700: no sink
    assert read_header(elsewhere)[1]["exact_lead"] == "0" and "k_lead" not in load_safetensors(elsewhere)


def test_a_blob_written_before_exact_leads_were_recorded_still_decodes():
    blob = encode_fragment(fragment(20, layers=2), CodecSpec("int8"))
    metadata = read_header(blob)[1]
    del metadata["exact_lead"]
    older = reseal(load_safetensors(blob), metadata)
    assert decode_fragment(older).token_ids == tuple(range(20))


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_tampered_exact_lead_is_caught_despite_a_valid_checksum(codec):
    blob = encode_fragment(fragment(20, layers=2, base_position=0), CodecSpec(codec))
    metadata = read_header(blob)[1]
    tensors = load_safetensors(blob)
    for lead in ("-1", "20", "21", "x", "2"):
        with pytest.raises(CorruptFragmentError):
            decode_fragment(reseal(tensors, {**metadata, "exact_lead": lead}), kv_heads=HEADS, head_dim=DIM)
    for case in (
        {k: v for k, v in tensors.items() if k != "v_lead"},
        {**tensors, "k_lead": tensors["k_lead"].half()},
        {**tensors, "k_lead": tensors["k_lead"][:1]},  # a layer missing
        {**tensors, "v_lead": tensors["v_lead"][:, :, :, :8]},
        {**tensors, "k_lead": tensors["k_lead"][0]},
        {**tensors, "k_lead": tensors["k_lead"][0, 0]},
        {**tensors, "v_lead": torch.cat([tensors["v_lead"]] * 2, dim=2)},  # more exact tokens than the header says
    ):
        with pytest.raises(CorruptFragmentError):
            decode_fragment(reseal(case, metadata), kv_heads=HEADS, head_dim=DIM, num_layers=2)


def test_int8_and_int4_sizes_meet_their_budgets():
    """Issue 3: int8 <= 0.26 and int4 <= 0.15 of fp32's bytes per token, at a typical memory size."""
    original = fragment(100)
    sizes = {codec: len(encode_fragment(original, CodecSpec(codec))) / 100 for codec in CODECS}
    assert sizes["fp32"] == pytest.approx(FP32_BYTES_PER_TOKEN, rel=0.01)
    assert sizes["int8"] <= 0.26 * sizes["fp32"]
    assert sizes["int4"] <= 0.15 * sizes["fp32"]
    assert sizes["fp16"] <= 0.51 * sizes["fp32"]


def test_metadata_is_checked_and_reserved_keys_refused():
    blob = encode_fragment(fragment(8, layers=2), CodecSpec("int8"), {"tenant": "alice", "memory_id": "m1"})
    assert verify_blob(blob)["tenant"] == "alice"
    decode_fragment(blob, expect={"tenant": "alice", "memory_id": "m1"})
    with pytest.raises(CorruptFragmentError, match="tenant"):
        decode_fragment(blob, expect={"tenant": "bob"})
    with pytest.raises(InvalidInputError, match="reserved"):
        encode_fragment(fragment(8, layers=2), CodecSpec("int8"), {"codec": "fp32"})
    with pytest.raises(InvalidInputError):
        encode_fragment(fragment(8, layers=2), CodecSpec("int8"), {"tenant": 5})  # type: ignore[dict-item]


def test_codec_spec_validation():
    for bad in ("int3", "", None):
        with pytest.raises(InvalidInputError):
            CodecSpec(bad)  # type: ignore[arg-type]
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(InvalidInputError):
            CodecSpec("int4", group_size=bad)  # type: ignore[arg-type]


def test_model_shape_mismatch_is_refused():
    blob = encode_fragment(fragment(8, layers=2), CodecSpec("int4"))
    decode_fragment(blob, kv_heads=HEADS, head_dim=DIM, num_layers=2)
    for wrong in ({"num_layers": 3}, {"kv_heads": 4}, {"head_dim": 128}):
        with pytest.raises(CorruptFragmentError):
            decode_fragment(blob, **{"kv_heads": HEADS, "head_dim": DIM, "num_layers": 2, **wrong})


@pytest.mark.parametrize("codec", CODECS)
def test_every_bit_flip_and_truncation_is_caught(codec):
    blob = encode_fragment(fragment(20, layers=2), CodecSpec(codec), {"tenant": "alice"})
    rng = random.Random(codec)
    for position in [0, 7, 8, 9, len(blob) // 3, len(blob) // 2, len(blob) - 1, *rng.sample(range(len(blob)), 40)]:
        damaged = bytearray(blob)
        damaged[position] ^= 1 << rng.randrange(8)
        with pytest.raises(CorruptFragmentError):
            decode_fragment(bytes(damaged))
    for size in [0, 3, 8, 100, len(blob) // 2, len(blob) - 1]:
        with pytest.raises(CorruptFragmentError):
            decode_fragment(blob[:size])
    with pytest.raises(CorruptFragmentError):
        decode_fragment(blob + b"\x00")


def reseal(tensors: dict, metadata: dict) -> bytes:
    """A blob with a *valid* checksum over whatever it holds: only the shape checks can refuse it."""
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    metadata = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    metadata[CHECKSUM_KEY] = blob_checksum(save_safetensors(tensors, metadata=metadata))
    return save_safetensors(tensors, metadata=metadata)


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_tensor_shapes_are_caught_despite_a_valid_checksum(codec):
    blob = encode_fragment(fragment(20, layers=2), CodecSpec(codec))
    metadata = read_header(blob)[1]
    tensors = load_safetensors(blob)
    tampered = [
        {**tensors, "k": tensors["k"][:, :, :10]},  # fewer tokens than token_ids
        {**tensors, "v": tensors["v"][:1]},  # a layer missing
        {**tensors, "token_ids": tensors["token_ids"][:5]},
        {k: v for k, v in tensors.items() if k != "v"},
        {**tensors, "k": tensors["k"].to(torch.float64)},  # wrong dtype
    ]
    if "ks" in tensors:
        tampered.append({**tensors, "ks": tensors["ks"][..., :1]})
    for case in tampered:
        with pytest.raises(CorruptFragmentError):
            decode_fragment(reseal(case, metadata), kv_heads=HEADS, head_dim=DIM, num_layers=2)
    for key, value in [("num_layers", "3"), ("codec", "int3"), ("group_size", "x"), ("format", "other")]:
        with pytest.raises(CorruptFragmentError):
            decode_fragment(reseal(tensors, {**metadata, key: value}))


def test_hostile_headers_are_refused_without_allocating():
    huge_header = struct.pack("<Q", 1 << 60) + b"{}"
    not_json = struct.pack("<Q", 5) + b"{{{{{"
    not_object = struct.pack("<Q", 2) + b"[]"
    offsets_out = struct.pack("<Q", 60) + json.dumps(
        {"k": {"dtype": "I8", "shape": [9], "data_offsets": [0, 9]}}
    ).encode().ljust(60)
    non_string_meta = struct.pack("<Q", 40) + json.dumps({"__metadata__": {"a": 1}}).encode().ljust(40)
    for blob in (b"", b"\x00" * 7, huge_header, not_json, not_object, offsets_out, non_string_meta):
        with pytest.raises(CorruptFragmentError):
            verify_blob(blob)
    with pytest.raises(CorruptFragmentError, match="no checksum"):
        verify_blob(save_safetensors({"k": torch.zeros(2)}, metadata={"format": "x"}))


def test_int4_group_size_must_divide_the_head_dimension():
    with pytest.raises(InvalidInputError, match="divide"):
        encode_fragment(fragment(8, layers=1), CodecSpec("int4", group_size=48))
