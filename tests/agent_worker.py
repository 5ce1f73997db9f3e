"""A worker process behind a load balancer: one agent session over a shared store, a turn per request.

    python agent_worker.py KV_URL CHUNK_TOKENS

Prints "ready" once its engine is loaded; then for each line on stdin (a user message) its
``AgentMemory(user_id="alice", session_id="trip")`` answers it (after reading the window the other
worker saved), waits until the
turn's K/V chunks are written, and prints one JSON line: the window's length after the turn, the
turn's prompt, cached, restored and prefilled token counts, and what the turn may prefill at most
(its message, its template tokens and its recalled memories).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from store_worker import HashEmbedder  # noqa: E402
from test_agent import _new_tokens_bound  # noqa: E402

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore  # noqa: E402


def main() -> None:
    kv_url, chunk_tokens = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)  # two workers share the machine's cores
    engine = KVShiftEngine.from_pretrained(chunk_tokens=chunk_tokens)
    # what is checked is the restoring; a busy machine may otherwise judge small chunks cheaper to compute
    engine.costs.recompute_cheaper = lambda tokens: False
    with MemoryStore(kv_url=kv_url, index_url=":memory:", embedder=HashEmbedder()) as store:
        agent = AgentMemory(engine, store, user_id="alice", session_id="trip", max_new_tokens=12)
        print("ready", flush=True)
        for line in sys.stdin:
            reply = agent.chat(line.rstrip("\n"))
            flushed = engine.flush_chunks(timeout_s=120)
            stats = reply.stats
            report = {
                "window": len(agent.window),
                "last_message": agent.window[-1][0],
                "flushed": flushed,
                "prompt_tokens": stats.prompt_tokens,
                "reused_tokens": stats.reused_tokens,
                "restored_tokens": stats.restored_tokens,
                "new_tokens_bound": _new_tokens_bound(engine, reply),
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
