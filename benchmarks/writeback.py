"""Does the write-back rule keep what users say? Fitted on one split, measured on another.

Three labelled sources, each split once into fitting and held-out parts:

- **stated facts vs small talk** written for this project (``benchmarks/data/``, see its README):
  ``fit_turns.txt`` fits, ``heldout_turns.txt`` (facts with a later question, small talk) measures;
- **LoCoMo** (../shared/data/locomo, CC BY-NC 4.0): a turn is evidence when a question names it;
  conversations 1-5 fit, 6-10 are held out;
- **MemoryBank** (../shared/data/memorybank_en, MIT): never fitted. Its probing questions have no
  evidence labels; the silver evidence of a question is the user's turn the bundled MiniLM finds
  most similar to it among that user's turns (printed as such).

The rule is a logistic regression over :data:`FEATURES` (fitting sources weighted equally), with
thresholds set on the fitting data: a turn is archived at or above the importance that keeps 97 %
of the fitting facts and of the fitting evidence, deferred (window, stored when it leaves it) down to
the importance that keeps 99 % of them, and content-free below that. ``--fit`` writes the rule into
the package. Held-out figures, for the rule as fitted now:

- facts stored (archived now) and small talk stored (archived or deferred) of the project's set;
- LoCoMo evidence turns stored and share of all turns stored (``observe`` stores a deferred turn);
- MemoryBank silver evidence stored and share of user turns stored.

``--agent`` then runs the real thing on the held-out set with the bundled model: the facts told to
``AgentMemory.chat`` over eight sessions with the small talk between them, as a user would, then
each question asked in a fresh session twice, with ``reuse="none"`` and with the agent's default
reuse. It prints stated-fact recall across sessions (the fact's memory recalled into the question's
prompt), answers that contain the expected words under each reuse, answer retention of the default
against ``reuse="none"`` (of the answers full recompute gets right, the share the default keeps) and
the TTFT of both.

    python benchmarks/writeback.py [--fit] [--agent] [--reuse blend --recompute-ratio 0.1]

Prints tables and writes ``benchmarks/results/writeback.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import command_line, data_dir, locomo_dir, write_report  # noqa: E402

from kvshift_memory.adapters import FEATURES, WriteBackModel, turn_features  # noqa: E402

RESULTS = HERE / "results"
DATA = HERE / "data"
MODEL_FILE = HERE.parent / "kvshift_memory" / "agent" / "writeback_model.json"
LOCOMO_FIT_CONVERSATIONS = 5
ARCHIVE_KEEPS = 0.97
DEFER_KEEPS = 0.99
EAGER_THRESHOLD = 0.5  # more likely than not to carry something: its fragment is worth encoding now
SESSIONS = 8


def read_turns(path: Path) -> list[tuple[bool, str, str, str]]:
    """(is a fact, text, later question, expected answer) of each line of a turns file."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        kind, _, rest = line.partition(" ")
        text, question, answer = ([*(p.strip() for p in rest.split("|")), "", ""])[:3]
        rows.append((kind == "F", text, question, answer))
    return rows


def locomo_rows() -> list[tuple[int, str, str, bool]]:
    """(conversation index, turn text, previous turn's text, is evidence) of every LoCoMo turn."""
    rows = []
    for index, sample in enumerate(json.loads((locomo_dir() / "locomo10.json").read_text())):
        evidence = {e.strip() for qa in sample["qa"] for e in qa.get("evidence", [])}
        conversation, session = sample["conversation"], 1
        while f"session_{session}" in conversation:
            turns = conversation[f"session_{session}"]
            for position, turn in enumerate(turns):
                previous = turns[position - 1]["text"] if position else ""
                rows.append((index, turn["text"], previous, turn["dia_id"] in evidence))
            session += 1
    return rows


def memorybank_rows() -> list[tuple[str, str, str, bool]]:
    """(user, user turn, the AI turn before it, is silver evidence) for every MemoryBank user turn."""
    from kvshift_memory.embedding import MiniLMEmbedder

    root = data_dir() / "memorybank_en"
    users = json.loads((root / "memory_bank_en.json").read_text())
    questions: dict[str, list[str]] = {}
    for line in (root / "probing_questions_en.jsonl").read_text().splitlines():
        if line.strip():
            questions.update(json.loads(line))
    embedder = MiniLMEmbedder()
    rows: list[tuple[str, str, str, bool]] = []
    for name in sorted(users):
        turns, previous = [], ""
        for _, day in sorted(users[name]["history"].items()):
            for exchange in day:
                turns.append((exchange["query"], previous))
                previous = exchange["response"]
        evidence: set[int] = set()
        if questions.get(name) and turns:
            turn_vectors = np.array(embedder.embed([t for t, _ in turns]))
            question_vectors = np.array(embedder.embed([q.strip('"') for q in questions[name]]))
            evidence = {int(i) for i in (question_vectors @ turn_vectors.T).argmax(1)}
        rows.extend((name, text, previous, i in evidence) for i, (text, previous) in enumerate(turns))
    return rows


