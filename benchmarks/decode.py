"""Whole replies against llama.cpp on the same GGUF file: decoding speed per weight format, prefill,
the reply time of a memory turn (warm and after a restart), fidelity of each format to float32,
and each format's weights in memory.

The peer is llama.cpp through llama-cpp-python (``benchmarks/llama_worker.py``), run by a
benchmark-only virtual environment's Python (``--llama-python``, default ``.bench-venv/bin/python``;
set it up with ``python3 -m venv .bench-venv && .bench-venv/bin/pip install llama-cpp-python==0.3.36``),
on the very GGUF file the shipped model is converted from, with ``n_threads`` as ours. Both are
given the same prompt token ids (the engine's own prompt layout) and decode greedily without
stopping at the end-of-turn token, so every arm decodes the same number of tokens.

Parts (``--parts``, default all):

- ``decode``: tokens/s of the 63 steps after the first token, after a prompt of 512, 2k and 4k
  tokens (LoCoMo chat as one user message), per arm: the default (``as-shipped``, the one-token
  step in the kernels), ``as-shipped`` through transformers' forward (what the step saves), the
  model quantized here (``int8``, ``int4``), ``fp32`` (oneDNN-packed, the step in PyTorch) and
  ``bf16`` (transformers' forward); and llama.cpp. The prompt is cached first (its prefill timed
  once: ``prefill``), then each repeat decodes 64 tokens after it; the arms take turns within a
  repeat, so the machine's noise reaches them alike.
- ``reply``: the reply time of a memory turn, call to 64th token: LoCoMo memories (1-2k tokens)
  in the system message and a question. ``warm``: the same memories were asked about before
  (a new question now): kvshift's default reuses them from its prefix cache, llama.cpp from its
  own; ``restart``: a new question after a restart: kvshift's caches emptied, the memories' K/V
  restored from a ``MemoryStore`` (the store's default codec); llama.cpp computes them again.
- ``prefill``: the default weights' prefill against float32's (oneDNN-packed), the one pass where
  the quantized weights could cost time: after a warm-up call each, the arms take turns, each
  repeat computing each prompt afresh (``reuse="none"``); the ``decode`` part's prefill row is a
  single cold call per arm.
- ``fidelity``: per format, over the fidelity set (LoCoMo instances of 8-12 memories and a
  question, ``benchmarks/benchdata.py``), the 24-token greedy answer compared with the float32
  engine's (``reuse="none"`` both), and the mean KL and top-1 agreement of the next-token
  distributions along the float32 answer.

    python benchmarks/decode.py --llama-python /path/to/venv/bin/python        # both models, ~1 h 45 min
    python benchmarks/decode.py --parts prefill --repeats 3 --output benchmarks/results/decode_prefill.json
    python benchmarks/decode.py --models smollm2 --parts decode --repeats 3

Prints tables and writes ``benchmarks/results/decode.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import build_instances, locomo_turns, write_report  # noqa: E402
from fidelity import kl_and_top1  # noqa: E402

from kvshift_memory import KVShiftEngine, MemoryStore  # noqa: E402
from kvshift_memory.engine.native import native_status  # noqa: E402
from kvshift_memory.engine.weights import resident_bytes  # noqa: E402
from kvshift_memory.shipped import SHIPPED_MODELS  # noqa: E402

RESULTS = HERE / "results"
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m"}
#: arm name: from_pretrained's options
ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "as-shipped, transformers": {"weights": "as-shipped", "one_token_step": False},
    "int8": {"weights": "int8"},
    "int4": {"weights": "int4"},
    "fp32": {"weights": "fp32"},
    "bf16": {"weights": "bf16"},
}
FIDELITY_FORMATS = ("as-shipped", "int8", "int4", "bf16")
QUESTIONS = (
    "What did they talk about first, and how did it end?",
    "Which plans came up, and who made them?",
    "What happened at work for either of them?",
    "Who mentioned family, and what about?",
    "What hobby came up most often?",
    "Was there anything either of them promised to do?",
    "Which places did they mention?",
)
TOKENS = 64
ANSWER_TOKENS = 24


class Llama:
    """llama.cpp in a worker process of the benchmark venv (``llama_worker.py``)."""

    def __init__(self, python: str, gguf: Path, n_ctx: int, threads: int) -> None:
        self._process = subprocess.Popen(
            [python, str(HERE / "llama_worker.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._ask({"op": "load", "path": str(gguf), "n_ctx": n_ctx, "threads": threads})

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        answer = json.loads(self._process.stdout.readline())
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def reply(self, prompt: list[int], tokens: int, fresh: bool = False) -> dict[str, Any]:
        return self._ask({"op": "reply", "prompt": prompt, "tokens": tokens, "fresh": fresh})

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=60)


@contextlib.contextmanager
def gguf_file(name: str) -> Iterator[Path]:
    """The shipped model's GGUF file (a split one joined in a temporary folder)."""
    shipped = SHIPPED_MODELS[name]
    with tempfile.TemporaryDirectory() as scratch:
        yield shipped.write_gguf(Path(scratch) / "joined.gguf")


