"""Write-back: after each turn, decide what happens to the user's words.

Every user statement that carries information is stored; only content-free turns
(acknowledgements, greetings, "ok thanks", "haha") stay in the window alone. A logistic regression
over cheap features of the turn (:data:`FEATURES`) gives its *importance*, the probability that
it carries something worth recalling; two fitted thresholds turn that into a :data:`Decision`, and
the importance also ranks the memory at recall. Explicit requests (:func:`explicit_request`) are
not left to the regression: "remember …" always archives, "forget …" removes a memory.

The rule is fitted by ``benchmarks/writeback.py --fit`` on three sources (chat turns written for
this project, LoCoMo's evidence labels, MemoryBank's user turns) and measured there on held-out
splits; it is shipped as ``writeback_model.json`` next to this module: a few numbers, not data
(LoCoMo itself, CC BY-NC 4.0, is never copied here).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

__all__ = [
    "FEATURES",
    "Decision",
    "WriteBackModel",
    "explicit_request",
    "first_person",
    "forget_subject",
    "is_question_only",
    "is_task_request",
    "turn_features",
]

Decision = Literal["archive", "defer", "window", "forget", "forget_ambiguous", "correction_ambiguous"]
"""What write-back did with a user's turn.

- ``"archive"``: stored now (text and index entry; its fragment encoded now or on first recall);
- ``"defer"``: kept in the window, stored when it leaves the window or the session closes (a
  turn the rule is unsure of);
