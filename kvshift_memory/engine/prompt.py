"""Turning messages and memories into token ids, with each memory's tokens as a separate span.

The chat template is rendered once with a sentinel in place of every content string; the rendered
text is split at the sentinels. Template pieces are tokenised with special tokens recognised, and
content (messages and memories) with special tokens *split*, so a message that contains
``<|im_start|>`` stays text and can never forge turn structure. Tokenising piecewise also gives each
memory the same token ids in every prompt, which is what lets its KV be reused.

Memories go inside the system message, after ``memory_header``, one per line::

    <system prompt>\\n\\n<memory header>\\n<memory 1>\\n<memory 2>\\n...
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["FragmentSpan", "PromptLayout", "digest_ids", "build_layout"]

ROLES = ("system", "user", "assistant")


def digest_ids(ids: Sequence[int]) -> str:
    """A stable digest of a token id sequence."""
    return hashlib.blake2b(torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class FragmentSpan:
    """Where one memory's tokens sit in the prompt: slots ``[start, end)``."""

    start: int
    end: int
    text: str
    token_ids: tuple[int, ...]
    record: Any = field(default=None, compare=False)  # the memory record it came from, when not plain text


@dataclass(frozen=True)
class PromptLayout:
    """A tokenised prompt: all ids, the memory spans inside it, and where the first one starts."""

    token_ids: torch.Tensor
    fragments: tuple[FragmentSpan, ...]

    @property
    def length(self) -> int:
        return int(self.token_ids.numel())

    @property
    def prefix_length(self) -> int:
        """Tokens before the first memory (the whole prompt when there is none)."""
        return self.fragments[0].start if self.fragments else self.length

    @property
    def tail_start(self) -> int:
        """First slot after the last memory."""
        return self.fragments[-1].end if self.fragments else self.length


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # A model without a chat template (a base model) gets a plain transcript.
    lines = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
    return "".join(lines) + "Assistant:"


def build_layout(
    tokenizer,
    messages: list[dict[str, str]],
    memories: Sequence[str],
    system_prompt: str,
    memory_header: str,
) -> PromptLayout:
    """Tokenise ``messages`` with ``memories`` placed in the system message.

    ``messages`` and ``memories`` must already be validated (roles known, contents strings,
    memories stripped and non-empty).
    """
    tag = secrets.token_hex(8)
    contents: dict[str, tuple[str, bool]] = {}  # sentinel -> (text, is_memory)

    def sentinel(text: str, is_memory: bool) -> str:
        key = f"\x00{tag}:{len(contents)}\x00"
        contents[key] = (text, is_memory)
        return key

    rendered_messages = []
    if messages[0]["role"] == "system":
        system_text, rest = messages[0]["content"], messages[1:]
    else:
        system_text, rest = system_prompt, messages
    system = sentinel(system_text, False)
    if memories:
        system += sentinel(f"\n\n{memory_header}\n", False)
        system += "".join(sentinel(f"{text}\n", True) for text in memories)
    rendered_messages.append({"role": "system", "content": system})
    rendered_messages.extend({"role": m["role"], "content": sentinel(m["content"], False)} for m in rest)
    text = _render(tokenizer, rendered_messages)

    ids: list[int] = []
    spans: list[FragmentSpan] = []
    memory_texts = iter(memories)
    for piece in text.split("\x00"):
        key = f"\x00{piece}\x00"
        if key in contents:
            content, is_memory = contents[key]
            piece_ids = tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            if is_memory:
                spans.append(FragmentSpan(len(ids), len(ids) + len(piece_ids), next(memory_texts), tuple(piece_ids)))
        elif piece:
            piece_ids = tokenizer(piece, add_special_tokens=False)["input_ids"]
        else:
            continue
        ids.extend(piece_ids)
    return PromptLayout(torch.tensor(ids, dtype=torch.long), tuple(spans))
