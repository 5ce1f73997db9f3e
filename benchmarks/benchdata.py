"""Benchmark instances built from real third-party data in ../shared/data (read there, never copied).

- LoCoMo (Maharana et al., ACL 2024; CC BY-NC 4.0): a question from the single-hop extractive
  subset, the memory fragment(s) holding its evidence turn, and distractor fragments from the same
  conversation: 8-12 fragments of 40-250 tokens in a seeded random order.
- MemoryBank (Zhong et al., AAAI 2024; MIT): a user's chat with an AI companion. ``exchanges``
  makes one memory of each user message and reply; ``facts`` keeps the user's messages alone, as
  short fact-like memories. Its probing questions have no gold answers, so these instances measure
  fidelity to full recompute only (a check that what helps on LoCoMo does not hurt other styles).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

__all__ = [
    "Instance",
    "build_instances",
    "command_line",
    "locomo_dir",
    "locomo_turns",
    "memorybank_instances",
    "provenance",
    "write_report",
]

MIN_FRAGMENT_TOKENS = 40
MAX_FRAGMENT_TOKENS = 250


def data_dir() -> Path:
    """``$KVSHIFT_DATA`` or ``../shared/data`` next to this checkout."""
    env = os.environ.get("KVSHIFT_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def locomo_dir() -> Path:
    return data_dir() / "locomo"


@dataclass(frozen=True)
class Instance:
    sample_id: str
    question: str
    answer: str
    memories: tuple[str, ...]
    evidence_index: tuple[int, ...]  # which memories hold the evidence


def _chunks(conversation: dict, count_tokens, rng: random.Random) -> list[tuple[str, set[str]]]:
    """Split every session into fragments of consecutive turns; returns (text, dia_ids)."""
    chunks = []
    session = 1
    while f"session_{session}" in conversation:
        date = conversation.get(f"session_{session}_date_time", "")
        lines: list[str] = []
        ids: set[str] = set()
        size, target = 0, rng.randint(60, 200)
        for turn in conversation[f"session_{session}"]:
            line = f"{turn['speaker']}: {turn['text']}"
            line_tokens = count_tokens(line)
            if lines and size + line_tokens > MAX_FRAGMENT_TOKENS:
                chunks.append((f"({date})\n" + "\n".join(lines), ids))
                lines, ids, size, target = [], set(), 0, rng.randint(60, 200)
            lines.append(line)
            ids.add(turn["dia_id"])
            size += line_tokens
            if size >= target:
                chunks.append((f"({date})\n" + "\n".join(lines), ids))
                lines, ids, size, target = [], set(), 0, rng.randint(60, 200)
        if lines:
            chunks.append((f"({date})\n" + "\n".join(lines), ids))
        session += 1
    return [(text, ids) for text, ids in chunks if MIN_FRAGMENT_TOKENS <= count_tokens(text) <= MAX_FRAGMENT_TOKENS]


def build_instances(count: int, count_tokens, seed: int = 0) -> list[Instance]:
    """``count`` instances, drawn with ``seed`` from the extractive single-hop subset.

    :param count_tokens: the tokenizer's length function (fragment sizes are in model tokens).
    """
    root = locomo_dir()
    conversations = {c["sample_id"]: c["conversation"] for c in json.loads((root / "locomo10.json").read_text())}
    questions = json.loads((root / "derived" / "locomo_cat4_extractive_short.json").read_text())
    rng = random.Random(seed)
    rng.shuffle(questions)
    chunk_cache: dict[str, list[tuple[str, set[str]]]] = {}
    instances: list[Instance] = []
    for qa in questions:
        if len(instances) == count:
            break
        sample = qa["sample_id"]
        if sample not in chunk_cache:
            chunk_cache[sample] = _chunks(conversations[sample], count_tokens, random.Random(f"{seed}:{sample}"))
        chunks = chunk_cache[sample]
        evidence = [i for i, (_, ids) in enumerate(chunks) if ids & set(qa["evidence"])]
        if not evidence or len(evidence) > 2:
            continue
        others = [i for i in range(len(chunks)) if i not in evidence]
        total = rng.randint(8, 12)
        picked = evidence + rng.sample(others, total - len(evidence))
        rng.shuffle(picked)
        instances.append(
            Instance(
                sample_id=sample,
                question=qa["question"],
                answer=str(qa["answer"]),
                memories=tuple(chunks[i][0] for i in picked),
                evidence_index=tuple(picked.index(i) for i in evidence),
            )
        )
    return instances


def _conversation_chunks(instance: Instance, count_tokens, seed: int) -> list[str]:
    """The fragments ``instance``'s conversation was cut into, in conversation order."""
    conversation = {
        c["sample_id"]: c["conversation"] for c in json.loads((locomo_dir() / "locomo10.json").read_text())
    }[instance.sample_id]
    return [text for text, _ in _chunks(conversation, count_tokens, random.Random(f"{seed}:{instance.sample_id}"))]


