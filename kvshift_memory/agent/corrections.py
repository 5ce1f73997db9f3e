"""Recognising a correction, and the one memory it corrects.

"The budget is not 50k, it is 70k" must supersede the stored memory about the budget, so that the
old value is never recalled again; "my son is allergic to cats, not peanuts" must not touch "my
daughter is allergic to peanuts". A message counts as a correction when it carries a correction
cue (below); it supersedes a memory only when :func:`corrects` holds for exactly one of the stored
memories close to it. Otherwise nothing changes: the message is stored as a statement of its own
(``"correction_ambiguous"``). A question ("is it not 50k?") is never a correction.

:func:`corrects` asks three things of a memory, all read from the words alone:

- it holds the value the message negates (the words after "not", "instead of", "rather than",
  "no longer"), or, for a correction that negates nothing ("correction: the meeting is at 4pm"),
  it says the same thing of the same subject with other values;
- it is about the same person: the people each text names (kin words, names, or the speaker
  when only "I"/"my" are there) do not differ;
- it is about the same attribute and time: they share a subject word ("birthday" is not
  "anniversary") and no time qualifier ("last year", "next week") stands in one alone.
"""

from __future__ import annotations

import re

__all__ = ["corrects", "is_correction_cue", "negated_value"]

# A bare "not" is everywhere ("I'm not sure"): a cue needs the shape of a replacement.
_CUES = re.compile(
    r"\b(?:not|isn't|aren't|wasn't|weren't|doesn't|don't)\b[^.?!]{0,80}?[,;]\s*"
    r"(?:but|it(?:'s| is| was| moved| has moved)|(?:he|she)(?:'s| is)|they(?:'re| are)|I(?:'m| am)|we(?:'re| are)"
    r"|(?:he|she|it|they|I|we)\s+(?!not\b|don't\b|doesn't\b)[a-z]+"  # "…not live in Porto, she lives in Braga"
    r"|rather|now)\b"
    r"|\bnot\b[^.?!,]{0,60}\bbut\b"
    r"|,\s*not\s+\w"
    r"|\b(?:correction|no longer|changed to|instead of|rather than|I meant|I was wrong|that was wrong"
    r"|has changed|have changed)\b"
    r"|\bactually\b[^.?!]{0,40}\b(?:is|are|was|it's|not)\b",
    re.IGNORECASE,
)
# what a correction says is wrong: the words after the negation, up to the clause's end
_NEGATED = re.compile(
    r"\b(?:not|isn't|aren't|wasn't|weren't|doesn't|don't|no longer|instead of|rather than|changed from)\s+"
    r"(?P<value>[^,;.!?]+?)\s*(?=[,;.!?]|\bbut\b|\bto\b|\bit(?:'s| is| was)\b|$)",
    re.IGNORECASE,
)
# what a correction gives instead: the clause after the negated value ("not 50k, it is 70k"), or
# the last words before it ("allergic to cats, not peanuts"; "on Friday instead of Saturday")
_NEW_AFTER = re.compile(
    r"\b(?:not|isn't|aren't|wasn't|weren't|doesn't|don't|no longer)\b[^,;]*[,;](?P<new>[^.;!?]+)", re.I
)
_NEW_BEFORE = re.compile(
    r"(?:^|\b(?:is|are|was|were|at|in|on|to|a|an|from|called|named)\s+)(?P<new>[^,;.!?]*?)\s*"
    r"(?:,\s*not\b|\s+instead of\b|\s+rather than\b)",
    re.I,
)
# a person named as the one something is about: "Tom's", "Ana lives", "Rui does"
_NAMED_PERSON = re.compile(
    r"\b([A-Z][a-z]+)(?='s\b|\s+(?:lives|lived|works|worked|does|did|has|had|likes|loves|moved|plays|studies|is|was)\b)"
)
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
_SENTENCE_START = re.compile(r"(?:^|[.!?:]\s+)([^\W\d_]+)")

