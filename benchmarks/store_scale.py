"""How the embedded store's upkeep scales: ``check()``, ``stats()``, ``gc()`` and search at N memories.

Memories are LoCoMo dialogue turns (``Speaker: text``; past the data set's turns they repeat with
a running number), added one by one through :meth:`MemoryStore.add` to the default embedded store
(disk tier + in-process index with its folder snapshot), all of one tenant: the tenant filter then
keeps every point, the slowest case for search. Texts are embedded with the bundled MiniLM in
batches first and served to ``add()`` from that table: the vectors ``add()`` would compute,
without 50k single-text forward passes.

Measured, each the median of ``--repeats`` runs where it repeats:

- ``search``: a query (MiniLM embedding included) against the warm index;
- ``first search``: the first search of a new process on the folder (loads the index snapshot);
- ``stats()``, ``check()`` (every record, embedding and blob verified, the index reconciled) and
  ``gc()`` (nothing to free: what a routine run costs).

    python benchmarks/store_scale.py                    # 50k memories, about 15 min on 2 cores
    python benchmarks/store_scale.py --memories 5000

Prints a table and writes ``benchmarks/results/store_scale.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchdata import locomo_turns, write_report

from kvshift_memory import MemoryStore
from kvshift_memory.embedding import MiniLMEmbedder

RESULTS = Path(__file__).parent / "results"
TENANT = "alice"
QUERIES = [
    f"What did {name} say about {topic}?"
    for name in ("Caroline", "Melanie", "Jon", "Gina")
    for topic in ("painting", "the conference", "her family", "running", "the weekend")
]


class TableEmbedder:
    """The bundled embedder, answering from a table computed in batches for the texts it knows."""

    def __init__(self, embedder: MiniLMEmbedder, texts: list[str]) -> None:
        self.name, self.dimension = embedder.name, embedder.dimension
        self._embedder = embedder
        self._table = dict(zip(texts, embedder.embed(texts), strict=True))

    def embed(self, texts):
        return [self._table[t] if t in self._table else self._embedder.embed([t])[0] for t in texts]


def memory_texts(count: int) -> list[str]:
    turns = locomo_turns(10**9)
    return [turns[i % len(turns)] + ("" if i < len(turns) else f" ({i // len(turns)})") for i in range(count)]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def first_search(folder: Path) -> float:
    """A new process's first search on the folder, timed inside that process."""
    code = (
        "import time, sys; from kvshift_memory import MemoryStore; "
        "store = MemoryStore(sys.argv[1]); store.embedder.embed(['warm up the embedder']); "
        "started = time.perf_counter(); store.search(sys.argv[2], tenant=sys.argv[3]); "
        "print(time.perf_counter() - started)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(folder), QUERIES[0], TENANT], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memories", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=RESULTS / "store_scale.json")
    args = parser.parse_args()
    texts = memory_texts(args.memories)
    started = time.perf_counter()
    embedder = TableEmbedder(MiniLMEmbedder(), texts)
    embed_s = time.perf_counter() - started
    row: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "store"
        store = MemoryStore(folder, embedder=embedder)
        started = time.perf_counter()
        for text in texts:
            store.add(text, tenant=TENANT)
        row["add_ms"] = (time.perf_counter() - started) / len(texts) * 1e3
        store.search("warm up the index", tenant=TENANT)
        searches = [timed(lambda q=q: store.search(q, tenant=TENANT, k=4)) for q in QUERIES[: max(args.repeats, 1) * 5]]
        row["search_ms"] = statistics.median(searches) * 1e3
        row["stats_s"] = statistics.median(timed(store.stats) for _ in range(args.repeats))
        checks = []
        for _ in range(args.repeats):
            report = None

            def check() -> None:
                nonlocal report
                report = store.check()

            checks.append(timed(check))
            assert report is not None and report.ok and report.memories == len(texts), report
        row["check_s"] = statistics.median(checks)
        row["gc_s"] = statistics.median(timed(store.gc) for _ in range(args.repeats))
        store.close()
        row["first_search_s"] = statistics.median(first_search(folder) for _ in range(args.repeats))
    print(f"\n{'memories':>9} {'add':>8} {'search':>8} {'first search':>13} {'stats()':>8} {'check()':>8} {'gc()':>8}")
    print(
        f"{len(texts):>9} {row['add_ms']:>6.2f}ms {row['search_ms']:>6.1f}ms {row['first_search_s']:>12.2f}s"
        f" {row['stats_s']:>7.2f}s {row['check_s']:>7.2f}s {row['gc_s']:>7.2f}s"
    )
    write_report(
        args.output,
        {
            "memories": len(texts),
            "tenants": 1,
            "embedding_s": embed_s,
            "repeats": args.repeats,
            **row,
        },
    )


if __name__ == "__main__":
    main()
