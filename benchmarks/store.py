"""What storing fragments costs: bytes per token, fetch time per tier, and fidelity per codec.

Part 1, per codec (fp32, fp16, int8, int4) and memory size (512-4096 tokens of LoCoMo fragments,
the memories of ``ttft.py``), stored as records of a :class:`MemoryStore`:

- bytes per token of the stored blobs, and the ratio to fp32;
- ``fetch``: reading the blobs from a tier and decoding them (checksum, shapes, dequantisation),
  from the hot pool (this process's RAM), the disk tier (diskcache) and Redis;
- time to first token of the same question with the fragments (a) already in the engine's
  in-process pool and (b) fetched from the disk tier and decoded inside the call; ``added`` is
  (b) - (a), what a cold fetch adds to TTFT; ``recompute`` is full recompute (``reuse="none"``).

Part 2: KL(fp32 || codec) of the next-token distributions over the fp32 answer on the fidelity
instances of ``fidelity.py`` (LoCoMo), with the default blend and with shift only (no recompute).

Part 3: the embedded store as it grows (LoCoMo dialogue turns, one memory each): time per add,
and search latency with the index in memory, and reopened (loaded from its folder's snapshot).

Part 4 (``isolation``): one tenant's search beside another tenant's volume: the embedded index's
search for a tenant with 10 memories, alone and beside 200k memories of another tenant (random
384-d vectors through the index's log, as the store feeds it), median of 200 searches each.

Redis: ``--redis-url``, or a throwaway ``redis-server`` on 127.0.0.1 when one is installed.

    python benchmarks/store.py                  # ~35 min on 2 cores
    python benchmarks/store.py --parts search   # one part; the others keep their results
    python benchmarks/store.py --parts isolation

Prints tables and writes ``benchmarks/results/store.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from benchdata import build_instances, locomo_turns, write_report  # noqa: E402
from fidelity import kl_and_top1  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from ttft import QUESTION, memories_of  # noqa: E402

from kvshift_memory import KVShiftEngine  # noqa: E402
from kvshift_memory.embedding import MiniLMEmbedder  # noqa: E402
from kvshift_memory.store import MemoryStore  # noqa: E402
from kvshift_memory.store.index import IndexedState, MemoryIndex  # noqa: E402

RESULTS = HERE / "results"
CODECS = ("fp32", "fp16", "int8", "int4")
TENANT = "bench"


def fill(store: MemoryStore, engine: KVShiftEngine, texts: list[str]) -> list:
    """Add ``texts`` as memories and store their fragments (from the engine's pool when it holds them)."""
    records = [store.add(text, tenant=TENANT) for text in texts]
    engine.warm(records, QUESTION)
    return records


def fetch_seconds(engine: KVShiftEngine, store: MemoryStore, records: list, from_hot: bool) -> float:
    """``warm`` with the engine's fragment pool empty: every blob is read from the store and decoded."""
    engine.clear_cache(prefixes=False)
    if not from_hot:
        store.clear_cache()
    started = time.perf_counter()
    encoded = engine.warm(records, QUESTION)
    seconds = time.perf_counter() - started
    assert encoded == 0, "every fragment should have come from the store"
    return seconds


def ttft(engine: KVShiftEngine, records: list, reuse: str, cold_store: MemoryStore | None) -> float:
    engine.clear_cache(fragments=cold_store is not None)
    if cold_store is not None:
        cold_store.clear_cache()
    result = engine.generate(QUESTION, records, reuse=reuse, max_new_tokens=1)
    if cold_store is not None:
        assert result.stats.fragments_loaded == len(records), result.stats
    return result.stats.ttft_s


def part_sizes(engine, embedder, sizes, repeats, redis_url, report) -> None:
    pool = [m for instance in build_instances(60, engine.count_tokens, seed=11) for m in instance.memories]
    pool = list(dict.fromkeys(pool))
    print(
        f"{'codec':>6} {'tokens':>6} {'B/token':>8} {'x fp32':>6} {'hot':>8} {'disk':>8} {'redis':>8}"
        f" {'ttft pool':>9} {'ttft disk':>9} {'added':>7} {'recompute':>9}"
    )
    with tempfile.TemporaryDirectory() as folder:
        for codec in CODECS:
            disk = MemoryStore(Path(folder) / codec, embedder=embedder, codec=codec, index_url=":memory:")
            redis = MemoryStore(kv_url=redis_url, embedder=embedder, codec=codec) if redis_url else None
            for size in sizes:
                texts = memories_of(engine, size, pool)
                before = disk.stats()["fragment_bytes"]
                disk_records = fill(disk, engine, texts)
                tokens = sum(engine.count_tokens(t) for t in texts)
                blob_bytes = disk.stats()["fragment_bytes"] - before
                row = {"tokens": tokens, "bytes_per_token": blob_bytes / tokens}
                redis_records = fill(redis, engine, texts) if redis else None
                runs: dict[str, list[float]] = {k: [] for k in ("hot", "disk", "redis", "pool", "cold", "none")}
                for repeat in range(repeats + 1):
                    measured = {
                        "hot": fetch_seconds(engine, disk, disk_records, from_hot=True),
                        "disk": fetch_seconds(engine, disk, disk_records, from_hot=False),
                        "redis": (
                            fetch_seconds(engine, redis, redis_records, from_hot=False)
                            if redis and redis_records is not None
                            else float("nan")
                        ),
                        "pool": ttft(engine, disk_records, "blend", None),
                        "cold": ttft(engine, disk_records, "blend", disk),
                        "none": ttft(engine, disk_records, "none", None),
                    }
                    if repeat:
                        for key, value in measured.items():
                            runs[key].append(value)
                medians = {k: statistics.median(v) for k, v in runs.items()}
                row.update(
                    median_s=medians, runs_s=runs, repeats=repeats, added_ttft_s=medians["cold"] - medians["pool"]
                )
                report["sizes"].setdefault(codec, {})[str(size)] = row
                fp32 = report["sizes"]["fp32"][str(size)]["bytes_per_token"]
                row["ratio_to_fp32"] = row["bytes_per_token"] / fp32
                print(
                    f"{codec:>6} {tokens:>6} {row['bytes_per_token']:>8.0f} {row['ratio_to_fp32']:>6.3f}"
                    f" {medians['hot'] * 1e3:>6.0f}ms {medians['disk'] * 1e3:>6.0f}ms {medians['redis'] * 1e3:>6.0f}ms"
                    f" {medians['pool']:>8.3f}s {medians['cold']:>8.3f}s {row['added_ttft_s'] * 1e3:>5.0f}ms"
                    f" {medians['none']:>8.3f}s",
                    flush=True,
                )
            disk.close()
            if redis:
                redis.close()


def part_fidelity(engine, embedder, count, report) -> None:
    instances = build_instances(count, engine.count_tokens, seed=2)
    conditions = {"blend": None, "shift": 0.0}
    scores: dict[str, dict[str, list[tuple[float, float]]]] = {c: {k: [] for k in CODECS[1:]} for c in conditions}
    for index, instance in enumerate(instances):
        reference_answer = engine.generate(instance.question, list(instance.memories), reuse="none", max_new_tokens=32)
        continuation = reference_answer.token_ids or [sorted(engine.runner.eos_token_ids)[0]]
        # the fp32 fragments are encoded once (here) and stored in every codec: one store each
        engine.clear_cache()
        engine.warm(list(instance.memories), QUESTION)
        stores = {
            codec: MemoryStore(kv_url="memory://", embedder=embedder, codec=codec, index_url=":memory:")
            for codec in CODECS[1:]
        }
        records = {codec: fill(store, engine, list(instance.memories)) for codec, store in stores.items()}
        for condition, ratio in conditions.items():
            engine.clear_cache()
            reference = engine.score(
                instance.question,
                list(instance.memories),
                continuation,
                reuse="blend",
                recompute_ratio=ratio,
                return_distributions=True,
            ).distributions
            for codec in CODECS[1:]:
                engine.clear_cache()
                result = engine.score(
                    instance.question,
                    records[codec],
                    continuation,
                    reuse="blend",
                    recompute_ratio=ratio,
                    return_distributions=True,
                )
                assert result.stats.fragments_loaded == len(records[codec]), result.stats
                scores[condition][codec].append(kl_and_top1(reference, result.distributions))
        for store in stores.values():
            store.close()
        print(f"  instance {index + 1}/{len(instances)}", flush=True)
    print(f"\n{'codec':>6} " + " ".join(f"{c + ' KL':>12} {c + ' top1':>11}" for c in conditions))
    summary = {}
    for codec in CODECS[1:]:
        summary[codec] = {
            c: {
                "mean_kl": statistics.fmean(k for k, _ in scores[c][codec]),
                "top1": statistics.fmean(t for _, t in scores[c][codec]),
            }
            for c in conditions
        }
        print(
            f"{codec:>6} "
            + " ".join(f"{summary[codec][c]['mean_kl']:>12.5f} {summary[codec][c]['top1']:>11.3f}" for c in conditions)
        )
    report["fidelity"] = {"instances": len(instances), "against": "fp32 fragments, same reuse", "codecs": summary}


def part_search(embedder, sizes, repeats, report) -> None:
    """Search latency of the embedded store (disk tier + local Qdrant folder) as it grows."""
    turns = locomo_turns(max(sizes))
    queries = [
        f"What did {name} say about {topic}?"
        for name in ("Caroline", "Melanie", "Jon", "Gina")
        for topic in ("painting", "the conference", "her family", "running")
    ]
    print(f"\n{'memories':>8} {'add':>8} {'search, folder held':>20} {'search, folder reopened':>24} {'embed':>7}")
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        store = MemoryStore(Path(folder) / "s", embedder=embedder)
        added = 0
        for size in sizes:
            started = time.perf_counter()
            for text in turns[added:size]:
                store.add(text, tenant=TENANT)
            add_s = (time.perf_counter() - started) / max(size - added, 1)
            added = size
            store.search("warm up the index", tenant=TENANT)
            held, reopened, embed = [], [], []
            for query in queries[: repeats * 3]:
                started = time.perf_counter()
                store.search(query, tenant=TENANT)
                held.append(time.perf_counter() - started)
                store.index.close()  # what the first search of a new process pays: load the snapshot
                started = time.perf_counter()
                store.search(query, tenant=TENANT)
                reopened.append(time.perf_counter() - started)
                started = time.perf_counter()
                embedder.embed([query])
                embed.append(time.perf_counter() - started)
            row = {
                "add_s": add_s,
                "search_held_s": statistics.median(held),
                "search_reopened_s": statistics.median(reopened),
                "embed_s": statistics.median(embed),
            }
            rows[str(size)] = row
            print(
                f"{size:>8} {add_s * 1e3:>6.1f}ms {row['search_held_s'] * 1e3:>18.1f}ms"
                f" {row['search_reopened_s'] * 1e3:>22.1f}ms {row['embed_s'] * 1e3:>5.1f}ms",
                flush=True,
            )
        store.close()
    report["search"] = {
        "memories": "LoCoMo dialogue turns, one memory each",
        "queries": len(queries[: repeats * 3]),
        "sizes": rows,
    }


def part_isolation(others: int, repeats: int, report) -> None:
    """Search latency of one tenant alone and beside ``others`` memories of another tenant."""
    import uuid

    import numpy as np

    class Source:
        """The store's side of the index: its log and each memory's state, in lists."""

        def __init__(self) -> None:
            self.log: list[bytes] = []
            self.states: dict[tuple[str, str], IndexedState] = {}

        def read_log(self, start: int) -> list[bytes]:
            return self.log[start:]

        def index_state(self, tenant: str, memory_id: str) -> IndexedState | None:
            return self.states.get((tenant, memory_id))

    rng = np.random.default_rng(0)
    source = Source()
    index = MemoryIndex(":memory:", 384, "bench", source=source)

    def add(tenant: str, count: int) -> None:
        for vector in rng.normal(size=(count, 384)).astype(np.float32):
            memory_id = uuid.uuid4().hex
            source.log.append(json.dumps({"tenant": tenant, "id": memory_id, "n": uuid.uuid4().hex}).encode())
            source.states[(tenant, memory_id)] = IndexedState(1, None, vector.tolist())

    def median_search_s() -> float:
        query = rng.normal(size=384).tolist()
        index.search(query, "bob", None, 20)  # replays the log: not timed
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            index.search(query, "bob", None, 20)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    add("bob", 10)
    alone = median_search_s()
    add("mallory", others)
    beside = median_search_s()
    print(
        f"\nbob's search (10 memories): alone {alone * 1e3:.3f} ms,"
        f" beside {others:,} of mallory's {beside * 1e3:.3f} ms"
    )
    report["isolation"] = {
        "searcher_memories": 10,
        "other_tenant_memories": others,
        "search_alone_s": alone,
        "search_beside_s": beside,
        "ratio": beside / alone,
        "repeats": repeats,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--instances", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--redis-url", default=None, help="default: start a throwaway redis-server")
    parser.add_argument(
        "--parts", default="sizes,fidelity,search,isolation", help="which parts to run (others keep their results)"
    )
    parser.add_argument("--search-sizes", default="500,2000,5000")
    parser.add_argument("--other-tenant-memories", type=int, default=200_000)
    parser.add_argument("--output", type=Path, default=RESULTS / "store.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = KVShiftEngine.from_pretrained()
    embedder = MiniLMEmbedder()
    parts = set(args.parts.split(","))
    # a run of some parts keeps the other parts' results from an earlier run in the same file
    report = json.loads(args.output.read_text()) if args.output.exists() else {}
    command = " ".join(["python", *sys.argv])
    report.update(
        {
            "model": "SmolLM2-135M-Instruct (bundled, fp32)",
            "threads": args.threads,
            "recompute_ratio": engine.settings.recompute_ratio,
        }
    )
    with contextlib.ExitStack() as stack:
        redis_url = args.redis_url
        if redis_url is None:
            try:
                redis_url = stack.enter_context(RedisServer()).url
            except RuntimeError as exc:
                print(f"no Redis column: {exc}")
        if "sizes" in parts:
            report["sizes"] = {}
            part_sizes(engine, embedder, [int(s) for s in args.sizes.split(",")], args.repeats, redis_url, report)
            report["sizes_command"] = command
        if "fidelity" in parts:
            part_fidelity(engine, embedder, args.instances, report)
            report["fidelity_command"] = command
        if "search" in parts:
            part_search(embedder, [int(s) for s in args.search_sizes.split(",")], args.repeats, report)
            report["search_command"] = command
        if "isolation" in parts:
            part_isolation(args.other_tenant_memories, 200, report)
            report["isolation_command"] = command
    write_report(args.output, report)


if __name__ == "__main__":
    main()
