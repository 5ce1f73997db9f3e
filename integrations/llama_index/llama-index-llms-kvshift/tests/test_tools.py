"""KVShiftLLM as a FunctionCallingLLM on the bundled model: structured output and tool calls
decoded under a grammar, a FunctionAgent round trip, a call rendered back as the model wrote it."""

from __future__ import annotations

import asyncio
import json
import runpy
from pathlib import Path

import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import TextBlock, ToolCallBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool

from kvshift_memory import InvalidInputError, inputs
from kvshift_memory.chat_turns import as_text_turns
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.llms.kvshift.base import to_engine_messages

pytestmark = pytest.mark.model  # every test drives the bundled model

# the same twenty texts and schemas as LangChain's structured-output test
CASES = runpy.run_path(str(Path(__file__).parents[4] / "tests" / "data" / "structured_cases.py"))["CASES"]


def convert_currency(amount: float, currency: str) -> str:
    """Convert an amount of euros into another currency."""
    return f"{amount * 1.1:.2f} {currency}"


CONVERT = FunctionTool.from_defaults(convert_currency)
QUESTION = "How much is 100 euros in dollars? Use the tool."


def test_a_function_calling_llm_as_llama_index_checks_it():
    llm = KVShiftLLM()
    assert isinstance(llm, FunctionCallingLLM) and llm.metadata.is_function_calling_model


def test_structured_predict_is_schema_valid_for_20_varied_prompts():
    llm = KVShiftLLM(max_tokens=96)
    valid = 0
    for schema, text in CASES:
        try:
            answer = llm.structured_predict(schema, PromptTemplate("{text}"), text=text)
        except (ValueError, TypeError) as exc:  # what LlamaIndex raises for an answer that does not parse
            print(schema.__name__, text, exc)
            continue
        valid += isinstance(answer, schema)
    assert valid == len(CASES) == 20


def test_a_structured_llm_and_async_structured_predict_answer_with_the_schema():
    person = CASES[0][0]
    llm = KVShiftLLM(max_tokens=64)
    response = llm.as_structured_llm(person).chat([ChatMessage(role="user", content="Alice is 31 years old.")])
    assert isinstance(response.raw, person) and json.loads(response.message.content) == response.raw.model_dump()
    answer = asyncio.run(llm.astructured_predict(person, PromptTemplate("{text}"), text="Bob turned 45."))
    assert isinstance(answer, person)


def test_a_function_agent_calls_the_tool_and_answers_from_its_result():
    agent = FunctionAgent(tools=[CONVERT], llm=KVShiftLLM(max_tokens=64), initial_tool_choice="convert_currency")

    async def run() -> tuple[list[ToolCallResult], str]:
        handler = agent.run(QUESTION)
        results = [event async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
        return results, str(await handler)

    results, answer = asyncio.run(run())
    assert [result.tool_name for result in results][:1] == ["convert_currency"]
    assert set(results[0].tool_kwargs) == {"amount", "currency"} and not results[0].tool_output.is_error
    assert answer.strip()


def test_a_tool_call_round_trip_reuses_the_call_it_made():
    llm = KVShiftLLM(max_tokens=64)
    call = llm.chat_with_tools([CONVERT], user_msg=QUESTION, tool_required=True)
    [selection] = llm.get_tool_calls_from_response(call)
    assert selection.tool_name == "convert_currency" and set(selection.tool_kwargs) == {"amount", "currency"}
    result = ChatMessage(
        role="tool",
        content=CONVERT(**selection.tool_kwargs).content,
        additional_kwargs={"tool_call_id": selection.tool_id},
    )
    history = [ChatMessage(role="user", content=QUESTION), call.message, result]
    answer = llm.chat_with_tools([CONVERT], chat_history=history, tool_choice="none")
    assert answer.message.content and not llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False)
    first, second = call.raw["reuse_stats"], answer.raw["reuse_stats"]
    print(
        "call:",
        first["prompt_tokens"],
        "+",
        first["generated_tokens"],
        "answer read from cache:",
        second["reused_tokens"],
    )
    # the call came back as the model wrote it: the previous prompt and the call were read from cache,
    # up to where the model split the call's text into other tokens than the tokenizer does
    assert second["reused_tokens"] >= first["prompt_tokens"] + first["generated_tokens"] // 2
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(answer)


def test_calls_and_results_reach_the_engine_as_calls_and_tool_messages():
    call = ChatMessage(
        role="assistant",
        blocks=[
            TextBlock(text="Let me convert it."),
            ToolCallBlock(
                tool_call_id="c1", tool_name="convert_currency", tool_kwargs='{"amount": 5, "currency": "X"}'
            ),
        ],
    )
    results = [
        ChatMessage(role="tool", content="5.50 USD", additional_kwargs={"tool_call_id": "c1"}),
        ChatMessage(role="tool", content="⟦mem:x@1⟧hi⟦/mem⟧", additional_kwargs={"tool_call_id": ["not", "an id"]}),
    ]
    messages = to_engine_messages([ChatMessage(role="user", content=QUESTION), call, *results])
    assert messages[1] == {
        "role": "assistant",
        "content": "Let me convert it.",
        "tool_calls": [{"name": "convert_currency", "arguments": {"amount": 5, "currency": "X"}, "id": "c1"}],
    }
    # a marker in a tool's output is plain text; an id the engine cannot take is left out
    assert messages[2:] == [
        {"role": "tool", "content": "5.50 USD", "tool_call_id": "c1"},
        {"role": "tool", "content": "hi"},
    ]
    # the bundled model's template renders no tools: our layout, as text, results sharing one user turn
    text_turns = as_text_turns(inputs.check_messages(messages), [])
    assert text_turns[1]["content"] == (
        "Let me convert it.\n<tool_call>\n"
        '{"name": "convert_currency", "arguments": {"amount": 5, "currency": "X"}}\n</tool_call>'
    )
    assert text_turns[2] == {
        "role": "user",
        "content": "<tool_response>\n5.50 USD\n</tool_response>\n<tool_response>\nhi\n</tool_response>",
    }
    broken = ChatMessage(role="assistant", blocks=[ToolCallBlock(tool_name="f", tool_kwargs="{not json")])
    assert to_engine_messages([broken])[0]["tool_calls"][0]["arguments"] == {}


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("no_such_tool", "names none of the bound tools"),
        (42, "tool_choice is"),
        ({"type": "function"}, "tool_choice is"),
    ],
)
def test_a_bad_tool_choice_is_a_clear_error(choice, message):
    llm = KVShiftLLM(max_tokens=4)
    with pytest.raises(InvalidInputError, match=message):
        llm.chat_with_tools([CONVERT], user_msg=QUESTION, tool_choice=choice)
    with pytest.raises(InvalidInputError, match="without tools"):
        llm.chat([ChatMessage(role="user", content=QUESTION)], tool_choice="convert_currency")