def _leading_within(texts: list[str], count_tokens, budget: int) -> list[str]:
    """The first of ``texts`` that fit in ``budget`` tokens together."""
    kept: list[str] = []
    size = 0
    for text in texts:
        size += count_tokens(text)
        if size > budget:
            break
        kept.append(text)
    return kept


def conversation_context(instance: Instance, count_tokens, budget: int, seed: int = 0) -> str:
    """Text from ``instance``'s own conversation that is none of its memories: its fragments in
    conversation order (the earliest first), as many as fit in ``budget`` tokens.

    What an application would encode a user's memories after: that user's earlier history.
    """
    others = [text for text in _conversation_chunks(instance, count_tokens, seed) if text not in instance.memories]
    return "\n\n".join(_leading_within(others, count_tokens, budget))


def history_before(instance: Instance, memory: str, count_tokens, budget: int, seed: int = 0) -> str:
    """What ``instance``'s conversation said before ``memory`` (one of its memories): the fragments
    just before it, in conversation order, as many as fit in ``budget`` tokens (empty for the first).

    The window a chat turn would have held when its user said ``memory``.
    """
    chunks = _conversation_chunks(instance, count_tokens, seed)
    before = chunks[: chunks.index(memory)]
    return "\n\n".join(_leading_within(before[::-1], count_tokens, budget)[::-1])


def memorybank_instances(count: int, count_tokens, kind: str = "exchanges", seed: int = 0) -> list[Instance]:
    """``count`` instances from MemoryBank: a probing question and 8-12 (exchanges) or 12-20 (facts)
    memories of the same user, in a seeded random order. ``answer`` is empty (no gold answers)."""
    root = data_dir() / "memorybank_en"
    users = json.loads((root / "memory_bank_en.json").read_text())
    questions = {}
    for line in (root / "probing_questions_en.jsonl").read_text().splitlines():
        if line.strip():
            questions.update(json.loads(line))
    rng = random.Random(seed)
    pool = [(name, q) for name in sorted(questions) if name in users for q in questions[name]]
    rng.shuffle(pool)
    instances = []
    for name, question in pool[:count]:
        memories = []
        for date, turns in sorted(users[name]["history"].items()):
            for turn in turns:
                if kind == "exchanges":
                    text = f"({date})\n{name}: {turn['query']}\nAI: {turn['response']}"
                else:
                    text = turn["query"]
                if count_tokens(text) >= 8:
                    memories.append(text)
        size = rng.randint(8, 12) if kind == "exchanges" else rng.randint(12, 20)
        picked = rng.sample(memories, min(size, len(memories)))
        instances.append(Instance(name, question.strip('"'), "", tuple(picked), ()))
    return instances


def locomo_turns(limit: int) -> list[str]:
    """The first ``limit`` dialogue turns of LoCoMo, as ``Speaker: text`` lines."""
    conversations = json.loads((locomo_dir() / "locomo10.json").read_text())
    turns: list[str] = []
    for conversation in conversations:
        session = 1
        while f"session_{session}" in conversation["conversation"]:
            turns.extend(f"{t['speaker']}: {t['text']}" for t in conversation["conversation"][f"session_{session}"])
            session += 1
    return turns[:limit]


def command_line() -> str:
    """The command that is running, as it would be typed from the repository's root."""
    script = Path(sys.argv[0]).resolve()
    root = Path(__file__).resolve().parents[1]
    shown = script.relative_to(root) if script.is_relative_to(root) else script
    return " ".join(["python", str(shown), *sys.argv[1:]])


def machine() -> dict[str, object]:
    """The machine a result was measured on: platform, processor, CPU count, threads and torch."""
    torch = sys.modules.get("torch")  # read only where the benchmark loaded it: the data locator does not
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads() if torch is not None else None,
        "torch": torch.__version__ if torch is not None else None,
    }


def provenance() -> dict[str, object]:
    """What a result was measured on: the command, the machine, the commit, whether the checkout had
    uncommitted changes (to tracked code; results files excepted), and when (UTC)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    return {
        "command": command_line(),
        "machine": machine(),
        "commit": git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def write_report(path: Path, report: dict) -> None:
    """Write a benchmark's JSON report (creating its folder), with its :func:`provenance`, and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**report, "provenance": provenance()}, indent=1))
    print(f"wrote {path}")


def main() -> None:
    """Say where the data sets are read from and what they hold (nothing is written)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    print(f"data folder: {data_dir()} ($KVSHIFT_DATA overrides)")
    locomo = locomo_dir() / "locomo10.json"
    print(
        f"LoCoMo: {len(json.loads(locomo.read_text()))} conversations"
        if locomo.exists()
        else f"LoCoMo: missing ({locomo})"
    )
    memorybank = data_dir() / "memorybank_en"
    print(f"MemoryBank: {'present' if memorybank.exists() else 'missing'} ({memorybank})")


if __name__ == "__main__":
    main()
