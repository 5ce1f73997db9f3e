"""Fidelity of KV reuse against full recompute of the same prompt, on real conversation data.

For each instance (system prefix + 8-12 LoCoMo memory fragments + a question) the greedy answer of
full recompute (``reuse="none"``) is the reference. Every condition is scored on that answer:

- mean KL(full || condition) of the next-token distributions over the answer span,
- top-1 agreement of those distributions,
- greedy exact match of the condition's own answer with the reference answer,
- contains-answer accuracy (the gold answer string appears in the generated answer),
- the share of fragment tokens recomputed,
- how much log-probability the reference answer's *copied* tokens lose against full recompute
  (``copy Δ``: tokens that, with the one before, continue a token pair found in a memory and not
  in the question, the way an entity is copied from a memory) and how much its other tokens lose
  (``other Δ``), in nats, averaged per instance: a continuous, paired reading of what the
  contains-answer figure counts in whole answers.

Conditions: ``reorder`` (full recompute with the memories shuffled: how much merely reordering
perturbs the answer, the bar reuse must meet), ``shift`` (fragments placed, nothing recomputed),
``blend@r`` for each recompute ratio, and four variants of the default blend: ``no encode context``
(fragments encoded after the prefix alone), ``no speaker matching`` (the encode context keeps its
own speakers' names instead of taking each memory's), ``no lead fragment`` (the first memory shifted and
repaired like the others instead of read from its lead fragment) and ``own-conversation context``
(LoCoMo only: fragments encoded after text from the instance's own conversation that is none of
its memories, as much as the built-in context's length, given as ``encode_context``; the JSON
counts the instances whose context holds the gold answer) and ``own turn K/V`` (LoCoMo only: each
memory said as the user message of a turn whose window holds the conversation before it, as much
as the built-in context's length, and its fragment cut from that turn's K/V, as write-back does;
``--fragment-sources`` runs only these two and the default).

    python benchmarks/fidelity.py                      # 40 LoCoMo instances, ~40 min on 2 cores
    python benchmarks/fidelity.py --instances 240 --default-only --output benchmarks/results/fidelity_default_240.json
    python benchmarks/fidelity.py --fragment-sources --output benchmarks/results/fidelity_fragment_sources.json

(every published run's command: ``docs/benchmarks/fidelity.md``)

    python benchmarks/fidelity.py --report benchmarks/results/fidelity_default_240.json --parts 40,120
                                                       # run nothing: the paired comparison of a results file
                                                       # (contains-answer, and copy Δ / other Δ with intervals)

Before each blend condition the instance's memories are warmed (``engine.warm``, lead fragments
included), as an agent does when it stores them, so a condition never depends on what earlier
instances left in the fragment pool.

Prints a table and writes ``benchmarks/results/fidelity.json`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdata import (  # noqa: E402
    build_instances,
    conversation_context,
    history_before,
    locomo_dir,
    memorybank_instances,
    write_report,
)

from kvshift_memory import KVShiftEngine  # noqa: E402
from kvshift_memory.shipped import DEFAULT_MODEL  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DATASETS = ("locomo", "memorybank-exchanges", "memorybank-facts")


def kl_and_top1(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Mean KL(reference || other) and top-1 agreement over rows of log-probabilities."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    top1 = (reference.argmax(-1) == other.argmax(-1)).float()
    return float(kl.mean()), float(top1.mean())


def copied_positions(answer_ids: list[int], memory_ids: list[list[int]], question_ids: list[int]) -> list[bool]:
    """Which answer tokens continue, with the token before them, a pair of adjacent tokens of a
    memory that the question lacks: the tokens the answer copies from its memories."""

    def pairs(ids: list[int]) -> set[tuple[int, int]]:
        return set(itertools.pairwise(ids))

    from_memories = set().union(*map(pairs, memory_ids)) - pairs(question_ids)
    return [False] + [pair in from_memories for pair in itertools.pairwise(answer_ids)]


def logprob_drops(
    reference: torch.Tensor, other: torch.Tensor, answer_ids: list[int], copied: list[bool]
) -> tuple[float | None, float | None]:
    """Mean log-probability the answer's copied tokens, and its other tokens, lose from
    ``reference`` to ``other`` (rows of log-probabilities); ``None`` for a kind with no token."""
    index = torch.arange(len(answer_ids))
    drop = reference[index, answer_ids] - other[index, answer_ids]
    mask = torch.tensor(copied)
    copied_drop, other_drop = (float(drop[kind].mean()) if bool(kind.any()) else None for kind in (mask, ~mask))
    return copied_drop, other_drop


def mean_of_known(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def contains(answer: str, text: str) -> bool:
    return answer.strip().lower() in text.lower() if answer else False


def context_names(engine: KVShiftEngine) -> set[str]:
    """Names, months and days of the encode context: if an answer uses one the prompt lacks, it leaked.

    The speakers, and the capitalised words the context never uses to open a sentence ("They",
    "How" are ordinary words an answer may start with; "Maya", "Thursday" are not).
    """
    text = engine.settings.encode_context
    speakers = set(re.findall(r"^([A-Z][a-z]+):", text, re.MULTILINE))
    capitalised = set(re.findall(r"\b[A-Z][a-z]{2,}\b", text))
    openers = set(re.findall(r"(?:^|[.!?:]\s+)([A-Z][a-z]{2,})\b", text, re.MULTILINE))
    return speakers | (capitalised - openers)


def context_words(engine: KVShiftEngine) -> set[str]:
    """Words of the encode context that at most one of LoCoMo's ten conversations uses ("pottery",
    "cabin", "kiln"): with the context's speakers renamed to a memory's, its names cannot show a
    leak, its story still can."""
    conversations = json.loads((locomo_dir() / "locomo10.json").read_text())
    used_by = Counter(w for c in conversations for w in words_of(json.dumps(c["conversation"])))
    return {w for w in words_of(engine.settings.encode_context) if len(w) >= 4 and used_by[w] < 2}


def words_of(text: str) -> set[str]:
    return set(re.findall(r"[a-z]+", text.lower()))


OWN_CONTEXT = "own-conversation context"
OWN_TURN = "own turn K/V"
#: the assistant's side of the exchange that holds a memory's history in its turn's window
HISTORY_REPLY = "Thank you for telling me."


def said_in_turns(engine, instance, memories, budget: int, seed: int) -> None:
    """The write-back flow of an agent that cuts fragments from the turn: each memory said as the
    user message of its own turn, after the conversation before it (as much as ``budget``
    tokens) in the window, and its fragment taken from that turn's K/V."""
    engine.clear_cache()  # fragments come from this instance's turns only
    for memory in memories:
        history = history_before(instance, memory, engine.count_tokens, budget, seed)
        window = [{"role": "user", "content": history}, {"role": "assistant", "content": HISTORY_REPLY}]
        turn = (window if history else []) + [{"role": "user", "content": memory}]
        engine.generate(turn, reuse="prefix", max_new_tokens=1)
        engine.warm([memory], lead_fragments=False, from_turn=turn)
    engine.clear_cache(fragments=False)  # the question reuses no stretch of a turn's prompt


