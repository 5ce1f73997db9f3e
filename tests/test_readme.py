"""The README's code: every Python block runs as written, each in a fresh interpreter and folder."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), flags=re.S | re.M)


def test_the_readme_is_a_short_user_page_with_its_quick_starts():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300
    assert len(BLOCKS) >= 5  # agent, engine, store, LangChain, LlamaIndex


@pytest.mark.model
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[block.splitlines()[0][:40] for block in BLOCKS])
def test_a_readme_block_runs_as_written(index, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", BLOCKS[index]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "a block prints what it shows"
