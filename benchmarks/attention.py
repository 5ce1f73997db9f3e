"""Where the answer's first token looks: attention under full recompute and under the blend.

For each LoCoMo instance of ``fidelity.py`` (same builder, same seed) the prompt is prepared twice,
by full recompute (``reuse="none"``) and by the default blend (memories warmed first, as an agent
stores them), and the prompt's last token is run once more over each cache with its attention
recorded: per layer, the share of its attention (summed over heads, normalised to 1) that each part
of the prompt receives. The parts:

- ``prefix``: the system message up to the memories;
- ``lead memory``: the memory that opens the block, read exactly from its lead fragment;
- ``evidence memory (shifted)`` / ``other memories (shifted)``: the shifted memories that hold the
  data set's evidence for the question, and the rest (instances with a shifted evidence memory);
- ``evidence memory (lead)``: the lead memory on the instances where it holds the evidence;
- ``recomputed tokens`` / ``kept shifted tokens``: the shifted memories' tokens the blend
  recomputed, and those it kept as shifted (the same slots under both conditions);
- ``question``: everything after the memories (the user's message and the assistant's header).

A part's figure is the mean over instances of its share averaged over layers; ``blend / full`` is
the ratio of those means, also per third of the layers. This says how the blend's K/V change what
the answer reads, which the KL and contains-answer figures of ``fidelity.py`` only show the result of.

    python benchmarks/attention.py                     # 40 instances; 31 min on 2 cores shared with another run
    python benchmarks/attention.py --recompute-window 4096   # the blend with no recompute window

Prints a table and writes ``benchmarks/results/attention.json`` (or ``--output``).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdata import build_instances, write_report  # noqa: E402

from kvshift_memory import KVShiftEngine  # noqa: E402
from kvshift_memory.engine.blend import reads_lead  # noqa: E402
from kvshift_memory.kv.cache import ForwardStep  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = (
    "prefix",
    "lead memory",
    "evidence memory (shifted)",
    "other memories (shifted)",
    "evidence memory (lead)",
    "recomputed tokens",
    "kept shifted tokens",
    "question",
)


def last_token_attention(engine: KVShiftEngine, prepared, ids: torch.Tensor) -> torch.Tensor:
    """``[layers, n]``: each layer's attention of the prompt's last token, normalised to 1.

    The last token is run again at its own slot over the prepared cache: its K/V come out as they
    were, and the attention function records what its query read.
    """
    n = ids.numel()
    capture: list[torch.Tensor] = []
    engine.runner.forward(
        prepared.cache,
        ids[n - 1 :],
        ForwardStep(torch.tensor([n - 1]), n, capture=capture, capture_queries=1),
        logits="none",
    )
    mass = torch.stack([layer[:n] for layer in capture])
    return mass / mass.sum(dim=1, keepdim=True)


def part_slots(layout, instance, recomputed: torch.Tensor, lead_read: bool) -> dict[str, torch.Tensor]:
    """Slot masks of each part of the prompt (a part an instance lacks is left out)."""
    n = layout.length
    spans = layout.fragments
    shifted = spans[1:] if lead_read else spans

    def mask_of(selected) -> torch.Tensor:
        mask = torch.zeros(n, dtype=torch.bool)
        for span in selected:
            mask[span.start : span.end] = True
        return mask

    evidence = set(instance.evidence_index)
    offset = len(spans) - len(shifted)
    parts = {"prefix": mask_of([]), "question": mask_of([])}
    parts["prefix"][: spans[0].start] = True
    parts["question"][spans[-1].end :] = True
    shifted_mask = mask_of(shifted)
    parts["recomputed tokens"] = shifted_mask & recomputed[:n]
    parts["kept shifted tokens"] = shifted_mask & ~recomputed[:n]
    if lead_read:
        parts["lead memory"] = mask_of(spans[:1])
        if 0 in evidence:
            parts["evidence memory (lead)"] = parts["lead memory"]
    held = [span for index, span in enumerate(shifted) if index + offset in evidence]
    if held:
        parts["evidence memory (shifted)"] = mask_of(held)
        parts["other memories (shifted)"] = shifted_mask & ~parts["evidence memory (shifted)"]
    return parts


def measure(engine: KVShiftEngine, instance) -> dict[str, dict[str, list[float]]]:
    """Per part, each condition's attention share per layer on one instance."""
    messages = [{"role": "user", "content": instance.question}]
    memories = list(instance.memories)
    engine.clear_cache(fragments=False)
    engine.warm(memories, messages)
    plan = engine.planner.plan(messages, memories, reuse="blend")
    layout = plan.layout
    lead_read = reads_lead(engine.runner, layout, layout.fragments[0])
    engine.clear_cache(fragments=False)
    full = engine.runner.prefill(replace(plan, reuse="none"))
    full_mass = last_token_attention(engine, full, layout.token_ids)
    del full
    engine.clear_cache(fragments=False)
    blend = engine.runner.prefill(plan)
    blend_mass = last_token_attention(engine, blend, layout.token_ids)
    recomputed = blend.recomputed if blend.recomputed is not None else torch.zeros(layout.length, dtype=torch.bool)
    parts = part_slots(layout, instance, recomputed, lead_read)
    return {
        part: {"full": full_mass[:, mask].sum(dim=1).tolist(), "blend": blend_mass[:, mask].sum(dim=1).tolist()}
        for part, mask in parts.items()
    }