def run_dataset(
    engine,
    ablations,
    instances,
    ratios,
    default_ratio,
    generate,
    max_new_tokens,
    seed,
    own_context=False,
    own_turn=None,
    default_only=False,
    curve=False,
    core=False,
    sources=False,
):
    default = f"blend@{default_ratio:g}"
    ablations = dict(ablations, **({OWN_CONTEXT: engine} if own_context else {}))
    if own_turn is not None:
        ablations[OWN_TURN] = own_turn
    if curve:
        conditions = [f"blend@{r:g}" for r in sorted(set(ratios))]
    elif default_only:
        conditions = [default]
    elif sources:
        conditions = [default] + [f"blend@default, {a}" for a in (OWN_CONTEXT, OWN_TURN) if a in ablations]
    elif core:
        conditions = ["reorder", "shift", default]
    else:
        ratios = sorted(set(ratios) | {default_ratio})
        conditions = (
            ["reorder", "shift"] + [f"blend@{r:g}" for r in ratios] + [f"blend@default, {a}" for a in ablations]
        )
    # Answers are generated (exact match, contains-answer) for the conditions a user meets and for
    # every ratio the fidelity bar allows (at most 15 %: candidates for the default); the others
    # are scored only (KL, top-1), which is what the recompute curve needs. ``curve`` generates
    # at every ratio: contains-answer against the share recomputed.
    allowed = {f"blend@{r:g}" for r in ratios if r <= 0.15 or curve}
    generated = (
        ({"reorder", "shift", default} | {f"blend@default, {a}" for a in ablations} | allowed) if generate else set()
    )
    rows = {name: [] for name in ["none", *conditions]}  # "none": the reference answers
    accuracy = {name: [] for name in ["none", *conditions]}
    leaks: list[dict] = []
    names = context_names(engine)
    story = context_words(engine)
    eos = sorted(engine.runner.eos_token_ids)[0]
    budget = engine.count_tokens(engine.settings.encode_context)
    contexts_with_answer = 0
    for index, instance in enumerate(instances):
        messages = [{"role": "user", "content": instance.question}]
        memories = list(instance.memories)
        reference = engine.generate(messages, memories, reuse="none", max_new_tokens=max_new_tokens)
        answer_ids = reference.token_ids + ([eos] if reference.finish_reason == "stop" else [])
        if not answer_ids:
            continue
        accuracy["none"].append(contains(instance.answer, reference.text))
        rows["none"].append(
            {
                "question": instance.question,
                "expected": instance.answer,
                "answer": reference.text,
                "contains": accuracy["none"][-1],
            }
        )
        full = engine.score(messages, memories, answer_ids, reuse="none", return_distributions=True).distributions
        encode = engine.tokenizer.encode
        copied = copied_positions(
            answer_ids,
            [encode(m, add_special_tokens=False) for m in memories],
            encode(instance.question, add_special_tokens=False),
        )
        shuffled = list(memories)
        random.Random(f"{seed}:{index}").shuffle(shuffled)
        own_text = conversation_context(instance, engine.count_tokens, budget, seed) if own_context else None
        contexts_with_answer += bool(own_text) and instance.answer.lower() in own_text.lower()
        for name in conditions:
            context = own_text if name == f"blend@default, {OWN_CONTEXT}" else None
            if name == "reorder":
                run_engine, run_memories, reuse, ratio = engine, shuffled, "none", None
            elif name == "shift":
                run_engine, run_memories, reuse, ratio = engine, memories, "blend", 0.0
            elif name.startswith("blend@default, "):
                run_engine, run_memories, reuse, ratio = (
                    ablations[name.split(", ")[1]],
                    memories,
                    "blend",
                    default_ratio,
                )
            else:
                run_engine, run_memories, reuse, ratio = engine, memories, "blend", float(name.split("@")[1])
            run_engine.clear_cache(fragments=False)  # no prompt may be reused from another condition
            if name == f"blend@default, {OWN_TURN}":
                said_in_turns(run_engine, instance, run_memories, budget, seed)
            if reuse == "blend":
                # The add-time flow: the fragments (the opening memory's lead fragment too) exist
                # before the question, whatever earlier instances left in the pool.
                run_engine.warm(run_memories, messages, encode_context=context)
            scored = run_engine.score(
                messages,
                run_memories,
                answer_ids,
                reuse=reuse,
                recompute_ratio=ratio,
                return_distributions=True,
                encode_context=context,
            )
            kl, top1 = kl_and_top1(full, scored.distributions)
            copy_drop, other_drop = logprob_drops(full, scored.distributions, answer_ids, copied)
            row = {
                "kl": kl,
                "top1": top1,
                "recomputed": scored.stats.recomputed_tokens,
                "copy_drop": copy_drop,
                "other_drop": other_drop,
            }
            if name in generated:
                run_engine.clear_cache(fragments=False)
                own = run_engine.generate(
                    messages,
                    run_memories,
                    reuse=reuse,
                    recompute_ratio=ratio,
                    max_new_tokens=max_new_tokens,
                    encode_context=context,
                )
                row["exact"] = own.token_ids == reference.token_ids
                accuracy[name].append(contains(instance.answer, own.text))
                row.update(answer=own.text, contains=accuracy[name][-1])
                if (
                    run_engine is not ablations.get("no encode context") and reuse == "blend" and context is None
                ):  # these read fragments encoded after it
                    leaked = {
                        n
                        for n in names
                        if n in own.text and n not in reference.text and all(n not in m for m in memories)
                    }
                    prompt_words = words_of(" ".join([reference.text, instance.question, *memories]))
                    leaked |= (story & words_of(own.text)) - prompt_words
                    if leaked:
                        leaks.append(
                            {"instance": index, "condition": name, "words": sorted(leaked), "answer": own.text}
                        )
            rows[name].append(row)
        layout = engine.planner.plan(messages, memories, reuse="blend", recompute_ratio=0.0).layout
        span_tokens = sum(span.end - span.start for span in layout.fragments)
        for name in conditions:
            rows[name][-1]["recomputed_share"] = rows[name][-1]["recomputed"] / span_tokens
        print(
            f"  [{index + 1}/{len(instances)}] {instance.question[:60]!r}: "
            + ", ".join(f"{n.replace('blend@default, ', '')} {rows[n][-1]['kl']:.3f}" for n in conditions),
            flush=True,
        )

    summary = {}
    for name in conditions:
        items = rows[name]
        summary[name] = {
            "mean_kl": statistics.fmean(r["kl"] for r in items),
            "top1": statistics.fmean(r["top1"] for r in items),
            "recomputed_share": statistics.fmean(r["recomputed_share"] for r in items) if name != "reorder" else 0.0,
            "copy_logprob_drop": mean_of_known(r["copy_drop"] for r in items),
            "other_logprob_drop": mean_of_known(r["other_drop"] for r in items),
        }
        if name in generated:
            summary[name]["exact_match"] = statistics.fmean(r["exact"] for r in items)
            summary[name]["contains_answer"] = statistics.fmean(accuracy[name]) if accuracy[name] else None
    if generate:
        summary["none"] = {
            "mean_kl": 0.0,
            "top1": 1.0,
            "recomputed_share": 0.0,
            "exact_match": 1.0,
            "contains_answer": statistics.fmean(accuracy["none"]) if accuracy["none"] else None,
        }
        summary["_encode_context_leaks"] = leaks
    if own_context:
        summary["_own_contexts_holding_the_answer"] = contexts_with_answer
    return summary, rows


