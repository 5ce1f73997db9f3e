"""Could the blend's own confidence say when it may answer? A gate measured before being built.

``reuse="auto"`` is exact on both shipped models because the blend changes answers full recompute
gets right (``long_memory.py``). A gate would keep the blend's speed where it is safe: stream the
blend's tokens while its next-token distribution is confident (the top token's probability ahead
of the second's by at least a threshold), and at the first unsure token compute the prompt exactly
and continue from there. The answer is then full recompute's whenever every token streamed before
the switch is full recompute's, and the first token comes at the blend's speed only when the
blend is sure of it.

Both are counted here without timing anything, on ``long_memory.py``'s set: LoCoMo sessions as
memories warmed with no system message known, ``--k`` recalled per question, asked under another
system message. Per question, full recompute's greedy answer, then the blend's next-token
distributions along it (the blend's tokens are full recompute's exactly as long as each position's
top token agrees): per threshold, how many questions would get their first token from the blend,
and how many answers the gate would keep equal to full recompute's.

Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/confidence.py [--models smollm2,gemma-3-270m] [--questions 40]

Prints a table and writes ``benchmarks/results/confidence.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import write_report  # noqa: E402
from long_memory import (  # noqa: E402
    MODELS,
    SYSTEM_PROMPT,
    question_set_parser,
    questions,
    reference,
    warm_sessions,
)

from kvshift_memory import KVShiftEngine, MemoryStore  # noqa: E402
from kvshift_memory.embedding import MiniLMEmbedder  # noqa: E402

RESULTS = HERE / "results"


def measure_model(name: str, args: argparse.Namespace, embedder: MiniLMEmbedder) -> dict:
    """Per question: the blend's top-two margin and its agreement with full recompute at every answer position."""
    engine = KVShiftEngine.from_pretrained(MODELS.get(name, name))
    asked = questions(args.questions, args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = MemoryStore(folder, embedder=embedder, index_url=":memory:")
        warm_sessions(engine, store, asked)
        for index, qa in enumerate(asked):
            user = qa["sample_id"]
            recalled = store.search(qa["question"], tenant=user, k=args.k)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": qa["question"]}]
            _, answer, full = reference(engine, messages, recalled, user)
            engine.clear_cache(prefixes=True, fragments=False)
            blend = engine.score(messages, recalled, answer, reuse="blend", return_distributions=True, tenant=user)
            assert full.distributions is not None and blend.distributions is not None
            top_two = blend.distributions.exp().topk(2, dim=-1).values
            row = {
                "question": qa["question"],
                "shifted": blend.stats.fragments_hit,
                "margin": [round(float(m), 4) for m in top_two[:, 0] - top_two[:, 1]],
                "agrees": (full.distributions.argmax(-1) == blend.distributions.argmax(-1)).tolist(),
            }
            rows.append(row)
            print(
                f"  {name} q{index:02d} first-token margin {row['margin'][0]:.3f} "
                + "agrees "
                + "".join("1" if a else "0" for a in row["agrees"]),
                flush=True,
            )
        store.close()
    return {"model": name, "questions": len(rows), "gates": gates(rows, args.thresholds), "rows": rows}


def gates(rows: list[dict], thresholds: list[float]) -> list[dict]:
    """What the gate would do at each threshold: first tokens from the blend, answers kept equal."""
    summary = []
    for threshold in thresholds:
        streamed = [next((t for t, m in enumerate(r["margin"]) if m < threshold), len(r["margin"])) for r in rows]
        summary.append(
            {
                "threshold": threshold,
                "first_token_from_blend": sum(count > 0 for count in streamed),
                "answers_equal": sum(all(r["agrees"][:count]) for r, count in zip(rows, streamed, strict=True)),
                "blend_tokens_median": statistics.median(streamed),
            }
        )
    return summary


def print_table(results: list[dict]) -> None:
    print(f"\n{'model':<14} {'threshold':>9} {'first token from blend':>23} {'answer = none':>14}")
    for result in results:
        rows, n = result["rows"], result["questions"]
        for gate in result["gates"]:
            print(
                f"{result['model']:<14} {gate['threshold']:>9.2f} {gate['first_token_from_blend']:>19}/{n:<3} "
                f"{gate['answers_equal']:>10}/{n:<3}"
            )
        first_agree = sum(r["agrees"][0] for r in rows)
        every_agree = sum(all(r["agrees"]) for r in rows)
        median_margin = statistics.median(r["margin"][0] for r in rows)
        print(
            f"{result['model']:<14} ungated blend: first token = none's {first_agree}/{n}, "
            f"whole answer {every_agree}/{n}; first-token margin median {median_margin:.3f}"
        )


def main() -> None:
    parser = question_set_parser(__doc__, 40, RESULTS / "confidence.json")
    parser.add_argument("--thresholds", type=lambda s: [float(t) for t in s.split(",")], default=[0.1, 0.2, 0.4, 0.8])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embedder = MiniLMEmbedder()
    results = [measure_model(name, args, embedder) for name in args.models.split(",")]
    print_table(results)
    write_report(Path(args.output), {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
