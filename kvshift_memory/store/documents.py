"""Splitting a long document into memories: consecutive parts of at most so many tokens.

A part ends at the largest boundary that keeps it within the budget: a paragraph (a blank line),
else a line, else a sentence, else a word; a single word longer than the budget (a long URL, a
base64 blob) is cut inside, into pieces that each fit: no part is ever over the budget, so none is
too long to be recalled. Only the whitespace at a cut is dropped: nothing of the text is lost or
reworded, and the pieces of a cut word, joined, are the word.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence

from .records import MemoryRecord

__all__ = ["approximate_tokens", "document_row", "in_document_order", "listed_parts", "split_document"]

# a token spans at most this many characters (in any tokenizer the engine meets), so a piece of a
# word is looked for among prefixes no longer than this many characters per token of budget: a
# wrong guess only makes a piece shorter than it could be, never longer than the budget
_MAX_TOKEN_CHARS = 64
# from the widest boundary to the narrowest; each pattern's match is the whitespace a cut removes
_BOUNDARIES = (re.compile(r"\n\s*\n\s*"), re.compile(r"\n\s*"), re.compile(r"(?<=[.!?])\s+"), re.compile(r"\s+"))
_TOKEN = re.compile(r"\w+|[^\w\s]")


def approximate_tokens(text: str) -> int:
    """Words and punctuation marks in ``text``: close to (a little under) a subword tokenizer's count."""
    return len(_TOKEN.findall(text))


def split_document(text: str, max_tokens: int, count_tokens: Callable[[str], int] = approximate_tokens) -> list[str]:
    """``text`` cut into consecutive parts of at most ``max_tokens`` tokens (by ``count_tokens``).

    :returns: the parts, in order, each stripped of the whitespace around it; none empty.
    """
    return [part for part in _split(text.strip(), max_tokens, count_tokens, 0) if part]


def _split(text: str, max_tokens: int, count_tokens: Callable[[str], int], level: int) -> list[str]:
    if not text or count_tokens(text) <= max_tokens:
        return [text]
    if level == len(_BOUNDARIES):
        return _cut_word(text, max_tokens, count_tokens)
    pieces = _BOUNDARIES[level].split(text)
    if len(pieces) == 1:
        return _split(text, max_tokens, count_tokens, level + 1)
    # greedy packing of whole pieces, keeping the separators the text had between them
    separators = _BOUNDARIES[level].findall(text)
    parts: list[str] = []
    current = ""
    for index, piece in enumerate(pieces):
        candidate = piece if not current else current + separators[index - 1] + piece
        if count_tokens(candidate) <= max_tokens:
            current = candidate
            continue
        if current:
            parts.append(current)
        if count_tokens(piece) <= max_tokens:
            current = piece
        else:
            parts.extend(_split(piece, max_tokens, count_tokens, level + 1))
            current = ""
    if current:
        parts.append(current)
    return parts


def _cut_word(word: str, max_tokens: int, count_tokens: Callable[[str], int]) -> list[str]:
    """``word`` (no boundary inside) in consecutive pieces of at most ``max_tokens`` tokens (a piece
    is one character at least, should that one character alone be over), each the longest a binary
    search finds among prefixes up to twice the previous piece."""
    pieces: list[str] = []
    while word:
        longest = max_tokens * _MAX_TOKEN_CHARS if not pieces else 2 * len(pieces[-1])
        low, high = 1, min(len(word), longest)
        while low < high:  # the longest prefix within the budget
            middle = (low + high + 1) // 2
            if count_tokens(word[:middle]) <= max_tokens:
                low = middle
            else:
                high = middle - 1
        pieces.append(word[:low])
        word = word[low:]
    return pieces


def document_row(part_ids: Sequence[str]) -> bytes:
    """The row that publishes a document: its parts are live only while it lists them, so a reader
    sees all of them or none (what :meth:`~kvshift_memory.MemoryStore.add_document` writes last)."""
    return json.dumps({"kind": "document", "parts": list(part_ids)}).encode("utf-8")


def listed_parts(raw: bytes | None) -> frozenset[str]:
    """The part ids a document row lists; none for a missing, fenced or malformed one (rows are untrusted)."""
    try:
        row = json.loads(raw) if raw else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        return frozenset()
    if not isinstance(row, dict) or row.get("kind") != "document" or not isinstance(row.get("parts"), list):
        return frozenset()
    return frozenset(part for part in row["parts"] if isinstance(part, str))


def in_document_order(records: Sequence[MemoryRecord]) -> list[MemoryRecord]:
    """Search hits with the parts of one document in the document's order, each document where its
    best-ranked part was; a memory that is no document's part keeps its place.

    :param records: best first, as :meth:`~kvshift_memory.MemoryStore.search` returns them.
    """
    rank: dict[str, int] = {}
    for position, record in enumerate(records):
        rank.setdefault(record.document or record.id, position)
    return sorted(records, key=lambda r: (rank[r.document or r.id], r.part or 0))
