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
# # LlamaIndex: a chat engine whose memory brings its K/V along
#
# `KVShiftLLM` is a LlamaIndex LLM over the engine; `KVShiftMemory` is the chat engine's memory:
# a window of recent turns, plus the user's memories each new message recalls from the store.
# After each reply the user's message is archived (when the write-back rule keeps it) and its
# K/V fragment encoded; a later turn that recalls it places the fragment instead of reading it.
#
# The window here is small (160 tokens), so the first turn has left it by the fifth and has to
# come back from the store.

# %%
import tempfile

import torch
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
from tqdm.auto import tqdm

from kvshift_memory import MemoryStore
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.memory.kvshift import KVShiftMemory

torch.set_num_threads(min(2, torch.get_num_threads()))
TURNS = [
    "My sister Ana lives in Porto and she is allergic to peanuts.",
    "I am also learning to play the cello this winter.",
    "Tell me one thing about the weather in Lisbon in March.",
    "Which bus should I take to get from the airport to the centre?",
    "Where does my sister live, and what is she allergic to?",
]


class ReuseStats(BaseEventHandler):
    """Keeps the engine's stats of each chat call (KVShiftLLM puts them in the response's raw)."""

    calls: list = []

    @classmethod
    def class_name(cls) -> str:
        return "ReuseStats"

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append(event.response.raw["reuse_stats"])


stats = ReuseStats()
get_dispatcher().add_event_handler(stats)

# %%
store = MemoryStore(tempfile.mkdtemp())
llm = KVShiftLLM(max_tokens=32, store=store, user_id="alice")
memory = KVShiftMemory.from_defaults(store=store, user_id="alice", session_id="winter", token_limit=160)
chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory, system_prompt="You are a brief assistant.")
for turn in tqdm(TURNS, desc="turns", leave=False):
    print(f"> {turn}\n  {chat.chat(turn).response.strip()[:120]}")

# %% [markdown]
# Per turn: the prompt, how much came from the cache (the previous turns, and recalled memories'
# fragments), and the memories placed from a stored fragment. The fifth turn recalls the first.

# %%
print(f"{'turn':>4} {'prompt':>6} {'from cache':>11} {'fragments hit':>13} {'TTFT':>7}")
for turn, s in enumerate(stats.calls, start=1):
    print(
        f"{turn:>4} {s['prompt_tokens']:>6} {s['reused_tokens'] / s['prompt_tokens']:>10.0%} {s['fragments_hit']:>13} {s['ttft_s'] * 1000:>5.0f}ms"
    )
print("\nthe fifth message, as the memory renders it (markers are resolved by KVShiftLLM, never read):")
print(memory.get()[-2].content)
store.close()