@contextlib.contextmanager
def endless(engine: KVShiftEngine) -> Iterator[None]:
    """Decode past the end-of-turn token, as llama.cpp is run here: every arm decodes as many tokens."""
    ends = engine.runner.eos_token_ids
    engine.runner.eos_token_ids = frozenset()
    try:
        yield
    finally:
        engine.runner.eos_token_ids = ends


def chat_prompt(engine: KVShiftEngine, tokens: int) -> str:
    """LoCoMo chat lines as one user message of about ``tokens`` tokens."""
    lines, total = [], 0
    for line in locomo_turns(4000):
        size = engine.count_tokens(line + "\n")
        if total + size > tokens - 30:
            break
        lines.append(line)
        total += size
    return "Here is a chat between two friends:\n" + "\n".join(lines) + "\nContinue their chat."


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def decode_part(
    name: str, engines: dict[str, KVShiftEngine], llama: Llama, sizes: list[int], repeats: int
) -> dict[str, Any]:
    default = engines["default"]
    prompts = {size: chat_prompt(default, size) for size in sizes}
    ids = {size: default.planner.plan(prompts[size]).layout.token_ids.tolist() for size in sizes}
    prefill: dict[str, dict[int, float]] = {arm: {} for arm in [*engines, "llama.cpp"]}
    for size in sizes:
        for arm, engine in engines.items():  # reuse="none" reads no cache, and leaves the prompt in it
            prefill[arm][size] = engine.generate(prompts[size], reuse="none", max_new_tokens=1).stats.ttft_s
        prefill["llama.cpp"][size] = llama.reply(ids[size], 1, fresh=True)["ttft_s"]
    rates: dict[str, dict[int, list[float]]] = {arm: {size: [] for size in sizes} for arm in prefill}
    for repeat in range(repeats):
        for size in sizes:
            for arm, engine in engines.items():
                with endless(engine):
                    stats = engine.generate(prompts[size], reuse="prefix", max_new_tokens=TOKENS).stats
                assert stats.generated_tokens == TOKENS and stats.reused_tokens == stats.prompt_tokens - 1, stats
                rates[arm][size].append(stats.decode_tokens_per_s)
            timing = llama.reply(ids[size], TOKENS)
            rates["llama.cpp"][size].append((timing["tokens"] - 1) / (timing["total_s"] - timing["ttft_s"]))
            print(
                f"  {name} repeat {repeat + 1}, {len(ids[size])} tokens: "
                + ", ".join(f"{arm} {rates[arm][size][-1]:.1f}" for arm in rates),
                flush=True,
            )
    return {
        "prompt_tokens": {size: len(ids[size]) for size in sizes},
        "prefill_s": prefill,
        "tokens_per_s": {
            arm: {size: spread(values) for size, values in by_size.items()} for arm, by_size in rates.items()
        },
        "decode_path": {arm: engine.runner.decode_path for arm, engine in engines.items()},
    }


def prefill_part(name: str, engines: dict[str, KVShiftEngine], sizes: list[int], repeats: int) -> dict[str, Any]:
    arms = {arm: engines[arm] for arm in ("default", "fp32")}
    prompts = {size: chat_prompt(arms["default"], size) for size in sizes}
    for engine in arms.values():  # the pool's threads started, oneDNN's kernels generated
        engine.generate(prompts[sizes[0]], reuse="none", max_new_tokens=1)
    times: dict[str, dict[int, list[float]]] = {arm: {size: [] for size in sizes} for arm in arms}
    for repeat in range(repeats):
        for size in sizes:
            for arm, engine in arms.items():
                times[arm][size].append(engine.generate(prompts[size], reuse="none", max_new_tokens=1).stats.ttft_s)
            print(
                f"  {name} prefill repeat {repeat + 1}, {size}: "
                + ", ".join(f"{arm} {times[arm][size][-1]:.2f}s" for arm in arms),
                flush=True,
            )
    return {arm: {size: spread(values) for size, values in by_size.items()} for arm, by_size in times.items()}


