"""Constrained decoding: answers that follow a JSON schema, a regular expression or a Lark grammar.

At every decoding step the grammar's matcher says which tokens may come next and every other token's
logit is set to ``-inf`` before a token is picked, so even a small model returns text the grammar
accepts (a JSON schema's instance, say) as long as ``max_new_tokens`` leaves room to finish it.
The matcher is llguidance's (the engine behind vLLM's, SGLang's and llama.cpp's structured output):
it computes a mask in tens of microseconds without compiling the whole grammar ahead, has no
dependencies of its own and ships one wheel for every Python version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ..exceptions import InvalidInputError

__all__ = ["COMPACT_JSON", "Grammar", "GrammarMatcher"]

#: JSON as ``json.dumps`` writes it (``", "``, ``": "``, no other whitespace): what chat templates'
#: ``tojson`` writes, so a call or answer the model wrote reads back as the same text
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# a grammar is text the caller gives: bounded like any other input
_MAX_GRAMMAR_CHARS = 1_000_000
_BIT_OFFSETS = torch.arange(8, dtype=torch.uint8)


def _llguidance() -> Any:
    import llguidance

    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What an answer must match; build one with :meth:`json_schema`, :meth:`regex` or :meth:`lark`.

    ``source`` is llguidance's grammar text; ``description`` says in words what it was built from
    (it appears in errors).
    """

    source: str
    description: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Answers that are one JSON value valid under ``schema`` (compact, no text around it).

        :raises InvalidInputError: ``schema`` is not a JSON object, is nested too deeply, or
            llguidance cannot compile it.
        """
        try:
            if isinstance(schema, str):
                _check_size(schema)
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise InvalidInputError(f"the JSON schema is not JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidInputError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
            text = json.dumps(schema)
        except RecursionError:
            raise InvalidInputError("the JSON schema is nested too deeply") from None
        _check_size(text)
        try:
            source = _llguidance().LLMatcher.grammar_from_json_schema(text, defaults=COMPACT_JSON)
        except ValueError as exc:
            raise InvalidInputError(f"the JSON schema cannot be compiled: {exc}") from None
        return cls._checked(source, f"JSON schema {schema.get('title', '')!s}".strip())

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Answers that match the regular expression ``pattern`` entirely (Rust ``regex`` syntax).

        :raises InvalidInputError: ``pattern`` is not a string or does not compile.
        """
        _check_text(pattern, "regular expression")
        return cls._checked(_llguidance().LLMatcher.grammar_from_regex(pattern), "regular expression")

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Answers that the Lark grammar ``grammar`` derives from its ``start`` rule (llguidance's
        Lark dialect, which also embeds JSON schemas: ``%json { ... }``).

        :raises InvalidInputError: ``grammar`` is not a string or does not compile.
        """
        _check_text(grammar, "Lark grammar")
        return cls._checked(_llguidance().LLMatcher.grammar_from_lark(grammar), "Lark grammar")

    @classmethod
    def _checked(cls, source: str, description: str) -> Grammar:
        error = _llguidance().LLMatcher.validate_grammar(source)
        if error:
            raise InvalidInputError(f"the {description} is not a grammar llguidance accepts: {error}")
        return cls(source, description)


def _check_text(text: object, what: str) -> None:
    if not isinstance(text, str):
        raise InvalidInputError(f"a {what} is a string, not {type(text).__name__}")
    _check_size(text)


def _check_size(text: str) -> None:
    if len(text) > _MAX_GRAMMAR_CHARS:
        raise InvalidInputError(f"a grammar of {len(text):,} characters is over the limit of {_MAX_GRAMMAR_CHARS:,}")


class GrammarMatcher:
    """One answer's walk through a :class:`Grammar`: masks the logits, then consumes the token picked.

    :param tokenizer: llguidance's view of the model's vocabulary (:func:`grammar_tokenizer`).
    :raises InvalidInputError: the grammar does not fit this vocabulary.
    """

    def __init__(self, grammar: Grammar, tokenizer: Any) -> None:
        self._matcher = _llguidance().LLMatcher(tokenizer, grammar.source, log_level=0)
        self._grammar = grammar
        self._check()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with every token the grammar forbids next set to ``-inf`` (a new tensor)."""
        bits = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> _BIT_OFFSETS) & 1).reshape(-1).bool()
        vocab = logits.shape[-1]
        if allowed.numel() < vocab:  # ids past the tokenizer's vocabulary (padding rows) are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(vocab - allowed.numel())])
        return logits.masked_fill(~allowed[:vocab].to(logits.device), float("-inf"))

    def consume(self, token: int) -> None:
        """Advance past ``token`` (one the mask allowed).

        :raises InvalidInputError: the grammar rejects it (a token the mask forbade).
        """
        self._matcher.consume_token(token)
        self._check()

    @property
    def finished(self) -> bool:
        """Whether the grammar allows nothing more than the end of the answer."""
        return bool(self._matcher.is_stopped())

    def _check(self) -> None:
        if self._matcher.is_error():
            raise InvalidInputError(f"the {self._grammar.description} failed: {self._matcher.get_error()}")


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: frozenset[int]) -> Any:
    """llguidance's view of a transformers tokenizer (building it takes about a second: keep it).

    :raises InvalidInputError: a slow (non-``tokenizers``) tokenizer, which llguidance cannot read.
    """
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise InvalidInputError("constrained decoding needs a fast (tokenizers) tokenizer")
    from llguidance.hf import from_tokenizer

    return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