_FUNCTION_WORDS = frozenset(
    """
    a an the and or but so of in on at to for from by with about as into over than then that this these
    those it its it's is are was were be been being am do does did has have had will would shall should
    can could may might must not no isn't aren't wasn't weren't doesn't don't didn't never longer
    i i'm i've i'd my me mine myself we our us you your he him his she her they them their there here
    what which who whom when where why how also just still now actually really correction wrong meant
    instead rather changed change changes sorry oops anyway well oh ok okay yes any more anymore
    called named
    """.split()
)
_PEOPLE = frozenset(
    """
    mother mom mum father dad parent parents son daughter sister brother sibling wife husband partner
    boyfriend girlfriend fiance fiancee friend boss colleague coworker manager grandma grandmother grandpa
    grandfather aunt uncle cousin niece nephew kid kids child children baby neighbour neighbor roommate
    teacher doctor dentist
    """.split()
)
_TIME_QUALIFIERS = frozenset(
    "last next previous this coming past yesterday tomorrow today tonight old former current new".split()
)
_CALENDAR = frozenset(
    """
    monday tuesday wednesday thursday friday saturday sunday january february march april may june july
    august september october november december jan feb mar apr jun jul aug sep sept oct nov dec
    morning afternoon evening night noon midnight am pm
    """.split()
)
_FIRST_PERSON = frozenset({"i", "i'm", "i've", "i'd", "my", "me", "mine", "myself"})


def is_correction_cue(text: str) -> bool:
    """Whether ``text`` is worded like a correction (a statement with a correction cue)."""
    stripped = text.strip()
    return bool(stripped) and not stripped.endswith("?") and bool(_CUES.search(stripped))


def _stem(word: str) -> str:
    word = word.lower().removesuffix("'s")
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def _tokens(text: str) -> tuple[set[str], set[str], set[str]]:
    """(people, values, subject words) of ``text``: who it is about (kin words, a named person, or
    the speaker), the values it states (numbers, dates, names of things) and the other content words."""
    starts = {m.start(1) for m in _SENTENCE_START.finditer(text)}
    people = {_stem(name) for name in _NAMED_PERSON.findall(text) if name.lower() not in _FUNCTION_WORDS}
    values: set[str] = set()
    subject: set[str] = set()
    first_person = False
    for match in _WORD.finditer(text):
        raw = match.group()
        word = _stem(raw)
        first_person = first_person or raw.lower() in _FIRST_PERSON
        if word in _FUNCTION_WORDS or raw.lower() in _FUNCTION_WORDS or word in people:
            continue
        if word in _PEOPLE:
            people.add(word)
        elif any(c.isdigit() for c in raw) or word in _CALENDAR or (raw[0].isupper() and match.start() not in starts):
            values.add(word)
        else:
            subject.add(word)
    if not people and first_person:
        people.add("<speaker>")
    return people, values, subject


def _content(text: str) -> set[str]:
    return {_stem(w) for w in _WORD.findall(text)} - _FUNCTION_WORDS


def negated_value(text: str) -> set[str]:
    """The words of the value ``text`` says is wrong ("not 50k" -> {"50k"}); empty when it negates none."""
    found: set[str] = set()
    for match in _NEGATED.finditer(text):
        found |= _content(match.group("value"))
    return found


def _new_value(text: str) -> set[str]:
    """The words of what ``text`` gives instead of the negated value."""
    found: set[str] = set()
    for pattern in (_NEW_AFTER, _NEW_BEFORE):
        for match in pattern.finditer(text):
            found |= _content(match.group("new"))
    return found


def corrects(message: str, memory: str) -> bool:
    """Whether the correction ``message`` is about what ``memory`` says (same person, attribute,
    time) and replaces a value it holds. When unsure: ``False``."""
    old = negated_value(message)
    said_people, said_values, said_subject = _tokens(message)
    held_people, held_values, held_subject = _tokens(memory)
    held_words = held_values | held_subject | held_people
    if said_people and held_people and not (said_people & held_people):
        return False  # another person's
    if (said_subject & _TIME_QUALIFIERS) ^ (held_subject & _TIME_QUALIFIERS):
        return False  # another time ("last year's budget" is not this year's)
    if old:
        # every subject word is the memory's, or part of the old or the new value: "the gate code is
        # not 4321" says nothing of the door code
        unexplained = said_subject - held_subject - old - _new_value(message)
        return old <= held_words and not unexplained and bool(said_subject & held_subject)
    # nothing negated in so many words: only a restatement of the same subject with other values
    return bool(said_subject) and said_subject == held_subject and bool(said_values - held_values)
