"""The engine's settings, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources

from .. import inputs
from ..exceptions import InvalidInputError
from .weights import check_weight_format

__all__ = ["EngineSettings", "builtin_encode_context"]


def builtin_encode_context() -> str:
    """The text fragments are encoded after by default (``encode_context.txt``, written for this project)."""
    return resources.files(__package__).joinpath("encode_context.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class EngineSettings:
    """Tunable behaviour of a :class:`KVShiftEngine`.

    :param system_prompt: used when the messages bring no system message of their own.
    :param memory_header: the line that introduces the memories inside the system message.
    :param recompute_ratio: share of the shifted fragment tokens (all but a lead fragment's, see
        ``lead_fragments``) the blend recomputes by default; chosen from
        ``benchmarks/fidelity.py`` and ``benchmarks/ttft.py`` (``docs/benchmarks/``).
    :param min_recompute_tokens: the blend recomputes at least this many fragment tokens (all of
        them when there are fewer): for a few short memories the repair costs less than it risks.
    :param recompute_window: a recomputed fragment token, and a question token in the selection
        pass other than the ranking ones, attends to the shared prefix and to this many slots
        before it, not to the whole context: a quarter of the attention cost at 4k tokens, for a
        small loss of fidelity (``docs/benchmarks/fidelity.md``). Not applied when every fragment token is
        recomputed (``recompute_ratio=1``), which is then exact.
    :param encode_context: text a fragment is encoded after (between the shared prefix and the
        fragment, and never placed in a prompt). In a prompt a memory follows other memories, not
        the bare prefix; encoding it after a realistic stretch of other memory text makes its K/V
        much closer to what full recompute computes (``benchmarks/fidelity.py`` measures it). The
        default is a made-up chat in the format the agent stores memories in; ``""`` encodes
        after the prefix alone.
    :param match_speakers: a memory written as ``Name: words`` lines is encoded after the encode
        context with the context's speakers renamed to its own (:mod:`~kvshift_memory.engine.speakers`;
        names both share stay put; a context whose speakers would not all be renamed, as for a
        one-speaker memory, stays as written): a chat between two made-up people, then two others,
        reads as a transcript the answer goes on with. Measured in ``benchmarks/fidelity.py`` and
        ``benchmarks/locomo.py`` (``docs/benchmarks/fidelity.md``).
    :param lead_fragments: the memory that opens the system message's memory block follows the
        shared prefix and nothing else, so its K/V can be exact (up to a store's codec): it is read
        from a second fragment,
        encoded right after the prefix (its *lead* fragment), instead of being shifted and repaired
        like the others, and the blend's recompute budget goes to the others. :meth:`KVShiftEngine.warm`
        then encodes two fragments per memory (its ``lead_fragments`` argument says whether the
        memories will be placed there). Measured in ``docs/benchmarks/fidelity.md``.
    :param auto_shifts: whether ``reuse="auto"`` (the default) shifts long memories in from their
        fragments (``True``) or recomputes every memory, as ``"prefix"`` does (``False``, and
        ``stats.fallback_reason`` says so). ``None``: the model's measured choice, ``False`` for a
        shipped model whose blend changed too many of the agent's answers
        (``docs/benchmarks/long_memory.md``), else ``True``.
    :param prefix_cache_bytes: bound on the K/V of earlier prompts kept for exact prefix reuse.
    :param chunk_tokens: tokens per chunk of the K/V a call given a ``kv_store`` keeps there
        (:mod:`~kvshift_memory.engine.chunks`); only full chunks are kept, so a restored prompt
        computes at most this many tokens of what was stored, plus what is new.
    :param fragment_cache_bytes: bound on the encoded memory fragments kept in this process.
    :param keep_freed_memory: on Linux with glibc, keep freed blocks of up to 32 MiB (and up to
        1 GiB of free heap) mapped for reuse, so that each generation's new cache does not fault
        its pages in again (``docs/benchmarks/ttft.md``). It is
        process-wide, as choosing jemalloc is; ``False`` leaves malloc as it was.
    :param weights: how the model's linear layers hold their weights (:mod:`~kvshift_memory.engine.weights`):
        ``"as-shipped"`` (a shipped model's GGUF blocks, 4- and 8-bit, the very values of its
        float32 conversion), ``"int4"`` or ``"int8"`` (quantized here, per group of 32), ``"fp32"``
        or ``"bf16"``. ``None``: a shipped model loaded by name on the CPU takes ``"as-shipped"``,
        the fastest measured (``docs/benchmarks/decode.md``); any other model keeps the weights it
        was loaded with. The format is part of the engine's fingerprint: K/V computed under one is
        never read under another.
    :param one_token_step: decode with the engine's own step (:mod:`~kvshift_memory.engine.stepping`)
        where the model's family has one, instead of transformers' forward: the same arithmetic
        without the per-module overhead. ``False`` decodes through transformers (an A/B switch).
    :param pack_weights: replace the model's linear layers by ones whose weights are packed once
        for oneDNN (:mod:`kvshift_memory.engine.packing`; float32 on the CPU only): faster decoding
        and short prefills (``docs/benchmarks/ttft.md``). The packed model's
        ``state_dict`` lacks those weights: ``False`` keeps a model that can be saved.
    """

    system_prompt: str = "You are a helpful assistant."
    memory_header: str = "Relevant memories:"
    recompute_ratio: float = 0.10
    min_recompute_tokens: int = 64
    recompute_window: int = 512
    encode_context: str = field(default_factory=builtin_encode_context)
    match_speakers: bool = True
    lead_fragments: bool = True
    auto_shifts: bool | None = None
    prefix_cache_bytes: int = 1 << 30
    chunk_tokens: int = 256
    fragment_cache_bytes: int = 1 << 30
    keep_freed_memory: bool = True
    weights: str | None = None
    one_token_step: bool = True
    pack_weights: bool = True

    def __post_init__(self) -> None:
        inputs.check_ratio(self.recompute_ratio)
        inputs.check_text(self.system_prompt, "system_prompt", allow_empty=True)
        inputs.check_text(self.memory_header, "memory_header", allow_empty=True)
        inputs.check_text(self.encode_context, "encode_context", allow_empty=True)
        inputs.check_positive_int(self.recompute_window, "recompute_window")
        inputs.check_positive_int(self.chunk_tokens, "chunk_tokens")
        for name in ("min_recompute_tokens", "prefix_cache_bytes", "fragment_cache_bytes"):
            inputs.check_non_negative_int(getattr(self, name), name)
        check_weight_format(self.weights)
        for name in ("match_speakers", "lead_fragments", "keep_freed_memory", "one_token_step", "pack_weights"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be True or False, not {getattr(self, name)!r}")
        if self.auto_shifts is not None and not isinstance(self.auto_shifts, bool):
            raise InvalidInputError(f"auto_shifts must be True, False or None, not {self.auto_shifts!r}")
