"""Does a turn cost the same at turn 30 as at turn 3? TTFT per turn of one long session.

One user's messages from a LoCoMo conversation (the first speaker's turns, in order) are sent to
two agents with the same settings: ``reuse="blend"`` (the window's cache reused, recalled
fragments shifted in, the window shifting when it passes its budget) and ``reuse="none"`` (every
turn's prompt prefilled whole). Both see the same turns, and the two users' stores are separate,
so each recalls only what it archived itself. Per turn: prompt tokens, tokens computed (prefilled,
recomputed or encoded), tokens shifted, TTFT of each, and the ratio. Data is read from
../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/turns.py [--turns 40] [--window-tokens 1024]     # ~6 min on 2 cores

Prints a table and writes ``benchmarks/results/turns.json``.
"""

from __future__ import annotations

import argparse
import json
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
from benchdata import locomo_dir, write_report  # noqa: E402
from locomo import sessions  # noqa: E402

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore  # noqa: E402

RESULTS = HERE / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sample", default="conv-26")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--window-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--output", type=Path, default=RESULTS / "turns.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    sample = next(s for s in json.loads((locomo_dir() / "locomo10.json").read_text()) if s["sample_id"] == args.sample)
    speaker = sample["conversation"]["speaker_a"]
    messages = [
        t["text"] for _, session in sessions(sample["conversation"]) for t in session if t["speaker"] == speaker
    ]
    messages = messages[: args.turns]
    engine = KVShiftEngine.from_pretrained()
    rows = []
    with tempfile.TemporaryDirectory() as folder, MemoryStore(folder) as store:
        agents = {
            reuse: AgentMemory(
                engine,
                store,
                user_id=f"user-{reuse}",
                session_id="long",
                reuse=reuse,
                window_tokens=args.window_tokens,
                max_new_tokens=args.max_new_tokens,
            )
            for reuse in ("blend", "none")
        }
        for number, message in enumerate(messages, start=1):
            row: dict[str, Any] = {"turn": number}
            for reuse, agent in agents.items():  # blend first: "none" would leave its exact prompt cached
                reply = agent.chat(message)
                s = reply.stats
                row[reuse] = {
                    "ttft_s": reply.ttft_s,
                    "prompt_tokens": s.prompt_tokens,
                    "computed_tokens": s.prompt_tokens - s.reused_tokens,
                    "shifted_tokens": s.shifted_tokens,
                    "recalled": len(reply.recalled),
                    "evicted_turns": reply.evicted_turns,
                }
            rows.append(row)
            b, n = row["blend"], row["none"]
            print(
                f"turn {number:3d}  prompt {b['prompt_tokens']:5d}  computed {b['computed_tokens']:4d}  "
                f"shifted {b['shifted_tokens']:4d}"
                f"{'  (window shifted)' if b['evicted_turns'] else '':18}  TTFT blend {b['ttft_s'] * 1000:5.0f} ms  "
                f"none {n['ttft_s'] * 1000:6.0f} ms  {n['ttft_s'] / b['ttft_s']:5.1f}x"
            )
    later = [r for r in rows if r["turn"] >= 5]
    summary = {
        "median_ttft_blend_s": statistics.median(r["blend"]["ttft_s"] for r in later),
        "median_ttft_none_s": statistics.median(r["none"]["ttft_s"] for r in later),
        "median_reused_share": statistics.median(
            1 - r["blend"]["computed_tokens"] / r["blend"]["prompt_tokens"] for r in later
        ),
        "window_shifts": sum(1 for r in rows if r["blend"]["evicted_turns"]),
        "first_half_median_ttft_blend_s": statistics.median(r["blend"]["ttft_s"] for r in later[: len(later) // 2]),
        "second_half_median_ttft_blend_s": statistics.median(r["blend"]["ttft_s"] for r in later[len(later) // 2 :]),
    }
    report = {"summary": summary, "turns": rows}
    print(
        f"\nfrom turn 5 on: blend TTFT median {summary['median_ttft_blend_s'] * 1000:.0f} ms "
        f"(first half {summary['first_half_median_ttft_blend_s'] * 1000:.0f}, second half "
        f"{summary['second_half_median_ttft_blend_s'] * 1000:.0f}), "
        f"none {summary['median_ttft_none_s'] * 1000:.0f} ms; "
        f"{summary['median_reused_share']:.1%} of the prompt reused at the median; "
        f"the window shifted {summary['window_shifts']} times"
    )
    write_report(args.output, report)


if __name__ == "__main__":
    main()
