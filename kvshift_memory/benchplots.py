"""PNG plots of the benchmark results: TTFT and fidelity against memory size and recompute share.

Used by ``kvshift bench``; needs matplotlib (``pip install kvshift-memory[bench]``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from .exceptions import KVShiftError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_results"]


def plot_results(results: Path) -> list[Path]:
    """Plot what ``results`` (a ``benchmarks/results`` folder) holds; returns the PNG files written.

    :raises KVShiftError: matplotlib is missing, or no result file is there to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVShiftError("plots need matplotlib: pip install 'kvshift-memory[bench]'") from None
    written = []
    ttft = results / "ttft.json"
    if ttft.is_file():
        data = json.loads(ttft.read_text())
        sizes = sorted(data["sizes"], key=int)
        figure, axis = plt.subplots(figsize=(6, 4))
        for mode in ("none", "prefix", "shift", "blend"):
            axis.plot(
                [int(s) for s in sizes], [data["sizes"][s]["median_s"][mode] for s in sizes], marker="o", label=mode
            )
        axis.set(xlabel="memory tokens", ylabel="TTFT, median (s)", yscale="log", title="Time to first token")
        axis.legend()
        written.append(_save(figure, results / "ttft.png"))
    fidelity = results / "fidelity.json"
    if fidelity.is_file():
        summary = json.loads(fidelity.read_text())["datasets"]["locomo"]["summary"]
        ratios = sorted(
            (float(key.split("@")[1]), row["mean_kl"])
            for key, row in summary.items()
            if key.startswith("blend@") and key.split("@")[1].replace(".", "", 1).isdigit()  # not the ablations
        )
        figure, axis = plt.subplots(figsize=(6, 4))
        axis.plot([r * 100 for r, _ in ratios], [kl for _, kl in ratios], marker="o", label="blend")
        axis.axhline(summary["reorder"]["mean_kl"], linestyle="--", color="grey", label="reordering the memories")
        axis.axhline(summary["shift"]["mean_kl"], linestyle=":", color="red", label="shift only")
        axis.set(xlabel="fragment tokens recomputed (%)", ylabel="mean KL to full recompute", title="Fidelity (LoCoMo)")
        axis.legend()
        written.append(_save(figure, results / "fidelity.png"))
    if not written:
        raise KVShiftError(f"no ttft.json or fidelity.json in {results} to plot")
    return written


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path