def memory_turn(engine: KVShiftEngine, target: int) -> list[str]:
    """Memories of the fidelity set's conversations adding up to ``target`` tokens."""
    picked, total = [], 0
    for instance in build_instances(12, engine.count_tokens):
        for memory in instance.memories:
            size = engine.count_tokens(memory)
            if total + size <= target:
                picked.append(memory)
                total += size
    return picked


def reply_part(name: str, engine: KVShiftEngine, llama: Llama, repeats: int, target: int) -> dict[str, Any]:
    memories = memory_turn(engine, target)
    arms: dict[str, list[float]] = {"warm": [], "restart": [], "llama.cpp warm": [], "llama.cpp restart": []}
    restored: list[int] = []
    with tempfile.TemporaryDirectory() as folder, MemoryStore(Path(folder) / "store") as store:
        first = engine.generate(QUESTIONS[0], memories, kv_store=store, max_new_tokens=TOKENS)
        prompt_tokens = first.stats.prompt_tokens
        llama.reply(engine.planner.plan(QUESTIONS[0], memories).layout.token_ids.tolist(), 1, fresh=True)
        engine.flush_chunks()
        for repeat in range(repeats):
            warm_q, restart_q = QUESTIONS[1 + (2 * repeat) % 6], QUESTIONS[1 + (2 * repeat + 1) % 6]
            with endless(engine):
                started = time.perf_counter()
                warm = engine.generate(warm_q, memories, kv_store=store, max_new_tokens=TOKENS)
                arms["warm"].append(time.perf_counter() - started)
                assert warm.stats.reused_tokens > 0.8 * warm.stats.prompt_tokens, warm.stats
                timing = llama.reply(engine.planner.plan(warm_q, memories).layout.token_ids.tolist(), TOKENS)
                arms["llama.cpp warm"].append(timing["total_s"])
                engine.flush_chunks()
                engine.clear_cache()  # a new process holds nothing: what is reused comes from the store
                started = time.perf_counter()
                restart = engine.generate(restart_q, memories, kv_store=store, max_new_tokens=TOKENS)
                arms["restart"].append(time.perf_counter() - started)
                restored.append(restart.stats.restored_tokens)
                prompt = engine.planner.plan(restart_q, memories).layout.token_ids.tolist()
                arms["llama.cpp restart"].append(llama.reply(prompt, TOKENS, fresh=True)["total_s"])
                engine.flush_chunks()
            print(
                f"  {name} reply repeat {repeat + 1}: "
                + ", ".join(f"{arm} {times[-1]:.2f}s" for arm, times in arms.items()),
                flush=True,
            )
    return {
        "memories": len(memories),
        "prompt_tokens": prompt_tokens,
        "restored_tokens": restored,
        "store_codec": "int8",
        "reply_s": {arm: spread(times) for arm, times in arms.items()},
    }


def fidelity_part(name: str, engines: dict[str, KVShiftEngine], count: int) -> dict[str, Any]:
    reference_engine = engines["fp32"]
    instances = build_instances(count, reference_engine.count_tokens)
    rows: dict[str, list[dict[str, float]]] = {weights: [] for weights in FIDELITY_FORMATS}
    by_format = {
        "as-shipped": engines["default"],
        "int8": engines["int8"],
        "int4": engines["int4"],
        "bf16": engines["bf16"],
    }
    for instance in instances:
        messages = [{"role": "user", "content": instance.question}]
        memories = list(instance.memories)
        reference = reference_engine.generate(messages, memories, reuse="none", max_new_tokens=ANSWER_TOKENS)
        answer = reference.token_ids or [reference_engine.runner.tokenizer.eos_token_id]
        full = reference_engine.score(messages, memories, answer, reuse="prefix", return_distributions=True)
        for weights, engine in by_format.items():
            own = engine.generate(messages, memories, reuse="none", max_new_tokens=ANSWER_TOKENS)
            scored = engine.score(messages, memories, answer, reuse="prefix", return_distributions=True)
            assert full.distributions is not None and scored.distributions is not None
            kl, top1 = kl_and_top1(full.distributions, scored.distributions.to(torch.float32))
            rows[weights].append({"greedy_equal": float(own.token_ids == reference.token_ids), "kl": kl, "top1": top1})
        print(f"  {name} fidelity {len(rows['int8'])}/{len(instances)}", flush=True)
    return {
        weights: {
            "greedy_equal": int(sum(r["greedy_equal"] for r in found)),
            "instances": len(found),
            "mean_kl": statistics.fmean(r["kl"] for r in found),
            "max_kl": max(r["kl"] for r in found),
            "top1": statistics.fmean(r["top1"] for r in found),
        }
        for weights, found in rows.items()
    }


