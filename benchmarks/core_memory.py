"""A user's core block in a new session of a new process: how much of the first turn's prompt is
read from stored K/V, its time to first token against full recompute, and whether it answers as
full recompute does.

LoCoMo's dialogue turns (``Speaker: text``) stand for what a user told the agent: they are stored and pinned
(``AgentMemory.pin``) until the core block holds about ``--blocks`` tokens. One agent session
answers a first question with ``resume`` on (the engine writes the prompt's K/V to the store as
chunks); then the process "restarts": the engine's caches are cleared, so nothing but the store
holds the K/V, and a new session asks another question. Timed, medians of ``--repeats``, the arms
interleaved, each repeat a new question:

- ``core``: the new session's first turn (the block restored from the store's chunks);
- ``none``: the same prompt, ``reuse="none"``.

The greedy answers of both arms are compared (with the exact codec, fp32, they must be equal);
the default codec (int8) is measured too.

``--parts answers``: a user with ``--paddings`` tokens of pinned LoCoMo turns states :data:`FACTS`
(written for this benchmark) in chat in one session (``core_facts=True``: write-back appends the
ones about the user to the core block). In later sessions each fact is asked once (a new
session per question) in each of :data:`ARMS`: the block and recall (the default), the block
alone, recall alone (k=4). Then :data:`CORRECTIONS` are said in chat and the corrected facts asked
again, with the superseded lines kept and after a compaction: an answer is right when it holds
the expected word; "old" counts answers that give the value the correction replaced.

``--parts session``: after the facts and a ~1k-token pinned block, one 20-turn session with 3
corrections and 1 forget of core facts: the share of each turn's prompt reused, whether the
forgotten text is in any later prompt, and how far the turn after the forget reused its prompt
(the stored K/V holding the forgotten line is never read again when that stops before the line).

Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

    python benchmarks/core_memory.py [--models smollm2-135m-instruct,gemma-3-270m] [--blocks 1000,2000]
        [--parts restart,answers,session]

Prints a table and writes ``benchmarks/results/core_memory.json``.
"""

from __future__ import annotations

import argparse
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
from benchdata import locomo_turns, write_report  # noqa: E402

from kvshift_memory import AgentMemory, KVShiftEngine, MemoryStore  # noqa: E402
from kvshift_memory.adapters import change_block, core_text  # noqa: E402

FACTS = [
    ("My name is Clara Jensen.", "What is my name?", "clara"),
    ("I live in Aarhus, in Denmark.", "Which city do I live in?", "aarhus"),
    ("I work as a marine biologist.", "What is my job?", "biologist"),
    ("My dog is called Pepper.", "What is my dog called?", "pepper"),
    ("My favourite food is ramen.", "What is my favourite food?", "ramen"),
    ("I am allergic to penicillin.", "What am I allergic to?", "penicillin"),
    ("My sister Ingrid works as a pilot.", "What does my sister Ingrid do for work?", "pilot"),
    ("I drive a green Volvo.", "What car do I drive?", "volvo"),
    ("My birthday is on the 14th of March.", "When is my birthday?", "march"),
    ("I play the cello in a city orchestra.", "Which instrument do I play?", "cello"),
    ("My wife Sofie teaches chemistry at a high school.", "What does my wife Sofie teach?", "chemistry"),
    ("I am learning Japanese in the evenings.", "Which language am I learning?", "japanese"),
    ("My favourite football team is Ajax.", "Which football team do I support?", "ajax"),
    ("My son Emil is seven years old.", "How old is my son Emil?", "seven|7"),
    ("I take my coffee black, without sugar.", "How do I take my coffee?", "black"),
    ("My office is on the ninth floor.", "Which floor is my office on?", "ninth|9"),
    ("My favourite author is Tove Jansson.", "Who is my favourite author?", "jansson"),
    ("I grew up in Bergen, in Norway.", "Where did I grow up?", "bergen"),
    ("My bank is Nordea.", "Which bank do I use?", "nordea"),
    ("My doctor is called Dr. Hansen.", "What is my doctor's name?", "hansen"),
]
CORRECTIONS = [
    ("My dog is called Mango, not Pepper.", "What is my dog called?", "mango"),
    ("I live in Odense now, not Aarhus.", "Which city do I live in?", "odense"),
    ("My favourite food is sushi, not ramen.", "What is my favourite food?", "sushi"),
    ("I drive a Toyota, not a Volvo.", "What car do I drive?", "toyota"),
    ("My office is on the fourth floor, not the ninth.", "Which floor is my office on?", "fourth|4"),
    ("I am learning Korean, not Japanese.", "Which language am I learning?", "korean"),
]
FORGET = ("Please forget that I am allergic to penicillin.", "I am allergic to penicillin.")
SMALL_TALK = [
    "Good morning!",
    "What should I cook tonight?",
    "ok thanks",
    "Any idea for a weekend trip?",
    "haha nice",
    "Can you suggest a book for the train?",
    "What is a good stretch after running?",
    "Tell me a fun fact about octopuses.",
]
QUESTIONS = [
    "What do you remember about my family?",
    "Which hobbies have I told you about?",
    "What was I worried about recently?",
    "Where did I travel last year?",
    "What are my plans for next month?",
    "Who are my closest friends?",
    "What did I say about my work?",
]


