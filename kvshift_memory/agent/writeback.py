"""Write-back: after each turn, decide whether it is archived as a memory, kept in the window, or dropped.

The decision comes from a logistic regression over eight cheap features of the user's message and
the reply before it, fitted on LoCoMo's evidence labels (the turns later questions need) by
``benchmarks/writeback.py --fit``, which writes ``writeback_model.json`` next to this module. The
same script measures the shipped rule held out, a conversation at a time (see the README).
The file holds 18 fitted numbers, not data: LoCoMo itself (CC BY-NC 4.0) is never copied here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Literal

__all__ = ["FEATURES", "Decision", "WriteBackModel", "turn_features"]

Decision = Literal["archive", "keep", "drop"]

FEATURES = (
    "log words",
    "has a digit",
    "sqrt capitalised words",
    "first person",
    "is a question",
    "shares an image",
    "answers a question",
    "log words of the turn before",
)

_CAPITALISED = re.compile(r"\b[A-Z][a-z]+")
_FIRST_PERSON = re.compile(r"\b(I|I'm|I've|my|me|we|our)\b")


def turn_features(text: str, previous: str = "", shares_image: bool = False) -> list[float]:
    """The :data:`FEATURES` of a turn ``text`` that follows ``previous`` (raw, not standardised)."""
    return [
        math.log1p(len(text.split())),
        float(any(c.isdigit() for c in text)),
        len(_CAPITALISED.findall(text)) ** 0.5,
        float(bool(_FIRST_PERSON.search(text))),
        float(text.strip().endswith("?")),
        float(shares_image),
        float(previous.strip().endswith("?")),
        math.log1p(len(previous.split())),
    ]


@dataclass(frozen=True)
class WriteBackModel:
    """A fitted write-back rule.

    :param mean: ``std``: feature standardisation, from the fitting data.
    :param weight: ``bias``: the logistic regression over standardised features.
    :param archive_threshold: importance at or above which a turn is archived.
    :param drop_threshold: importance below which a turn is dropped (neither archived nor kept).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    weight: tuple[float, ...]
    bias: float
    archive_threshold: float
    drop_threshold: float

    @classmethod
    def bundled(cls) -> WriteBackModel:
        """The rule fitted on LoCoMo and shipped with the package."""
        data = json.loads(resources.files(__package__).joinpath("writeback_model.json").read_text(encoding="utf-8"))
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> WriteBackModel:
        return cls(
            mean=tuple(data["mean"]),
            std=tuple(data["std"]),
            weight=tuple(data["weight"]),
            bias=float(data["bias"]),
            archive_threshold=float(data["archive_threshold"]),
            drop_threshold=float(data["drop_threshold"]),
        )

    def importance_of_features(self, features: Sequence[float]) -> float:
        """The probability that a turn with these raw features is needed later."""
        z = self.bias + sum(w * (f - m) / s for w, f, m, s in zip(self.weight, features, self.mean, self.std))
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def importance(self, text: str, previous: str = "", shares_image: bool = False) -> float:
        """The probability that the turn ``text`` is needed later (stored as the memory's importance)."""
        return self.importance_of_features(turn_features(text, previous, shares_image))

    def decide(self, importance: float) -> Decision:
        """``"archive"`` (store it now), ``"keep"`` (window only) or ``"drop"`` (not even the window)."""
        if importance >= self.archive_threshold:
            return "archive"
        return "drop" if importance < self.drop_threshold else "keep"
