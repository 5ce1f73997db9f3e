# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # LlamaIndex: a chat engine whose long-term memory brings its K/V along
#
# `KVShiftLLM` is a LlamaIndex LLM over the engine; `KVShiftMemoryBlock` is a memory block of
# LlamaIndex's `Memory`: for each new user message it recalls the user's memories from every
# earlier session (in span markers, which `KVShiftLLM` resolves to the memories' stored K/V) and
# writes the message back when the write-back rule keeps it. `insert_method="user"` puts the
# recalled memories into the latest user message, so every earlier message of the prompt stays as
# it was and each turn reuses the previous one's cache. The conversation itself lives in
# `Memory`'s chat store (SQLite here, a file that survives a restart).
#
# On Monday Alice tells the assistant about her sister; on Tuesday, in a new session, she asks.

# %%
import tempfile
from pathlib import Path

import torch
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from llama_index.core.memory import Memory
from tqdm.auto import tqdm

from kvshift_memory import MemoryStore
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.memory.kvshift import KVShiftMemoryBlock

torch.set_num_threads(min(2, torch.get_num_threads()))
TURNS = [  # (session, message)
    ("monday", "My sister Ana lives in Porto and she is allergic to peanuts."),
    ("monday", "I am also learning to play the cello this winter."),
    ("monday", "Tell me one thing about the weather in Lisbon in March."),
    ("tuesday", "Where does my sister live?"),
    ("tuesday", "And what is my sister allergic to?"),
]


class ReuseStats(BaseEventHandler):
    """Keeps the engine's stats of each chat call (KVShiftLLM puts them in the response's raw)."""

    calls: list = []
    messages: list = []  # what each call sent the model

    @classmethod
    def class_name(cls) -> str:
        return "ReuseStats"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append(event.response.raw["reuse_stats"])
            self.messages.append(event.messages)


stats = ReuseStats()
get_dispatcher().add_event_handler(stats)

# %%
folder = Path(tempfile.mkdtemp())
store = MemoryStore(folder / "memories")
llm = KVShiftLLM(max_tokens=32, store=store, user_id="alice")
engines = {}
for session, message in tqdm(TURNS, desc="turns", leave=False):
    if session not in engines:  # a new session: a new Memory over the same chat database
        memory = Memory.from_defaults(
            session_id=session,
            token_limit=4000,
            memory_blocks=[KVShiftMemoryBlock(store=store, user_id="alice")],
            insert_method="user",
            async_database_uri=f"sqlite+aiosqlite:///{folder / 'chats.db'}",
        )
        engines[session] = SimpleChatEngine.from_defaults(
            llm=llm, memory=memory, system_prompt="You are a brief assistant."
        )
    print(f"[{session}] > {message}\n  {engines[session].chat(message).response.strip()[:120]}")

# %% [markdown]
# Per turn: the prompt, how much came from the cache, the recalled memories the model read, how
# many of them came as stored fragments, and the time to the first token. Tuesday's turns recall
# what Alice said on Monday. By default a recalled memory is recomputed with the question (on
# the bundled model every one: shifting them in was measured to change too many answers), so the
# answer is full recompute's while the earlier turns come from the cache;
# `KVShiftLLM(reuse="blend", recompute_ratio=0)` places the stored fragment as it is (the fastest,
# and it can change an answer).

# %%
print(f"{'turn':>4} {'prompt':>6} {'from cache':>11} {'memories':>8} {'as fragments':>12} {'TTFT':>7}")
for turn, s in enumerate(stats.calls, start=1):
    memories = s["fragments_hit"] + s["fragments_missed"] + s["fragments_recomputed"]
    print(
        f"{turn:>4} {s['prompt_tokens']:>6} {s['reused_tokens'] / s['prompt_tokens']:>10.0%} "
        f"{memories:>8} {s['fragments_hit']:>12} {s['ttft_s'] * 1000:>5.0f}ms"
    )
print(
    "\nTuesday's last message as the model was sent it (KVShiftLLM resolves the markers, the model never reads them):"
)
print(stats.messages[-1][-1].content)
store.close()