def run_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    model = MODELS[name]
    engines = {}
    for arm, options in ARMS.items():
        started = time.perf_counter()
        engines[arm] = KVShiftEngine.from_pretrained(model, **options)
        print(f"{name}: {arm} loaded in {time.perf_counter() - started:.1f} s ({engines[arm].runner.decode_path})")
    report: dict[str, Any] = {
        "weights_bytes": {arm: resident_bytes(engine.model) for arm, engine in engines.items()},
        "formats": {arm: engine.runner.weights for arm, engine in engines.items()},
    }
    if "prefill" in args.parts:
        report["prefill"] = prefill_part(name, engines, args.sizes, args.repeats)
    if args.parts & {"decode", "reply"}:
        with gguf_file(model) as gguf:
            llama = Llama(args.llama_python, gguf, max(args.sizes) + TOKENS + 512, args.threads)
            try:
                if "decode" in args.parts:
                    report["decode"] = decode_part(name, engines, llama, args.sizes, args.repeats)
                if "reply" in args.parts:
                    report["reply"] = reply_part(name, engines["default"], llama, args.repeats, args.reply_tokens)
            finally:
                llama.close()
    if "fidelity" in args.parts:
        report["fidelity"] = fidelity_part(name, engines, args.fidelity)
    return report


def print_tables(results: dict[str, Any]) -> None:
    for name, report in results.items():
        decode = report.get("decode")
        if decode:
            sizes = list(decode["prompt_tokens"])
            lengths = ", ".join(map(str, decode["prompt_tokens"].values()))
            print(f"\n{name}: decode tokens/s (median of the repeats) after a prompt of {lengths} tokens")
            llama = decode["tokens_per_s"]["llama.cpp"]
            for arm, by_size in decode["tokens_per_s"].items():
                cells = [
                    f"{by_size[s]['median']:6.1f} ({by_size[s]['median'] / llama[s]['median']:.2f}x)" for s in sizes
                ]
                print(f"  {arm:<26} " + "  ".join(cells))
            print(
                "  prefill (s): "
                + "; ".join(
                    f"{arm} " + "/".join(f"{decode['prefill_s'][arm][s]:.2f}" for s in sizes)
                    for arm in decode["prefill_s"]
                )
            )
        prefill = report.get("prefill")
        if prefill:
            print(f"\n{name}: prefill (median s, warmed up)")
            for arm, by_size in prefill.items():
                print(f"  {arm:<8} " + "  ".join(f"{size}: {cell['median']:.2f}" for size, cell in by_size.items()))
        reply = report.get("reply")
        if reply:
            times = reply["reply_s"]
            print(
                f"\n{name}: a memory turn of {reply['prompt_tokens']} prompt tokens, {TOKENS}-token reply (median s): "
                f"warm {times['warm']['median']:.2f} vs llama.cpp {times['llama.cpp warm']['median']:.2f} "
                f"({times['llama.cpp warm']['median'] / times['warm']['median']:.2f}x); restart "
                f"{times['restart']['median']:.2f} vs {times['llama.cpp restart']['median']:.2f} "
                f"({times['llama.cpp restart']['median'] / times['restart']['median']:.2f}x)"
            )
        fidelity = report.get("fidelity")
        if fidelity:
            print(f"\n{name}: against the float32 engine")
            for weights, row in fidelity.items():
                print(
                    f"  {weights:<11} greedy equal {row['greedy_equal']}/{row['instances']}, "
                    f"mean KL {row['mean_kl']:.1e} (max {row['max_kl']:.1e}), top-1 {row['top1']:.3f}"
                )
        print(
            f"\n{name}: weights in memory (MB): "
            + ", ".join(f"{arm} {b / 1e6:.0f}" for arm, b in report["weights_bytes"].items())
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma")
    parser.add_argument("--parts", default="decode,reply,fidelity", help="also: prefill")
    parser.add_argument("--sizes", default="512,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fidelity", type=int, default=40, help="fidelity-set instances")
    parser.add_argument("--reply-tokens", type=int, default=1500, help="tokens of memories in the memory turn")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-python", default=os.environ.get("KVSHIFT_LLAMA_PYTHON", ".bench-venv/bin/python"))
    parser.add_argument("--output", type=Path, default=RESULTS / "decode.json")
    args = parser.parse_args()
    args.sizes = [int(size) for size in args.sizes.split(",") if size]
    args.parts = set(args.parts.split(","))
    torch.set_num_threads(args.threads)
    results = {name: run_model(name, args) for name in args.models.split(",")}
    print_tables(results)
    write_report(
        args.output,
        {
            "models": {name: MODELS[name] for name in results},
            "threads": args.threads,
            "kernels": native_status(),
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
