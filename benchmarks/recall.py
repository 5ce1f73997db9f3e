"""Does the store find the evidence? Session and turn recall@k on all of LoCoMo's single-hop questions.

For each of the ten LoCoMo conversations, the turns the agent's write-back rule archives are
stored in a MemoryStore (RAM tier, in-process index, the bundled embedder), each as the agent
archives it (with the question it answers, when it answers one), in the conversation's session.
Then each question of the derived extractive single-hop subset (341) is searched, top ``k``,
with the embedding alone (``keyword_weight=0``) and with the keyword path fused at several
weights. A question's session is recalled when a hit comes from an evidence session, its turn when
a hit is the evidence turn. No model is run: this measures retrieval only, over many more questions
than ``benchmarks/locomo.py`` can afford to answer. Data is read from ../shared/data/locomo
(CC BY-NC 4.0), never copied.

    python benchmarks/recall.py [--k 4]        # ~3 min on 2 cores

Prints a table and writes ``benchmarks/results/recall.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import locomo_dir, write_report  # noqa: E402
from locomo import sessions, turn_text  # noqa: E402

from kvshift_memory import MemoryStore  # noqa: E402
from kvshift_memory.adapters import (
    WriteBackModel,  # noqa: E402
    archived_text,  # noqa: E402
)
from kvshift_memory.embedding import MiniLMEmbedder  # noqa: E402

RESULTS = HERE / "results"
WEIGHTS = (0.0, 0.02, 0.05, 0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS / "recall.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    data = json.loads((locomo_dir() / "locomo10.json").read_text())
    questions = json.loads((locomo_dir() / "derived" / "locomo_cat4_extractive_short.json").read_text())
    rule, embedder = WriteBackModel.bundled(), MiniLMEmbedder()
    hits: dict[float, dict[str, list[bool]]] = {weight: {"session": [], "turn": []} for weight in WEIGHTS}
    archived_total = turns_total = 0
    for sample in data:
        asked = [q for q in questions if q["sample_id"] == sample["sample_id"]]
        if not asked:
            continue
        stores = {
            weight: MemoryStore(kv_url="memory://", index_url=":memory:", embedder=embedder, keyword_weight=weight)
            for weight in WEIGHTS
        }
        dia_of: dict[tuple[float, str], str] = {}
        previous = ""
        for number, session in sessions(sample["conversation"]):
            for turn in session:
                text = turn_text(turn)
                turns_total += 1
                if rule.decide(rule.importance(text, previous)) == "archive":
                    archived_total += 1
                    for weight, store in stores.items():
                        record = store.add(archived_text(text, previous), tenant="u", session_id=f"session_{number}")
                        dia_of[(weight, record.id)] = turn["dia_id"]
                previous = text
        for qa in asked:
            evidence_sessions = {f"session_{n}" for n in qa["evidence_sessions"]}
            for weight, store in stores.items():
                found = store.search(qa["question"], tenant="u", k=args.k)
                hits[weight]["session"].append(any(r.session_id in evidence_sessions for r in found))
                hits[weight]["turn"].append(any(dia_of[(weight, r.id)] in qa["evidence"] for r in found))
        for store in stores.values():
            store.close()
        print(f"{sample['sample_id']}: {len(asked)} questions")
    report = {
        "k": args.k,
        "questions": len(hits[WEIGHTS[0]]["session"]),
        "archived_share": archived_total / turns_total,
        "seconds": time.perf_counter() - started,
        "results": {
            str(weight): {f"{kind}_recall_at_k": statistics.mean(values) for kind, values in found.items()}
            for weight, found in hits.items()
        },
    }
    print(f"\n{report['questions']} questions, {report['archived_share']:.0%} of turns archived, k = {args.k}")
    print(f"{'keyword_weight':>15} {'session recall':>15} {'turn recall':>12}")
    for weight, result in report["results"].items():
        print(f"{weight:>15} {result['session_recall_at_k']:15.3f} {result['turn_recall_at_k']:12.3f}")
    write_report(args.output, report)


if __name__ == "__main__":
    main()
