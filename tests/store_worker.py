"""A child process that writes to a shared store, for the durability and concurrency tests.

It never imports torch: fragment blobs are built with safetensors' numpy API in the codec's
int8 layout, so a child starts in a fraction of a second and 50 of them fit in a test.

    python store_worker.py add-forever KV_URL TENANT          # prints "ready", then each id once its add returned
    python store_worker.py add-and-read KV_URL TENANT COUNT   # prints a JSON report
    python store_worker.py search-forever KV_URL TENANT        # searches every 0.3 s until killed
    python store_worker.py supersede-race KV_URL TENANT MEMORY_ID COUNT NAME START  # prints a JSON report
    python store_worker.py add-skewed KV_URL TENANT COUNT SKEW_S  # adds with time.time() SKEW_S behind; prints ids
    python store_worker.py item-churn KV_URL TENANT           # prints "ready", then puts and deletes items until killed
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid

import numpy as np
from safetensors.numpy import save

from kvshift_memory.adapters import delete_item, put_item
from kvshift_memory.blobs import CHECKSUM_KEY, blob_checksum
from kvshift_memory.exceptions import VersionConflictError
from kvshift_memory.store import MemoryStore

LAYERS, HEADS, DIM = 2, 2, 8


class HashEmbedder:
    """Bag-of-words hashing into 512 dimensions: deterministic, instant, and enough to find an exact text."""

    name = "test-hash-512"
    dimension = 512

    def embed(self, texts):
        out = []
        for text in texts:
            vector = np.zeros(self.dimension, dtype=np.float32)
            for word in text.lower().split():
                vector[int(hashlib.md5(word.encode()).hexdigest(), 16) % self.dimension] += 1.0
            vector /= max(float(np.linalg.norm(vector)), 1e-9)
            out.append(vector.tolist())
        return out


def int8_blob(store: MemoryStore, record, n: int = 6) -> bytes:
    """A valid int8 fragment blob for ``record`` (random K/V), sealed like the codec seals one."""
    rng = np.random.default_rng(n)
    tensors = {
        "token_ids": np.arange(n, dtype=np.int32),
        "k": rng.integers(-127, 128, (LAYERS, HEADS, n, DIM), dtype=np.int8),
        "ks": np.full((LAYERS, HEADS, 1, DIM), 0.01, dtype=np.float16),
        "v": rng.integers(-127, 128, (LAYERS, HEADS, n, DIM), dtype=np.int8),
        "vs": np.full((LAYERS, HEADS, n, 1), 0.01, dtype=np.float16),
    }
    metadata = {
        "format": "kvshift-fragment/1",
        "codec": "int8",
        "group_size": "32",
        "rotation": "post",
        "base_position": "10",
        "context_digest": "test",
        "num_layers": str(LAYERS),
        "dtype": "float32",
        "model_fingerprint": "test-model",
        **store.fragment_expectations(record),
    }
    metadata[CHECKSUM_KEY] = blob_checksum(save(tensors, metadata=metadata))
    return save(tensors, metadata=metadata)


VARIANT = "ab" * 16


def main() -> None:
    command, kv_url, tenant = sys.argv[1:4]
    if command == "add-skewed":  # this process's own clock runs behind every other's
        real_time, skew = time.time, float(sys.argv[5])
        time.time = lambda: real_time() - skew
    if kv_url.startswith("file://"):  # the embedded default: diskcache + a local Qdrant folder
        store = MemoryStore(kv_url.removeprefix("file://"), embedder=HashEmbedder())
    else:
        store = MemoryStore(kv_url=kv_url, index_url=":memory:", embedder=HashEmbedder())
    if command in ("add-forever", "item-churn"):
        print("ready", flush=True)  # the store is open: a kill from now on lands while it writes
    if command == "add-forever":
        index = 0
        while True:
            record = store.add(f"{tenant} memory number {index} {uuid.uuid4().hex}", tenant=tenant)
            store.save_fragment(record, VARIANT, int8_blob(store, record, n=4 + index % 50))
            print(json.dumps({"id": record.id, "text": record.text}), flush=True)
            index += 1
    if command == "add-and-read":
        count = int(sys.argv[4])
        report = {"added": [], "misread": []}
        for index in range(count):
            text = f"{tenant} item {index} {uuid.uuid4().hex}"
            record = store.add(text, tenant=tenant, session_id=f"s{index % 3}")
            report["added"].append({"id": record.id, "text": text})
            got = store.get(record.id, tenant=tenant)
            if got is None or got.text != text or got.tenant != tenant:
                report["misread"].append(record.id)
            if index % 20 == 0:
                if record.id not in [hit.id for hit in store.search(text, tenant=tenant, k=5)]:
                    report["misread"].append(f"search:{record.id}")
        print(json.dumps(report), flush=True)
    if command == "search-forever":
        store.search("warm up", tenant=tenant)
        print("searching", flush=True)
        while True:
            store.search("where is the spare key", tenant=tenant, k=4)
            time.sleep(0.3)
    if command == "supersede-race":
        memory_id, count, name, start = sys.argv[4], int(sys.argv[5]), sys.argv[6], float(sys.argv[7])
        time.sleep(max(0.0, start - time.time()))  # both processes begin together
        outcomes = []
        for attempt in range(count):
            live = store.get(memory_id, tenant=tenant)
            text = f"{name} attempt {attempt} {uuid.uuid4().hex}"
            try:
                new = store.supersede(memory_id, text, tenant=tenant, expected_version=live.version)
                outcomes.append({"text": text, "version": new.version})
            except VersionConflictError:
                outcomes.append({"text": text, "version": None})
        print(json.dumps(outcomes), flush=True)
    if command == "add-skewed":
        for index in range(int(sys.argv[4])):
            record = store.add(f"{tenant} skewed memory {index} {uuid.uuid4().hex}", tenant=tenant)
            print(json.dumps({"id": record.id, "text": record.text}), flush=True)
    if command == "item-churn":
        index = 0
        while True:
            key = f"k{index % 3}"
            text = f"value {index} of {key} {uuid.uuid4().hex}"
            if index % 4 == 3:
                delete_item(store, tenant, ("notes",), key)
            else:
                put_item(store, tenant, ("notes",), key, {"text": text}, text)
            index += 1


if __name__ == "__main__":
    main()
