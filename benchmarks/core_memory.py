"""A user's core block in a new session of a new process: how much of the first turn's prompt is
read from stored K/V, its time to first token against full recompute, and whether it answers as
full recompute does.

LoCoMo's dialogue turns (``Speaker: text``) stand for what a user told the agent: they are stored and pinned
(``AgentMemory.pin``) until the core block holds about ``--blocks`` tokens. One agent session
answers a first question with ``resume`` on (the engine writes the prompt's K/V to the store as
chunks); then the process "restarts": the engine's caches are cleared, so nothing but the store
holds the K/V, and a new session asks another question. Timed, medians of ``--repeats``, the arms
interleaved, each repeat a new question:

- ``core``: the new session's first turn (the block restored from the store's chunks);
- ``none``: the same prompt, ``reuse="none"``.

The greedy answers of both arms are compared (with the exact codec, fp32, they must be equal);
the default codec (int8) is measured too. This is the first part of ``docs/benchmarks/core_memory.md``'s
plan (issue 53): answers with the core block against recall only, and a session with corrections,
are not measured here yet.

Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/core_memory.py [--models smollm2-135m-instruct,gemma-3-270m] [--blocks 1000,2000]

Prints a table and writes ``benchmarks/results/core_memory.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import locomo_turns, write_report  # noqa: E402

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore  # noqa: E402

QUESTIONS = [
    "What do you remember about my family?",
    "Which hobbies have I told you about?",
    "What was I worried about recently?",
    "Where did I travel last year?",
    "What are my plans for next month?",
    "Who are my closest friends?",
    "What did I say about my work?",
]


def pinned_block(agent: AgentMemory, store: MemoryStore, engine: KVShiftEngine, tokens: int) -> int:
    """Store and pin the user's own messages until the block holds about ``tokens`` tokens; its tokens."""
    used = 0
    for text in locomo_turns(2000):
        if used >= tokens:
            break
        record = store.add(text, tenant=agent.user_id)
        agent.pin(record.id)
        used += engine.count_tokens(text) + 1
    return used


def measure(model: str, block_tokens: int, codec: str, repeats: int) -> dict[str, Any]:
    engine = KVShiftEngine.from_pretrained(model)
    with tempfile.TemporaryDirectory() as folder:
        store = MemoryStore(Path(folder) / "store", codec=codec)
        first = AgentMemory(engine, store, user_id="user", session_id="first", write_back=False, max_new_tokens=16)
        settled = pinned_block(first, store, engine, block_tokens)
        first.chat("Hello again, what do you know about me?")
        engine.flush_chunks(timeout_s=300)
        core_ttft, none_ttft, shares, equal = [], [], [], 0
        for repeat in range(repeats):
            engine.clear_cache()  # a restart: only the store holds the K/V
            session = AgentMemory(
                engine, store, user_id="user", session_id=f"new-{repeat}", write_back=False, max_new_tokens=16
            )
            question = QUESTIONS[repeat % len(QUESTIONS)] + f" ({repeat})"
            reply = session.chat(question)
            engine.flush_chunks(timeout_s=300)
            messages = [*session._system_messages(), {"role": "user", "content": question}]  # noqa: SLF001
            recomputed = engine.generate(messages, reuse="none", max_new_tokens=16, tenant="user")
            core_ttft.append(reply.stats.ttft_s)
            none_ttft.append(recomputed.stats.ttft_s)
            shares.append(reply.stats.restored_tokens / reply.stats.prompt_tokens)
            equal += reply.stats.generated_tokens > 0 and reply.text == recomputed.text
        store.close()
    core_s, none_s = statistics.median(core_ttft), statistics.median(none_ttft)
    return {
        "model": model,
        "codec": codec,
        "block_tokens": settled,
        "prompt_tokens": reply.stats.prompt_tokens,
        "restored_share": statistics.median(shares),
        "core_ttft_s": core_s,
        "none_ttft_s": none_s,
        "speedup": none_s / core_s,
        "answers_equal": f"{equal}/{repeats}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    parser.add_argument("--blocks", default="1000,2000", help="core block sizes in tokens")
    parser.add_argument("--codecs", default="fp32,int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "core_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = [
        measure(model, int(block), codec, args.repeats)
        for model in args.models.split(",")
        for block in args.blocks.split(",")
        for codec in args.codecs.split(",")
    ]
    print(
        f"{'model':24} {'codec':5} {'block':>6} {'prompt':>6} {'stored':>7} {'core s':>7} {'none s':>7} {'x':>6} equal"
    )
    for row in rows:
        print(
            f"{row['model']:24} {row['codec']:5} {row['block_tokens']:6d} {row['prompt_tokens']:6d} "
            f"{row['restored_share']:7.1%} {row['core_ttft_s']:7.3f} {row['none_ttft_s']:7.3f} "
            f"{row['speedup']:6.1f} {row['answers_equal']}"
        )
    write_report(args.output, {"rows": rows, "repeats": args.repeats})


if __name__ == "__main__":
    main()
