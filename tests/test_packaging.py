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
    for index, (folder, typed) in enumerate(DISTRIBUTIONS.items()):
        out = tmp_path / str(index)
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)]
        done = subprocess.run([*command, str(ROOT / folder)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        (wheel,) = out.glob("*.whl")
        names = zipfile.ZipFile(wheel).namelist()
        assert typed in names, wheel.name
        assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), wheel.name
        if folder == ".":
            assert wheel.name.startswith(f"kvshift_memory-{kvshift_memory.__version__}-")


def test_the_core_version_is_written_in_one_place():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"] and "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvshift_memory.__version__"}


def test_llamahub_metadata_names_what_each_llama_index_package_exports():
    import importlib

    for folder in DISTRIBUTIONS:
        if "llama-index" not in folder:
            continue
        hub = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["tool"]["llamahub"]
        module = importlib.import_module(hub["import_path"])
        assert set(hub["class_authors"]) == set(module.__all__), folder
