"""Fragments to bytes and back: safetensors with a checked JSON header, optionally quantised.

A blob from a shared store is untrusted input, so it is never unpickled: safetensors holds only
tensors and string metadata, and :func:`decode_fragment` checks the checksum, the metadata it was
asked to expect, and every tensor's dtype and shape before building anything.

Codecs (per decoder layer, tensors ``[kv_heads, tokens, head_dim]``):

- ``fp32`` / ``fp16``: the K/V as they are, or halved.
- ``int8``: symmetric; keys scaled per channel (a scale per layer, head and channel: RoPE'd keys
  have outlier channels that a per-token scale would spread over every channel), values per token
  (a scale per layer, head and token).
- ``int4``: symmetric, 15 levels, two per byte; keys in groups of ``group_size`` tokens per
  channel, values in groups of ``group_size`` channels per token, one fp16 scale per group.

In both quantised codecs a sequence's first token (a fragment at ``base_position`` 0: the first
chunk of a stored conversation) keeps its K/V in fp32 (``k_lead``/``v_lead``, ``exact_lead`` in
the header): it is the attention sink, which every later token attends to, so its rounding error
reaches every output (``docs/benchmarks/resume.md``).

Keys are stored post-rotation at ``base_position`` (``rotation = "post"`` in the header), as the
engine placed them; placing a fragment rotates them by the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..blobs import CHECKSUM_KEY, CODECS, blob_checksum, check_codec, codec_label, verify_blob
from ..exceptions import CorruptFragmentError, InvalidInputError
from .fragment import Fragment

__all__ = ["CODECS", "CodecSpec", "decode_fragment", "encode_fragment"]

FORMAT = "kvshift-fragment/1"
_INT8_MAX = 127
_INT4_MAX = 7
# positions below this are stored unquantised (the attention sink); one was measured to be enough
_EXACT_POSITIONS = 1


@dataclass(frozen=True)
class CodecSpec:
    """How fragments are compressed.

    :param name: one of :data:`CODECS`.
    :param group_size: tokens (keys) or channels (values) sharing one scale in ``int4``.
    :raises InvalidInputError: unknown codec or a group size that is not a positive even int.
    """

    name: str = "int8"
    group_size: int = 32

    def __post_init__(self) -> None:
        check_codec(self.name, self.group_size)

    @property
    def label(self) -> str:
        return codec_label(self.name, self.group_size)


def encode_fragment(fragment: Fragment, spec: CodecSpec, metadata: dict[str, str] | None = None) -> bytes:
    """Serialise ``fragment`` with ``spec``; ``metadata`` (strings) goes into the checked header.

    :raises InvalidInputError: metadata that is not a map of strings, or reuses a reserved key;
        layers of different shapes; an ``int4`` group size that does not divide the head dimension.
    """
    extra = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise InvalidInputError("fragment metadata must map strings to strings")
    if len({tuple(k.shape) for k in (*fragment.keys, *fragment.values)}) != 1:
        raise InvalidInputError("every layer of a stored fragment must have the same K/V shape")
    # one tensor per kind, layers stacked: a header of a few entries instead of a few per layer
    # a blob is bytes on the host, whichever device computed the fragment
    keys = torch.cat(fragment.keys).float().cpu()
    values = torch.cat(fragment.values).float().cpu()
    lead = _exact_lead(spec, fragment.base_position, len(fragment.token_ids))
    tensors = {
        "token_ids": torch.tensor(fragment.token_ids, dtype=torch.int32, device="cpu"),
        **_encode(keys[:, :, lead:].contiguous(), values[:, :, lead:].contiguous(), spec),
    }
    if lead:
        tensors["k_lead"], tensors["v_lead"] = keys[:, :, :lead].contiguous(), values[:, :, :lead].contiguous()
    header = {
        "format": FORMAT,
        "codec": spec.name,
        "group_size": str(spec.group_size),
        "rotation": "post",
        "base_position": str(fragment.base_position),
        "context_digest": fragment.context_digest,
        "num_layers": str(len(fragment.keys)),
        "dtype": str(fragment.keys[0].dtype).removeprefix("torch."),
        "exact_lead": str(lead),
    }
    clash = header.keys() & extra.keys() | ({CHECKSUM_KEY} & extra.keys())
    if clash:
        raise InvalidInputError(f"fragment metadata may not set reserved keys {sorted(clash)}")
    header.update(extra)
    unsealed = save_safetensors(tensors, metadata=header)
    header[CHECKSUM_KEY] = blob_checksum(unsealed)
    return save_safetensors(tensors, metadata=header)


def decode_fragment(
    blob: bytes,
    *,
    expect: dict[str, str] | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Fragment:
    """Rebuild a fragment from a blob written by :func:`encode_fragment`.

    :param expect: metadata the blob must carry with exactly these values (the memory id, its
        text hash, the model fingerprint...): a blob stored under the wrong key is refused.
    :param kv_heads: ``head_dim``, ``num_layers``: the loading model's shapes, checked.
    :raises CorruptFragmentError: checksum, format, metadata or shape mismatch.
    """
    metadata = verify_blob(blob)
    if metadata.get("format") != FORMAT:
        raise CorruptFragmentError(f"not a fragment blob (format {metadata.get('format')!r})")
    for key, value in (expect or {}).items():
        if metadata.get(key) != value:
            raise CorruptFragmentError(f"fragment blob has {key}={metadata.get(key)!r}, expected {value!r}")
    try:
        spec = CodecSpec(metadata.get("codec", ""), int(metadata.get("group_size", "")))
        layers = int(metadata["num_layers"])
        base_position = int(metadata["base_position"])
        lead = int(metadata.get("exact_lead", "0"))  # blobs written before it was recorded have none
        tensors = load_safetensors(bytes(blob))
    except (InvalidInputError, KeyError, ValueError, SafetensorError) as exc:
        raise CorruptFragmentError(f"fragment blob header is unusable: {exc}") from None
    if num_layers is not None and layers != num_layers:
        raise CorruptFragmentError(f"fragment has {layers} layers; the model has {num_layers}")
    token_ids = tensors.get("token_ids")
    if token_ids is None or token_ids.dtype != torch.int32 or token_ids.dim() != 1 or token_ids.numel() == 0:
        raise CorruptFragmentError("fragment blob has no valid token ids")
    if not 0 <= lead < token_ids.numel():
        raise CorruptFragmentError(f"fragment blob keeps {lead} of its {token_ids.numel()} tokens exact")
    keys, values = _decode(tensors, spec, (layers, kv_heads, token_ids.numel() - lead, head_dim), dtype)
    if lead:
        keys, values = _with_lead(tensors, lead, keys, values, dtype)
    return Fragment(
        token_ids=tuple(token_ids.tolist()),
        keys=tuple(layer[None] for layer in keys),
        values=tuple(layer[None] for layer in values),
        base_position=base_position,
        context_digest=metadata.get("context_digest", ""),
    )


def _exact_lead(spec: CodecSpec, base_position: int, tokens: int) -> int:
    """How many leading tokens a blob keeps unquantised: those at positions below
    :data:`_EXACT_POSITIONS` in a quantised codec, leaving at least one token quantised."""
    if spec.name not in ("int8", "int4"):
        return 0
    return max(0, min(_EXACT_POSITIONS - base_position, tokens - 1))


def _with_lead(
    tensors: dict[str, torch.Tensor],
    lead: int,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``lead`` exact tokens put back before the decoded ones (each layer ``[heads, tokens, dim]``).

    :raises CorruptFragmentError: they are missing, or their count, layers, heads or dimension differ."""
    shape = (len(keys), keys[0].shape[0], lead, keys[0].shape[2]) if keys else None
    exact = []
    for name in ("k_lead", "v_lead"):
        tensor = tensors.get(name)
        if tensor is None or tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
            raise CorruptFragmentError(f"fragment blob lacks a valid {name!r} tensor")
        exact.append(tensor.to(dtype))
    return (
        [torch.cat([first, rest], dim=1) for first, rest in zip(exact[0], keys, strict=True)],
        [torch.cat([first, rest], dim=1) for first, rest in zip(exact[1], values, strict=True)],
    )