def fit_logistic(x: np.ndarray, y: np.ndarray, weights: np.ndarray, l2: float = 1e-2) -> tuple[np.ndarray, float]:
    inputs, targets, sample_weights = torch.tensor(x), torch.tensor(y), torch.tensor(weights)
    weight = torch.zeros(x.shape[1], dtype=inputs.dtype, requires_grad=True)
    bias = torch.zeros(1, dtype=inputs.dtype, requires_grad=True)
    optimiser = torch.optim.LBFGS([weight, bias], max_iter=500)

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(
            inputs @ weight + bias, targets, weight=sample_weights
        )
        value = value / sample_weights.mean() + l2 * (weight * weight).sum()
        value.backward()
        return value

    optimiser.step(loss)
    return weight.detach().numpy(), float(bias.detach())


def fit_rule(sources: dict[str, tuple[np.ndarray, np.ndarray]]) -> WriteBackModel:
    """The rule fitted on raw features and labels of each source, the sources weighted equally."""
    x = np.vstack([f for f, _ in sources.values()])
    y = np.concatenate([labels for _, labels in sources.values()]).astype(np.float64)
    weights = np.concatenate([np.full(len(labels), 1.0 / len(labels)) for _, labels in sources.values()])
    mean, std = x.mean(0), x.std(0) + 1e-6
    weight, bias = fit_logistic((x - mean) / std, y, weights)
    draft = WriteBackModel(tuple(mean.tolist()), tuple(std.tolist()), tuple(weight.tolist()), bias, 0.0, 0.0, 0.0)
    positives = [
        np.array([draft.importance_of_features(row) for row in f[labels > 0]]) for f, labels in sources.values()
    ]
    archive = min(float(np.quantile(p, 1.0 - ARCHIVE_KEEPS)) for p in positives)
    window = min(float(np.quantile(p, 1.0 - DEFER_KEEPS)) for p in positives)
    return WriteBackModel(
        draft.mean, draft.std, draft.weight, draft.bias, archive, min(window, archive), EAGER_THRESHOLD
    )


def decisions(model: WriteBackModel, x: np.ndarray) -> np.ndarray:
    return np.array([model.decide(model.importance_of_features(row)) for row in x])


