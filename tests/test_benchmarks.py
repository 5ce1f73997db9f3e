"""The benchmark scripts: every one starts (``--help``) and its results carry their provenance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))

# one interpreter for all scripts: each imports the same heavy libraries
_RUN_ALL = """
import contextlib, io, runpy, sys
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise SystemExit(f"{path}: --help exited {exc.code}")
    if "usage:" not in out.getvalue():
        raise SystemExit(f"{path}: --help printed no usage")
    print("started", path)
"""


def test_every_benchmark_script_starts():
    assert len(SCRIPTS) >= 10
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _RUN_ALL, *map(str, SCRIPTS)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("started") == len(SCRIPTS)


def test_a_report_records_command_machine_commit_dirty_flag_and_date(tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from benchdata import write_report
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "ttft.py"), "--sizes", "512"])
    write_report(tmp_path / "r.json", {"figure": 1})
    report = json.loads((tmp_path / "r.json").read_text())
    provenance = report["provenance"]
    assert report["figure"] == 1
    assert provenance["command"] == "python benchmarks/ttft.py --sizes 512"  # as typed from the repository's root
    assert provenance["machine"]["cpus"] == os.cpu_count() and provenance["machine"]["platform"]
    assert len(provenance["commit"]) == 40 and isinstance(provenance["dirty"], bool)
    assert provenance["date"].endswith("+00:00")
