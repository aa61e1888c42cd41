"""The tables of ``scripts/head_tables.sh`` as Markdown, and the data-scaling plot.

    python scripts/head_tables_report.py [--results docs/heads/tables] [--plot docs/heads/tables/data_scaling.png]

Reads each head's ``*-train_summary.json``, ``*-eval.json`` (chain, k = 4) and ``*-eval-tree.json``
(EAGLE-2 dynamic tree) that the script copied, prints one table row per head (missing pieces as
"-"), says whether the chain's and the tree's greedy outputs are the same tokens (both must equal
decoding without speculation), and plots acceptance length against training tokens.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from specserve.plotting import load_pyplot


def load(results: Path) -> list[dict]:
    heads = []
    for summary in sorted(results.glob("*-train_summary.json")):
        name = summary.name[:-len("-train_summary.json")]
        m = re.fullmatch(r"int4-(\w+)-(\d+)", name)
        if m is None:   # not one of head_tables.sh's heads
            continue
        row = {"name": name, "variant": m.group(1), "budget": int(m.group(2)), "summary": json.loads(summary.read_text())}
        for kind in ("eval", "eval-tree"):
            f = results / f"{name}-{kind}.json"
            row[kind] = json.loads(f.read_text())["engine"] if f.is_file() else None
        heads.append(row)
    return sorted(heads, key=lambda r: (r["variant"] != "eagle3", r["variant"], r["budget"]))


def _al(e: dict | None) -> str:
    return "-" if e is None else f"{e['acceptance_length']:.2f} ± {e['acceptance_length_stderr']:.2f} ({e['num_verify_steps']:,})"


def _chain(e: dict | None) -> str:
    return "-" if e is None else " / ".join(f"{x:.3f}" for x in e["chain_accuracy"])


def table(heads: list[dict]) -> str:
    lines = ["| head | training tokens | steps | training s | val. loss | val. top-1 (chain 1..4) "
             "| chain k = 4: acceptance length (steps) | P(first j accepted) | tree 12 nodes: acceptance length (steps) "
             "| P(path >= j deep) | chain = tree outputs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for h in heads:
        s, chain, tree = h["summary"], h["eval"], h["eval-tree"]
        same = "-" if chain is None or tree is None else (
            "yes" if chain["output_token_ids"] == tree["output_token_ids"] else "**no**")
        va = s.get("val_after")   # absent while a run is unfinished
        loss = "-" if va is None else f"{va['loss']:.3f}"
        top1 = "-" if va is None else " / ".join(f"{x:.3f}" for x in va["chain_top1"])
        lines.append(f"| {h['variant']} | {s['train_tokens']:,} | {s['train_config']['num_steps']} | {s['seconds']:,.0f} "
                     f"| {loss} | {top1} | {_al(chain)} "
                     f"| {_chain(chain)} | {_al(tree)} | {_chain(tree)} | {same} |")
    return "\n".join(lines)


def plot(heads: list[dict], out: str) -> str | None:
    plt, note = load_pyplot(out)
    if plt is None:
        return note
    fig, ax = plt.subplots(figsize=(6.4, 4))
    scaling = [h for h in heads if h["variant"] == "eagle3"]
    for kind, label in (("eval", "eagle3 (3 steps), chain k = 4"), ("eval-tree", "eagle3, EAGLE-2 tree of 12 nodes")):
        pts = [(h["summary"]["train_tokens"], h[kind]) for h in scaling if h[kind] is not None]
        if pts:
            ax.errorbar([p[0] for p in pts], [p[1]["acceptance_length"] for p in pts],
                        yerr=[p[1]["acceptance_length_stderr"] for p in pts], marker="o", capsize=3, label=label)
    # the one-step variants (the norm / no-norm rows) as points beside eagle3's largest size, shifted
    # apart on the log axis so that their error bars do not overlap
    one_step = [h for h in heads if h["variant"] != "eagle3"]
    for i, h in enumerate(one_step):
        for kind, marker, label in (("eval", "s", "chain"), ("eval-tree", "D", "tree")):
            if h[kind] is not None:
                ax.errorbar([h["summary"]["train_tokens"] * 1.06 ** (i + 1)], [h[kind]["acceptance_length"]],
                            yerr=[h[kind]["acceptance_length_stderr"]], marker=marker, linestyle="", capsize=3,
                            color=f"C{2 + i}", label=f"{h['variant']} (1 step), {label}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("acceptance length (held-out prompts)")
    ax.set_title("Draft heads of the int4 Qwen2.5-Coder-1.5B: data scaling, norms at 500k", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default="docs/heads/tables")
    p.add_argument("--plot", default=None, help="write the data-scaling plot here (PNG)")
    args = p.parse_args()
    heads = load(Path(args.results))
    print(table(heads))
    if args.plot:
        print(plot(heads, args.plot) or f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
