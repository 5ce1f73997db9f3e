"""Long memories recalled into a prompt whose system message the store never saw: TTFT and fidelity.

Each LoCoMo session (a whole dated transcript) is one memory of its conversation's user, added to
a :class:`MemoryStore` and warmed the way an agent stores memories: ``engine.warm(records,
tenant=user)``, with no system message known at store time (fragments are encoded after the
engine's own). Each question of the extractive single-hop subset (category 4) then recalls
``--k`` sessions from the store (a MiniLM search) and is asked under another system message,
with the recalled sessions as memories, in these conditions (same model, same run):

- ``none``: full recompute of the prompt (the baseline);
- ``default``: the engine's default (``reuse="auto"``): fragments found after the engine's own
  system message, shifted in and repaired; from this process's fragment pool;
- ``from store``: the same with the pool emptied, so every fragment is read from the store's disk
  tier (as in a new process);
- ``cold``: nothing warmed (the memories as plain texts, every cache emptied): the misses are
  computed with the question; must cost no more than ``none``;
- ``exact prefix``: after the sessions are warmed again under this system message (the best case).

Then each of ``--agent-questions`` questions is asked of an :class:`AgentMemory` (its own recall
of ``--k``, the same system message, nothing written back), under ``"none"``, under its default
reuse, under the default with each of ``--agent-ratios`` as its recompute ratio, and with
``--agent-reorder`` under ``"none"`` with its recalled memories in reverse order (the yardstick: a
change that computes everything exactly): TTFT, whether the answer holds the reference answer
(contains), and how many of ``none``'s right answers each arm keeps.

``--auto-shifts`` makes ``reuse="auto"`` shift long memories on every model (the measurement
``EngineSettings.auto_shifts`` is chosen by); without it each model's default is measured.

TTFT: medians of ``--repeats`` calls per question (prompt prefixes forgotten before each, so no
call reuses the previous one's prompt), the median over questions reported with the ratio of
``none``'s to each condition's. Fidelity against full recompute: KL and top-1 agreement of the
next-token distributions over ``none``'s greedy answer, with a reorder (full recompute of the
sessions in reverse order) as the yardstick, and whether the greedy answer is the same.

Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/long_memory.py [--models smollm2,gemma-3-270m] [--questions 12] [--repeats 3]
        [--agent-questions N] [--agent-ratios 0.25,0.5] [--agent-reorder]

Prints a table and writes ``benchmarks/results/long_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
from fidelity import kl_and_top1  # noqa: E402
from locomo import contains_answer, sessions, turn_text  # noqa: E402

from kvshift_memory import (  # noqa: E402
    AgentMemory,
    AgentSettings,
    GenerationResult,
    KVShiftEngine,
    MemoryStore,
    ScoreResult,
)
from kvshift_memory.embedding import MiniLMEmbedder  # noqa: E402

RESULTS = HERE / "results"
SYSTEM_PROMPT = "You answer questions about the user's past conversations in a few words."
ANSWER_TOKENS = 24
TIMED = ("none", "default", "from store", "cold", "exact prefix")
MODELS = {"smollm2": None, "gemma-3-270m": "gemma-3-270m"}


def session_memories(sample: dict) -> list[str]:
    """A conversation's sessions, each as one dated transcript."""
    conversation = sample["conversation"]
    return [
        f"({conversation.get(f'session_{number}_date_time', '')})\n" + "\n".join(turn_text(t) for t in turns)
        for number, turns in sessions(conversation)
    ]


def questions(count: int, seed: int) -> list[dict]:
    """``count`` extractive single-hop questions, drawn with ``seed`` over all conversations."""
    drawn = json.loads((locomo_dir() / "derived" / "locomo_cat4_extractive_short.json").read_text())
    random.Random(seed).shuffle(drawn)
    return drawn[:count]


def warm_sessions(engine: KVShiftEngine, store: MemoryStore, asked: list[dict]) -> None:
    """Store every session of the conversations these questions come from, each a memory of its own
    conversation's tenant, and warm its fragment with no system prompt known (as the agent stores it)."""
    samples = {s["sample_id"]: s for s in json.loads((locomo_dir() / "locomo10.json").read_text())}
    for sample_id in sorted({qa["sample_id"] for qa in asked}):
        for text in session_memories(samples[sample_id]):  # one at a time: together they pass the context window
            engine.warm([store.add(text, tenant=sample_id)], tenant=sample_id, lead_fragments=False)


