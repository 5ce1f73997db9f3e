"""Structured output and tool calls on the bundled 135M model: every answer parses and validates."""

from __future__ import annotations

import runpy
from pathlib import Path

from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

from langchain_kvshift import ChatKVShift

CASES = runpy.run_path(str(Path(__file__).parents[4] / "tests" / "data" / "structured_cases.py"))["CASES"]


def test_structured_output_is_schema_valid_for_20_varied_prompts():
    llm = ChatKVShift(max_tokens=96)
    valid = 0
    for schema, text in CASES:
        answer = llm.with_structured_output(schema, include_raw=True).invoke(text)
        if answer["parsing_error"] is None and isinstance(answer["parsed"], schema):
            valid += 1
        else:
            print(schema.__name__, text, answer["raw"].content, answer["parsing_error"])
    assert valid == len(CASES) == 20


def test_a_tool_call_round_trip_reuses_the_call_it_made():
    @tool
    def convert_currency(amount: float, currency: str) -> str:
        """Convert an amount of euros into another currency."""
        return f"{amount * 1.1:.2f} {currency}"

    llm = ChatKVShift(max_tokens=64).bind_tools([convert_currency], tool_choice="any")
    question = HumanMessage("How much is 100 euros in dollars? Use the tool.")
    call = llm.invoke([question])
    assert [c["name"] for c in call.tool_calls] == ["convert_currency"]
    assert set(call.tool_calls[0]["args"]) == {"amount", "currency"}
    result = convert_currency.invoke(call.tool_calls[0])
    answer = (
        ChatKVShift(max_tokens=32).bind_tools([convert_currency], tool_choice="none").invoke([question, call, result])
    )
    assert answer.content and not answer.tool_calls
    details = answer.usage_metadata["input_token_details"]
    # the call came back as the model wrote it: the previous prompt and the call were read from cache,
    # up to where the model split the call's text into other tokens than the tokenizer does ('"}' '}'
    # against '"' '}}')
    assert details["cache_read"] >= call.usage_metadata["input_tokens"] + call.usage_metadata["output_tokens"] // 2
