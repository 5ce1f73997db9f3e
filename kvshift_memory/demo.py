"""``kvshift demo``: two sessions with one user's agent memory, on the bundled model.

Session 1 tells the agent a few facts (stated, not asked), some small talk, then corrects one
fact; each turn reuses the previous turn's cache and prefills only what is new, and write-back
archives every stated fact while the small talk stays in the window. Then session 1 is resumed
as a new process would resume it (the engine's caches emptied, the store opened again): its
window comes back from the store, and its K/V from the store's chunks instead of a prefill. Session 2 (a new
conversation, as a new process would hold it) asks about them: the facts come back from the
store, the corrected one at its new version only: the facts the user stated about themselves
the ones the user stated about themselves also from the core block, laid after the system prompt
and read back from the store's K/V (session 1 stored it as it closed; session 2 runs as a new process would, its caches
empty), the others recalled by search. Between the sessions the user stores a
project brief (``demo_brief.txt``, about 1.4k tokens) as a document, its parts' fragments encoded
once. Each question of session 2 is answered three times, with the same recall: with
``reuse="none"`` (everything recomputed), with the agent's default (``"auto"``: on the bundled
model the recalled memories are recomputed, as measured in docs/benchmarks/long_memory.md) and
with ``reuse="blend"`` (the brief's fragments shifted in, asked for by name); the table compares
time to first token, says which session each recalled memory was stated in, and whether each
answer agrees with full recompute's.
"""

from __future__ import annotations

import tempfile
import time
from importlib import resources
from pathlib import Path

__all__ = ["run_demo"]

SESSION_1 = [
    "Hi! I am planning a team trip to Lisbon in May.",
    "The budget for the Lisbon trip is 50k euros for eight people.",
    "My dog Biscuit, a beagle, needs a sitter while we are in Lisbon.",
    "ok, thanks!",
    "Marta books the hotel near Praça do Comércio and wants every receipt within a week.",
    "The budget for the Lisbon trip is not 50k, it is 70k euros.",
]
RESUMED = "Remind me, who books the hotel?"
SESSION_2 = [
    "What is the budget for the Lisbon trip?",
    "Who needs a sitter during the trip?",
    "Who books the hotel?",
    "When does the boat tour on the Tagus leave?",
    "Who signs the orders above 500 euros?",
]
BRIEF_PART_TOKENS = 400


