"""matplotlib for the benchmarks' plots, optional: a missing install is a note, not an error."""
from __future__ import annotations


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