def classify(args: argparse.Namespace, report: dict) -> WriteBackModel:
    """Fit on the fitting splits, measure on the held-out ones; returns the rule fitted now."""
    own_fit = read_turns(DATA / "fit_turns.txt")
    own_held = read_turns(DATA / "heldout_turns.txt")
    locomo = locomo_rows()
    memorybank = memorybank_rows()

    def features(rows: list[tuple[str, str]]) -> np.ndarray:
        return np.array([turn_features(text, previous) for text, previous in rows], dtype=np.float64)

    own_fit_x, own_fit_y = features([(t, "") for _, t, _, _ in own_fit]), np.array([f for f, *_ in own_fit], float)
    lo_fit = [r for r in locomo if r[0] < LOCOMO_FIT_CONVERSATIONS]
    lo_held = [r for r in locomo if r[0] >= LOCOMO_FIT_CONVERSATIONS]
    lo_fit_x, lo_fit_y = features([(t, p) for _, t, p, _ in lo_fit]), np.array([e for *_, e in lo_fit], float)
    model = fit_rule({"own": (own_fit_x, own_fit_y), "locomo": (lo_fit_x, lo_fit_y)})

    held_x = features([(t, "") for _, t, _, _ in own_held])
    held_facts = np.array([f for f, *_ in own_held])
    own_decisions = decisions(model, held_x)
    lo_x, lo_y = features([(t, p) for _, t, p, _ in lo_held]), np.array([e for *_, e in lo_held])
    lo_stored = decisions(model, lo_x) != "window"
    mb_x, mb_y = features([(t, p) for _, t, p, _ in memorybank]), np.array([e for *_, e in memorybank])
    mb_stored = decisions(model, mb_x) != "window"
    results = {
        "own heldout: facts archived now": float((own_decisions[held_facts] == "archive").mean()),
        "own heldout: small talk stored": float((own_decisions[~held_facts] != "window").mean()),
        "LoCoMo heldout: evidence turns stored": float(lo_stored[lo_y].mean()),
        "LoCoMo heldout: turns stored": float(lo_stored.mean()),
        "MemoryBank: silver evidence stored": float(mb_stored[mb_y].mean()),
        "MemoryBank: user turns stored": float(mb_stored.mean()),
    }
    report["classifier"] = {
        "features": FEATURES,
        "fitting": (
            f"logistic regression (L2 1e-2) on {len(own_fit)} turns of fit_turns.txt and {len(lo_fit)} turns of LoCoMo "
            f"conversations 1-{LOCOMO_FIT_CONVERSATIONS}, each source weighted equally"
        ),
        "held_out": {
            "own": f"{int(held_facts.sum())} facts and {int((~held_facts).sum())} small-talk turns "
            "of heldout_turns.txt",
            "locomo": f"{len(lo_held)} turns ({int(lo_y.sum())} evidence) "
            f"of conversations {LOCOMO_FIT_CONVERSATIONS + 1}-10",
            "memorybank": f"{len(memorybank)} user turns of {len({r[0] for r in memorybank})} users "
            f"({int(mb_y.sum())} silver evidence)",
        },
        "thresholds": {
            "archive": model.archive_threshold,
            "window": model.window_threshold,
            "eager": model.eager_threshold,
        },
        "results": results,
    }
    started = time.perf_counter()
    for text, previous in [(t, "") for _, t, _, _ in own_held] * 10:
        model.decide(model.importance(text, previous))
    per_turn = (time.perf_counter() - started) / (10 * len(own_held))
    report["classifier"]["seconds_per_turn"] = per_turn
    print("write-back rule, held out (never fitted on):")
    for name, value in results.items():
        print(f"  {name:<42} {value:.3f}")
    print(f"  {'classifier time per turn':<42} {per_turn * 1e3:.3f} ms")
    missed = [t for (f, t, _, _), d in zip(own_held, own_decisions, strict=True) if f and d != "archive"]
    stored_talk = [t for (f, t, _, _), d in zip(own_held, own_decisions, strict=True) if not f and d != "window"]
    report["classifier"]["facts_not_archived"] = missed
    report["classifier"]["small_talk_stored"] = stored_talk
    if missed:
        print(f"  facts not archived now: {missed}")
    if stored_talk:
        print(f"  small talk stored: {stored_talk}")
    if args.fit:
        MODEL_FILE.write_text(
            json.dumps({**vars(model), "features": FEATURES, "fitted_by": command_line()}, indent=1) + "\n",
            encoding="utf-8",
        )
        print(f"wrote {MODEL_FILE}")
    return model


def contains(text: str, expected: str) -> bool:
    return expected.lower() in text.lower()