def print_table(title: str, summary: dict) -> None:
    print(f"\n{title}")
    header = (
        f"{'condition':<42} {'mean KL':>8} {'top-1':>6} {'exact':>6} {'contains':>8} {'recomputed':>10} "
        f"{'copy Δ':>7} {'other Δ':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, s in summary.items():
        if name.startswith("_"):
            continue
        exact = f"{s['exact_match']:.2f}" if "exact_match" in s else "-"
        acc = f"{s['contains_answer']:.2f}" if s.get("contains_answer") is not None else "-"
        drops = " ".join(
            f"{s[k]:>7.3f}" if s.get(k) is not None else f"{'-':>7}"
            for k in ("copy_logprob_drop", "other_logprob_drop")
        )
        print(
            f"{name:<42} {s['mean_kl']:>8.4f} {s['top1']:>6.3f} {exact:>6} {acc:>8} "
            f"{s['recomputed_share']:>9.1%} {drops}"
        )


TRANSCRIPT_OPENING = re.compile(r"^[A-Z][a-z]+:")


def continues_transcript(answer: str) -> bool:
    """Whether an answer opens as a transcript line (``Name: ...``) instead of answering."""
    return TRANSCRIPT_OPENING.match(answer.strip()) is not None


def bootstrap_interval(values: list[float], resamples: int) -> tuple[float, float]:
    """A 95 % bootstrap interval of the mean of ``values`` (seeded: the same values print the same interval)."""
    rng = random.Random(0)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples)]