- ``"window"``: kept in the window only and never stored: content-free, a question that states
  nothing, or a task for the assistant that says nothing of the user ("Convert 50 euros to
  dollars."): it matters while it is discussed; as a memory it would only come back as noise;
- ``"forget"``: a request to forget, which removed the memory it named;
- ``"forget_ambiguous"``: a request to forget that removed nothing (no stored memory was close
  enough, or two were equally close);
- ``"correction_ambiguous"``: worded as a correction, but no single stored memory is clearly
  about the same subject and holds the value it negates: stored as a statement of its own, and
  nothing else changed.
"""

FEATURES = (
    "log words",
    "log content words",
    "content share",
    "has a digit",
    "sqrt capitalised words inside a sentence",
    "first person",
    "is a question",
    "answers a question",
)

# English function words and the words small talk is made of: a turn made only of these carries
# nothing to recall ("ok thanks", "haha that's so true", "good morning!").
_PLAIN_WORDS = frozenset(
    """
    a about above after again against all also am an and any are as at be because been before being
    below between both but by can could did do does doing down during each else even ever few for from
    further had has have having he her here hers herself him himself his how i if in into is it its
    itself just let me more most much must my myself no nor not now of off on once only or other our
    ours ourselves out over own same she should so some still such than that the their theirs them
    themselves then there these they this those through to too under until up very was we were what
    when where which while who whom why will with would you your yours yourself yourselves
    im ive id ill dont doesnt didnt isnt arent wasnt cant couldnt wont wouldnt thats whats its youre
    theyre were hes shes lets theres heres
    ok okay okie dokie k kk yes yeah yep yup yea ya no nope nah sure fine alright right well oh ah ahh
    aw aww hmm hm mm uh um er huh wow whoa oops ugh meh yay woohoo hooray phew
    haha hahaha hehe hihi lol lmao rofl xd omg wtf brb ttyl thx ty ta np pls plz
    hi hello hey hiya howdy bye goodbye cya later soon again back morning evening night afternoon day
    weekend nice good great cool awesome amazing brilliant lovely perfect excellent fantastic wonderful
    fun funny hilarious sweet true totally exactly absolutely definitely indeed certainly course really
    agreed agree same too thanks thank thankyou cheers appreciate appreciated welcome please sorry
    kind kindly many lot lots bit little best job done stuff thing things point sense idea plan
    see know think guess mean say said tell told hear heard sound sounds seems looks works work get got
    gotcha understood noted care talk chat catch go going gone come coming continue next question
    maybe perhaps probably whatever anyway anyways never mind important enough again here there
    mate dude buddy man guys friend all everyone anyone someone something nothing everything
    one two sec second minute moment wait hang hold make makes made worry worries fair interesting
    laugh laughing thinking help helps helped today tonight happy glad take like forget remember
    enjoy enjoyed pleasure
    """.split()
)
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)?")
_SENTENCE_START = re.compile(r"(?:^|[.!?]\s+)([^\W\d_]+)")
_FIRST_PERSON = re.compile(r"\b(?:I|I'm|I've|I'd|I'll|my|me|mine|we|we're|our|us)\b", re.IGNORECASE)

_REMEMBER = re.compile(
    r"^(?:(?:hey|ok|okay|so|and|also|btw|oh)[,!]?\s+)*(?:(?:please|pls|can you|could you|would you)\s+)?"
    r"(?:remember|don'?t forget|do not forget|never forget|note that|note:|make a note|take note|keep in mind"
    r"|for the record)\b",
    re.IGNORECASE,
)
# "forget …" is always about the memory; "delete/erase/wipe/remove …" only when what follows names
# what the user told it (_ABOUT_MEMORY): "delete the draft email to John" is an instruction for a tool
_FORGET = re.compile(
    r"^(?:(?:hey|ok|okay|so|and|also|actually|oh)[,!]?\s+)*(?:(?:please|pls|can you|could you|would you)\s+)?"
    r"(?:(?P<forget>forget|unlearn|(?:don'?t|do not|stop) remember(?:ing)?)|(?P<delete>delete|erase|wipe|remove|clear))"
    r"\s+(?P<subject>.+)$",
    re.IGNORECASE | re.DOTALL,
)
_ABOUT_MEMORY = re.compile(
    r"^(?:(?:what|everything|anything|all)\s+(?:that\s+)?(?:I|we)\s+(?:said|told you|mentioned|wrote|shared)\b"
    r"|(?:the|that|this|my)\s+(?:memory|memories|note|notes|fact|facts)\s+(?:about|of|that|on)\b)"
    r"|\bfrom\s+(?:your|the|my)\s+(?:memory|memories|notes)\b",
    re.IGNORECASE,
)
_SUBJECT_LEAD = re.compile(
    r"^(?:(?:what|everything|anything|all)\s+(?:that\s+)?(?:I|we)\s+(?:said|told you|mentioned|wrote|shared)\s+"
    r"(?:to you\s+)?(?:about|regarding|on)?\s*|about\s+|the (?:memory|note|fact|thing)s?\s+(?:about|of|that)\s+"
    r"|that\s+)",
    re.IGNORECASE,
)


def _words(text: str) -> list[str]:
    return [w.lower().replace("'", "") for w in _WORD.findall(text)]


def content_words(text: str) -> list[str]:
    """The words of ``text`` that are neither function words nor small talk (numbers count)."""
    return [w for w in _words(text) if w not in _PLAIN_WORDS and (len(w) > 1 or w.isdigit())]


def first_person(text: str) -> bool:
    """Whether ``text`` speaks of its speaker ("I", "my", "we", ...)."""
    return bool(_FIRST_PERSON.search(text))


def turn_features(text: str, previous: str = "") -> list[float]:
    """The :data:`FEATURES` of a turn ``text`` that follows ``previous`` (raw, not standardised)."""
    words = _words(text)
    content = content_words(text)
    sentence_starts = {m.start(1) for m in _SENTENCE_START.finditer(text)}
    capitalised = sum(
        1
        for m in _WORD.finditer(text)
        if m.group()[0].isupper() and m.start() not in sentence_starts and m.group() != "I"
    )
    return [
        math.log1p(len(words)),
        math.log1p(len(content)),
        len(content) / len(words) if words else 0.0,
        float(any(c.isdigit() for c in text)),
        capitalised**0.5,
        float(first_person(text)),
        float(text.strip().endswith("?")),
        float(previous.strip().endswith("?")),
    ]


def is_question_only(text: str) -> bool:
    """Whether ``text`` asks and states nothing: one question ("What is my budget?")."""
    stripped = text.strip()
    return stripped.endswith("?") and not re.search(r"[.!?]\s", stripped)


# what a user tells an assistant to do: a task for now, not something about the user to remember
_TASK = re.compile(
    r"^(?:(?:hey|hi|ok|okay|so|now|then|and|also|quick|quickly)[,!]?\s+)*"
    r"(?:(?:please|pls|kindly|can you|could you|would you|will you)\s+)?"
    r"(?:convert|translate|summari[sz]e|write|draft|compose|rewrite|rephrase|explain|describe|tell|give|show|list"
    r"|find|search|look up|calculate|compute|book|order|send|email|schedule|create|make|generate|suggest"
    r"|recommend|compare|check|fix|play|open|turn|set)\b",
    re.IGNORECASE,
)


def is_task_request(text: str) -> bool:
    """Whether ``text`` only asks the assistant to do something ("Convert 50 euros to dollars.",
    "Please translate this into French."): a task for the turn, which says nothing about the
    user. One that speaks of the user ("Book a table for me, I am vegetarian.") is not only that."""
    stripped = text.strip()
    return bool(_TASK.match(stripped)) and not first_person(stripped)


def explicit_request(text: str) -> Literal["remember", "forget"] | None:
    """Whether ``text`` asks, in so many words, to remember something or to forget something.

    A question ("do you remember …?") is neither, and neither is a request without a subject
    ("forget it", "never mind"): those are small talk.
    """
    stripped = text.strip()
    if not stripped or stripped.endswith("?"):
        return None
    if _REMEMBER.match(stripped):
        return "remember"
    if forget_subject(stripped) is not None:
        return "forget"
    return None


def forget_subject(text: str) -> str | None:
    """What a request to forget names ("delete what I said about the plumber" -> "the plumber"),
    or ``None`` when ``text`` is no such request or names nothing ("forget it").

    "Forget …" (and "don't remember …") is always a request to the memory. "Delete", "erase",
    "wipe", "remove" and "clear" are one only when they name what the user told it ("what I said
    about …", "the note about …", "… from your memory"): an imperative about a thing in the world
    ("delete the draft email to John", "wipe the staging server") is meant for a tool and deletes
    nothing.
    """
    match = _FORGET.match(text.strip())
    if match is None:
        return None
    named = match.group("subject").strip()
    if match.group("delete") and not _ABOUT_MEMORY.search(named):
        return None  # an imperative about a thing in the world, meant for a tool
    named = re.sub(r"\s+from\s+(?:your|the|my)\s+(?:memory|memories|notes)\b", "", named, flags=re.IGNORECASE)
    subject = _SUBJECT_LEAD.sub("", named).strip(" .!,;:")
    return subject if content_words(subject) else None


@dataclass(frozen=True)
class WriteBackModel:
    """A fitted write-back rule.

    :param mean: ``std``: feature standardisation, from the fitting data.
    :param weight: ``bias``: the logistic regression over standardised features.
    :param archive_threshold: importance at or above which a turn is archived now.
    :param window_threshold: importance below which a turn is content-free (window only, never
        stored); between the two thresholds a turn is deferred (stored when it leaves the window).
    :param eager_threshold: importance at or above which an archived turn's fragment is encoded
        at once; a less important one is encoded when it is first recalled.
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    weight: tuple[float, ...]
    bias: float
    archive_threshold: float
    window_threshold: float
    eager_threshold: float

    @classmethod
    def bundled(cls) -> WriteBackModel:
        """The rule shipped with the package."""
        data = json.loads(resources.files(__package__).joinpath("writeback_model.json").read_text(encoding="utf-8"))
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> WriteBackModel:
        """A rule from its stored form (what ``benchmarks/writeback.py --fit`` writes).

        :raises KeyError: a field is missing; ``ValueError``: the feature count does not match.
        """
        model = cls(
            mean=tuple(float(v) for v in data["mean"]),
            std=tuple(float(v) for v in data["std"]),
            weight=tuple(float(v) for v in data["weight"]),
            bias=float(data["bias"]),
            archive_threshold=float(data["archive_threshold"]),
            window_threshold=float(data["window_threshold"]),
            eager_threshold=float(data["eager_threshold"]),
        )
        if not len(model.mean) == len(model.std) == len(model.weight) == len(FEATURES):
            raise ValueError(f"a write-back rule needs {len(FEATURES)} features, this one has {len(model.weight)}")
        return model

    def importance_of_features(self, features: Sequence[float]) -> float:
        """The probability that a turn with these raw features carries something to recall.

        A turn without a single content word carries nothing, whatever else it has: 0.
        """
        if features[FEATURES.index("log content words")] == 0.0:
            return 0.0
        z = self.bias + sum(
            w * (f - m) / s for w, f, m, s in zip(self.weight, features, self.mean, self.std, strict=True)
        )
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def importance(self, text: str, previous: str = "") -> float:
        """The probability that the turn ``text`` carries something to recall (its memory's importance)."""
        return self.importance_of_features(turn_features(text, previous))

    def decide(self, importance: float) -> Decision:
        """``"archive"``, ``"defer"`` or ``"window"`` for a turn of this importance."""
        if importance >= self.archive_threshold:
            return "archive"
        return "window" if importance < self.window_threshold else "defer"