def run_agent(args: argparse.Namespace, report: dict, model: WriteBackModel) -> None:
    """Tell the held-out facts over eight sessions with small talk between, then ask each in a new session."""
    from kvshift_memory import AgentMemory, AgentSettings, KVShiftEngine, MemoryStore

    rows = read_turns(DATA / "heldout_turns.txt")
    facts = [r for r in rows if r[0]]
    talk = [r for r in rows if not r[0]]
    # facts in their order, small talk spread between them; eight sessions of equal length
    told: list[str] = []
    for index, (_, text, _, _) in enumerate(facts):
        told.append(text)
        told.extend(t for _, t, _, _ in talk[index * len(talk) // len(facts) : (index + 1) * len(talk) // len(facts)])
    per_session = -(-len(told) // SESSIONS)
    engine = KVShiftEngine.from_pretrained()
    defaults = AgentSettings()
    overrides = {}
    if args.reuse is not None:
        overrides["reuse"] = args.reuse
    if args.recompute_ratio is not None:
        overrides["recompute_ratio"] = args.recompute_ratio
    asking = AgentSettings(max_new_tokens=args.max_new_tokens, write_back=False, **overrides)
    reuse = asking.reuse
    with tempfile.TemporaryDirectory() as folder:
        with MemoryStore(folder) as store:
            started = time.perf_counter()
            for number in range(SESSIONS):
                # told with the asking setting's reuse: a blend agent encodes fragments as it archives
                agent = AgentMemory(
                    engine,
                    store,
                    user_id="user",
                    session_id=f"told-{number}",
                    writeback=model,
                    max_new_tokens=args.tell_tokens,
                    reuse=asking.reuse,
                )
                for message in told[number * per_session : (number + 1) * per_session]:
                    agent.chat(message)
            telling_s = time.perf_counter() - started
        engine.clear_cache()
        questions = []
        with MemoryStore(folder) as store:  # a later process: the store reopened, the engine's caches empty
            for index, (_, fact, question, answer) in enumerate(facts):
                row: dict = {"fact": fact, "question": question, "answer": answer}
                for condition in (reuse, "none") if reuse != "none" else ("none",):
                    store.clear_cache()
                    agent = AgentMemory(
                        engine,
                        store,
                        user_id="user",
                        session_id=f"ask-{condition}-{index}",
                        settings=asking,
                        reuse=condition,
                    )
                    reply = agent.chat(question)
                    row[condition] = {
                        "text": reply.text,
                        "contains": contains(reply.text, answer),
                        "ttft_s": reply.ttft_s,
                        "recalled": [r.text for r in reply.recalled],
                        "fact_recalled": any(fact in r.text for r in reply.recalled),
                    }
                questions.append(row)
                print(
                    f"  q{index:02d} recalled {'+' if row['none']['fact_recalled'] else '-'} "
                    + " ".join(
                        f"{c}:{'+' if row[c]['contains'] else '-'}{row[c]['ttft_s'] * 1000:4.0f}ms"
                        for c in row
                        if isinstance(row[c], dict)
                    )
                    + f"  {question[:50]}"
                )
    right_none = [q for q in questions if q["none"]["contains"]]
    summary = {
        "sessions": SESSIONS,
        "turns_told": len(told),
        "telling_s": telling_s,
        "reuse": reuse,
        "recompute_ratio": asking.recompute_ratio,
        "agent_default_reuse": defaults.reuse,
        "agent_default_recompute_ratio": defaults.recompute_ratio,
        "stated_fact_recall": statistics.mean(q["none"]["fact_recalled"] for q in questions),
        "contains_none": statistics.mean(q["none"]["contains"] for q in questions),
        "contains_reuse": statistics.mean(q[reuse]["contains"] for q in questions),
        "retention": statistics.mean(q[reuse]["contains"] for q in right_none) if right_none else None,
        "ttft_none_median_s": statistics.median(q["none"]["ttft_s"] for q in questions),
        "ttft_reuse_median_s": statistics.median(q[reuse]["ttft_s"] for q in questions),
    }
    report["agent"] = {"summary": summary, "questions": questions}
    print(
        f"\n{len(facts)} facts told over {SESSIONS} sessions ({len(told)} turns, {telling_s:.0f} s), "
        "asked in new sessions:\n"
        f"  stated-fact recall across sessions   {summary['stated_fact_recall']:.3f}\n"
        f"  answer contains, reuse='none'        {summary['contains_none']:.3f}   "
        f"TTFT median {summary['ttft_none_median_s'] * 1000:.0f} ms\n"
        f"  answer contains, reuse={reuse!r:<13} {summary['contains_reuse']:.3f}   "
        f"TTFT median {summary['ttft_reuse_median_s'] * 1000:.0f} ms"
        f" (recompute_ratio {asking.recompute_ratio})\n"
        f"  retention against reuse='none'       {summary['retention']:.3f} "
        f"({len(right_none)} answers right without reuse)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--fit", action="store_true", help=f"write the rule fitted on the fitting splits to {MODEL_FILE.name}"
    )
    parser.add_argument(
        "--agent", action="store_true", help="also tell and ask the held-out facts with the bundled model"
    )
    parser.add_argument("--reuse", default=None, help="the asking agent's reuse (default: the agent's)")
    parser.add_argument("--recompute-ratio", type=float, default=None, help="the asking agent's (default: the agent's)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length of a question")
    parser.add_argument("--tell-tokens", type=int, default=16, help="reply length while facts are told")
    parser.add_argument("--output", type=Path, default=RESULTS / "writeback.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    report: dict = {}
    model = classify(args, report)
    if args.agent:
        run_agent(args, report, model)
    write_report(args.output, report)


if __name__ == "__main__":
    main()