def print_copy_drops(rows: dict, title: str = "", resamples: int = 5000) -> None:
    """For each condition, the log-probability the reference answer's copied tokens and its other
    tokens lose against full recompute (``copy Δ``, ``other Δ``) and, per instance, how much more
    the copied ones lose, each with a bootstrap 95 % interval of the mean over the instances whose
    answer has both kinds. Prints nothing for results written before these were measured."""
    measured = [name for name, items in rows.items() if name != "none" and items and "copy_drop" in items[0]]
    if not measured:
        return
    print(f"\n{title}\n{'condition':<42} {'instances':>9} {'copy Δ':>24} {'other Δ':>24} {'copy Δ - other Δ':>24}")
    for name in measured:
        both = [r for r in rows[name] if r["copy_drop"] is not None and r["other_drop"] is not None]
        if not both:
            continue
        cells = []
        for values in (
            [r["copy_drop"] for r in both],
            [r["other_drop"] for r in both],
            [r["copy_drop"] - r["other_drop"] for r in both],
        ):
            low, high = bootstrap_interval(values, resamples)
            cells.append(f"{statistics.fmean(values):+.3f} [{low:+.3f}, {high:+.3f}]")
        print(f"{name:<42} {len(both):>9} " + " ".join(f"{c:>24}" for c in cells))


