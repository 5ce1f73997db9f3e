"""The ``kvshift`` command on a real store: inspect, check, gc, and refusals with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvshift_memory import MemoryStore
from kvshift_memory.cli import main


@pytest.fixture
def folder(tmp_path, embedder):
    path = tmp_path / "store"
    with MemoryStore(path, embedder=embedder) as store:
        keep = store.add("Keep this fact.", tenant="alice")
        gone = store.add("Delete this fact.", tenant="alice")
        store.delete(gone.id, tenant="alice")
    return path, keep


def test_inspect_check_gc(folder, capsys):
    path, _ = folder
    assert main(["inspect", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["memories"], stats["deleted"]) == (1, 1)
    assert main(["check", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert main(["gc", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["erased_memories"] == 1


def test_check_fails_on_a_damaged_record(folder, capsys, embedder):
    path, keep = folder
    with MemoryStore(path, embedder=embedder) as store:
        store.tier.set(f"r/alice/{keep.id}/1", b"garbage")
    assert main(["check", str(path)]) == 1
    assert keep.id in capsys.readouterr().out


def test_refusals_are_one_line_and_status_2(tmp_path, capsys):
    assert main(["inspect"]) == 2
    assert "give a store folder" in capsys.readouterr().err
    assert main(["inspect", "--kv-url", "ftp://host/x"]) == 2
    assert capsys.readouterr().err.startswith("kvshift: unknown store URL scheme")
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    assert main(["inspect", str(a_file)]) == 2
    with pytest.raises(SystemExit):
        main(["no-such-command"])


def test_console_script_runs(folder):
    path, _ = folder
    out = subprocess.run([sys.executable, "-m", "kvshift_memory.cli", "inspect", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["memories"] == 1