def pinned_block(agent: AgentMemory, store: MemoryStore, engine: KVShiftEngine, tokens: int) -> int:
    """Store and pin the user's own messages until the block holds about ``tokens`` tokens; its tokens."""
    used = 0
    for text in locomo_turns(2000):
        if used >= tokens:
            break
        record = store.add(text, tenant=agent.user_id)
        agent.pin(record.id)
        used += engine.count_tokens(text) + 1
    return used


def measure(model: str, block_tokens: int, codec: str, repeats: int) -> dict[str, Any]:
    engine = KVShiftEngine.from_pretrained(model)
    with tempfile.TemporaryDirectory() as folder:
        store = MemoryStore(Path(folder) / "store", codec=codec)
        first = AgentMemory(engine, store, user_id="user", session_id="first", write_back=False, max_new_tokens=16)
        settled = pinned_block(first, store, engine, block_tokens)
        first.chat("Hello again, what do you know about me?")
        engine.flush_chunks(timeout_s=300)
        core_ttft, none_ttft, shares, equal = [], [], [], 0
        for repeat in range(repeats):
            engine.clear_cache()  # a restart: only the store holds the K/V
            session = AgentMemory(
                engine, store, user_id="user", session_id=f"new-{repeat}", write_back=False, max_new_tokens=16
            )
            question = QUESTIONS[repeat % len(QUESTIONS)] + f" ({repeat})"
            reply = session.chat(question)
            engine.flush_chunks(timeout_s=300)
            messages = [*session._system_messages(), {"role": "user", "content": question}]  # noqa: SLF001
            recomputed = engine.generate(messages, reuse="none", max_new_tokens=16, tenant="user")
            core_ttft.append(reply.stats.ttft_s)
            none_ttft.append(recomputed.stats.ttft_s)
            shares.append(reply.stats.restored_tokens / reply.stats.prompt_tokens)
            equal += reply.stats.generated_tokens > 0 and reply.text == recomputed.text
        store.close()
    core_s, none_s = statistics.median(core_ttft), statistics.median(none_ttft)
    return {
        "model": model,
        "codec": codec,
        "block_tokens": settled,
        "prompt_tokens": reply.stats.prompt_tokens,
        "restored_share": statistics.median(shares),
        "core_ttft_s": core_s,
        "none_ttft_s": none_s,
        "speedup": none_s / core_s,
        "answers_equal": f"{equal}/{repeats}",
    }


def _right(answer: str, expected: str) -> bool:
    return any(word in answer.lower() for word in expected.split("|"))


def state_facts(engine: KVShiftEngine, store: MemoryStore, user: str) -> int:
    """The user states :data:`FACTS` in one chat session; how many joined the core block."""
    with AgentMemory(engine, store, user_id=user, session_id="told", max_new_tokens=8, core_facts=True) as told:
        for text, _, _ in FACTS:
            told.chat(text)
        return len(told.core())


# how each arm answers: the block and recall (the default), the block alone, recall alone
ARMS: dict[str, dict[str, Any]] = {
    "core": {},
    "block_only": {"recall_min_score": 1.0},
    "recall_only": {"core_tokens": 1},
}
# the block is measured whole, however long the padding makes it
MEASURED_CORE_TOKENS = 4096


def ask(engine: KVShiftEngine, store: MemoryStore, user: str, questions: list[tuple[str, str, str]], tag: str) -> dict:
    """Each question in a new session, in each of :data:`ARMS`: the answers, per arm."""
    answered: dict[str, list[str]] = {arm: [] for arm in ARMS}
    for index, (_, question, _) in enumerate(questions):
        for arm, overrides in ARMS.items():
            settings: dict[str, Any] = {
                "write_back": False,
                "max_new_tokens": 24,
                "core_tokens": MEASURED_CORE_TOKENS,
                **overrides,
            }
            agent = AgentMemory(engine, store, user_id=user, session_id=f"{tag}-{arm}-{index}", **settings)
            answered[arm].append(agent.chat(question).text)
    return answered


