"""A conversation resumed after a restart: TTFT of its next turn, from stored K/V or recomputed.

A LoCoMo conversation (its two speakers as user and assistant) is cut to 2k, 4k and 8k tokens of
chat. One engine answers it with ``kv_store`` set, which writes the prompt's and answer's K/V to
the store as chunks; then the process "restarts": the engine's caches are cleared and a new
``MemoryStore`` object is opened on the same folder (or Redis database), so nothing but the store
holds the K/V. The next turn (the answer so far, then a new user message) is timed:

- ``disk``: restored from the embedded store's folder (diskcache, chunks of 256 tokens, int8);
- ``redis``: restored from a Redis server on 127.0.0.1 (loopback);
- ``recompute``: ``reuse="none"``, the whole prompt prefilled.

Medians of ``--repeats`` runs in one process, the arms interleaved; the speedup is recompute's
median over each arm's. A timed call writes its own chunks too (after the answer, waited for
outside the timing): each repeat's new message is another, so that no repeat restores what an
earlier one wrote. Fidelity: with the exact codec (fp32) the restored turn's greedy answer
must equal full recompute's; with int8 the mean KL and top-1 agreement of the next-token
distributions over recompute's answer are reported. The folder's files stay in the OS page cache
between the runs, as they do for a process restarted on the same machine.

With ``--alternate N``, first: one agent session whose N turns (LoCoMo's first speaker's
messages) land on two worker processes in turn, as behind a load balancer, each with its own
engine and store over one Redis Cluster (three nodes on 127.0.0.1, started and stopped here); per
turn, how much of the prompt came from cache (the worker's own prefix cache, or chunks the other
worker stored) and what was prefilled.

Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/resume.py [--sizes 2000,4000,8000] [--repeats 5]    # ~12 min on 2 cores
    python benchmarks/resume.py --sizes "" --alternate 24 --output benchmarks/results/resume_alternate.json
    python benchmarks/resume.py --model gemma-3-270m --sizes 2000,4000 --output benchmarks/results/resume_gemma3.json

Prints a table and writes ``benchmarks/results/resume.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from agent_worker import alternate  # noqa: E402
from benchdata import locomo_turns, write_report  # noqa: E402
from fidelity import kl_and_top1  # noqa: E402
from redis_server import RedisCluster, RedisServer  # noqa: E402

from kvshift_memory import EngineSettings, KVShiftEngine, MemoryStore  # noqa: E402
from kvshift_memory.embedding import MiniLMEmbedder  # noqa: E402

RESULTS = HERE / "results"
NEXT_MESSAGES = (
    "Remind me: what did we say about the trip, and what should I do next?",
    "Quick question: which of the plans we talked about should come first?",
    "Tell me again what I decided about my job last time.",
    "Could you sum up what we agreed on so far?",
    "Which friend did I mention most, and why?",
    "Was there anything I promised to do this week?",
    "What was the last thing I told you about my family?",
)
ANSWER_TOKENS = 32


def conversation(engine: KVShiftEngine, tokens: int) -> list[dict[str, Any]]:
    """LoCoMo turns as a chat (first speaker: user; second: assistant) of at most ``tokens`` tokens,
    ending with a user message."""
    messages: list[dict[str, Any]] = []
    speakers: list[str] = []
    for line in locomo_turns(2000):
        speaker, _, text = line.partition(": ")
        if speaker not in speakers:
            speakers.append(speaker)
        role = "user" if speakers.index(speaker) % 2 == 0 else "assistant"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
        if messages[-1]["role"] == "user" and engine.planner.plan(messages).layout.length > tokens:
            messages.pop()
            break
    while messages[-1]["role"] != "user":
        messages.pop()
    return messages


def answered(engine: KVShiftEngine, store: MemoryStore, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` and their answer, computed once with ``store`` (its K/V written there)."""
    first = engine.generate(messages, kv_store=store, tenant="alice", max_new_tokens=ANSWER_TOKENS)
    assert engine.flush_chunks(timeout_s=600), "the chunks were not written"
    return [*messages, {"role": "assistant", "content": first.text, "token_ids": first.token_ids}]


def restarted(engine: KVShiftEngine, reopen) -> MemoryStore:
    """What a new process has: an engine with nothing cached, and the store opened anew."""
    engine.clear_cache()
    return reopen()


def timed(engine: KVShiftEngine, turn, reopen) -> tuple[float, Any]:
    """TTFT of ``turn`` after a restart: restored from the store ``reopen`` opens, or recomputed (``None``)."""
    if reopen is None:
        engine.clear_cache()
        result = engine.generate(turn, reuse="none", tenant="alice", max_new_tokens=1)
    else:
        store = restarted(engine, reopen)
        result = engine.generate(turn, kv_store=store, tenant="alice", max_new_tokens=1)
        assert engine.flush_chunks(timeout_s=600)  # its own chunks: written before the next run starts
        store.close()
    return result.stats.ttft_s, result.stats


def fidelity(engine: KVShiftEngine, turn, open_exact, open_int8) -> dict[str, Any]:
    """Greedy answers with the exact codec against recompute; int8's KL over recompute's answer."""
    engine.clear_cache()
    reference = engine.generate(turn, reuse="none", tenant="alice", max_new_tokens=ANSWER_TOKENS)
    out: dict[str, Any] = {"answer_tokens": len(reference.token_ids)}
    distributions = {}
    for label, reopen in (("fp32", open_exact), ("int8", open_int8)):
        store = restarted(engine, reopen)
        answer = engine.generate(turn, kv_store=store, tenant="alice", max_new_tokens=ANSWER_TOKENS)
        out[f"{label}_restored_tokens"] = answer.stats.restored_tokens
        out[f"{label}_greedy_equal"] = answer.token_ids == reference.token_ids
        engine.clear_cache()
        scored = engine.score(
            turn, continuation=reference.token_ids, kv_store=store, tenant="alice", return_distributions=True
        )
        assert scored.distributions is not None
        distributions[label] = scored.distributions
        store.close()
    engine.clear_cache()
    exact = engine.score(turn, continuation=reference.token_ids, reuse="none", return_distributions=True)
    assert exact.distributions is not None
    for label, restored in distributions.items():
        out[f"{label}_kl"], out[f"{label}_top1"] = kl_and_top1(exact.distributions, restored)
    return out


