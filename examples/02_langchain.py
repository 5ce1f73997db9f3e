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
# # LangChain: an agent whose long-term memory brings its K/V along
#
# `create_agent` with three pieces from `langchain_kvshift`: `ChatKVShift` (the chat model over
# the engine), `KVShiftStore` (a LangGraph store over the memory store: the agent's long-term
# memory) and `KVShiftMiddleware` (before each model call it recalls the user's memories into the
# latest message, in span markers; after it, it writes the user's message back). The user and
# the session come from the run's `context`, so one agent serves every user; a checkpointer
# keeps each conversation's messages.
#
# On Monday Alice tells the agent a few things; on Tuesday, in a new conversation, she asks about
# them. Two identical agents run the same turns: one with reuse (the default), one with
# `reuse="none"`, which reads every prompt from scratch.

# %%
import tempfile
from pathlib import Path

import torch
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from langgraph.checkpoint.memory import InMemorySaver
from tqdm.auto import tqdm

from kvshift_memory import KVShiftEngine, MemoryStore
from langchain_kvshift import ChatKVShift, KVShiftMiddleware, KVShiftStore

torch.set_num_threads(min(2, torch.get_num_threads()))
engine = KVShiftEngine.shared()  # the process's engine for the bundled model, which ChatKVShift uses too
engine.generate("Hello!", max_new_tokens=4)  # a warm-up, so that neither agent pays for the first call
SYSTEM = (
    "You are a travel assistant for a small team planning trips to Lisbon, Porto and Madrid. You remember "
    "what each user told you in earlier conversations and use it when it helps. Answer in one or two sentences."
)
TURNS = [  # (conversation, message)
    ("monday", "My sister Ana lives in Porto and she is allergic to peanuts."),
    ("monday", "Mr Costa, my neighbour, looks after my beagle Biscuit when I travel."),
    ("tuesday", "Hi! I am packing for the trip to Porto."),
    ("tuesday", "Who looks after my dog while I am away?"),
    ("tuesday", "Which city does my sister live in?"),
]


class ReuseStats(BaseCallbackHandler):
    """Keeps the engine's stats of each model call (ChatKVShift puts them in response_metadata)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.answers: list[str] = []

    def on_llm_end(self, response, **kwargs) -> None:
        self.calls.append(response.generations[0][0].message.response_metadata["reuse_stats"])


def run(reuse: str | None, folder: Path) -> ReuseStats:
    stats = ReuseStats()
    with MemoryStore(folder) as memory_store:
        agent = create_agent(
            model=ChatKVShift(max_tokens=32, reuse=reuse, callbacks=[stats]),
            tools=[],
            system_prompt=SYSTEM,
            middleware=[KVShiftMiddleware()],
            store=KVShiftStore(memory_store),
            checkpointer=InMemorySaver(),
        )
        for conversation, message in tqdm(TURNS, desc=f"reuse={reuse}", leave=False):
            state = agent.invoke(
                {"messages": [HumanMessage(message)]},
                config={"configurable": {"thread_id": conversation}},
                context={"user_id": "alice", "session_id": conversation},
            )
            stats.answers.append(state["messages"][-1].content)
            print(f"[{conversation}] > {message}\n  {stats.answers[-1].strip()[:120]}")
    return stats


scratch = Path(tempfile.mkdtemp())
reusing = run(None, scratch / "reusing")
baseline = run("none", scratch / "baseline")

# %% [markdown]
# Per turn: the prompt, how much of it came from the cache (`cache_read` in LangChain's usage
# metadata), memories placed from their stored fragments, the time to the first token, and
# whether the two agents answered alike. The third turn opens Tuesday's conversation: its prompt
# shares only the system prompt with Monday's.

# %%
print(
    f"{'turn':>4} {'prompt':>6} {'from cache':>11} {'fragments':>9} {'TTFT reuse':>10} {'TTFT none':>9} {'same answer':>11}"
)
for turn, (mine, theirs) in enumerate(zip(reusing.calls, baseline.calls, strict=True), start=1):
    share = mine["reused_tokens"] / mine["prompt_tokens"]
    same = reusing.answers[turn - 1] == baseline.answers[turn - 1]
    print(
        f"{turn:>4} {mine['prompt_tokens']:>6} {share:>10.0%} {mine['fragments_hit']:>9} "
        f"{mine['ttft_s'] * 1000:>8.0f}ms {theirs['ttft_s'] * 1000:>7.0f}ms {'yes' if same else 'no':>11}"
    )

# %% [markdown]
# `ChatKVShift` places recalled memories with the engine's blend by default: short memories next to
# the question are recomputed with it, so the answer is full recompute's while the earlier turns
# come from the cache. `ChatKVShift(recompute_ratio=0)` shifts memories in without repair, the
# fastest placement, and it can change an answer: on this notebook's fourth turn it repeated the
# previous reply where full recompute named the dog's sitter (`docs/integrations.md`).