# ---------------------------------------------------------------- codecs over [layers, heads, tokens, dim]


def _encode(keys: torch.Tensor, values: torch.Tensor, spec: CodecSpec) -> dict[str, torch.Tensor]:
    if spec.name in ("fp32", "fp16"):
        dtype = torch.float32 if spec.name == "fp32" else torch.float16
        return {"k": keys.to(dtype).contiguous(), "v": values.to(dtype).contiguous()}
    if spec.name == "int8":
        k, ks = _quantise(keys, dim=2, levels=_INT8_MAX)
        v, vs = _quantise(values, dim=3, levels=_INT8_MAX)
        return {"k": k, "ks": ks, "v": v, "vs": vs}
    layers, heads, n, dim = keys.shape
    group = spec.group_size
    value_group = min(group, dim)
    if dim % value_group:
        raise InvalidInputError(f"int4 group_size {group} does not divide the head dimension {dim}")
    groups = -(-n // group)
    # the last token group may be short: it is scaled as if zero-padded, and only n rows are kept
    padded = torch.nn.functional.pad(keys, (0, 0, 0, groups * group - n)).view(layers, heads, groups, group, dim)
    k, ks = _quantise(padded, dim=3, levels=_INT4_MAX)
    v, vs = _quantise(values.view(layers, heads, n, dim // value_group, value_group), dim=4, levels=_INT4_MAX)
    return {
        "k": _pack4(k.view(layers, heads, groups * group, dim)[:, :, :n]),
        "ks": ks,
        "v": _pack4(v.view(layers, heads, n, dim)),
        "vs": vs,
    }


def _decode(
    tensors: dict[str, torch.Tensor],
    spec: CodecSpec,
    expected: tuple[int, int | None, int, int | None],
    dtype: torch.dtype,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers, heads, n, dim = expected

    def get(name: str, kind: torch.dtype) -> torch.Tensor:
        tensor = tensors.get(name)
        if tensor is None or tensor.dtype != kind:
            raise CorruptFragmentError(f"fragment blob lacks a valid {name!r} tensor")
        return tensor

    def check(tensor: torch.Tensor, shape: tuple, name: str) -> None:
        if tensor.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
        ):
            raise CorruptFragmentError(f"fragment tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")

    if spec.name in ("fp32", "fp16"):
        kind = torch.float32 if spec.name == "fp32" else torch.float16
        k, v = get("k", kind), get("v", kind)
        check(k, expected, "k")
        check(v, tuple(k.shape), "v")
        return list(k.to(dtype).unbind(0)), list(v.to(dtype).unbind(0))
    if spec.name == "int8":
        k, v = get("k", torch.int8), get("v", torch.int8)
        check(k, expected, "k")
        check(v, tuple(k.shape), "v")
        layers, heads, n, dim = k.shape
        ks, vs = get("ks", torch.float16), get("vs", torch.float16)
        check(ks, (layers, heads, 1, dim), "ks")
        check(vs, (layers, heads, n, 1), "vs")
        return _scaled(k, ks, dtype), _scaled(v, vs, dtype)
    packed_k, packed_v = get("k", torch.uint8), get("v", torch.uint8)
    half = None if dim is None else dim // 2
    check(packed_k, (layers, heads, n, half), "k")
    check(packed_v, tuple(packed_k.shape), "v")
    layers, heads, n, half = packed_k.shape
    dim, group = half * 2, spec.group_size
    value_group, groups = min(group, dim), -(-n // group)
    if dim % value_group:
        raise CorruptFragmentError(f"int4 group size {group} does not divide the head dimension {dim}")
    ks, vs = get("ks", torch.float16), get("vs", torch.float16)
    check(ks, (layers, heads, groups, 1, dim), "ks")
    check(vs, (layers, heads, n, dim // value_group, 1), "vs")
    k = torch.nn.functional.pad(_unpack4(packed_k), (0, 0, 0, groups * group - n)).view(
        layers, heads, groups, group, dim
    )
    keys = [layer.view(heads, groups * group, dim)[:, :n] for layer in _scaled(k, ks, dtype)]
    v = _unpack4(packed_v).view(layers, heads, n, dim // value_group, value_group)
    return keys, [layer.view(heads, n, dim) for layer in _scaled(v, vs, dtype)]


def _scaled(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """``q * scale`` in ``dtype``, one view per layer.

    Layers are multiplied in chunks of at most ~8 MB of output: few operations for a short
    fragment, and buffers the allocator reuses for a long one (a single buffer for thousands of
    tokens would be mapped afresh from the OS on every fetch, which costs more than the work).
    """
    layer_bytes = q[0].numel() * dtype.itemsize
    step = max(1, (8 << 20) // max(layer_bytes, 1))
    out: list[torch.Tensor] = []
    for start in range(0, q.shape[0], step):
        chunk = q[start : start + step]
        out.extend(
            torch.mul(
                chunk,
                scale[start : start + step].to(dtype),
                out=torch.empty(chunk.shape, dtype=dtype, device=chunk.device),
            ).unbind(0)
        )
    return out


def _quantise(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantisation with one fp16 scale per slice along ``dim``; the stored scale is the one used."""
    scale = (x.abs().amax(dim=dim, keepdim=True) / levels).clamp_min(1e-6).to(torch.float16)
    q = torch.round(x / scale.float()).clamp_(-levels, levels)
    return q.to(torch.int8), scale


def _pack4(q: torch.Tensor) -> torch.Tensor:
    """Pairs of values in ``[-7, 7]`` along the last axis into one byte each."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def _unpack4(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)
