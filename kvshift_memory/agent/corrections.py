"""Recognising a correction: a message that says an earlier fact is wrong and gives the right one.

"The budget is not 50k, it is 70k" must supersede the stored memory about the budget, so that the
old value is never recalled again. A message counts as a correction when it carries a correction
cue (below) and a stored memory is close enough to it (the agent's ``correction_min_score``); the
cue alone never touches the store, and a question ("is it not 50k?") is never a correction.
"""

from __future__ import annotations

import re

__all__ = ["is_correction_cue"]

# A bare "not" is everywhere ("I'm not sure"): a cue needs the shape of a replacement.
_CUES = re.compile(
    r"\b(?:not|isn't|aren't|wasn't|weren't|doesn't|don't)\b[^.?!]{0,80}?[,;]\s*"
    r"(?:but|it(?:'s| is| was)|they(?:'re| are)|rather|now)\b"
    r"|\bnot\b[^.?!,]{0,60}\bbut\b"
    r"|\b(?:correction|no longer|changed to|instead of|rather than|I meant|I was wrong|that was wrong"
    r"|has changed|have changed)\b"
    r"|\bactually\b[^.?!]{0,40}\b(?:is|are|was|it's|not)\b",
    re.IGNORECASE,
)


def is_correction_cue(text: str) -> bool:
    """Whether ``text`` is worded like a correction (a statement with a correction cue)."""
    stripped = text.strip()
    return bool(stripped) and not stripped.endswith("?") and bool(_CUES.search(stripped))
