"""LoCoMo through AgentMemory: ingest conversations session by session, then ask single-hop questions.

Each conversation's turns are observed one by one (``AgentMemory.observe``, one agent session per
LoCoMo session), so the write-back rule decides what is archived, with its fragment encoded and
stored. Then every question of the derived extractive single-hop subset (category 4) is asked in a
fresh session under four conditions, same model, same run:

- ``none``: no memory, the question alone;
- ``full``: the transcript's most recent turns that fit ``--full-context-tokens``, then the
  question (the transcript is prefilled once per conversation and reused exactly: its TTFT is the
  best full context can do; the first, cold question's TTFT is in the JSON);
- ``rag``: AgentMemory recall (the same search), memories as text, ``reuse="none"``;
- ``kvshift``: the same recall with the stored fragments, ``reuse="blend"`` (the agent's default
  ``recompute_ratio`` unless ``--recompute-ratio``).

Answer retention: of the questions ``rag`` answers right, the share ``kvshift`` also answers right.

Before the questions the engine's fragment pool and the store's RAM tier are emptied, so
fragments come from the store's disk tier, as in a new process; before each recall condition the
store's RAM tier and the embedder's recent queries are emptied again, so each condition embeds its
query (the first one would otherwise pay for the second's). Reported per condition:
contains-answer accuracy, token F1, TTFT (from the call, retrieval included) median and mean; for
the recall conditions session recall@k (a recalled memory comes from an evidence session), turn
recall@k (the evidence turn itself was recalled) and fragments hit. Data is read from
../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/locomo.py [--samples conv-26,conv-30] [--k 4]     # ~10 min on 2 cores

Prints a table and writes ``benchmarks/results/locomo.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import string
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import locomo_dir, write_report  # noqa: E402

from kvshift_memory import AgentMemory, AgentSettings, KVShiftEngine, MemoryStore  # noqa: E402

RESULTS = HERE / "results"
CONDITIONS = ("none", "full", "rag", "kvshift")
SYSTEM_PROMPT = "You are a helpful assistant. Answer the question in a few words, using the memories."


def normalise(text: str) -> list[str]:
    text = text.lower()
    text = "".join(c for c in text if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return text.split()


def token_f1(prediction: str, answer: str) -> float:
    predicted, gold = normalise(prediction), normalise(answer)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def contains_answer(prediction: str, answer: str) -> bool:
    return " ".join(normalise(answer)) in " ".join(normalise(prediction))


def turn_text(turn: dict) -> str:
    text = f"{turn['speaker']}: {turn['text']}"
    if turn.get("blip_caption"):
        text += f" [shares a photo: {turn['blip_caption']}]"
    return text


def sessions(conversation: dict) -> list[tuple[int, list[dict]]]:
    found, number = [], 1
    while f"session_{number}" in conversation:
        found.append((number, conversation[f"session_{number}"]))
        number += 1
    return found


def ingest(engine, store, sample: dict, settings: AgentSettings) -> dict:
    """Observe every turn; returns which dia_ids were archived, and under which memory ids."""
    archived: dict[str, str] = {}  # memory id -> dia_id
    started = time.perf_counter()
    turns = 0
    for number, session in sessions(sample["conversation"]):
        agent = AgentMemory(
            engine, store, user_id=sample["sample_id"], session_id=f"session_{number}", settings=settings
        )
        for turn in session:
            record = agent.observe(turn_text(turn))
            turns += 1
            if record is not None:
                archived[record.id] = turn["dia_id"]
    evidence = {e for qa in sample["qa"] for e in qa.get("evidence", [])}
    kept = set(archived.values())
    return {
        "turns": turns,
        "archived": len(archived),
        "archived_share": len(archived) / turns,
        "evidence_turns": len(evidence),
        "evidence_archived": len(evidence & kept) / max(1, len(evidence)),
        "seconds": time.perf_counter() - started,
        "memory_ids": archived,
    }


def transcript(engine, sample: dict, budget: int) -> str:
    """The most recent turns of the conversation that fit ``budget`` tokens."""
    lines: list[str] = []
    used = 0
    for _number, session in reversed(sessions(sample["conversation"])):
        for turn in reversed(session):
            line = turn_text(turn)
            cost = engine.count_tokens(line) + 1
            if used + cost > budget:
                return "\n".join(reversed(lines))
            lines.append(line)
            used += cost
    return "\n".join(reversed(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", default="conv-26,conv-30", help="LoCoMo conversations (sample ids)")
    parser.add_argument("--k", type=int, default=4, help="memories recalled per question")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--full-context-tokens", type=int, default=4096)
    parser.add_argument("--reuse", default="blend", help="the kvshift condition's reuse (blend or prefix)")
    parser.add_argument("--recompute-ratio", type=float, default=None, help="the blend's (default: the agent's)")
    parser.add_argument("--min-recompute-tokens", type=int, default=None, help="the engine setting (default: its own)")
    parser.add_argument("--output", type=Path, default=RESULTS / "locomo.json")
    args = parser.parse_args()
    torch.set_num_threads(2)

    data = {s["sample_id"]: s for s in json.loads((locomo_dir() / "locomo10.json").read_text())}
    questions = json.loads((locomo_dir() / "derived" / "locomo_cat4_extractive_short.json").read_text())
    overrides = {} if args.min_recompute_tokens is None else {"min_recompute_tokens": args.min_recompute_tokens}
    engine = KVShiftEngine.from_pretrained(**overrides)
    # ingested as the asking setting will read it: the blend's fragments are encoded on archive
    settings = AgentSettings(
        system_prompt=SYSTEM_PROMPT, recall_k=args.k, max_new_tokens=args.max_new_tokens, reuse=args.reuse
    )
    asking = AgentSettings(
        system_prompt=SYSTEM_PROMPT, recall_k=args.k, max_new_tokens=args.max_new_tokens, write_back=False
    )
    if args.recompute_ratio is not None:
        asking = replace(asking, recompute_ratio=args.recompute_ratio)
    report: dict = {
        "k": args.k,
        "reuse": args.reuse,
        "recompute_ratio": asking.recompute_ratio,
        "min_recompute_tokens": engine.settings.min_recompute_tokens,
        "samples": {},
        "questions": [],
    }
    rows: list[dict] = []
    for sample_id in args.samples.split(","):
        sample = data[sample_id]
        with tempfile.TemporaryDirectory() as folder, MemoryStore(folder) as store:
            ingested = ingest(engine, store, sample, settings)
            memory_ids = ingested.pop("memory_ids")
            report["samples"][sample_id] = ingested
            print(
                f"{sample_id}: {ingested['turns']} turns observed in {ingested['seconds']:.0f} s, "
                f"{ingested['archived_share']:.0%} archived, {ingested['evidence_archived']:.0%} of evidence turns"
            )
            context = transcript(engine, sample, args.full_context_tokens)
            engine.clear_cache()
            store.clear_cache()
            first_full = True
            for index, qa in enumerate(q for q in questions if q["sample_id"] == sample_id):
                row = {"sample_id": sample_id, "question": qa["question"], "answer": qa["answer"]}
                evidence_sessions = {f"session_{n}" for n in qa["evidence_sessions"]}
                evidence = set(qa["evidence"])

                result = engine.generate(
                    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": qa["question"]}],
                    reuse="none",
                    max_new_tokens=args.max_new_tokens,
                )
                row["none"] = {"text": result.text, "ttft_s": result.stats.ttft_s}

                full_prompt = f"Conversation so far:\n{context}\n\nQuestion: {qa['question']}"
                result = engine.generate(
                    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": full_prompt}],
                    reuse="prefix",
                    max_new_tokens=args.max_new_tokens,
                )
                row["full"] = {"text": result.text, "ttft_s": result.stats.ttft_s, "cold": first_full}
                first_full = False

                # kvshift first: "rag" leaves its exact prompt in the prefix cache, which kvshift
                # would then reuse whole (recomputing nothing) instead of placing fragments
                for condition, reuse in (("kvshift", args.reuse), ("rag", "none")):
                    # each pays its own query embedding (the embedder keeps recent queries' vectors)
                    store.clear_cache()
                    agent = AgentMemory(
                        engine,
                        store,
                        user_id=sample_id,
                        session_id=f"{condition}-q{index}",
                        settings=asking,
                        reuse=reuse,
                    )
                    reply = agent.chat(qa["question"])
                    recalled = reply.recalled
                    row[condition] = {
                        "text": reply.text,
                        "ttft_s": reply.ttft_s,
                        "engine_ttft_s": reply.stats.ttft_s,
                        "recalled": [r.id for r in recalled],
                        "session_hit": any(r.session_id in evidence_sessions for r in recalled),
                        "turn_hit": any(memory_ids.get(r.id) in evidence for r in recalled),
                        "fragments_hit": reply.stats.fragments_hit,
                        "fragments_loaded": reply.stats.fragments_loaded,
                        "prompt_tokens": reply.stats.prompt_tokens,
                        "recomputed_tokens": reply.stats.recomputed_tokens,
                    }
                for condition in CONDITIONS:
                    cell = row[condition]
                    cell["contains"] = contains_answer(cell["text"], qa["answer"])
                    cell["f1"] = token_f1(cell["text"], qa["answer"])
                rows.append(row)
                print(
                    f"  q{index:02d} "
                    + " ".join(
                        f"{c}:{'+' if row[c]['contains'] else '-'}{row[c]['ttft_s'] * 1000:5.0f}ms" for c in CONDITIONS
                    )
                    + f"  {qa['question'][:50]}"
                )
    report["questions"] = rows
    summary = {}
    for condition in CONDITIONS:
        cells = [row[condition] for row in rows if not row[condition].get("cold")]
        ttfts = [c["ttft_s"] for c in cells]
        summary[condition] = {
            "accuracy": statistics.mean(row[condition]["contains"] for row in rows),
            "f1": statistics.mean(row[condition]["f1"] for row in rows),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_mean_s": statistics.mean(ttfts),
        }
        if condition in ("rag", "kvshift"):
            summary[condition]["session_recall_at_k"] = statistics.mean(row[condition]["session_hit"] for row in rows)
            summary[condition]["turn_recall_at_k"] = statistics.mean(row[condition]["turn_hit"] for row in rows)
            summary[condition]["engine_ttft_median_s"] = statistics.median(
                row[condition]["engine_ttft_s"] for row in rows
            )
            summary[condition]["fragments_hit_mean"] = statistics.mean(row[condition]["fragments_hit"] for row in rows)
    summary["same_recall"] = statistics.mean(row["rag"]["recalled"] == row["kvshift"]["recalled"] for row in rows)
    # of the answers full recompute of the same recall gets right, the share KV reuse keeps
    right = [row for row in rows if row["rag"]["contains"]]
    summary["retention_vs_rag"] = statistics.mean(row["kvshift"]["contains"] for row in right) if right else None  # type: ignore[assignment]
    summary["kvshift_ttft_speedup_vs_rag"] = summary["rag"]["ttft_median_s"] / summary["kvshift"]["ttft_median_s"]
    summary["learned_costs"] = {  # what the engine's cost model learned here (engine/costs.py)
        "pass_seconds_per_token": engine.costs.pass_token_s(),
        "fetch_seconds_40_tokens": engine.costs.fetch_s(40),
    }
    report["summary"] = summary
    print(f"\n{len(rows)} questions; k = {args.k}; TTFT from the call, retrieval included (full: warm prefix)")
    print(
        f"{'condition':>10} {'accuracy':>9} {'F1':>6} {'TTFT med':>9} {'recall@k sess':>14} {'turn':>6} {'frag hit':>9}"
    )
    for condition in CONDITIONS:
        s = summary[condition]
        recall = (
            f"{s['session_recall_at_k']:14.3f} {s['turn_recall_at_k']:6.3f} {s['fragments_hit_mean']:9.2f}"
            if "session_recall_at_k" in s
            else ""
        )
        print(f"{condition:>10} {s['accuracy']:9.3f} {s['f1']:6.3f} {s['ttft_median_s'] * 1000:7.0f}ms {recall}")
    print(
        f"kvshift TTFT {summary['kvshift_ttft_speedup_vs_rag']:.2f}x lower than text RAG at the median; "
        f"same recall in {summary['same_recall']:.0%}"
    )
    if summary["retention_vs_rag"] is not None:
        print(
            f"answer retention of kvshift ({args.reuse}, recompute_ratio {asking.recompute_ratio}) "
            "against the same recall with "
            f"reuse='none': {summary['retention_vs_rag']:.3f} of {len(right)} right answers kept"
        )
    costs = summary["learned_costs"]
    if costs["pass_seconds_per_token"] is not None and costs["fetch_seconds_40_tokens"] is not None:
        print(
            f"cost model: {costs['pass_seconds_per_token'] * 1000:.2f} ms a token of a pass, "
            f"{costs['fetch_seconds_40_tokens'] * 1000:.2f} ms to fetch a 40-token fragment"
        )
    write_report(args.output, report)


if __name__ == "__main__":
    main()