def run_demo(store_path: str | None = None, max_new_tokens: int = 32) -> int:
    """Run the scripted demo, printing as it goes; returns 0."""
    import torch
    from tqdm.auto import tqdm

    from . import AgentMemory, AgentSettings, KVShiftEngine, MemoryStore

    torch.set_num_threads(min(2, torch.get_num_threads()))
    started = time.perf_counter()
    print("loading the bundled SmolLM2-135M-Instruct (converted to safetensors once, on the first run)")
    engine = KVShiftEngine.from_pretrained()
    described = engine.describe()
    print(
        f"model loaded in {time.perf_counter() - started:.1f} s: weights {described['weights']} "
        f"({described['weights_bytes'] / 1e6:.0f} MB), K/V {described['kv_dtype']}, decoding: {described['decode']}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(store_path) if store_path else Path(scratch) / "store"
        with MemoryStore(folder) as store:
            settings = AgentSettings(max_new_tokens=max_new_tokens)
            print(f"\n== session 1 (store: {folder}) ==")
            planning = AgentMemory(engine, store, user_id="alice", session_id="planning", settings=settings)
            rows = []
            for message in tqdm(SESSION_1, desc="session 1 turns", leave=False):
                reply = planning.chat(message)
                rows.append(reply)
            print(f"{'turn':<66} {'prompt':>6} {'reused':>6} {'new':>4} {'TTFT':>7} {'decode':>9}  write-back")
            for reply in rows:
                s = reply.stats
                new = s.prompt_tokens - s.reused_tokens
                note = reply.decision + (" (corrects a memory)" if reply.corrected is not None else "")
                print(
                    f"{reply.message[:66]:<66} {s.prompt_tokens:>6} {s.reused_tokens:>6} {new:>4} "
                    f"{reply.ttft_s * 1000:>5.0f}ms {s.decode_tokens_per_s:>5.0f} t/s  {note}"
                )
            planning.close()  # the block session 2 starts with is computed and stored once, now
            corrected = next((r.corrected for r in rows if r.corrected is not None), None)
            if corrected is not None:
                print("\nhistory of the corrected memory:")
                for version in planning.history(corrected.id):
                    print(f"  v{version.version} [{version.status}] {version.text}")

            print("\n== session 1 resumed after a restart ==")
            engine.flush_chunks(timeout_s=120)  # the K/V of session 1, written in the background
            engine.clear_cache()  # a new process holds nothing: what is reused comes from the store
            with MemoryStore(folder) as reopened:
                resumed = AgentMemory(engine, reopened, user_id="alice", session_id="planning", settings=settings)
                earlier = len(resumed.window)
                s = resumed.chat(RESUMED).stats
                print(
                    f"window read back from the store: {earlier} turns; prompt of {s.prompt_tokens} tokens: "
                    f"{s.restored_tokens} ({s.restored_tokens / s.prompt_tokens:.0%}) restored from stored K/V, "
                    f"{s.prompt_tokens - s.reused_tokens} computed; {s.ttft_s * 1000:.0f} ms to first token, "
                    f"{s.decode_tokens_per_s:.0f} tokens/s after it"
                )

            print("\n== the project brief, stored as a document ==")
            brief = resources.files(__package__).joinpath("demo_brief.txt").read_text(encoding="utf-8")
            started_brief = time.perf_counter()
            # an agent that shifts its memories in (reuse="blend") encodes their fragments as it stores them
            documents = AgentMemory(engine, store, user_id="alice", session_id="documents", reuse="blend")
            parts = documents.add_document(brief, source="lisbon-brief.md", max_tokens=BRIEF_PART_TOKENS)
            encoded_s = time.perf_counter() - started_brief
            print(
                f"{engine.count_tokens(brief)} tokens stored as {len(parts)} memories of at most "
                f"{BRIEF_PART_TOKENS} tokens, their fragments encoded once in {encoded_s:.1f} s"
            )

            print("\n== session 2: a new conversation, a week later, in a new process ==")
            engine.flush_chunks(timeout_s=120)
            engine.clear_cache()  # a new process: the core block's K/V comes from the store
            asking = AgentSettings(max_new_tokens=max_new_tokens, write_back=False)
            # the blend first: an exact arm before it would leave the exact prompt stored for it to read
            arms = ("blend", asking.reuse, "none")
            table = []
            for index, question in enumerate(tqdm(SESSION_2, desc="session 2 questions", leave=False)):
                answers = {}
                for reuse in arms:
                    # each arm as a new process would run it: what it reuses of the prompt's start
                    # (the system prompt and the core block) it reads from the store itself
                    engine.clear_cache(fragments=False)
                    agent = AgentMemory(
                        engine,
                        store,
                        user_id="alice",
                        session_id=f"later-{reuse}-{index}",
                        settings=asking,
                        reuse=reuse,
                    )
                    answers[reuse] = agent.chat(question)
                table.append((question, answers))
            engine.flush_chunks()  # the turns' K/V chunks are written in the background: before the store closes
            first = table[0][1][arms[0]]
            block_tokens = engine.count_tokens("\n".join(line.text for line in first.core))
            print(
                f"core block: {len(first.core)} facts the user stated about themselves (~{block_tokens} tokens), "
                f"after the system prompt; the first turn read {first.stats.restored_tokens} of its "
                f"{first.stats.prompt_tokens} prompt tokens from stored K/V "
                f"({first.stats.restored_tokens / first.stats.prompt_tokens:.0%})\n"
            )
            print(
                f"{'question':<38} {'best recalled memory (+ others)':<48} {'stated in':>10} {'recalled':>8} "
                + " ".join(f"{reuse:>20}" for reuse in arms[:-1])
                + f" {'restored':>8} {arms[-1]:>7}"
            )
            for question, answers in table:
                recalled = answers["none"].recalled  # most relevant last
                best = f"{' '.join(recalled[-1].text.split())[:42]} (+{len(recalled) - 1})" if recalled else "-"
                source = (recalled[-1].source or recalled[-1].session_id or "-") if recalled else "-"
                tokens = sum(engine.count_tokens(r.text) for r in recalled)
                none = answers["none"].ttft_s
                cells = []
                for reuse in arms[:-1]:
                    agree = "same" if answers[reuse].text == answers["none"].text else "differ"
                    cells.append(
                        f"{answers[reuse].ttft_s * 1000:>5.0f}ms {none / answers[reuse].ttft_s:>4.1f}x {agree:>6}"
                    )
                print(
                    f"{question[:38]:<38} {best[:48]:<48} {source[:10]:>10} {tokens:>4} tok "
                    + " ".join(cells)
                    + f" {answers[asking.reuse].stats.restored_tokens:>8} {none * 1000:>5.0f}ms"
                )
            print(f"\nanswers ({' | '.join(arms)}):")
            for question, answers in table:
                print(f"  {question}")
                for name in arms:  # one line each: a reply's line breaks would scatter the table
                    print(f"    {name + ':':<8} {' '.join(answers[name].text.split())[:100]}")
            print(
                "\nTTFT counts from the call, recall from the store included; each speed-up is against full\n"
                "recompute (none) and says whether the answer is full recompute's. The default, auto, reuses the\n"
                "conversation exactly and recomputes recalled memories on this model: shifting them in changed too\n"
                "many answers when measured (docs/benchmarks/long_memory.md). It also reads back K/V that earlier\n"
                "turns with the same prompt start stored (restored: tokens); stored at int8, the store's default,\n"
                'that can move an answer (MemoryStore(codec="fp32") stores it exactly). reuse="blend" shifts the\n'
                "brief's fragments in, faster the more is recalled, and its answers may differ. The bundled model\n"
                "has 135M parameters and often gets facts wrong even with the right memory."
            )
    print(f"\ndemo finished in {time.perf_counter() - started:.0f} s")
    return 0
