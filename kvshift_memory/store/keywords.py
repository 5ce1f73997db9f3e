"""Keywords of a text: the index's second search path, next to the embedding.

A small sentence encoder places "What is Gina's favourite style of dance?" near every turn about
dancing; the turn that names Gina and contemporary dance may still rank fifth. A keyword path
weighted by rarity (Qdrant's IDF over the indexed memories) lifts exactly those turns:
``benchmarks/locomo.py`` measures session recall@4 with and without it.

Keywords are the lower-cased words of the text, without a short list of English function words;
each is sent to Qdrant as a sparse dimension (a stable 31-bit hash of the word).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .records import MemoryRecord

__all__ = ["keywords", "memory_keywords", "sparse_terms"]

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")
_STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have
    having he her here hers herself him himself his how i if in into is it its itself just me more most my
    myself no nor not now of off on once only or other our ours ourselves out over own same she should so
    some such than that the their theirs them themselves then there these they this those through to too
    under until up very was we were what when where which while who whom why will with would you your
    yours yourself yourselves i'm i've i'd i'll it's that's what's you're don't didn't doesn't isn't
    let's also yes yeah oh hey hi really just like get got one""".split()
)


def keywords(text: str) -> list[str]:
    """The distinct keywords of ``text``, in order of first appearance."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(text.lower()):
        if word.endswith("'s"):  # "Gina's" is about Gina
            word = word[:-2]
        if word not in _STOPWORDS and (len(word) > 2 or word.isdigit()):
            seen.setdefault(word, None)
    return list(seen)


def sparse_terms(words: Iterable[str]) -> tuple[list[int], list[float]]:
    """Sparse-vector indices and values (presence, 1.0) for ``words``; rarity is weighted by the index."""
    indices = sorted({zlib.crc32(word.encode("utf-8")) & 0x7FFFFFFF for word in words})
    return indices, [1.0] * len(indices)


def memory_keywords(record: MemoryRecord) -> list[str]:
    """What the keyword path indexes for a memory: its text's keywords and its ``semantic_keywords``."""
    return keywords(" ".join([record.text, *record.semantic_keywords]))