def _count(answered: dict[str, list[str]], questions: list[tuple[str, str, str]]) -> dict[str, int]:
    return {arm: sum(_right(a, q[2]) for a, q in zip(texts, questions, strict=True)) for arm, texts in answered.items()}


def answers(model: str, padding: int) -> dict[str, Any]:
    """:data:`FACTS` stated after ``padding`` tokens of pinned LoCoMo turns, asked in each arm;
    then :data:`CORRECTIONS`, asked with the superseded lines kept and once the block is compacted."""
    engine = KVShiftEngine.from_pretrained(model)
    old_values = [next(expected for _, asked, expected in FACTS if asked == question) for _, question, _ in CORRECTIONS]
    olds = [(text, question, old) for (text, question, _), old in zip(CORRECTIONS, old_values, strict=True)]
    with tempfile.TemporaryDirectory() as folder, MemoryStore(Path(folder) / "store") as store:
        pinner = AgentMemory(engine, store, user_id="clara", session_id="pins", write_back=False)
        padded = pinned_block(pinner, store, engine, padding) if padding else 0
        joined = state_facts(engine, store, "clara")
        block = core_text(pinner.core())
        before = ask(engine, store, "clara", FACTS, "asked")
        with AgentMemory(
            engine, store, user_id="clara", session_id="corrects", max_new_tokens=8, core_facts=True
        ) as corrects:
            detected = sum(corrects.chat(text).corrected is not None for text, _, _ in CORRECTIONS)
            superseded = sum(line.superseded for line in corrects.core())
        after = ask(engine, store, "clara", CORRECTIONS, "again")
        change_block(store, "clara", lambda kept: kept.compacted(0.0))
        compacted = ask(engine, store, "clara", CORRECTIONS, "compacted")
        engine.flush_chunks(timeout_s=300)  # written in the background: before the folder goes
    return {
        "model": model,
        "padding_tokens": padded,
        "block_tokens": engine.count_tokens(block),
        "facts": len(FACTS),
        "joined_core": joined,
        "right": _count(before, FACTS),
        "corrections": len(CORRECTIONS),
        "corrections_detected": detected,
        "superseded_lines_kept": superseded,
        "corrected_new_value": _count(after, CORRECTIONS),
        "corrected_old_value": _count(after, olds),
        "compacted_new_value": _count(compacted, CORRECTIONS),
        "compacted_old_value": _count(compacted, olds),
        "answers": {"facts": before, "corrected": after, "compacted": compacted},
    }


