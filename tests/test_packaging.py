"""Every distribution ships its licence and its type hints, and the version is defined once."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

import kvshift_memory

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTIONS = {
    ".": "kvshift_memory/py.typed",
    "integrations/langchain": "langchain_kvshift/py.typed",
    "integrations/llama_index/llama-index-llms-kvshift": "llama_index/llms/kvshift/py.typed",
    "integrations/llama_index/llama-index-memory-kvshift": "llama_index/memory/kvshift/py.typed",
}


def test_every_wheel_holds_its_licence_and_py_typed(tmp_path):
    for folder in DISTRIBUTIONS:
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
        done = subprocess.run([*command, str(ROOT / folder)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    wheels = sorted(tmp_path.glob("*.whl"))
    assert len(wheels) == len(DISTRIBUTIONS)
    for wheel, typed in zip(wheels, sorted(DISTRIBUTIONS.values(), key=_wheel_order), strict=True):
        names = zipfile.ZipFile(wheel).namelist()
        assert typed in names, wheel.name
        assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), wheel.name
    core = next(w for w in wheels if w.name.startswith("kvshift_memory-"))
    assert core.name.startswith(f"kvshift_memory-{kvshift_memory.__version__}-")


def test_the_core_version_is_written_in_one_place():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvshift_memory.__version__"}


def _wheel_order(typed: str) -> str:
    """The wheel file name a package's py.typed belongs to, for sorting alongside the wheels."""
    return typed.split("/py.typed")[0].replace("/", "_")
