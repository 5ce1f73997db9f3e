"""ChatKVShift without a model: LangChain's standard unit tests, message conversion, bad input."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_tests.unit_tests import ChatModelUnitTests

import kvshift_memory.engine.engine as engine_module
from kvshift_memory import InvalidInputError
from langchain_kvshift import ChatKVShift, chat_models


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
        (ToolMessage("42", tool_call_id="call-1"), "tool"),
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
    with pytest.raises(InvalidInputError, match="tools"):
        llm._options(None, {"tools": []})
    options = llm._options(["\n\n"], {"max_tokens": 5, "model": chat_models.BUNDLED_MODEL})
    assert options["max_new_tokens"] == 5 and options["stop"] == ["\n\n"]
    assert llm._get_ls_params(stop=["x"], max_tokens=5)["ls_max_tokens"] == 5


def test_markers_never_reach_the_engine_without_a_store():
    marked = "Human: hi\n⟦mem:a@1⟧The budget is 50k.⟦/mem⟧\nHuman: and?"
    unresolved = chat_models.to_engine_messages([SystemMessage(marked), HumanMessage(marked), AIMessage(marked)])
    assert all("⟦" not in m["content"] and "memories" not in m for m in unresolved)