def print_paired(rows: dict, parts: list[int], title: str = "", resamples: int = 5000) -> None:
    """Each generated condition against full recompute, question by question, over the whole set
    and over the instance ranges that ``parts`` (ascending boundaries) cut it into: contains-answer
    gained and lost, a one-sided sign test on those that differ, a paired bootstrap 95 % interval of
    the difference, and transcript openings (the ``Name: ...`` rule). Prints nothing for a set
    whose conditions were scored only."""
    generated = [name for name, items in rows.items() if name != "none" and items and "contains" in items[0]]
    if not generated:
        return
    reference = rows["none"]
    total = len(reference)
    bounds = [0, *[b for b in parts if 0 < b < total], total]
    ranges = list(itertools.pairwise(bounds))
    spans = [(0, total)] + (ranges if len(ranges) > 1 else [])
    print(
        f"\n{title}\n{'condition':<28} {'instances':>10} {'mean KL':>8} {'top-1':>6} {'none':>5} {'cond':>5} "
        f"{'gained':>6} "
        f"{'lost':>5} {'sign p':>7} {'95% interval':>16} {'Name: none/cond':>16} {'plain both: n, none, cond':>26}"
    )
    for name in generated:
        items = rows[name]
        for lo, hi in spans:
            ref, own = reference[lo:hi], items[lo:hi]
            gained = sum(o["contains"] and not r["contains"] for r, o in zip(ref, own, strict=True))
            lost = sum(r["contains"] and not o["contains"] for r, o in zip(ref, own, strict=True))
            differing = gained + lost
            sign_p = sum(math.comb(differing, k) for k in range(gained + 1)) / 2**differing if differing else 1.0
            diffs = [float(o["contains"]) - float(r["contains"]) for r, o in zip(ref, own, strict=True)]
            low, high = bootstrap_interval(diffs, resamples)
            interval = f"[{100 * low:+.1f}, {100 * high:+.1f}]"
            plain = [
                (r, o)
                for r, o in zip(ref, own, strict=False)
                if not continues_transcript(r["answer"]) and not continues_transcript(o["answer"])
            ]
            print(
                f"{name:<28} {f'{lo}-{hi}':>10} {statistics.fmean(o['kl'] for o in own):>8.4f} "
                f"{statistics.fmean(o['top1'] for o in own):>6.3f} {sum(r['contains'] for r in ref):>5} "
                f"{sum(o['contains'] for o in own):>5} {gained:>6} {lost:>5} {sign_p:>7.3f} {interval:>16} "
                f"{sum(continues_transcript(r['answer']) for r in ref):>7}/"
                f"{sum(continues_transcript(o['answer']) for o in own):<8} "
                f"{len(plain):>12}, {sum(r['contains'] for r, _ in plain)}, {sum(o['contains'] for _, o in plain)}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=40)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--ratios", default="0.05,0.10,0.15,0.30")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--datasets",
        default="locomo",
        help=f"comma-separated, of {', '.join(DATASETS)} (MemoryBank: KL only, no generation)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-own-context", action="store_true", help="leave out the own-conversation context row")
    parser.add_argument(
        "--no-ablations",
        action="store_true",
        help="leave out the rows that turn an engine feature off, and the own-conversation context "
        "(more instances per hour)",
    )
    parser.add_argument(
        "--default-only",
        action="store_true",
        help="only full recompute and the default blend (implies --no-ablations): a larger paired sample per hour",
    )
    parser.add_argument(
        "--fragment-sources",
        action="store_true",
        help="only full recompute and the default blend with fragments encoded after the encode context, "
        "after the own conversation, or cut from the turn that said them (LoCoMo; implies --no-ablations)",
    )
    parser.add_argument(
        "--core",
        action="store_true",
        help="only full recompute, reorder, shift only and the default blend (implies --no-ablations)",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a shipped model's name (default: the default model, smollm2-135m-instruct), or a local folder",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="only full recompute and the blend at exactly --ratios, each with its own answers: contains-answer "
        "against the share recomputed (implies --no-ablations)",
    )
    parser.add_argument(
        "--recompute-window", type=int, default=None, help="EngineSettings.recompute_window (default: the engine's)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "fidelity.json")
    parser.add_argument(
        "--report",
        type=Path,
        help="run nothing: print the paired comparisons (contains-answer, copy and other Δ) "
        "of a results JSON this script wrote",
    )
    parser.add_argument(
        "--parts", default="", help="with --report: comma-separated instance boundaries to report ranges too"
    )
    args = parser.parse_args()
    if args.report:
        for name, result in json.loads(args.report.read_text())["datasets"].items():
            title = f"{name} ({result['instances']} instances), paired against full recompute:"
            print_paired(result["per_instance"], [int(b) for b in args.parts.split(",") if b], title)
            print_copy_drops(result["per_instance"], f"{name}, log-probability lost against full recompute (nats):")
        return
    args.no_ablations = args.no_ablations or args.default_only or args.curve or args.core or args.fragment_sources
    dataset_names = list(dict.fromkeys(args.datasets.split(",")))
    unknown = set(dataset_names) - set(DATASETS)
    if unknown:
        parser.error(f"unknown dataset(s): {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]

    window = {} if args.recompute_window is None else {"recompute_window": args.recompute_window}
    engine = KVShiftEngine.from_pretrained(args.model, **window)
    ablations = {
        name: KVShiftEngine(engine.model, engine.tokenizer, fingerprint=engine.fingerprint, **window, **setting)
        for name, setting in (
            ("no encode context", {"encode_context": ""}),
            ("no speaker matching", {"match_speakers": False}),
            ("no lead fragment", {"lead_fragments": False}),
        )
        if not args.no_ablations
    }
    own_turn = (
        KVShiftEngine(engine.model, engine.tokenizer, fingerprint=engine.fingerprint, **window)
        if args.fragment_sources or not args.no_ablations
        else None
    )
    default_ratio = engine.settings.recompute_ratio
    started = time.time()
    datasets = {}
    for name in dataset_names:
        if name == "locomo":
            datasets[name] = (build_instances(args.instances, engine.count_tokens, seed=args.seed), True)
        else:
            kind = name.removeprefix("memorybank-")
            datasets[name] = (memorybank_instances(args.instances, engine.count_tokens, kind, seed=args.seed), False)

    report = {
        "model": f"{args.model or DEFAULT_MODEL} ({type(engine.model).__name__}, {engine.model.dtype})",
        "default_recompute_ratio": default_ratio,
        "recompute_window": engine.settings.recompute_window,
        "threads": args.threads,
        "seed": args.seed,
        "datasets": {},
    }
    for name, (instances, generate) in datasets.items():
        print(f"{name}: {len(instances)} instances", flush=True)
        own_context = name == "locomo" and not (args.no_own_context or args.no_ablations)
        summary, rows = run_dataset(
            engine,
            ablations,
            instances,
            ratios,
            default_ratio,
            generate,
            args.max_new_tokens,
            args.seed,
            own_context=own_context or (name == "locomo" and args.fragment_sources),
            own_turn=own_turn if name == "locomo" else None,
            default_only=args.default_only,
            curve=args.curve,
            core=args.core,
            sources=args.fragment_sources,
        )
        report["datasets"][name] = {"instances": len(instances), "summary": summary, "per_instance": rows}
        print_table(f"{name} ({len(instances)} instances, seed {args.seed})", summary)
        if generate:
            print_paired(rows, [], "paired against full recompute:")
            print(
                "answers naming something from the encode context the prompt lacks: "
                f"{len(summary['_encode_context_leaks'])}"
            )
        print_copy_drops(rows, "log-probability lost against full recompute (nats):")
        if "_own_contexts_holding_the_answer" in summary:
            print(f"own-conversation contexts holding the gold answer: {summary['_own_contexts_holding_the_answer']}")
    report["elapsed_s"] = time.time() - started
    write_report(args.output, report)
    print(f"in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
