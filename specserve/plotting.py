"""matplotlib for the benchmarks' plots, optional: a missing install is a note, not an error; and
writing a benchmark's figures (JSON) and plot."""
from __future__ import annotations

import sys
from typing import Callable

from specserve.results import write_json


def load_pyplot(path: str):
    """``(pyplot, None)`` on the non-interactive Agg backend, or ``(None, note)`` when matplotlib is
    not installed (the note says the plot at ``path`` was not written and how to get it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, f"--plot {path}: matplotlib is not installed, no plot written (pip install matplotlib)"
    return plt, None


def write_results(result: dict, json_path: str | None, plot_path: str | None,
                  write_plot: Callable[[dict, str], str | None], what: str = "plot") -> None:
    """Write ``result`` as JSON to ``json_path`` and its plot to ``plot_path`` (either may be None);
    says on stderr where each went, or the note ``write_plot`` returned instead of a plot."""
    if plot_path:
        note = write_plot(result, plot_path)
        print(note or f"{what} written to {plot_path}", file=sys.stderr)
    if json_path:
        write_json(json_path, result)
        print(f"figures written to {json_path}", file=sys.stderr)
