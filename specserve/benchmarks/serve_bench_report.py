"""``specserve bench-serve``'s report: the markdown table it prints, and the plot of output tokens/s,
TPOT and speedup by concurrency."""
from __future__ import annotations

from pathlib import Path

from specserve.plotting import load_pyplot


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _fmt_rounds(xs: list[float]) -> str:
    """`` (a, b, ...)``: each round's figure after the combined one; empty for a single round."""
    return " (" + ", ".join(_fmt(x) for x in xs) + ")" if len(xs) > 1 else ""


def render_markdown(result: dict) -> str:
    """Header lines and one table row per mode x concurrency."""
    cfg, mach = result["config"], result["machine"]
    draft = ""
    if "spec" in cfg["modes"]:
        draft = (f", draft {cfg['speculative_model']} k={cfg['num_speculative_tokens']}"
                 + (" (adaptive: k chosen per step, up to this)" if cfg.get("adaptive_speculation") else ""))
    lines = [
        f"machine: {mach['cpu']}, {mach['cpu_count']} cpus; torch {mach['torch']}",
        f"model: {cfg['model']}, dtype {cfg['dtype']}{draft}; prompts: HumanEval (request i -> prompt i mod "
        f"{cfg['num_prompts']}), {cfg['max_tokens']} tokens per request (EOS ignored), greedy, streamed",
        "",
        "| mode | concurrency | requests | output tok/s | speedup vs none | TTFT median (s) | TTFT p99 (s) "
        "| TPOT median (ms) | TPOT p99 (ms) | acceptance rate | mean acceptance length | decode steps by k |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        for lv in run["levels"]:
            sd = lv.get("spec_decode") or {}
            tok_s = _fmt(lv["output_tok_s"]) + _fmt_rounds([r["output_tok_s"] for r in lv.get("rounds", [])])
            speedup = _fmt(lv.get("speedup_vs_none")) + _fmt_rounds(lv.get("round_speedups", []))
            by_k = sd.get("decode_steps_by_k") or {}
            steps = ", ".join(f"k={k}: {n:g}" for k, n in sorted(by_k.items(), key=lambda kv: -int(kv[0])))
            lines.append(f"| {run['mode']} | {lv['concurrency']} | {lv['num_requests']} | {tok_s} "
                         f"| {speedup} | {_fmt(lv['ttft_median_s'], 3)} "
                         f"| {_fmt(lv['ttft_p99_s'], 3)} | {_fmt(lv['tpot_median_ms'], 1)} "
                         f"| {_fmt(lv['tpot_p99_ms'], 1)} | {_fmt(sd.get('acceptance_rate'))} "
                         f"| {_fmt(sd.get('mean_acceptance_length'))} | {steps or '-'} |")
    a = result.get("agreement")
    if a:
        lines += ["", f"greedy texts of spec identical to none on {a['identical']}/{a['total']} requests"
                  + (" (differences: " + ", ".join(f"{d['request']} at char {d['first_diff_char']}"
                                                  for d in a["differences"][:10]) + ")" if a["differences"] else "")]
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """PNG: output tokens/s, median TPOT and the speedup over ``none`` vs concurrency, one line per
    mode (log2 x), each round as a dot;
    returns a note instead when matplotlib is missing."""
    plt, note = load_pyplot(path)
    if plt is None:
        return note
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    for run in result["runs"]:
        cs = [lv["concurrency"] for lv in run["levels"]]
        line, = ax1.plot(cs, [lv["output_tok_s"] for lv in run["levels"]], marker="o", label=run["mode"])
        ax2.plot(cs, [lv["tpot_median_ms"] for lv in run["levels"]], marker="o", label=run["mode"])
        if run["mode"] != "none" and any(lv.get("speedup_vs_none") for lv in run["levels"]):
            ax3.plot(cs, [lv.get("speedup_vs_none") for lv in run["levels"]], marker="o",
                     color=line.get_color(), label=f"{run['mode']} / none")
        for lv in run["levels"]:  # each round as a faint dot around the median
            for ax, ys in ((ax1, [r["output_tok_s"] for r in lv.get("rounds", [])]),
                           (ax3, lv.get("round_speedups", []))):
                ax.scatter([lv["concurrency"]] * len(ys), ys, s=12, color=line.get_color(), alpha=0.4)
    ax3.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    cfg = result["config"]
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "median TPOT (ms)"), (ax3, "output tok/s ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(cfg["concurrency"])
        ax.set_xticklabels([str(c) for c in cfg["concurrency"]])
        if ax is not ax3:
            ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    quant = f" {cfg['quantization']}" if cfg.get("quantization") else ""
    ax1.set_title(f"{cfg['model']}{quant}, {cfg['max_tokens']} tokens/request")
    ax2.set_title("time per output token")
    ax3.set_title("speedup vs none (dots: paired rounds)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