def reference(
    engine: KVShiftEngine, messages: list[dict], recalled: list, tenant: str
) -> tuple[GenerationResult, list[int], ScoreResult]:
    """Full recompute's greedy answer, the tokens to score along it (its end where the answer is empty)
    and full recompute's next-token distributions along them."""
    answer = engine.generate(messages, recalled, reuse="none", max_new_tokens=ANSWER_TOKENS, tenant=tenant)
    continuation = answer.token_ids or [min(engine.runner.eos_token_ids)]
    full = engine.score(messages, recalled, continuation, reuse="none", return_distributions=True, tenant=tenant)
    return answer, continuation, full


def ttft(engine: KVShiftEngine, messages, memories, tenant: str, reuse: str | None, forget_fragments: bool):
    """One call's TTFT and stats, with the prompt prefixes forgotten first."""
    engine.clear_cache(prefixes=True, fragments=forget_fragments)
    result = engine.generate(messages, memories, reuse=reuse, max_new_tokens=1, tenant=tenant)
    return result.stats.ttft_s, result.stats


def run_model(name: str, args, embedder: MiniLMEmbedder) -> dict:
    engine = KVShiftEngine.from_pretrained(MODELS.get(name, name), auto_shifts=True if args.auto_shifts else None)
    asked = questions(args.questions, args.seed)
    asked_of_agents = questions(args.agent_questions or args.questions, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        store = MemoryStore(folder, embedder=embedder, index_url=":memory:")
        warm_sessions(engine, store, asked + asked_of_agents)
        rows = []
        for index, qa in enumerate(asked):
            user = qa["sample_id"]
            recalled = store.search(qa["question"], tenant=user, k=args.k)
            texts = [record.text for record in recalled]
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": qa["question"]}]
            plan = engine.planner.plan(messages, recalled, tenant=user)
            row: dict = {
                "question": qa["question"],
                "answer": qa["answer"],
                "memory_tokens": sum(span.end - span.start for span in plan.layout.fragments),
                "prompt_tokens": plan.layout.length,
                "ttft_s": {},
            }
            none_answer, continuation, full = reference(engine, messages, recalled, user)
            engine.clear_cache(prefixes=True, fragments=False)
            default = engine.generate(messages, recalled, max_new_tokens=ANSWER_TOKENS, tenant=user)
            row["none_answer"], row["default_answer"] = none_answer.text, default.text
            row["none_right"] = contains_answer(none_answer.text, str(qa["answer"]))
            row["default_right"] = contains_answer(default.text, str(qa["answer"]))
            row["greedy_match"] = default.token_ids == none_answer.token_ids
            row["default_memory_reuse"] = default.stats.memory_reuse
            for condition, memories, reuse in (("reorder", recalled[::-1], "none"), ("default", recalled, None)):
                engine.clear_cache(prefixes=True, fragments=False)
                scored = engine.score(
                    messages, memories, continuation, reuse=reuse, return_distributions=True, tenant=user
                )
                assert full.distributions is not None and scored.distributions is not None
                kl, top1 = kl_and_top1(full.distributions, scored.distributions)
                row[f"{condition}_kl"], row[f"{condition}_top1"] = kl, top1
            times: dict[str, list[float]] = {c: [] for c in TIMED if c != "exact prefix"}
            for _ in range(args.repeats):
                times["none"].append(ttft(engine, messages, recalled, user, "none", False)[0])
                seconds, stats = ttft(engine, messages, recalled, user, None, False)
                times["default"].append(seconds)
                row["default_hits"] = stats.fragments_hit
                seconds, stats = ttft(engine, messages, recalled, user, None, True)
                times["from store"].append(seconds)
                row["store_loaded"] = stats.fragments_loaded
                seconds, stats = ttft(engine, messages, texts, user, None, True)
                times["cold"].append(seconds)
                row["cold_missed"] = stats.fragments_missed
            row["ttft_s"] = {c: statistics.median(v) for c, v in times.items()}
            rows.append(row)
            print(
                f"  {name} q{index:02d} {row['memory_tokens']:5d} tok  "
                + " ".join(f"{c}:{row['ttft_s'][c] * 1000:6.0f}ms" for c in times)
                + f"  KL {row['default_kl']:.4f} (reorder {row['reorder_kl']:.4f}) match {row['greedy_match']}",
                flush=True,
            )
        # the best case: fragments warmed after this very system message (the same questions again)
        for row, qa in zip(rows, asked, strict=True):
            user = qa["sample_id"]
            recalled = store.search(qa["question"], tenant=user, k=args.k)
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": qa["question"]}]
            engine.warm(recalled, messages, tenant=user, lead_fragments=False)
            _, continuation, full = reference(engine, messages, recalled, user)
            engine.clear_cache(prefixes=True, fragments=False)
            scored = engine.score(messages, recalled, continuation, return_distributions=True, tenant=user)
            assert full.distributions is not None and scored.distributions is not None
            row["exact_kl"], row["exact_top1"] = kl_and_top1(full.distributions, scored.distributions)
            row["ttft_s"]["exact prefix"] = statistics.median(
                ttft(engine, messages, recalled, user, None, False)[0] for _ in range(args.repeats)
            )
        agent_rows = [ask_agents(engine, store, qa, index, args) for index, qa in enumerate(asked_of_agents)]
        store.close()
    engine_summary = summarise(name, rows) if rows else {"model": name, "questions": 0}
    return {**engine_summary, "agent": summarise_agents(agent_rows)}


class _ReorderedAgent(AgentMemory):
    """The agent with its recalled memories in reverse order (the reorder yardstick)."""

    def _recall(self, message: str, exclude: set[tuple[str, int]]) -> list[Any]:
        return super()._recall(message, exclude)[::-1]


def agent_arms(args) -> list[tuple[str, str, float | None, type[AgentMemory]]]:
    """(arm, reuse, recompute ratio, agent class) for each arm asked; ``none`` first."""
    default = AgentSettings().reuse
    arms: list[tuple[str, str, float | None, type[AgentMemory]]] = [
        ("none", "none", None, AgentMemory),
        ("default", default, None, AgentMemory),
    ]
    arms += [(f"ratio {r}", default, float(r), AgentMemory) for r in args.agent_ratios.split(",") if r]
    if args.agent_reorder:
        arms.append(("reorder", "none", None, _ReorderedAgent))
    return arms


def ask_agents(engine: KVShiftEngine, store: MemoryStore, qa: dict, index: int, args) -> dict:
    """The question asked of an :class:`AgentMemory` in each arm, each in a new session (recall,
    window and write-back as a user gets them; nothing written back)."""
    row: dict = {"question": qa["question"], "answer": qa["answer"]}
    for condition, reuse, ratio, agent_class in agent_arms(args):
        engine.clear_cache(prefixes=True, fragments=False)
        settings = AgentSettings(
            system_prompt=SYSTEM_PROMPT,
            recall_k=args.k,
            window_tokens=4096,
            max_new_tokens=ANSWER_TOKENS,
            reuse=reuse,
            recompute_ratio=ratio,
            write_back=False,
            resume=False,
        )
        agent = agent_class(
            engine, store, user_id=qa["sample_id"], session_id=f"{condition}-{index}", settings=settings
        )
        reply = agent.chat(qa["question"])
        row[condition] = {
            "text": reply.text,
            "right": contains_answer(reply.text, str(qa["answer"])),
            "ttft_s": reply.stats.ttft_s,
            "recalled": len(reply.recalled),
            "memory_reuse": reply.stats.memory_reuse,
        }
    timings = " ".join(f"{arm} {row[arm]['ttft_s'] * 1000:5.0f}ms" for arm, *_ in agent_arms(args))
    print(f"  agent q{index:02d} recalled {row['default']['recalled']}: {timings} {row['default']['memory_reuse']}")
    return row


def summarise_agents(rows: list[dict]) -> dict:
    arms = [arm for arm in rows[0] if isinstance(rows[0][arm], dict)]
    ttft = {arm: statistics.median(r[arm]["ttft_s"] for r in rows) for arm in arms}
    none_right = [r for r in rows if r["none"]["right"]]
    return {
        "questions": len(rows),
        "ttft_s_median": ttft,
        "speedup_vs_none": {arm: ttft["none"] / ttft[arm] for arm in arms},
        "none_right": len(none_right),
        "keeps": {arm: sum(r[arm]["right"] for r in none_right) for arm in arms},
        "right": {arm: sum(r[arm]["right"] for r in rows) for arm in arms},
        "same_answer": {arm: sum(r[arm]["text"] == r["none"]["text"] for r in rows) for arm in arms},
        "rows": rows,
    }


def summarise(name: str, rows: list[dict]) -> dict:
    median_ttft = {c: statistics.median(r["ttft_s"][c] for r in rows) for c in TIMED}
    none_right = [r for r in rows if r["none_right"]]
    return {
        "model": name,
        "questions": len(rows),
        "memory_tokens_median": statistics.median(r["memory_tokens"] for r in rows),
        "ttft_s_median": median_ttft,
        "speedup_vs_none": {c: median_ttft["none"] / median_ttft[c] for c in TIMED},
        "kl": {c: statistics.fmean(r[f"{c}_kl"] for r in rows) for c in ("default", "exact", "reorder")},
        "top1": {c: statistics.fmean(r[f"{c}_top1"] for r in rows) for c in ("default", "exact", "reorder")},
        "greedy_match": sum(r["greedy_match"] for r in rows),
        "none_right": len(none_right),
        "default_keeps": sum(r["default_right"] for r in none_right),
        "default_right": sum(r["default_right"] for r in rows),
        "rows": rows,
    }


def print_table(results: list[dict]) -> None:
    engine_results = [s for s in results if s["questions"]]
    if engine_results:
        print_engine_table(engine_results)
    print()
    print(
        f"{'AgentMemory':<14} {'arm':<10} {'questions':>9} {'TTFT':>10} {'speedup':>8} {'right':>6} "
        f"{'kept of none right':>18} {'same answer':>11}"
    )
    for s in results:
        a = s["agent"]
        for arm, ttft in a["ttft_s_median"].items():
            print(
                f"{s['model']:<14} {arm:<10} {a['questions']:>9} {ttft * 1000:>7.0f} ms "
                f"{a['speedup_vs_none'][arm]:>7.1f}x {a['right'][arm]:>6} "
                f"{a['keeps'][arm]:>11}/{a['none_right']:<6} {a['same_answer'][arm]:>11}"
            )


def print_engine_table(results: list[dict]) -> None:
    print()
    print(f"{'model':<14} {'memory tok':>10} " + " ".join(f"{c:>16}" for c in TIMED))
    for s in results:
        cells = (f"{s['ttft_s_median'][c] * 1000:8.0f} ms {s['speedup_vs_none'][c]:4.1f}x" for c in TIMED)
        print(f"{s['model']:<14} {s['memory_tokens_median']:>10.0f} " + " ".join(f"{cell:>16}" for cell in cells))
    print()
    print(
        f"{'model':<14} {'KL default':>10} {'KL exact':>9} {'KL reorder':>10} {'top-1 def':>9} {'top-1 ex':>8} "
        f"{'greedy =':>8} {'none right':>10} {'kept':>5}"
    )
    for s in results:
        print(
            f"{s['model']:<14} {s['kl']['default']:>10.4f} {s['kl']['exact']:>9.4f} {s['kl']['reorder']:>10.4f} "
            f"{s['top1']['default']:>9.3f} {s['top1']['exact']:>8.3f} {s['greedy_match']:>5}/{s['questions']:<2} "
            f"{s['none_right']:>10} {s['default_keeps']:>5}"
        )


def question_set_parser(description: str | None, questions: int, output: Path) -> argparse.ArgumentParser:
    """The arguments of every benchmark on this question set: models, questions, k, seed, threads, output."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models", default="smollm2,gemma-3-270m", help="shipped models' short names, or model folders / hub ids"
    )
    parser.add_argument("--questions", type=int, default=questions)
    parser.add_argument("--k", type=int, default=3, help="memories recalled per question")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=str(output))
    return parser


def main() -> None:
    parser = question_set_parser(__doc__, 12, RESULTS / "long_memory.json")
    parser.add_argument(
        "--agent-questions", type=int, default=0, help="questions asked of the agents (default: --questions)"
    )
    parser.add_argument("--agent-ratios", default="", help="recompute ratios of extra default arms, e.g. 0.25,0.5")
    parser.add_argument("--agent-reorder", action="store_true", help="add the reorder arm (none, reversed recall)")
    parser.add_argument(
        "--auto-shifts", action="store_true", help="auto shifts memories on every model (how auto_shifts is chosen)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    embedder = MiniLMEmbedder()
    results = [run_model(name, args, embedder) for name in args.models.split(",")]
    print_table(results)
    write_report(Path(args.output), {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
