"""The framework adapters, turn by turn: share of each prompt read from the cache, and TTFT against
the same conversation with ``reuse="none"``.

- LangChain: ``ConversationChain(llm=ChatKVShift(...), memory=KVShiftMemory(...))``, six turns,
  20-token replies, four memories from an earlier session in the user's store (their fragments
  encoded when stored);
- LlamaIndex: ``SimpleChatEngine`` with ``KVShiftLLM`` and ``KVShiftMemory``, five turns, 24-token
  replies.

Each conversation runs twice with identical stores (the reusing one first, so that ``none`` cannot
profit from its caches), after one warm-up call; ``torch.set_num_threads(2)``.

    python benchmarks/frameworks.py      # ~1 min on 2 cores

Prints a table and writes ``benchmarks/results/frameworks.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from langchain_core.callbacks import BaseCallbackHandler
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

from kvshift_memory import KVShiftEngine, MemoryStore
from langchain_kvshift import ChatKVShift, KVShiftMemory
from llama_index.llms.kvshift import KVShiftLLM
from llama_index.memory.kvshift import KVShiftMemory as LlamaKVShiftMemory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdata import write_report

with warnings.catch_warnings():  # deprecated in LangChain, still what many users run
    warnings.simplefilter("ignore")
    from langchain_classic.chains import ConversationChain

RESULTS = Path(__file__).resolve().parent / "results"
FACTS = [
    "The budget for the Lisbon trip is 50k euros.",
    "Ana, my sister, lives in Porto and works as a nurse.",
    "The flight to Lisbon leaves on 12 May at 7am.",
    "I am allergic to peanuts.",
]
CHAIN_TURNS = [
    "Hi, I am planning the Lisbon trip.",
    "What is the budget?",
    "When does the flight leave?",
    "Where does my sister live?",
    "Anything about food I should know?",
    "Thanks, that is all for today.",
]
CHAT_TURNS = [
    "I am planning a team trip to Lisbon with a budget of 50k euros.",
    "Which city are we going to?",
    "What is the budget?",
    "Suggest one thing to do there.",
    "Thanks, that is all.",
]


class _ChainStats(BaseCallbackHandler):
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def on_llm_end(self, response, **kwargs) -> None:
        self.calls.append(response.generations[0][0].message.response_metadata["reuse_stats"])


class _ChatStats(BaseEventHandler):
    calls: list = []
    active: bool = False

    @classmethod
    def class_name(cls) -> str:
        return "KVShiftBenchmarkStats"

    def handle(self, event, **kwargs) -> None:
        if self.active and isinstance(event, LLMChatEndEvent) and event.response is not None:
            self.calls.append((event.response.raw or {})["reuse_stats"])


def langchain_run(folder: Path, reuse: str | None) -> list[dict]:
    stats = _ChainStats()
    with MemoryStore(folder) as store:
        # stored with their fragments encoded, as an AgentMemory or KVShiftMemory stores them
        KVShiftEngine.shared().warm(
            [store.add(fact, tenant="alice", session_id="earlier") for fact in FACTS],
            lead_fragments=False,
            tenant="alice",
        )
        llm = ChatKVShift(store=store, user_id="alice", max_tokens=20, reuse=reuse, callbacks=[stats])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            chain = ConversationChain(llm=llm, memory=KVShiftMemory(store=store, user_id="alice", session_id="today"))
        for turn in CHAIN_TURNS:
            chain.invoke({"input": turn})
    return stats.calls


def llama_index_run(folder: Path, reuse: str | None, handler: _ChatStats) -> list[dict]:
    handler.calls, handler.active = [], True
    with MemoryStore(folder) as store:
        llm = KVShiftLLM(max_tokens=24, reuse=reuse, store=store, user_id="alice")
        memory = LlamaKVShiftMemory.from_defaults(store=store, user_id="alice", session_id="trip")
        chat = SimpleChatEngine.from_defaults(llm=llm, memory=memory, system_prompt="You are a brief travel assistant.")
        for turn in CHAT_TURNS:
            chat.chat(turn)
    handler.active = False
    return list(handler.calls)


def rows(reusing: list[dict], baseline: list[dict]) -> list[dict]:
    return [
        {
            "turn": turn,
            "prompt_tokens": mine["prompt_tokens"],
            "from_cache": mine["reused_tokens"] / mine["prompt_tokens"],
            "fragments_hit": mine["fragments_hit"],
            "ttft_s": mine["ttft_s"],
            "ttft_none_s": theirs["ttft_s"],
        }
        for turn, (mine, theirs) in enumerate(zip(reusing, baseline, strict=False), start=1)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=RESULTS / "frameworks.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = KVShiftEngine.shared()
    engine.generate("Hello!", max_new_tokens=4)  # warm-up: neither run pays for the first call
    handler = _ChatStats()
    get_dispatcher().add_event_handler(handler)
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (bundled, fp32)",
        "threads": 2,
    }
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        report["langchain_conversation_chain"] = rows(
            langchain_run(scratch / "lc", None), langchain_run(scratch / "lc-none", "none")
        )
        report["llama_index_simple_chat_engine"] = rows(
            llama_index_run(scratch / "li", None, handler), llama_index_run(scratch / "li-none", "none", handler)
        )
    for name in ("langchain_conversation_chain", "llama_index_simple_chat_engine"):
        print(f"\n{name}")
        print(f"{'turn':>4} {'prompt':>6} {'from cache':>10} {'fragments':>9} {'TTFT':>8} {'TTFT none':>9}")
        for row in report[name]:
            print(
                f"{row['turn']:>4} {row['prompt_tokens']:>6} {row['from_cache']:>10.0%} {row['fragments_hit']:>9} "
                f"{row['ttft_s'] * 1000:>6.0f}ms {row['ttft_none_s'] * 1000:>7.0f}ms"
            )
    write_report(args.output, report)


if __name__ == "__main__":
    main()
