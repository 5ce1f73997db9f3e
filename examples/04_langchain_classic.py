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
# # LangChain: a `ConversationChain` that reads each turn from the cache
#
# `ChatKVShift` is a LangChain chat model over the engine; `KVShiftMemory` is the chain's memory.
# The chain sends one flat message a turn; the memory renders the conversation and the memories
# each input recalls (in span markers), and the model places the recalled memories' stored K/V
# where their markers stand. Each prompt starts with the previous one, so the engine reuses it.
#
# Two identical stores, two chains: one with reuse (the default), one with `reuse="none"`.

# %%
import tempfile
from pathlib import Path

import torch
from langchain_classic.chains import ConversationChain
from langchain_core.callbacks import BaseCallbackHandler
from tqdm.auto import tqdm

from kvshift_memory import KVShiftEngine, MemoryStore
from langchain_kvshift import ChatKVShift, KVShiftMemory

torch.set_num_threads(min(2, torch.get_num_threads()))
engine = KVShiftEngine.shared()  # the process's engine for the bundled model, which ChatKVShift uses too
engine.generate("Hello!", max_new_tokens=4)  # a warm-up, so that neither chain pays for the first call
EARLIER = [  # what an earlier session left in the user's store
    "Alice's dog Biscuit is a three-year-old beagle; Mr Costa, the neighbour, looks after him during trips.",
    "The team trip to Lisbon is on 14-18 May, with a budget of 50k euros for eight people.",
    "Alice's sister Ana lives in Porto and is allergic to peanuts.",
]
TURNS = [
    "Hi! I am packing for Lisbon.",
    "Who looks after my dog while I am away?",
    "What is the budget of the trip?",
    "I also want to visit my sister. Where does she live?",
    "Thanks, that is all for today.",
]


class ReuseStats(BaseCallbackHandler):
    """Keeps the engine's stats of each model call (ChatKVShift puts them in response_metadata)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        self.calls.append(response.generations[0][0].message.response_metadata["reuse_stats"])


def run(reuse: str | None, folder: Path) -> ReuseStats:
    stats = ReuseStats()
    with MemoryStore(folder) as store:
        # stored with their K/V fragments encoded, as an AgentMemory or KVShiftMemory stores them
        # (placed in user messages by the chain's memory: no lead fragments needed)
        engine.warm(
            [store.add(text, tenant="alice", session_id="spring") for text in EARLIER],
            lead_fragments=False,
            tenant="alice",
        )
        chain = ConversationChain(
            llm=ChatKVShift(store=store, user_id="alice", max_tokens=32, reuse=reuse, callbacks=[stats]),
            memory=KVShiftMemory(store=store, user_id="alice", session_id="may"),
        )
        for turn in tqdm(TURNS, desc=f"reuse={reuse}", leave=False):
            print(f"> {turn}\n  {chain.invoke({'input': turn})['response'].strip()[:120]}")
    return stats


scratch = Path(tempfile.mkdtemp())
reusing = run(None, scratch / "reusing")
baseline = run("none", scratch / "baseline")

# %% [markdown]
# Per turn: the prompt, how much of it came from the cache (`cache_read` in LangChain's usage
# metadata), memories placed from their fragments, and the time to the first token.

# %%
print(f"{'turn':>4} {'prompt':>6} {'from cache':>11} {'fragments':>9} {'TTFT reuse':>10} {'TTFT none':>9}")
for turn, (mine, theirs) in enumerate(zip(reusing.calls, baseline.calls, strict=False), start=1):
    share = mine["reused_tokens"] / mine["prompt_tokens"]
    print(
        f"{turn:>4} {mine['prompt_tokens']:>6} {share:>10.0%} {mine['fragments_hit']:>9} "
        f"{mine['ttft_s'] * 1000:>8.0f}ms {theirs['ttft_s'] * 1000:>7.0f}ms"
    )
