"""Tools through a model's own chat template: how much of each turn's prompt is read from the cache.

For each template whose tool branch we render (``tests/test_templates.py``: Qwen 2.5, Llama 3.1,
Hermes 3), a tiny random-weight model with the bundled tokenizer (and the template's special
tokens) answers a question with a tool bound and its first call forced under the layout's grammar;
turn 2 sends the call and the tool's result back; turn 3 sends the answer and a new question. The
figures are token counts (no timing): the prompt's tokens, and those read from the prefix cache.
A random model writes random (valid) arguments, so the call's length varies with the seed; the
share reused is what the template's layout allows.

    python benchmarks/tool_templates.py [--seed 0]    # ~10 s

Prints a table and writes ``benchmarks/results/tool_templates.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from benchdata import write_report  # noqa: E402

RESULTS = HERE / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="the tiny model's weights")
    args = parser.parse_args()

    import test_templates as templates
    from transformers import AutoTokenizer

    from kvshift_memory import adapters
    from kvshift_memory.engine.loading import bundled_gguf_path

    gguf = bundled_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = templates.TINY_CONFIGS["llama"]()
    config.vocab_size = templates.VOCAB + 8  # room for the templates' special tokens
    model = templates.tiny_model(config, seed=args.seed)
    rows = []
    for name, (template, layout, special, _) in templates.TOOL_TEMPLATES.items():
        engine = templates.engine_with(model, tokenizer, template, special)
        question = [
            {"role": "system", "content": templates.SYSTEM},
            {"role": "user", "content": "Is it warm in Lisbon today?"},
        ]
        tools, memories = [templates.WEATHER], templates.MEMORIES[:1]
        grammar = adapters.tool_call_grammar(tools, "any", layout=layout)
        first = engine.generate(question, memories, tools=tools, grammar=grammar, max_new_tokens=60)
        _, calls = adapters.parse_tool_calls(first.text, layout)
        history = [
            *question,
            {"role": "assistant", "content": "", "tool_calls": [{**calls[0], "id": "call_1"}]},
            {"role": "tool", "content": "24 C and sunny", "tool_call_id": "call_1"},
        ]
        second = engine.generate(history, memories, tools=tools, max_new_tokens=4)
        third = engine.generate(
            [*history, {"role": "assistant", "content": second.text}, {"role": "user", "content": "And tomorrow?"}],
            memories,
            tools=tools,
            max_new_tokens=2,
        )
        rows.append(
            {
                "template": name,
                "layout": engine.tool_layout,
                "turn1_prompt_and_call": first.stats.prompt_tokens + first.stats.generated_tokens,
                "turn2_reused": second.stats.reused_tokens,
                "turn2_prompt": second.stats.prompt_tokens,
                "turn3_reused": third.stats.reused_tokens,
                "turn3_prompt": third.stats.prompt_tokens,
            }
        )
    print(f"{'template':<10} {'layout':<11} {'turn 1':>7} {'turn 2 reused':>16} {'turn 3 reused':>16}")
    for row in rows:
        two, three = row["turn2_reused"] / row["turn2_prompt"], row["turn3_reused"] / row["turn3_prompt"]
        print(
            f"{row['template']:<10} {row['layout']:<11} {row['turn1_prompt_and_call']:>7} "
            f"{row['turn2_reused']:>5}/{row['turn2_prompt']:<4} {two:>5.0%} "
            f"{row['turn3_reused']:>5}/{row['turn3_prompt']:<4} {three:>5.0%}"
        )
    write_report(RESULTS / "tool_templates.json", {"seed": args.seed, "rows": rows})


if __name__ == "__main__":
    main()