def alternated(turns: int, answer_tokens: int, model: str) -> list[dict[str, Any]]:
    """The first ``turns`` messages of LoCoMo's first speaker, told to one agent session whose turns
    alternate between two worker processes over a throwaway Redis Cluster (each worker an engine
    and a store of its own, the store's default chunks and cost model); each turn's report."""
    first_speaker = locomo_turns(1)[0].partition(": ")[0]
    lines = (line.partition(": ") for line in locomo_turns(10 * turns))
    messages = [text for speaker, _, text in lines if speaker == first_speaker][:turns]
    cluster = RedisCluster()
    try:
        return alternate(cluster.url, messages, "--max-new-tokens", str(answer_tokens), "--model", model)
    finally:
        cluster.stop()


def restart_rows(args: argparse.Namespace, sizes: list[int]) -> list[dict[str, Any]]:
    """The restart arms (disk, Redis, recompute) and the fidelity checks, a row per conversation size."""
    engine = KVShiftEngine.from_pretrained(args.model)
    embedder = MiniLMEmbedder()
    rows = []
    with contextlib.ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        redis_url = args.redis_url
        if redis_url is None:
            server = RedisServer()
            stack.callback(server.stop)
            redis_url = server.url

        def opener(kind: str, codec: str = "int8"):
            if kind == "disk":
                return lambda: MemoryStore(folder / codec, embedder=embedder, index_url=":memory:", codec=codec)
            return lambda: MemoryStore(kv_url=redis_url, index_url=":memory:", embedder=embedder, codec=codec)

        for size in sizes:
            saids = []
            for kind, codec in (("disk", "int8"), ("redis", "int8"), ("disk", "fp32")):
                store = restarted(engine, opener(kind, codec))
                saids.append(answered(engine, store, conversation(engine, size)))
                store.close()
            said = saids[0]
            assert all(other == said for other in saids), "the first answer differed between the stores"
            times: dict[str, list[float]] = {"disk": [], "redis": [], "recompute": []}
            restored: dict[str, list[int]] = {"disk": [], "redis": []}
            tokens = 0
            for repeat in range(args.repeats):
                turn = [*said, {"role": "user", "content": NEXT_MESSAGES[repeat % len(NEXT_MESSAGES)]}]
                for arm in times:
                    seconds, stats = timed(engine, turn, None if arm == "recompute" else opener(arm))
                    times[arm].append(seconds)
                    tokens = stats.prompt_tokens
                    if arm in restored:
                        restored[arm].append(stats.restored_tokens)
            medians = {arm: statistics.median(values) for arm, values in times.items()}
            turn = [*said, {"role": "user", "content": NEXT_MESSAGES[0]}]
            row = {
                "target_tokens": size,
                "prompt_tokens": tokens,
                **{f"{arm}_restored_tokens": counts for arm, counts in restored.items()},
                **{f"{arm}_s": value for arm, value in medians.items()},
                **{f"{arm}_runs_s": values for arm, values in times.items()},
                "speedup_disk": medians["recompute"] / medians["disk"],
                "speedup_redis": medians["recompute"] / medians["redis"],
                **fidelity(engine, turn, opener("disk", "fp32"), opener("disk")),
            }
            rows.append(row)
            print(
                f"{tokens:>6} tok | restored {statistics.median(restored['disk']):>5.0f} "
                f"| disk {medians['disk']:.3f} s "
                f"({row['speedup_disk']:.1f}x) | redis {medians['redis']:.3f} s ({row['speedup_redis']:.1f}x) "
                f"| recompute {medians['recompute']:.2f} s | fp32 greedy equal {row['fp32_greedy_equal']} "
                f"| int8 KL {row['int8_kl']:.2e} top-1 {row['int8_top1']:.3f}",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2000,4000,8000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a shipped model's name, a folder or hub id")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis-url", default=None, help="default: a throwaway redis-server on 127.0.0.1")
    parser.add_argument(
        "--alternate", type=int, default=0, help="turns of one session alternated between two worker processes"
    )
    parser.add_argument("--output", default=str(RESULTS / "resume.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    turns = alternated(args.alternate, ANSWER_TOKENS, args.model) if args.alternate else []
    for number, report in enumerate(turns, start=1):
        share = report["reused_tokens"] / report["prompt_tokens"]
        print(
            f"turn {number:>2} (worker {2 - number % 2}) | prompt {report['prompt_tokens']:>5} | from cache "
            f"{report['reused_tokens']:>5} ({share:.0%}), of which restored {report['restored_tokens']:>5} "
            f"| prefilled {report['prefilled_tokens']:>4} (message {report['message_tokens']:>3})",
            flush=True,
        )
    sizes = [int(size) for size in args.sizes.split(",") if size]
    rows = restart_rows(args, sizes) if sizes else []
    write_report(
        Path(args.output),
        {
            "model": args.model,
            "chunk_tokens": EngineSettings().chunk_tokens,
            "threads": args.threads,
            "repeats": args.repeats,
            "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "rows": rows,
            "alternated_turns": turns,
        },
    )


if __name__ == "__main__":
    main()
