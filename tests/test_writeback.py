"""The write-back rule: the bundled model, its features and its decisions."""

import math

import pytest

from kvshift_memory.agent.writeback import FEATURES, WriteBackModel, turn_features


def test_features_are_the_documented_eight():
    features = turn_features("I moved to Lisbon in 2023, my new job starts Monday.", "Where do you live now?")
    assert len(features) == len(FEATURES) == 8
    assert features[1] == 1.0 and features[3] == 1.0 and features[6] == 1.0 and features[4] == 0.0
    assert features[0] == pytest.approx(math.log1p(11))  # words


def test_the_bundled_rule_ranks_a_fact_above_small_talk():
    model = WriteBackModel.bundled()
    fact = model.importance("I adopted a dog named Bruno from the shelter on 14 May, he is a beagle.", "Any news?")
    chat = model.importance("ok", "Thanks!")
    assert 0.0 < chat < fact < 1.0
    assert model.decide(fact) == "archive"
    assert model.decide(chat) in ("keep", "drop")
    assert model.drop_threshold < model.archive_threshold


def test_decisions_follow_the_thresholds():
    model = WriteBackModel.bundled()
    assert model.decide(model.archive_threshold) == "archive"
    assert model.decide(model.drop_threshold) == "keep"
    assert model.decide(model.drop_threshold - 1e-9) == "drop"


@pytest.mark.parametrize("text", ["", " ", "\x00" * 10, "word " * 50_000, "🙂" * 1000])
def test_any_text_gets_an_importance(text):
    importance = WriteBackModel.bundled().importance(text, text)
    assert 0.0 <= importance <= 1.0
