"""Constrained decoding: answers follow a JSON schema, a regular expression or a Lark grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvshift_memory import Grammar, InvalidInputError
from kvshift_memory.engine.decoding import penalise_repeats

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "mood": {"enum": ["sunny", "rainy"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "mood", "days"],
    "additionalProperties": False,
}


@pytest.mark.model
def test_an_answer_follows_a_json_schema(bundled_engine):
    result = bundled_engine.generate(
        "Plan a trip to Lisbon as JSON.", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=64
    )
    answer = json.loads(result.text)
    assert set(answer) == {"city", "mood", "days"} and answer["mood"] in ("sunny", "rainy")
    assert isinstance(answer["days"], int) and result.finish_reason == "stop"


@pytest.mark.model
def test_an_answer_follows_a_regular_expression_and_streams_the_same(bundled_engine):
    grammar = Grammar.regex(r"[0-9]{3}-[A-Z]{2}")
    result = bundled_engine.generate("Give me a code.", grammar=grammar, max_new_tokens=16)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2}", result.text) and result.finish_reason == "stop"
    streamed = "".join(bundled_engine.generate("Give me a code.", grammar=grammar, max_new_tokens=16, stream=True))
    assert streamed == result.text


@pytest.mark.model
def test_a_lark_grammar_and_reuse_do_not_change_the_answer(bundled_engine):
    grammar = Grammar.lark('start: "The answer is " ANSWER "."\nANSWER: "yes" | "no"')
    question = [{"role": "system", "content": "Answer yes or no."}, {"role": "user", "content": "Is Porto in Spain?"}]
    answers = {
        reuse: bundled_engine.generate(question, grammar=grammar, reuse=reuse, max_new_tokens=16).text
        for reuse in ("none", "prefix")
    }
    assert answers["none"] == answers["prefix"] and answers["none"] in ("The answer is yes.", "The answer is no.")


@pytest.mark.model
def test_an_answer_cut_by_the_token_budget_says_so(bundled_engine):
    result = bundled_engine.generate("Plan a trip.", grammar=Grammar.json_schema(SCHEMA), max_new_tokens=3)
    assert result.finish_reason == "length" and len(result.token_ids) == 3


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "object"}
    node = schema
    for _ in range(depth):
        node["properties"] = {"x": {"type": "object"}}
        node = node["properties"]["x"]
    return schema


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: Grammar.json_schema("{not json"), "not JSON"),
        (lambda: Grammar.json_schema([1, 2]), "JSON object"),
        (lambda: Grammar.json_schema({"type": "objekt"}), "cannot be compiled|not a grammar"),
        (lambda: Grammar.regex("(unclosed"), "not a grammar"),
        (lambda: Grammar.regex(42), "string"),
        (lambda: Grammar.lark("start: ??? nothing"), "not a grammar"),
        (lambda: Grammar.lark(None), "string"),
        (lambda: Grammar.lark("start: " + '"a" ' * 400_000), "over the limit"),
        (lambda: Grammar.json_schema({"description": "x" * 1_100_000}), "over the limit"),
        (lambda: Grammar.json_schema('{"properties": {"x": ' * 2000 + "{}" + "}}" * 2000), "nested too deeply"),
        (lambda: Grammar.json_schema(_nested_schema(2000)), "nested too deeply"),
    ],
)
def test_bad_grammars_are_clear_errors(build, match):
    with pytest.raises(InvalidInputError, match=match):
        build()


@pytest.mark.model
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"grammar": "[0-9]+"}, "kvshift_memory.Grammar"),
        ({"repetition_penalty": 0.5}, "repetition_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"repetition_penalty": "high"}, "repetition_penalty"),
    ],
)
def test_bad_decoding_options_are_refused(bundled_engine, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        bundled_engine.generate("hi", max_new_tokens=2, **kwargs)


def test_only_the_answers_own_tokens_are_penalised():
    logits = torch.tensor([2.0, -2.0, 4.0, 1.0])
    assert torch.equal(penalise_repeats(logits, [0, 1, 0], 2.0), torch.tensor([1.0, -4.0, 4.0, 1.0]))
    assert penalise_repeats(logits, [], 2.0) is logits and penalise_repeats(logits, [0], 1.0) is logits
