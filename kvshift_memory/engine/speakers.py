"""Who speaks in a text of ``Name: words`` lines, and an encode context recast with a memory's speakers.

A fragment's K/V depend on the text it was encoded after. The built-in encode context is a chat
between two made-up people; a memory from a conversation between two others, encoded after it,
reads as a new pair of people breaking into that chat, and the shifted memory pulls the answer
towards continuing a transcript ("Tim: Thanks! ...") instead of answering. The same context with
its speakers renamed to the memory's own was as good as a stretch of the memory's own conversation
(``docs/benchmarks/fidelity.md``).
"""

from __future__ import annotations

import re
from functools import lru_cache

__all__ = ["cast_speakers", "speakers"]

# a speaker opens a line: one capitalised word, a colon, a space
_SPEAKER = re.compile(r"^([A-Z][A-Za-z'-]{0,39}):[ \t]", re.MULTILINE)


def speakers(text: str) -> tuple[str, ...]:
    """The names that open a line of ``text`` as ``Name: ...``, in order of first appearance."""
    return tuple(dict.fromkeys(_SPEAKER.findall(text)))


def cast_speakers(context: str, memory: str) -> str:
    """``context`` with its speakers renamed, wherever the name stands as a word, to ``memory``'s.

    Names the two texts share keep their places (a context from the memory's own conversation is
    left as it is). The others are paired: the context's in order of first appearance with the
    memory's in alphabetical order, so that every memory between the same people is encoded after
    the same context, whoever speaks first in it. The context is left as written when some of its
    speakers would find no partner (a memory of one turn, a context of two people): its people are
    either all the memory's or all its own, never a made-up one talking with a real one, which
    measured worse than either (``docs/benchmarks/fidelity.md``).
    """
    return _cast(context, tuple(sorted(speakers(memory))))


@lru_cache(maxsize=256)
def _cast(context: str, cast: tuple[str, ...]) -> str:
    if not cast:
        return context
    present = speakers(context)
    theirs = [name for name in present if name not in cast]
    ours = [name for name in cast if name not in present]
    if not theirs or len(ours) < len(theirs):
        return context
    renamed = dict(zip(theirs, ours, strict=False))  # the memory may have more speakers than the context
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, renamed)) + r")\b")
    return pattern.sub(lambda match: renamed[match.group(1)], context)
