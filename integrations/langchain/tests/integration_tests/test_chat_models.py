"""ChatKVShift on the bundled model: LangChain's standard integration tests, and what reuse promises."""

from __future__ import annotations

import itertools

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from kvshift_memory import InvalidInputError
from langchain_kvshift import ChatKVShift

SYSTEM = (
    "You are a travel assistant for a small team planning trips to Lisbon, Porto and Madrid. "
    "Budgets are in euros; dates are in European format; answer in one or two sentences."
)
_unique = itertools.count()


class TestChatKVShiftIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatKVShift]:
        return ChatKVShift

    @property
    def chat_model_params(self) -> dict:
        return {"max_tokens": 64, "temperature": 0}  # room for a tool call with its tags

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine holds one model's weights and K/V: another model is another instance

    @property
    def supports_json_mode(self) -> bool:
        return True  # with_structured_output(method="json_mode"): any JSON object, under a grammar

    @property
    def supported_usage_metadata_details(self) -> dict:
        details = ["cache_read_input", "cache_creation_input"]
        return {"invoke": details, "stream": details}

    @pytest.mark.xfail(
        reason="with tool_choice='auto' the 135M model answers in text rather than call the tool (it did for 3 of "
        "3 weather questions); forced choices ('any', a name) are tested above and pass"
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(
        reason="json_mode constrains the answer to any JSON object: the 135M model left out a key the prompt asked "
        "for ('punchline'); method='json_schema' (the default, tested above) enforces the keys"
    )
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVShift(**self.chat_model_params)
        history = [SystemMessage(SYSTEM), HumanMessage("Which cities are we visiting?")]
        first = llm.invoke(history)
        follow_up = [*history, first, HumanMessage("Which one is in Spain?")]
        message = _collect(llm, follow_up) if stream else llm.invoke(follow_up)
        assert message.usage_metadata["input_token_details"]["cache_read"] > 0  # the first turn was reused
        return message

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVShift(**self.chat_model_params)
        never_seen = [SystemMessage(f"{SYSTEM} Request {next(_unique)}."), HumanMessage("Hello")]
        message = _collect(llm, never_seen) if stream else llm.invoke(never_seen)
        assert message.usage_metadata["input_token_details"]["cache_creation"] > 0
        return message


def _collect(llm: ChatKVShift, messages) -> AIMessage:
    full = None
    for chunk in llm.stream(messages):
        full = chunk if full is None else full + chunk
    return full


def test_a_conversation_reads_most_of_each_prompt_from_the_cache():
    llm = ChatKVShift(max_tokens=24)
    history = [SystemMessage(SYSTEM)]
    for turn, question in enumerate(
        [
            "Which cities are we visiting?",
            "What currency is the budget in?",
            "How are dates written?",
            "Which city is in Spain?",
        ]
    ):
        history.append(HumanMessage(question))
        reply = llm.invoke(history)
        history.append(reply)
        usage = reply.usage_metadata
        details = usage["input_token_details"]
        assert details["cache_read"] + details["cache_creation"] == usage["input_tokens"]
        if turn:  # everything but the new question and its template tokens came from the cache
            assert details["cache_read"] >= 0.8 * usage["input_tokens"], usage
        assert reply.response_metadata["reuse_stats"]["reused_tokens"] == details["cache_read"]


def test_exact_reuse_answers_as_full_recompute():
    reusing, recomputing = ChatKVShift(max_tokens=20, reuse="prefix"), ChatKVShift(max_tokens=20, reuse="none")
    history = [SystemMessage(SYSTEM)]
    for question in ["Which cities are we visiting?", "Which one is in Spain?"]:
        history.append(HumanMessage(question))
        reply, baseline = reusing.invoke(history), recomputing.invoke(history)
        assert reply.content == baseline.content
        history.append(reply)


def test_a_stream_closed_early_leaves_the_model_usable():
    llm = ChatKVShift(max_tokens=24)
    stream = llm.stream("Tell me about Lisbon.")
    next(stream)
    stream.close()
    assert llm.invoke("Tell me about Lisbon.").content


def _guess_code(attacker: ChatKVShift, length: int) -> str:
    """The prompt-cache side channel: the guess whose prompt reads the most cached tokens shares
    the longest prefix with a prompt the engine has seen."""
    known = ""
    for _ in range(length):
        reads = {}
        for digit in "0123456789":
            message = attacker.invoke([HumanMessage(f"My door code is {known}{digit}")])
            reads[digit] = message.usage_metadata["input_token_details"]["cache_read"]
        known += max(reads, key=reads.get)
    return known


def test_one_user_cannot_read_anothers_prompt_from_cache_reads():
    import random

    rng = random.Random(21)
    for run in range(3):
        code = "".join(rng.choice("123456789") for _ in range(4))
        victim = ChatKVShift(max_tokens=1, user_id=f"alice-{run}")
        victim.invoke([HumanMessage(f"My door code is {code}, keep it safe.")])
        guessed = _guess_code(ChatKVShift(max_tokens=1, user_id=f"mallory-{run}"), len(code))
        assert sum(a == b for a, b in zip(guessed, code, strict=False)) <= 1, (code, guessed)
        # the same attack inside the victim's own namespace reads the code back: the channel is real
        assert _guess_code(ChatKVShift(max_tokens=1, user_id=f"alice-{run}"), len(code)) == code


def test_a_langgraph_thread_continued_after_a_restart_restores_its_kv_from_the_store(tmp_path):
    """A thread's history comes back from the checkpointer (shared by the workers); its K/V from the
    store the model was given: the new process prefills only the new message."""
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    from kvshift_memory import KVShiftEngine, MemoryStore

    checkpointer, thread = InMemorySaver(), {"configurable": {"thread_id": "t1"}}

    def worker(store):  # a process of its own: a new engine, nothing cached
        engine = KVShiftEngine.from_pretrained()
        return engine, create_agent(
            model=ChatKVShift(engine=engine, store=store, user_id="alice", max_tokens=24),
            tools=[],
            system_prompt=SYSTEM,
            checkpointer=checkpointer,
        )

    with MemoryStore(tmp_path / "store") as store:
        engine, agent = worker(store)
        agent.invoke({"messages": [HumanMessage("Which cities are we visiting?")]}, thread)
        agent.invoke({"messages": [HumanMessage("What currency is the budget in?")]}, thread)
        engine.flush_chunks(timeout_s=60)
    with MemoryStore(tmp_path / "store") as store:
        _, agent = worker(store)
        state = agent.invoke({"messages": [HumanMessage("Which city is in Spain?")]}, thread)
    reply = state["messages"][-1]
    stats, usage = reply.response_metadata["reuse_stats"], reply.usage_metadata
    assert len(state["messages"]) == 6 and stats["restored_tokens"] > 0
    assert usage["input_token_details"]["cache_read"] >= 0.7 * usage["input_tokens"], usage


def test_a_model_device_and_dtype_are_picked_without_building_an_engine():
    from kvshift_memory import KVShiftEngine

    one = ChatKVShift(device="cpu", dtype="float32", max_tokens=8)
    other = ChatKVShift(device="cpu", dtype="float32", max_tokens=4, top_k=1)
    assert one.loaded_engine() is other.loaded_engine() is KVShiftEngine.shared(device="cpu", dtype="float32")
    tuned = ChatKVShift(device="cpu", dtype="float32", model_kwargs={"recompute_ratio": 0.25})
    assert tuned.loaded_engine() is not one.loaded_engine() and tuned.loaded_engine().settings.recompute_ratio == 0.25
    # top_k=1 samples the most likely token: the greedy answer, at any temperature
    question = "Name a city in Portugal."
    greedy = one.invoke(question).content
    assert ChatKVShift(temperature=1.5, top_k=1, seed=3, max_tokens=8).invoke(question).content == greedy
    assert ChatKVShift(temperature=1.5, seed=3, max_tokens=8).invoke(question, top_k=1).content == greedy
    with pytest.raises(InvalidInputError, match="cuda"):
        ChatKVShift(device="cuda:99").invoke(question)
    with pytest.raises(InvalidInputError, match="plain JSON"):
        ChatKVShift(model_kwargs={"pack_weights": object()}).invoke(question)
