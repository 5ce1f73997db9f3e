"""Which turns must an agent archive? Fitted and measured on LoCoMo's evidence labels.

LoCoMo's QA items name the dialogue turns (``evidence``) a later question needs: a labelled set
for a write-back classifier that decides, after each turn, whether to archive it as a memory. The
target is recall of evidence turns >= 0.9 while archiving <= 60 % of all turns.

Scorers, each ranking the turns of a conversation; the top share is archived:

- ``length``: longer turns first (the baseline);
- ``features``: logistic regression over 8 cheap features of the turn and the turn before it;
- ``features+embedding`` (``--embeddings``): the same plus the bundled MiniLM embedding.

Both regressions are fitted leave-one-conversation-out: the conversation scored was never seen in
fitting. Data is read from ../shared/data/locomo (CC BY-NC 4.0), never copied.

The agent's rule (``kvshift_memory/agent/writeback.py``) is the ``features`` regression with two
fixed thresholds: archive at or above the importance that archives ``--archive-share`` of the
fitting turns, drop below the importance of the least important 1 % of the fitting evidence. It is
measured the same way (thresholds too are fitted without the conversation scored), and ``--fit``
writes the rule fitted on all ten conversations into the package.

    python benchmarks/writeback.py [--embeddings] [--fit]   # ~10 s, ~90 s with embeddings

Prints a table and writes ``benchmarks/results/writeback.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchdata import locomo_dir, write_report  # noqa: E402

from kvshift_memory.agent.writeback import FEATURES, WriteBackModel, turn_features  # noqa: E402

RESULTS = HERE / "results"
SHARES = (0.5, 0.55, 0.6)
MODEL_FILE = HERE.parent / "kvshift_memory" / "agent" / "writeback_model.json"
DROP_EVIDENCE_SHARE = 0.01


def labelled_turns() -> list[tuple[int, dict, str, bool]]:
    """(conversation index, turn, previous turn's text, is evidence) for every LoCoMo turn."""
    conversations = json.loads((locomo_dir() / "locomo10.json").read_text())
    rows = []
    for index, sample in enumerate(conversations):
        evidence = {e.strip() for qa in sample["qa"] for e in qa.get("evidence", [])}
        conversation, session = sample["conversation"], 1
        while f"session_{session}" in conversation:
            turns = conversation[f"session_{session}"]
            for position, turn in enumerate(turns):
                previous = turns[position - 1]["text"] if position else ""
                rows.append((index, turn, previous, turn["dia_id"] in evidence))
            session += 1
    return rows


def features(turn: dict, previous: str) -> list[float]:
    return turn_features(turn["text"], previous, "blip_caption" in turn or "img_url" in turn)


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float = 1e-2) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = torch.tensor(x), torch.tensor(y)
    weight = torch.zeros(x.shape[1], requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimiser = torch.optim.LBFGS([weight, bias], max_iter=300)

    def loss() -> torch.Tensor:
        optimiser.zero_grad()
        value = torch.nn.functional.binary_cross_entropy_with_logits(inputs @ weight + bias, targets)
        value = value + l2 * (weight * weight).sum()
        value.backward()
        return value

    optimiser.step(loss)
    return weight.detach(), bias.detach()


def held_out_scores(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> np.ndarray:
    scores = np.zeros(len(y))
    for group in np.unique(groups):
        held = groups == group
        weight, bias = fit_logistic(x[~held], y[~held])
        scores[held] = (torch.tensor(x[held]) @ weight + bias).numpy()
    return scores


def fit_rule(x: np.ndarray, y: np.ndarray, archive_share: float) -> WriteBackModel:
    """The agent's rule fitted on raw features ``x``: regression plus archive and drop thresholds."""
    mean, std = x.mean(0), x.std(0) + 1e-6
    weight, bias = fit_logistic(((x - mean) / std).astype(np.float32), y)
    model = WriteBackModel(tuple(mean.tolist()), tuple(std.tolist()), tuple(weight.tolist()), float(bias), 0.0, 0.0)
    importance = np.array([model.importance_of_features(row) for row in x])
    return WriteBackModel(
        model.mean,
        model.std,
        model.weight,
        model.bias,
        archive_threshold=float(np.quantile(importance, 1.0 - archive_share)),
        drop_threshold=float(np.quantile(importance[y > 0], DROP_EVIDENCE_SHARE)),
    )


def rule_metrics(x: np.ndarray, y: np.ndarray, groups: np.ndarray, archive_share: float) -> dict[str, float]:
    """The agent's decisions on each conversation, with the rule fitted on the other nine."""
    decisions = np.empty(len(y), dtype=object)
    for group in np.unique(groups):
        held = groups == group
        model = fit_rule(x[~held], y[~held], archive_share)
        decisions[held] = [model.decide(model.importance_of_features(row)) for row in x[held]]
    archived, dropped = decisions == "archive", decisions == "drop"
    return {
        "recall": float(y[archived].sum() / y.sum()),
        "precision": float(y[archived].mean()),
        "archived": float(archived.mean()),
        "dropped": float(dropped.mean()),
        "evidence_dropped": float(y[dropped].sum() / y.sum()),
    }


def archive_metrics(scores: np.ndarray, y: np.ndarray, groups: np.ndarray, share: float) -> dict[str, float]:
    """Archive the top ``share`` of each conversation's turns; recall and precision of evidence."""
    kept = hits = 0
    for group in np.unique(groups):
        mask = groups == group
        top = np.argsort(-scores[mask], kind="stable")[: int(share * mask.sum())]
        kept += len(top)
        hits += y[mask][top].sum()
    return {"recall": float(hits / y.sum()), "precision": float(hits / kept), "archived": float(kept / len(y))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--embeddings", action="store_true", help="also the bundled MiniLM embedding as features")
    parser.add_argument("--archive-share", type=float, default=0.57, help="share of fitting turns the rule archives")
    parser.add_argument("--fit", action="store_true", help=f"write the rule fitted on all turns to {MODEL_FILE.name}")
    parser.add_argument("--output", type=Path, default=RESULTS / "writeback.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    rows = labelled_turns()
    y = np.array([label for *_, label in rows], dtype=np.float32)
    groups = np.array([group for group, *_ in rows])
    raw = np.array([features(turn, previous) for _, turn, previous, _ in rows], dtype=np.float64)
    hand = ((raw - raw.mean(0)) / (raw.std(0) + 1e-6)).astype(np.float32)
    scorers = {"length": hand[:, 0], "features": held_out_scores(hand, y, groups)}
    if args.embeddings:
        from kvshift_memory.embedding import MiniLMEmbedder

        vectors = np.array(MiniLMEmbedder().embed([turn["text"] for _, turn, _, _ in rows]), dtype=np.float32)
        scorers["features+embedding"] = held_out_scores(np.hstack([hand, vectors]), y, groups)
    report = {
        "command": " ".join(["python", *sys.argv]),
        "turns": len(rows),
        "evidence_share": float(y.mean()),
        "features": FEATURES,
        "fitting": "logistic regression, L2 1e-2, leave-one-conversation-out (10 conversations)",
        "results": {},
    }
    print(f"{len(rows)} turns, {y.mean():.1%} of them evidence\n")
    print(f"{'scorer':>20} " + " ".join(f"{'archive ' + format(s, '.0%'):>20}" for s in SHARES))
    for name, scores in scorers.items():
        report["results"][name] = {str(share): archive_metrics(scores, y, groups, share) for share in SHARES}
        cells = " ".join(
            f"{'R ' + format(m['recall'], '.3f') + ' P ' + format(m['precision'], '.3f'):>20}"
            for m in report["results"][name].values()
        )
        print(f"{name:>20} {cells}")
    rule = rule_metrics(raw, y, groups, args.archive_share)
    report["agent_rule"] = {"archive_share_fitted": args.archive_share, **rule}
    print(
        f"\nagent rule (held out): archives {rule['archived']:.1%} of turns, evidence recall {rule['recall']:.3f}, "
        f"precision {rule['precision']:.3f}; drops {rule['dropped']:.1%} ({rule['evidence_dropped']:.1%} of evidence)"
    )
    if args.fit:
        model = fit_rule(raw, y, args.archive_share)
        MODEL_FILE.write_text(json.dumps({**vars(model), "features": FEATURES, "fitted_by": report["command"]}, indent=1) + "\n")
        print(f"wrote {MODEL_FILE}")
    write_report(args.output, report)


if __name__ == "__main__":
    main()