def summarise(per_instance: list[dict], layers: int) -> dict[str, dict]:
    thirds = [(int(part[0]), int(part[-1]) + 1) for part in torch.arange(layers).tensor_split(3)]
    summary = {}
    for part in PARTS:
        rows = [row[part] for row in per_instance if part in row]
        if not rows:
            continue
        full = torch.tensor([r["full"] for r in rows])
        blend = torch.tensor([r["blend"] for r in rows])
        summary[part] = {
            "instances": len(rows),
            "full": float(full.mean()),
            "blend": float(blend.mean()),
            "ratio": float(blend.mean() / full.mean()),
            "ratio_by_layers": {f"{a}-{b - 1}": float(blend[:, a:b].mean() / full[:, a:b].mean()) for a, b in thirds},
            "per_layer_ratio": (blend.mean(0) / full.mean(0)).tolist(),
        }
    return summary


def print_table(summary: dict) -> None:
    thirds = list(next(iter(summary.values()))["ratio_by_layers"])
    header = (
        "| part | instances | full recompute | blend | blend / full | "
        + " | ".join(f"layers {t}" for t in thirds)
        + " |"
    )
    print(header)
    print("|---|" + "---:|" * (header.count("|") - 2))
    for part, row in summary.items():
        cells = [part, str(row["instances"]), f"{row['full']:.4f}", f"{row['blend']:.4f}", f"{row['ratio']:.3f}"]
        cells += [f"{row['ratio_by_layers'][t]:.3f}" for t in thirds]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=40)
    parser.add_argument("--seed", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--recompute-window", type=int, default=None, help="EngineSettings.recompute_window (default: the engine's)"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "attention.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = {} if args.recompute_window is None else {"recompute_window": args.recompute_window}
    engine = KVShiftEngine.from_pretrained(**overrides)
    instances = build_instances(args.instances, engine.count_tokens, seed=args.seed)
    started = time.perf_counter()
    per_instance = []
    for index, instance in enumerate(instances):
        per_instance.append(measure(engine, instance))
        print(f"  [{index + 1}/{len(instances)}] {instance.question[:60]!r}", flush=True)
    summary = summarise(per_instance, engine.runner.num_layers)
    print(
        f"\nattention share of the prompt's last token ({len(instances)} LoCoMo instances, "
        f"recompute_ratio {engine.settings.recompute_ratio:g}, recompute_window {engine.settings.recompute_window})"
    )
    print_table(summary)
    write_report(
        args.output,
        {
            "model": "SmolLM2-135M-Instruct (bundled), float32",
            "threads": args.threads,
            "seed": args.seed,
            "recompute_ratio": engine.settings.recompute_ratio,
            "recompute_window": engine.settings.recompute_window,
            "elapsed_s": round(time.perf_counter() - started, 1),
            "summary": summary,
            "per_instance": per_instance,
        },
    )


if __name__ == "__main__":
    main()
