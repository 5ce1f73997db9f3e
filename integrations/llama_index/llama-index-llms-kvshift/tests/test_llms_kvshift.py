"""KVShiftLLM on the bundled model: a LlamaIndex chat engine that reuses each turn, streaming, async."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.llms import ChatMessage
from llama_index.core.memory import ChatMemoryBuffer

from kvshift_memory import InvalidInputError
from llama_index.llms.kvshift import KVShiftLLM

pytestmark = pytest.mark.model  # every test drives the bundled model

QUESTIONS = [
    "I am planning a team trip to Lisbon with a budget of 50k euros.",
    "Which city are we going to?",
    "What is the budget?",
    "Suggest one thing to do there.",
    "Thanks, that is all.",
]


def _engine_chat(llm: KVShiftLLM) -> tuple[SimpleChatEngine, list]:
    """A chat engine (with a memory counting the model's own tokens: the default downloads
    tiktoken's vocabulary) and the reuse stats of each of its calls."""
    memory = ChatMemoryBuffer.from_defaults(
        token_limit=4000, tokenizer_fn=lambda text: [0] * llm.engine.count_tokens(text)
    )
    seen: list = []
    original = llm.chat

    def chat(messages, **kwargs):
        response = original(messages, **kwargs)
        seen.append(response.raw["reuse_stats"])
        return response

    object.__setattr__(llm, "chat", chat)
    return SimpleChatEngine.from_defaults(
        llm=llm, memory=memory, system_prompt="You are a brief travel assistant."
    ), seen


def test_a_chat_engine_reads_each_turn_from_the_cache():
    chat, seen = _engine_chat(KVShiftLLM(max_tokens=24))
    for question in QUESTIONS:
        assert chat.chat(question).response
    # the whole previous prompt, and its reply, read from the cache
    for before, now in itertools.pairwise(seen):
        assert now["reused_tokens"] >= before["prompt_tokens"] + before["generated_tokens"] - 1, (before, now)
    shares = [stats["reused_tokens"] / stats["prompt_tokens"] for stats in seen]
    print("share of each prompt read from the cache:", " ".join(f"{share:.0%}" for share in shares))  # -s shows it


def test_exact_reuse_answers_as_full_recompute():
    reusing, _ = _engine_chat(KVShiftLLM(max_tokens=24, reuse="prefix"))
    recomputing, _ = _engine_chat(KVShiftLLM(max_tokens=24, reuse="none"))
    for question in QUESTIONS[:3]:
        assert reusing.chat(question).response == recomputing.chat(question).response


def test_streaming_and_async_give_the_same_text():
    llm = KVShiftLLM(max_tokens=16)
    messages = [ChatMessage(role="user", content="Name a city in Portugal.")]
    whole = llm.chat(messages).message.content
    streamed = list(llm.stream_chat(messages))
    assert "".join(r.delta for r in streamed) == whole and streamed[-1].raw["reuse_stats"]["generated_tokens"] > 0
    assert asyncio.run(llm.achat(messages)).message.content == whole
    assert asyncio.run(llm.acomplete("Name a city in Portugal.")).text == llm.complete("Name a city in Portugal.").text

    async def collect() -> str:
        return "".join([r.delta async for r in await llm.astream_chat(messages)])

    assert asyncio.run(collect()) == whole


def test_async_streaming_leaves_the_event_loop_free():
    llm = KVShiftLLM(max_tokens=48)
    messages = [ChatMessage(role="user", content="Describe Lisbon in a few sentences.")]
    llm.chat(messages)  # the engine loaded; the streamed call below reuses the prompt and decodes

    async def run() -> tuple[int, float, str]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        started = asyncio.get_running_loop().time()
        text = "".join([r.delta async for r in await llm.astream_chat(messages)])
        elapsed = asyncio.get_running_loop().time() - started
        done.set()
        await task
        return ticks, elapsed, text

    ticks, elapsed, text = asyncio.run(run())
    print(f"ticks {ticks} of {elapsed / 0.01:.0f} expected")
    assert text and ticks >= 0.5 * elapsed / 0.01, (ticks, elapsed)


def test_an_async_stream_closed_early_stops_the_generation():
    llm = KVShiftLLM(max_tokens=64)
    messages = [ChatMessage(role="user", content="Count from one to fifty in words.")]

    async def first_piece() -> str:
        stream = await llm.astream_complete("Count from one to fifty in words.")
        piece = await anext(stream)
        await stream.aclose()
        return piece.delta

    assert asyncio.run(first_piece())
    assert llm.chat(messages).message.content  # the engine is free again


def test_async_calls_fire_their_callback_events_once():
    from llama_index.core.callbacks import CallbackManager, LlamaDebugHandler

    handler = LlamaDebugHandler()
    llm = KVShiftLLM(max_tokens=8, callback_manager=CallbackManager([handler]))
    messages = [ChatMessage(role="user", content="Name a city in Spain.")]
    asyncio.run(llm.achat(messages))
    asyncio.run(llm.acomplete("Name a city in Spain."))
    assert len(handler.get_llm_inputs_outputs()) == 2


def test_roles_the_engine_cannot_read_are_refused():
    for role in ("function", "chatbot"):
        with pytest.raises(InvalidInputError, match=role):
            KVShiftLLM().chat([ChatMessage(role=role, content="42")])


def test_a_model_device_and_dtype_are_picked_without_building_an_engine():
    from kvshift_memory import KVShiftEngine

    llm = KVShiftLLM(device="cpu", dtype="float32", max_tokens=8)
    assert llm.engine is KVShiftEngine.shared(device="cpu", dtype="float32")
    question = "Name a city in Portugal."
    greedy = llm.complete(question).text
    assert (
        KVShiftLLM(device="cpu", dtype="float32", max_tokens=8, temperature=1.5, top_k=1).complete(question).text
        == greedy
    )
    with pytest.raises(InvalidInputError, match="cuda"):
        KVShiftLLM(device="cuda:99").complete(question)