def session(model: str, block_tokens: int) -> dict[str, Any]:
    """The 20-turn session: 3 corrections and 1 forget of core facts among small talk and questions."""
    engine = KVShiftEngine.from_pretrained(model)
    # turns 5, 10 and 16 correct a core fact, turn 13 forgets one; the rest is small talk and questions
    chatter = iter([*SMALL_TALK, *(question for _, question, _ in FACTS)])
    said = {5: CORRECTIONS[0][0], 10: CORRECTIONS[1][0], 13: FORGET[0], 16: CORRECTIONS[2][0]}
    script = [said.get(turn) or next(chatter) for turn in range(1, 21)]
    with tempfile.TemporaryDirectory() as folder, MemoryStore(Path(folder) / "store") as store:
        state_facts(engine, store, "clara")
        pinner = AgentMemory(engine, store, user_id="clara", session_id="pins", write_back=False)
        pinned_block(pinner, store, engine, block_tokens)
        agent = AgentMemory(engine, store, user_id="clara", session_id="twenty", max_new_tokens=24, core_facts=True)
        turns: list[dict[str, Any]] = []
        forgotten_after: list[bool] = []
        reused_after_forget, line_offset = None, None
        for number, message in enumerate(script):
            system = agent._system_messages()[0]["content"]  # noqa: SLF001
            if message == FORGET[0]:
                line_offset = engine.count_tokens(system[: system.index(FORGET[1])])
            reply = agent.chat(message)
            kind = "forget" if reply.decision == "forget" else "correction" if reply.corrected is not None else "turn"
            turns.append(
                {
                    "turn": number + 1,
                    "kind": kind,
                    "prompt_tokens": reply.stats.prompt_tokens,
                    "reused_tokens": reply.stats.reused_tokens,
                    "reused_share": reply.stats.reused_tokens / reply.stats.prompt_tokens,
                    "ttft_s": reply.ttft_s,
                }
            )
            if line_offset is not None and kind != "forget":
                # the system message and every memory the window shows (the user's own request, which
                # names what to forget, stays in the window as said)
                shown = [r.text for turn in agent.turns for r in turn.recalled]
                prompt = agent._system_messages()[0]["content"] + "\n".join(shown)  # noqa: SLF001
                forgotten_after.append(FORGET[1] in prompt)
                if reused_after_forget is None:
                    reused_after_forget = reply.stats.reused_tokens
        lines = agent.core()
        engine.flush_chunks(timeout_s=300)
    after_correction = [
        t["reused_share"] for prev, t in zip(turns, turns[1:], strict=False) if prev["kind"] == "correction"
    ]
    return {
        "model": model,
        "block_tokens": block_tokens,
        "turns": turns,
        "kinds": [t["kind"] for t in turns],
        "min_share_after_correction": min(after_correction) if after_correction else None,
        "median_share": statistics.median(t["reused_share"] for t in turns),
        "forgotten_in_a_later_prompt": any(forgotten_after),
        "forgotten_line_offset_tokens": line_offset,
        "reused_tokens_after_forget": reused_after_forget,
        "superseded_lines_kept": sum(line.superseded for line in lines),
        "block_lines": len(lines),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    parser.add_argument("--blocks", default="1000,2000", help="core block sizes in tokens")
    parser.add_argument("--codecs", default="fp32,int8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--parts", default="restart,answers,session", help="restart, answers, session")
    parser.add_argument("--paddings", default="0,1000,2000", help="answers: pinned tokens before the stated facts")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "core_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    parts = args.parts.split(",")
    models = args.models.split(",")
    report: dict[str, Any] = {"repeats": args.repeats}
    if "restart" in parts:
        rows = [
            measure(model, int(block), codec, args.repeats)
            for model in models
            for block in args.blocks.split(",")
            for codec in args.codecs.split(",")
        ]
        print(
            f"{'model':24} {'codec':5} {'block':>6} {'prompt':>6} {'stored':>7} {'core s':>7} {'none s':>7} "
            f"{'x':>6} equal"
        )
        for row in rows:
            print(
                f"{row['model']:24} {row['codec']:5} {row['block_tokens']:6d} {row['prompt_tokens']:6d} "
                f"{row['restored_share']:7.1%} {row['core_ttft_s']:7.3f} {row['none_ttft_s']:7.3f} "
                f"{row['speedup']:6.1f} {row['answers_equal']}"
            )
        report["rows"] = rows
    if "answers" in parts:
        paddings = [int(tokens) for tokens in args.paddings.split(",")]
        report["answers"] = [answers(model, padding) for model in models for padding in paddings]
        print(
            f"\n{'model':24} {'block':>5} {'right: core':>11} {'block':>5} {'recall':>6} {'fixed':>5} "
            f"{'new: core':>9} {'block':>5} {'recall':>6} {'old: core':>9} {'block':>5} | compacted new old"
        )
        for row in report["answers"]:
            right, new, old = row["right"], row["corrected_new_value"], row["corrected_old_value"]
            print(
                f"{row['model']:24} {row['block_tokens']:5d} {right['core']:11d} {right['block_only']:5d} "
                f"{right['recall_only']:6d} {row['corrections_detected']:3d}/{row['corrections']:<1d} "
                f"{new['core']:9d} {new['block_only']:5d} {new['recall_only']:6d} {old['core']:9d} "
                f"{old['block_only']:5d} | {row['compacted_new_value']['core']:9d} "
                f"{row['compacted_old_value']['core']:3d}"
            )
    if "session" in parts:
        report["session"] = [session(model, 1000) for model in models]
        for row in report["session"]:
            shares = " ".join(
                f"{t['reused_share']:.0%}{t['kind'][0] if t['kind'] != 'turn' else ''}" for t in row["turns"]
            )
            print(
                f"\n{row['model']}: reused per turn ({row['block_lines']} block lines; c correction, f forget):\n"
                f"  {shares}\n"
                f"  after a correction >= {row['min_share_after_correction']:.0%}; forgotten text in a later prompt: "
                f"{row['forgotten_in_a_later_prompt']}; the turn after the forget reused "
                f"{row['reused_tokens_after_forget']} tokens, the forgotten line began at "
                f"{row['forgotten_line_offset_tokens']}"
            )
    write_report(args.output, report)


if __name__ == "__main__":
    main()
