# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The engine on its own: reuse against full recompute
#
# A `KVShiftEngine` answers a question with memories in its prompt. With `reuse="none"` it reads
# the whole prompt (the baseline); with reuse it takes the K/V it computed before:
#
# - `prefix`: the system prompt and memories were the start of an earlier prompt (exact);
# - `shift`: each memory's fragment was encoded once, on its own, and is moved into place by
#   re-rotating its keys (RoPE); only the question is read;
# - `blend`: shift, then recompute a chosen share of memory tokens so memories see each other.
#
# The bundled SmolLM2-135M-Instruct, offline, on 2 CPU threads. This notebook and
# `01_engine.py` are one file in two formats (jupytext); the test suite runs the notebook.

# %%
import os
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from tqdm.auto import tqdm

from kvshift_memory import KVShiftEngine

torch.set_num_threads(min(2, torch.get_num_threads()))
engine = KVShiftEngine.from_pretrained()  # the bundled model; converted to safetensors on first use
# the figure goes next to this file (a notebook: its folder), or where KVSHIFT_FIGURES says
here = Path(__file__).resolve().parent if "__file__" in globals() else Path.cwd()
figures = Path(os.environ.get("KVSHIFT_FIGURES") or here / "figures")

# %% [markdown]
# Sixteen memories of an assistant's user, 40-80 tokens each, and a question about one of them.

# %%
MEMORIES = [
    "(12 March) The team trip to Lisbon is booked for 14-18 May. The budget is 50k euros for eight people, covering flights, the hotel near Praça do Comércio and one team dinner.",
    "(19 March) Alice's dog Biscuit is a three-year-old beagle who loves the beach and steals socks. She needs someone to look after him during the Lisbon trip; kennels make him anxious.",
    "(2 April) The weekly engineering meeting moved from Tuesday to Thursday at 3pm. The 2.4 release slipped to the end of April because the payment tests are flaky; Jonas owns the fix.",
    "(5 April) Alice started learning the cello in January. Her teacher, Mrs Okafor, gives lessons on Saturday mornings, and Alice practises scales for twenty minutes before work.",
    "(9 April) Alice's sister Ana lives in Porto with her partner Rui. Ana is allergic to peanuts and shellfish, so the family dinner in June needs a restaurant that can cater for that.",
    "(11 April) Marta handles the trip bookings and wants every receipt uploaded to the shared folder within a week of the trip. Taxi receipts count; meals outside the team dinner do not.",
    "(14 April) Alice is training for the Lisbon half marathon in October. Her plan has three runs a week, a long one on Sunday, and she wants to finish under two hours.",
    "(18 April) The office moves to the fourth floor of the Dock building on 1 June. Desks are assigned by team; the engineering team sits next to the kitchen, which Alice finds noisy.",
    "(22 April) Alice's car, a blue 2016 Golf, is due for its inspection in July. The garage on Rua Augusta quoted 180 euros for the service and the new front tyres.",
    "(25 April) Alice prefers window seats, vegetarian meals on flights and hotels with a gym. She is a member of the TAP Miles&Go programme, number ending 4471.",
    "(28 April) Jonas fixed the flaky payment tests: a race between the mock bank server and the retry timer. The 2.4 release is now planned for 6 May, with Priya as release manager.",
    "(2 May) Alice's parents celebrate their fortieth wedding anniversary on 20 June. The siblings plan a surprise dinner in Porto and are splitting the cost of a weekend in the Douro valley.",
    "(4 May) For the Lisbon trip, the team dinner is booked at a seafood restaurant in Alfama on 16 May at 8pm. Two colleagues are vegetarian; the restaurant confirmed options for them.",
    "(6 May) Alice has a dentist appointment on 23 May at 10am with Dr Lopes. She should not eat for an hour afterwards and must bring the X-rays from her last visit.",
    "(8 May) The neighbour, Mr Costa, agreed to look after Biscuit during the Lisbon trip. He needs the dog food, the lead and the vet's phone number, and walks him twice a day.",
    "(10 May) Alice is reading 'The Count of Monte Cristo' for her book club, which meets on the last Wednesday of the month at Livraria Bertrand. She is halfway through.",
]
QUESTION = "Who is looking after Biscuit while Alice is in Lisbon, and what does he need?"
print(f"{len(MEMORIES)} memories, {sum(engine.count_tokens(m) for m in MEMORIES)} tokens")

# %% [markdown]
# Each condition prepares the caches it assumes (untimed), then times one answer's first token.
# Every repeat runs all four back to back, so machine noise hits them alike; medians of 3.


# %%
CONDITIONS = {"none": ("none", None), "prefix": ("prefix", None), "shift": ("blend", 0.0), "blend": ("blend", None)}


def answer(condition: str, memories: list[str], max_new_tokens: int = 1):
    engine.clear_cache(fragments=False)  # no prompt prefix cached ...
    if condition == "prefix":  # ... except for "prefix": an earlier question about the same memories
        engine.generate("What did we talk about first?", memories, reuse="none", max_new_tokens=1)
    engine.warm(memories)  # fragments encoded once, when the memories were stored
    reuse, ratio = CONDITIONS[condition]
    return engine.generate(QUESTION, memories, reuse=reuse, recompute_ratio=ratio, max_new_tokens=max_new_tokens)


def first_token_s(condition: str, memories: list[str]) -> float:
    return answer(condition, memories).stats.ttft_s


sizes = [4, 8, 16]
first_token_s("none", MEMORIES)  # warm-up
ttft = {condition: [] for condition in CONDITIONS}
tokens = []
for size in tqdm(sizes, desc="memory sizes"):
    memories = MEMORIES[:size]
    tokens.append(engine.generate(QUESTION, memories, reuse="none", max_new_tokens=1).stats.prompt_tokens)
    runs = [{c: first_token_s(c, memories) for c in CONDITIONS} for _ in range(3)]
    for condition in CONDITIONS:
        ttft[condition].append(statistics.median(run[condition] for run in runs))

print(f"{'prompt tokens':>13} " + " ".join(f"{c:>15}" for c in CONDITIONS))
for i, n in enumerate(tokens):
    cells = [f"{ttft[c][i] * 1000:6.0f} ms {ttft['none'][i] / ttft[c][i]:4.1f}x" for c in CONDITIONS]
    print(f"{n:>13} " + " ".join(f"{cell:>15}" for cell in cells))

# %%
figures.mkdir(parents=True, exist_ok=True)
fig, ax = plt.subplots(figsize=(6, 3.6))
for condition, marker in zip(CONDITIONS, "osD^", strict=False):
    ax.plot(tokens, [t * 1000 for t in ttft[condition]], marker=marker, label=condition)
ax.set_xlabel("prompt tokens (memories + question)")
ax.set_ylabel("time to first token (ms)")
ax.set_yscale("log")
ax.set_title("SmolLM2-135M, 2 CPU threads: reuse against full recompute")
ax.legend()
fig.tight_layout()
fig.savefig(figures / "01_engine_ttft.png", dpi=120)
plt.show()

# %% [markdown]
# Does reuse change the answer? `prefix` is exact; `shift` and `blend` approximate the
# cross-attention between memories. The bundled model has 135M parameters and gets facts wrong
# even with full recompute: judge reuse by how closely it follows the `none` answer.

# %%
for condition in CONDITIONS:
    result = answer(condition, MEMORIES, max_new_tokens=40)
    s = result.stats
    print(
        f"{condition:<7} reused {s.reused_tokens:>4}/{s.prompt_tokens} recomputed {s.recomputed_tokens:>3}: {result.text.strip()}"
    )
