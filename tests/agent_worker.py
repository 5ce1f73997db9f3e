"""A worker process behind a load balancer: one agent session over a shared store, a turn per request.

    python agent_worker.py KV_URL [--model NAME] [--chunk-tokens N] [--max-new-tokens N]
                                  [--always-restore] [--threads N]

Prints "ready" once its engine is loaded; then for each line on stdin (a user message) its
``AgentMemory(user_id="alice", session_id="trip")`` answers it (after reading the window the other
worker saved), waits until the turn's K/V chunks are written, and prints one JSON line: the
window's length after the turn, the turn's prompt, cached, restored and prefilled token counts,
the message's own tokens, and what the turn may prefill at most (its message, its template tokens
and its recalled memories). ``tests/test_sessions.py`` and ``benchmarks/resume.py --alternate`` run two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from store_worker import HashEmbedder  # noqa: E402
from test_agent import _new_tokens_bound  # noqa: E402

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore  # noqa: E402


def alternate(kv_url: str, messages: Sequence[str], *options: str) -> list[dict]:
    """Two worker processes over the store at ``kv_url``, answering ``messages`` in turn (the first
    worker the first message); ``options`` go to both. :returns: each turn's report, in order.
    :raises AssertionError: a worker ended early or did not write its chunks."""
    command = [sys.executable, __file__, kv_url, *options]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    pipe = subprocess.PIPE
    workers = [subprocess.Popen(command, stdin=pipe, stdout=pipe, text=True, env=env) for _ in range(2)]
    reports = []
    try:
        assert [worker.stdout.readline().strip() for worker in workers] == ["ready", "ready"]
        for index, message in enumerate(messages):
            worker = workers[index % 2]
            worker.stdin.write(message.replace("\n", " ") + "\n")
            worker.stdin.flush()
            line = worker.stdout.readline()
            assert line, f"a worker ended (exit status {worker.wait(timeout=60)}); its error is above"
            report = json.loads(line)
            assert report["flushed"], "a worker's chunks were not written in time"
            reports.append(report)
    finally:
        for worker in workers:
            worker.stdin.close()
            worker.wait(timeout=60)
    return reports


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kv_url")
    parser.add_argument("--model", default=None, help="default: the bundled model")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: the engine's")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="two workers share the machine's cores")
    parser.add_argument(
        "--always-restore",
        action="store_true",
        help="read stored chunks even where the cost model would compute them (a busy machine slows reads)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    chunks = {} if args.chunk_tokens is None else {"chunk_tokens": args.chunk_tokens}
    engine = KVShiftEngine.from_pretrained(args.model, **chunks)
    if args.always_restore:
        engine.costs.recompute_cheaper = lambda tokens: False
    with MemoryStore(kv_url=args.kv_url, index_url=":memory:", embedder=HashEmbedder()) as store:
        agent = AgentMemory(engine, store, user_id="alice", session_id="trip", max_new_tokens=args.max_new_tokens)
        print("ready", flush=True)
        for line in sys.stdin:
            message = line.rstrip("\n")
            reply = agent.chat(message)
            flushed = engine.flush_chunks(timeout_s=120)
            stats = reply.stats
            report = {
                "window": len(agent.window),
                "last_message": agent.window[-1][0],
                "flushed": flushed,
                "prompt_tokens": stats.prompt_tokens,
                "reused_tokens": stats.reused_tokens,
                "restored_tokens": stats.restored_tokens,
                "prefilled_tokens": stats.prefilled_tokens,
                "message_tokens": engine.count_tokens(message, tenant="alice"),
                "recalled": len(reply.recalled),
                "new_tokens_bound": _new_tokens_bound(engine, reply),
                "ttft_s": stats.ttft_s,
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
