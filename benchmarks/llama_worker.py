"""llama.cpp (through llama-cpp-python) as the peer of ``benchmarks/decode.py``, run by the Python of
a benchmark-only virtual environment: llama-cpp-python is never a dependency of the package or of
its tests. One JSON request a line on stdin, one JSON answer a line on stdout:

    {"op": "load", "path": "model.gguf", "n_ctx": 4608, "threads": 2}
    {"op": "reply", "prompt": [token ids], "tokens": 64, "fresh": false}

``reply`` decodes greedily, ``tokens`` tokens after the prompt, not stopping at the end-of-turn
token (our engine is measured the same way), and answers the seconds to the first token and to the
last, and how many prompt tokens the context already held: llama-cpp-python's ``generate`` reuses
the longest prefix of the previous prompt it still holds (its prefix cache), unless ``fresh`` asks
for a new context's state first (a restart).

Set up once, from PyPI's source distribution (a few minutes of compiling on 2 cores):

    python3 -m venv .bench-venv && .bench-venv/bin/pip install llama-cpp-python==0.3.36
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def main() -> None:
    argparse.ArgumentParser(
        description="llama.cpp's side of benchmarks/decode.py: JSON requests on stdin, answers on stdout."
    ).parse_args()
    from llama_cpp import Llama

    llm: Any = None
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "load":
            llm = Llama(
                model_path=request["path"],
                n_ctx=request["n_ctx"],
                n_threads=request["threads"],
                n_threads_batch=request["threads"],
                n_batch=512,
                verbose=False,
            )
            answer: dict[str, Any] = {"ok": True}
        elif request["op"] == "reply":
            if request.get("fresh"):
                llm.reset()
            held = llm.n_tokens
            prompt = request["prompt"]
            common = 0
            for a, b in zip(llm._input_ids[:held], prompt[:held], strict=False):
                if a != b:
                    break
                common += 1
            started = time.perf_counter()
            first = last = started
            produced = 0
            for _ in llm.generate(prompt, temp=0.0, top_k=1):
                produced += 1
                last = time.perf_counter()
                if produced == 1:
                    first = last
                if produced == request["tokens"]:
                    break
            answer = {"ttft_s": first - started, "total_s": last - started, "tokens": produced, "reused": common}
        else:
            answer = {"error": f"unknown op {request['op']!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
