"""Training curves of one or several heads (validation loss and top-1 by step) as one PNG."""
from __future__ import annotations

import json
from pathlib import Path

from specserve.plotting import load_pyplot


def read_log(path: str | Path) -> list[dict]:
    """The evaluated steps of a ``train_log.jsonl``: ``[{"step", "tokens", "val": {...}}, ...]``."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if "val" in r]


def write_training_plot(logs: dict[str, str | Path], out: str | Path) -> str | None:
    """Plot validation loss, top-1 and the top-1 of the last chain step against training tokens
    for each named log; returns a note instead when matplotlib is missing."""
    plt, note = load_pyplot(str(out))
    if plt is None:
        return note
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, path in logs.items():
        rows = read_log(path)
        x = [r["tokens"] / 1000 for r in rows]
        axes[0].plot(x, [r["val"]["loss"] for r in rows], marker="o", label=name)
        axes[1].plot(x, [r["val"]["top1"] for r in rows], marker="o", label=name)
        axes[2].plot(x, [r["val"]["chain_top1"][-1] for r in rows], marker="o", label=name)
    for ax, title in zip(axes, ("validation loss", "validation top-1 (next token)",
                                "top-1 at the last chain step (own features)")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("training tokens (thousands)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(str(out), dpi=110)
    plt.close(fig)
    return None
