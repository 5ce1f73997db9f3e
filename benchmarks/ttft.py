"""Time to first token with and without reuse, as ratios against full recompute in the same run.

A memory of 512, 1024, 2048 and 4096 tokens (LoCoMo conversation fragments of 40-250 tokens) and a
~30-token question. Conditions, each timed from the call to the first generated token:

- ``none``: full recompute of the whole prompt (the baseline every ratio is against);
- ``prefix``: the system prompt and the memories were the exact prefix of an earlier prompt (a
  previous question about the same memories); only the new question is prefilled;
- ``shift``: each memory's fragment was encoded earlier (at add time); the fragments are placed
  at their positions by RoPE re-rotation and only the question is prefilled;
- ``blend``: shift, then recompute the default share of fragment tokens (``recompute_ratio``).

Every repeat runs all conditions back to back (so machine noise hits them alike); the table gives
medians over ``--repeats`` after one warm-up, with ``torch.set_num_threads(2)``.

    python benchmarks/ttft.py            # ~4 min on 2 cores
    python benchmarks/ttft.py --sizes 2048 --no-pack-weights      # an A/B of one engine setting
    python benchmarks/ttft.py --device cuda --model gemma-3-270m --sizes 2048,4096,8192

The decoding speed after each size's prompt (32 tokens, greedy) is reported too.

Prints a table and writes ``benchmarks/results/ttft.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdata import build_instances, write_report  # noqa: E402

from kvshift_memory import KVShiftEngine  # noqa: E402
from kvshift_memory.shipped import DEFAULT_MODEL  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = (
    "Looking back over everything we talked about, what did Evan and his partner try on the weekend, and how did it go?"
)
WARMING_QUESTION = "What is the first thing we talked about in these memories?"


def memories_of(engine: KVShiftEngine, target: int, pool: list[str]) -> list[str]:
    """Fragments from ``pool`` adding up to just under ``target`` tokens."""
    picked, total = [], 0
    for text in pool:
        size = engine.count_tokens(text) + 1
        if total + size <= target:
            picked.append(text)
            total += size
        if total > target - 40:
            break
    return picked


def timed(engine: KVShiftEngine, condition: str, memories: list[str], ratio: float) -> float:
    """Prepare the caches ``condition`` assumes (untimed), then time one generation's first token."""
    engine.clear_cache(fragments=False)
    if condition == "prefix":
        engine.generate(WARMING_QUESTION, memories, reuse="none", max_new_tokens=1)
    elif condition in ("shift", "blend"):
        engine.warm(memories, QUESTION)
    reuse = {"none": "none", "prefix": "prefix", "shift": "blend", "blend": "blend"}[condition]
    recompute = 0.0 if condition == "shift" else ratio if condition == "blend" else None
    result = engine.generate(QUESTION, memories, reuse=reuse, recompute_ratio=recompute, max_new_tokens=1)
    assert result.stats.reuse == reuse, result.stats
    return result.stats.ttft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--recompute-ratio", type=float, default=None, help="blend's ratio (default: the engine's)")
    parser.add_argument(
        "--recompute-window", type=int, default=None, help="EngineSettings.recompute_window (default: the engine's)"
    )
    parser.add_argument("--no-pack-weights", action="store_true", help="EngineSettings.pack_weights=False (an A/B)")
    parser.add_argument(
        "--no-keep-freed-memory", action="store_true", help="EngineSettings.keep_freed_memory=False (an A/B)"
    )
    parser.add_argument(
        "--model", default=None, help="a shipped model's name (default: smollm2-135m-instruct) or a folder"
    )
    parser.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, mps")
    parser.add_argument(
        "--dtype", default="auto", help="auto (the checkpoint's; fp32 for the shipped models), bfloat16…"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "ttft.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    window = {} if args.recompute_window is None else {"recompute_window": args.recompute_window}
    engine = KVShiftEngine.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        pack_weights=not args.no_pack_weights,
        keep_freed_memory=not args.no_keep_freed_memory,
        **window,
    )
    ratio = engine.settings.recompute_ratio if args.recompute_ratio is None else args.recompute_ratio
    pool = [m for instance in build_instances(60, engine.count_tokens, seed=11) for m in instance.memories]
    pool = list(dict.fromkeys(pool))
    conditions = ("none", "prefix", "shift", "blend")
    report = {
        "model": f"{args.model or DEFAULT_MODEL} ({type(engine.model).__name__}, {engine.model.dtype})",
        "device": str(engine.device),
        "threads": args.threads,
        "repeats": args.repeats,
        "recompute_ratio": ratio,
        "recompute_window": engine.settings.recompute_window,
        "pack_weights": engine.settings.pack_weights,
        "keep_freed_memory": engine.settings.keep_freed_memory,
        "decode_tokens_per_s": {},
        "question_tokens": engine.count_tokens(QUESTION),
        "sizes": {},
    }
    print(f"{'memory':>8} {'prompt':>7} " + " ".join(f"{c:>14}" for c in conditions))
    for size in (int(s) for s in args.sizes.split(",")):
        memories = memories_of(engine, size, pool)
        engine.clear_cache()
        engine.warm(memories, QUESTION)
        runs: dict[str, list[float]] = {c: [] for c in conditions}
        for repeat in range(args.repeats + 1):
            for condition in conditions:
                seconds = timed(engine, condition, memories, ratio)
                if repeat:  # the first round warms up allocators and caches
                    runs[condition].append(seconds)
        prompt = engine.generate(QUESTION, memories, reuse="none", max_new_tokens=1).stats.prompt_tokens
        # decoding speed after the prompt (the prompt is cached now, so this is quick)
        decode = engine.generate(QUESTION, memories, reuse="prefix", max_new_tokens=32).stats.decode_tokens_per_s
        report["decode_tokens_per_s"][str(size)] = decode
        medians = {c: statistics.median(v) for c, v in runs.items()}
        spread = {c: (min(v), max(v)) for c, v in runs.items()}
        speedup = {c: medians["none"] / medians[c] for c in conditions}
        report["sizes"][str(size)] = {
            "memories": len(memories),
            "prompt_tokens": prompt,
            "median_s": medians,
            "min_max_s": spread,
            "speedup_vs_none": speedup,
            "runs_s": runs,
        }
        cells = " ".join(f"{medians[c]:>7.3f}s {speedup[c]:>5.1f}x" for c in conditions)
        print(f"{size:>8} {prompt:>7} {cells}  decode {decode:.1f} tok/s", flush=True)
    print(f"\nblend recomputes {ratio:.0%} of fragment tokens")
    write_report(args.output, report)


if __name__ == "__main__":
    main()
