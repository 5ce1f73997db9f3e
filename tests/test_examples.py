"""The example notebooks: each matches its script, and runs top to bottom on the bundled model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jupytext
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
_spec = importlib.util.spec_from_file_location("example_notebooks", EXAMPLES / "notebooks.py")
notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(notebooks)

NAMES = ["01_engine", "02_langchain", "03_llama_index", "04_langchain_classic"]


def test_every_example_script_has_its_notebook():
    assert [script.stem for script in notebooks.SCRIPTS] == NAMES
    for name in NAMES:
        script, notebook = jupytext.read(EXAMPLES / f"{name}.py"), jupytext.read(EXAMPLES / f"{name}.ipynb")
        # the committed notebook holds the script's cells, unchanged (`make notebooks` rebuilds it)
        assert [(c.cell_type, c.source) for c in notebook.cells] == [(c.cell_type, c.source) for c in script.cells], (
            name
        )


@pytest.mark.model
@pytest.mark.parametrize("name", NAMES)
def test_the_notebook_runs_top_to_bottom(name, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSHIFT_FIGURES", str(tmp_path / "figures"))
    notebook = notebooks.executed(EXAMPLES / f"{name}.py", tmp_path)
    text = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "Traceback" not in text and "IProgress not found" not in text  # tqdm.auto draws its widget
    widgets = [
        o
        for c in notebook.cells
        for o in c.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in o.get("data", {})
    ]
    assert widgets, "no progress bar rendered as a Jupyter widget"
    if name == "01_engine":
        assert (tmp_path / "figures" / "01_engine_ttft.png").stat().st_size > 10_000
        rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and line.count("ms") == 4]
        assert len(rows) == 3
        for row in rows:  # prompt tokens, then (ms, "ms", ratio) for none, prefix, shift, blend
            none, prefix, shift = float(row[1]), float(row[4]), float(row[7])
            assert prefix < none and shift < none, row
    turns = [
        line.split() for line in text.splitlines() if line[:4].strip() in {"1", "2", "3", "4", "5"} and "%" in line
    ]
    if name in ("02_langchain", "04_langchain_classic"):  # turn, prompt, share, fragments, TTFT reuse, TTFT none
        assert [int(row[0]) for row in turns] == [1, 2, 3, 4, 5]
        # each turn reads the last from the cache (a new conversation: its system prompt)
        assert all(float(row[2].rstrip("%")) > 0 for row in turns[1:]), turns
        assert any(int(row[3]) > 0 for row in turns), turns  # recalled memories placed from their fragments
    if name == "02_langchain":  # ..., whether both agents answered alike
        assert all(row[6] in ("yes", "no") for row in turns), turns
    if name == "03_llama_index":  # turn, prompt, share, memories read, as fragments, TTFT
        assert [int(row[0]) for row in turns] == [1, 2, 3, 4, 5]
        assert int(turns[3][3]) >= 1 and int(turns[4][3]) >= 1, turns  # Tuesday recalled Monday's fact
        assert "⟦mem:" in text
