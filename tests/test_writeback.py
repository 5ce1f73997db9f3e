"""The write-back rule: the bundled model, its features, its decisions and explicit requests."""

import json
import math
from pathlib import Path

import pytest

from kvshift_memory.agent.writeback import (
    FEATURES,
    WriteBackModel,
    content_words,
    explicit_request,
    forget_subject,
    turn_features,
)

FIT_TURNS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "fit_turns.txt"


def test_features_are_the_documented_ones():
    features = dict(
        zip(FEATURES, turn_features("I moved to Lisbon in 2023, my new job starts Monday.", "Where now?"), strict=True)
    )
    assert features["log words"] == pytest.approx(math.log1p(11))
    assert features["has a digit"] == 1.0 and features["first person"] == 1.0 and features["answers a question"] == 1.0
    assert features["is a question"] == 0.0
    assert features["sqrt capitalised words inside a sentence"] == pytest.approx(2**0.5)  # Lisbon, Monday
    assert content_words("ok thanks, haha that's so true") == []
    assert content_words("My cat Miso is 12") == ["cat", "miso", "12"]


def test_the_bundled_rule_archives_a_fact_and_keeps_small_talk_in_the_window():
    model = WriteBackModel.bundled()
    fact = model.importance("I'm allergic to sesame, even a little makes my throat swell.")
    for chat in ("ok thanks", "haha", "good morning!", "👍"):
        assert model.decide(model.importance(chat)) == "window", chat
        assert model.importance(chat) < fact
    assert model.decide(fact) == "archive"
    assert model.window_threshold <= model.archive_threshold


def test_the_bundled_rule_is_the_one_the_fitting_data_gives():
    # the shipped numbers come from benchmarks/writeback.py --fit; its fitting file must still
    # be the one they were fitted on: every fact of it is archived, most small talk is not
    model = WriteBackModel.bundled()
    rows = [
        line.split(" ", 1) for line in FIT_TURNS.read_text(encoding="utf-8").splitlines() if line[:2] in ("F ", "S ")
    ]
    facts = [model.decide(model.importance(text)) for kind, text in rows if kind == "F"]
    talk = [model.decide(model.importance(text)) for kind, text in rows if kind == "S"]
    assert sum(d == "archive" for d in facts) / len(facts) >= 0.95
    assert sum(d != "window" for d in talk) / len(talk) <= 0.2


def test_decisions_follow_the_thresholds():
    model = WriteBackModel.bundled()
    assert model.decide(model.archive_threshold) == "archive"
    assert model.decide(model.window_threshold) in ("defer", "archive")
    assert model.decide(model.window_threshold - 1e-9) == "window"


def test_a_rule_with_the_wrong_feature_count_is_refused():
    data = json.loads(json.dumps(vars(WriteBackModel.bundled())))
    data["weight"] = data["weight"][:-1]
    with pytest.raises(ValueError, match="features"):
        WriteBackModel.from_dict(data)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Remember: my passport expires in August 2027.", "remember"),
        ("remember that my car is a grey Skoda", "remember"),
        ("Please remember I park on level 3", "remember"),
        ("don't forget I take my coffee with oat milk", "remember"),
        ("Note that the deadline moved to the 14th.", "remember"),
        ("ok, keep in mind that I hate coriander", "remember"),
        ("Do you remember my car?", None),
        ("I don't remember where I parked", None),
        ("I always forget my keys", None),
        ("Forget my door code.", "forget"),
        ("please delete what I said about the plumber", "forget"),
        ("forget everything I told you about Marta", "forget"),
        ("forget it, not important", None),
        ("forget it", None),
        ("never mind", None),
        ("Forget the plumber?", None),
        ("", None),
    ],
)
def test_explicit_requests_are_recognised(text, expected):
    assert explicit_request(text) == expected


def test_a_request_to_forget_names_its_subject():
    assert forget_subject("please delete what I said about the plumber") == "the plumber"
    assert forget_subject("Forget my door code.") == "my door code"
    assert forget_subject("forget that") is None


@pytest.mark.parametrize("text", ["", " ", "\x00" * 10, "word " * 50_000, "🙂" * 1000, "forget " * 10_000, "remember"])
def test_any_text_gets_an_importance_and_a_request_answer(text):
    importance = WriteBackModel.bundled().importance(text, text)
    assert 0.0 <= importance <= 1.0
    assert explicit_request(text) in (None, "remember", "forget")
