"""The notebooks, built from their scripts and executed: ``make notebooks``.

Each ``examples/NN_*.py`` is the source (jupytext's percent format); its ``.ipynb`` twin is the
same cells with the outputs of a run on this machine. The test suite runs every notebook top to
bottom with the same function (``tests/test_examples.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

EXAMPLES = Path(__file__).resolve().parent
SCRIPTS = sorted(EXAMPLES.glob("[0-9][0-9]_*.py"))


def executed(script: Path, workdir: Path, timeout_s: int = 600) -> nbformat.NotebookNode:
    """``script`` as a notebook, run top to bottom in a fresh Python kernel working in ``workdir``.

    :raises nbclient.exceptions.CellExecutionError: a cell failed (the error names it).
    """
    notebook = jupytext.read(script)
    NotebookClient(
        notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(workdir)}}
    ).execute()
    return notebook


def main() -> int:
    for script in SCRIPTS:
        print(f"running {script.name}", flush=True)
        jupytext.write(executed(script, EXAMPLES), script.with_suffix(".ipynb"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
