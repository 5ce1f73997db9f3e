"""ChatKVShift without a model: LangChain's standard unit tests, message conversion, bad input."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, FunctionMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

import kvshift_memory.engine.engine as engine_module
from kvshift_memory import InvalidInputError, inputs
from kvshift_memory.chat_turns import as_text_turns
from langchain_kvshift import ChatKVShift, chat_models, tool_calls


class TestChatKVShiftUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatKVShift]:
        return ChatKVShift

    @property
    def chat_model_params(self) -> dict:
        return {"temperature": 0}

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine holds one model's weights and K/V: another model is another instance

    @pytest.mark.xfail(
        strict=True,
        reason="load(allowed_objects='all') admits only the classes in langchain-core's own mapping; "
        "ChatKVShift loads with allowed_objects=[ChatKVShift] "
        "(test_settings_round_trip_through_langchain_serialisation)",
    )
    def test_serdes(self, model, snapshot) -> None:
        super().test_serdes(model, snapshot)


def test_constructing_loads_no_engine():
    before = dict(engine_module._SHARED)
    llm = ChatKVShift(max_tokens=8, stop=["\n"], reuse="prefix")
    assert engine_module._SHARED == before and llm.engine is None
    assert llm.model_name == chat_models.BUNDLED_MODEL


def test_system_messages_are_joined_first_and_text_blocks_read():
    messages = [
        SystemMessage("Be brief."),
        HumanMessage([{"type": "text", "text": "Where is "}, "Porto?"]),
        AIMessage("In Portugal."),
        SystemMessage("Answer in English."),
        HumanMessage("And Lisbon?"),
    ]
    assert chat_models.to_engine_messages(messages) == [
        {"role": "system", "content": "Be brief.\n\nAnswer in English."},
        {"role": "user", "content": "Where is Porto?"},
        {"role": "assistant", "content": "In Portugal."},
        {"role": "user", "content": "And Lisbon?"},
    ]


@pytest.mark.parametrize(
    "message, match",
    [
        (FunctionMessage("42", name="lookup"), "function"),
        (HumanMessage([{"type": "image", "url": "https://example.com/cat.png"}]), "image"),
        (HumanMessage([{"type": "text", "text": 3}]), "text"),
    ],
)
def test_what_the_engine_cannot_read_is_refused_clearly(message, match):
    with pytest.raises(InvalidInputError, match=match):
        chat_models.to_engine_messages([message])


def test_call_options_are_checked_before_any_model_work():
    llm = ChatKVShift()
    with pytest.raises(InvalidInputError, match="per-call model"):
        llm._options(None, {"model": "gpt2"})
    with pytest.raises(InvalidInputError, match="functions"):
        llm._options(None, {"functions": []})
    options = llm._options(["\n\n"], {"max_tokens": 5, "model": chat_models.BUNDLED_MODEL})
    assert options["max_new_tokens"] == 5 and options["stop"] == ["\n\n"]
    assert llm._get_ls_params(stop=["x"], max_tokens=5)["ls_max_tokens"] == 5


def test_markers_never_reach_the_engine_without_a_store():
    marked = "Human: hi\n⟦mem:a@1⟧The budget is 50k.⟦/mem⟧\nHuman: and?"
    unresolved = chat_models.to_engine_messages([SystemMessage(marked), HumanMessage(marked), AIMessage(marked)])
    assert all("⟦" not in m["content"] and "memories" not in m for m in unresolved)


def test_tool_calls_and_results_reach_the_engine_as_calls_and_tool_messages():
    call = {"name": "magic_function", "args": {"input": 3}, "id": "call_1", "type": "tool_call"}
    messages = [
        HumanMessage("What is magic_function(3)?"),
        AIMessage("", tool_calls=[call]),
        ToolMessage("5", tool_call_id="call_1"),
        ToolMessage("7", tool_call_id="call_2", name="magic_function"),
        ToolMessage("9", tool_call_id="x" * 300),  # an id the engine cannot take is left out, the result kept
    ]
    turns = chat_models.to_engine_messages(messages)
    assert turns[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "magic_function", "arguments": {"input": 3}, "id": "call_1"}],
    }
    assert turns[2:] == [
        {"role": "tool", "content": "5", "tool_call_id": "call_1"},
        {"role": "tool", "content": "7", "tool_call_id": "call_2", "name": "magic_function"},
        {"role": "tool", "content": "9"},
    ]
    # a template without tools of its own (the bundled model's) gets them as text, results sharing one turn
    text_turns = as_text_turns(inputs.check_messages(turns), [])
    assert (
        text_turns[1]["content"] == '<tool_call>\n{"name": "magic_function", "arguments": {"input": 3}}\n</tool_call>'
    )
    assert text_turns[2] == {
        "role": "user",
        "content": "\n".join(f"<tool_response>\n{n}\n</tool_response>" for n in (5, 7, 9)),
    }
    text, calls = tool_calls.parse_tool_calls("Sure.\n" + text_turns[1]["content"])
    assert text == "Sure." and [(c["name"], c["args"]) for c in calls] == [("magic_function", {"input": 3})]
    assert calls[0]["id"].startswith("call_")


def test_a_call_in_llama_31s_format_is_read_for_that_layout_only():
    text = '{"name": "magic_function", "parameters": {"input": 3}}'
    answer, calls = tool_calls.parse_tool_calls(text, "llama-json")
    assert answer == "" and [(c["name"], c["args"]) for c in calls] == [("magic_function", {"input": 3})]
    assert tool_calls.parse_tool_calls(text) == (text, [])  # our layout reads tagged calls only
    for other in ("It is sunny.", '{"parameters": {}}', "[1, 2]", "{not json"):
        assert tool_calls.parse_tool_calls(other, "llama-json") == (other, [])
    with pytest.raises(InvalidInputError, match="layout"):
        tool_calls.tool_call_grammar([], None, layout="mistral")


def test_a_block_that_is_not_a_call_stays_text():
    for body in ("not json", '["a list"]', '{"arguments": {}}'):
        text = f"<tool_call>\n{body}\n</tool_call>"
        assert tool_calls.parse_tool_calls(text) == (text, [])


def test_schemas_are_closed_unless_they_say_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "tags": {"type": "array", "items": {"type": "object", "properties": {}}},
            "extra": {"type": "object", "additionalProperties": True},
        },
    }
    closed = tool_calls.closed_schema(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["type"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]["type"]["properties"]["x"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tool_choice": "any"}, "tool_choice without tools"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema", "schema": {"type": "objekt"}}}, "schema"),
    ],
)
def test_bad_tool_and_format_options_are_refused_before_any_model_work(kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        ChatKVShift()._prompt([HumanMessage("hi")], dict(kwargs))


def test_bind_tools_refuses_what_it_cannot_honour():
    with pytest.raises(InvalidInputError, match="names none of the bound tools"):
        ChatKVShift().bind_tools([{"type": "function", "function": {"name": "a", "parameters": {}}}], tool_choice="b")
    with pytest.raises(InvalidInputError, match="JSON schema"):
        ChatKVShift().bind_tools([42])
    with pytest.raises(InvalidInputError, match="method"):
        ChatKVShift().with_structured_output({"type": "object"}, method="xml")


def test_identifying_params_hold_every_setting_that_changes_an_answer_and_the_tenant():
    base = ChatKVShift()._identifying_params
    for field, value in [
        ("top_p", 0.5),
        ("seed", 3),
        ("stop", ["\n"]),
        ("recompute_ratio", 0.2),
        ("user_id", "alice"),
        ("session_id", "s1"),
    ]:
        assert ChatKVShift(**{field: value})._identifying_params != base, field


def test_profile_is_known_without_loading_weights():
    before = dict(engine_module._SHARED)
    assert ChatKVShift().profile["max_input_tokens"] == 8192
    assert ChatKVShift(model="gemma-3-270m").profile["max_input_tokens"] == 32768
    assert ChatKVShift(model="/nowhere/at/all").profile is None
    assert engine_module._SHARED == before


def test_settings_round_trip_through_langchain_serialisation():
    """The call docs/integrations.md shows, run as written there."""
    import re
    from pathlib import Path

    docs = (Path(__file__).parents[4] / "docs" / "integrations.md").read_text(encoding="utf-8")
    [block] = [b for b in re.findall(r"^```python\n(.*?)^```", docs, flags=re.S | re.M) if "dumpd(" in b]
    namespace: dict = {}
    exec(compile(block, "docs/integrations.md", "exec"), namespace)  # our own documentation, run as a user would
    llm, loaded = namespace["llm"], namespace["loaded"]
    assert isinstance(loaded, ChatKVShift) and loaded._identifying_params == llm._identifying_params


def test_reply_token_ids_go_along_only_when_they_could_be_ids():
    def sent(ids):
        message = AIMessage("Porto.", response_metadata={"token_ids": ids})
        return chat_models.to_engine_messages([HumanMessage("Where?"), message])[1].get("token_ids")

    assert sent([52, 1093, 30]) == [52, 1093, 30]  # the engine still checks they read back as the text
    for forged in ([-1], [True, 2], ["52"], [1.0], list(range(100)), [], "52", None, {"a": 1}):
        assert sent(forged) is None, forged
