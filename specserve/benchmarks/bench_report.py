"""``specserve bench``'s report: the markdown tables it prints, and the plot of V(k) and of the
speedup by k."""
from __future__ import annotations

from specserve.plotting import load_pyplot


def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def render_markdown(result: dict) -> str:
    cfg, mach = result["config"], result["machine"]
    lines = [
        f"machine: {mach['cpu']}, {mach['cpu_count']} cpus, torch threads {mach['torch_threads']}; "
        f"torch {mach['torch']}",
        f"model: {cfg['model']}, dtype {cfg['dtype']}, quantization {cfg.get('quantization', 'none')}, prompts: HumanEval 0-{cfg['num_prompts'] - 1}, "
        f"max tokens {cfg['max_tokens']} (EOS ignored), batch size {cfg['batch_size']}, greedy",
        "load average (1 min) at start / after each phase: "
        + ", ".join(f"{k} {v[0]}" for k, v in result.get("load_average", {}).items() if v),
        "",
        "| engine | TTFT median (s) | decode tok/s median | decode tok/s aggregate | e2e tok/s median "
        "| e2e tok/s aggregate | decode ratio specserve/HF |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    ours = result["specserve"]["summary"]
    hf = result.get("hf", {}).get("summary") if result.get("hf") else None
    for name, s in (("specserve", ours), ("transformers", hf)):
        if s is None:
            continue
        ratio = "1.00" if name == "transformers" else (
            _fmt(ours["decode_tok_s_median"] / hf["decode_tok_s_median"]) if hf else "-")
        lines.append(f"| {name} | {_fmt(s['ttft_median_s'], 3)} | {_fmt(s['decode_tok_s_median'])} "
                     f"| {_fmt(s['decode_tok_s_aggregate'])} | {_fmt(s['e2e_tok_s_median'])} "
                     f"| {_fmt(s['e2e_tok_s_aggregate'])} | {ratio} |")
    if result.get("agreement"):
        a = result["agreement"]
        lines += ["", f"greedy tokens identical to transformers on {a['identical_prompts']}/{a['prompts']} prompts"
                  + (f" (first divergence at positions {a['first_divergence_positions']})"
                     if a["first_divergence_positions"] else "")]
    if result.get("speculative"):
        lines += ["", f"speculation (draft {result['speculative'][0]['draft']}), same prompts, same run:", "",
                  "| k | decode tok/s median | e2e tok/s aggregate | speedup (decode median) | speedup (e2e) "
                  "| mean acceptance length | acceptance rate | draft s / verify s | identical to no speculation |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["speculative"]:
            s, sd, a = r["summary"], r["spec_decode"], r["agreement_with_no_speculation"]
            lines.append(f"| {r['k']} | {_fmt(s['decode_tok_s_median'])} | {_fmt(s['e2e_tok_s_aggregate'])} "
                         f"| {_fmt(r['speedup_decode_median'])} | {_fmt(r['speedup_e2e_aggregate'])} "
                         f"| {_fmt(sd['mean_acceptance_length'])} | {_fmt(sd['acceptance_rate'])} "
                         f"| {sd['draft_time_s']:.0f} / {sd['verify_time_s']:.0f} "
                         f"| {a['identical_prompts']}/{a['prompts']} |")
    lc = result.get("llama_cpp")
    if lc:
        p = lc["plain"]["summary"]
        lines += ["", f"llama.cpp (llama-cpp-python {lc['version']}, {lc['threads']} threads) on the same GGUF, "
                  f"same prompt tokens, greedy:", "",
                  "| llama.cpp | TTFT median (s) | decode tok/s median | e2e tok/s aggregate | speedup vs its plain "
                  "| greedy tokens == its plain | specserve decode / llama.cpp plain |",
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  f"| plain | {_fmt(p['ttft_s_median'], 3)} | {_fmt(p['decode_tok_s_median'])} "
                  f"| {_fmt(p['e2e_tok_s_aggregate'])} | 1.00 | - "
                  f"| {_fmt(ours['decode_tok_s_median'] / p['decode_tok_s_median'])} |"]
        for r in lc["speculative"]:
            s = r["summary"]
            lines.append(f"| draft k={r['k']} | {_fmt(s['ttft_s_median'], 3)} | {_fmt(s['decode_tok_s_median'])} "
                         f"| {_fmt(s['e2e_tok_s_aggregate'])} | {_fmt(r['speedup_decode_median'])} "
                         f"| {r['greedy_equal_to_plain']} | - |")
        for r in result.get("speculative") or []:
            lines.append(f"| (specserve k={r['k']} / llama.cpp plain) | | | | | | "
                         f"{_fmt(r['summary']['decode_tok_s_median'] / p['decode_tok_s_median'])} |")
    q = result.get("quality")
    if q:
        lines += ["", f"quality: {q['num_tokens']} teacher-forced tokens ({q['text']}), segments of "
                  f"{q['segment_len']}, against the float32 target:", "",
                  "| quantization | top-1 agreement with float32 | perplexity | weight bytes (linears) |",
                  "| --- | --- | --- | --- |"]
        for r in q["rows"]:
            lines.append(f"| {r['quantization']} | {_fmt(100 * r['top1_agreement'], 2)}% | {_fmt(r['perplexity'], 3)} "
                         f"| {_fmt(r.get('linear_gb'), 3)} GB |")
        if q.get("kv_cache"):
            lines += ["", "KV-cache entries against float32 entries (same weights), two segments of each length:", "",
                      "| segment length | KV cache | top-1 agreement with float32 KV | perplexity | float32 KV perplexity |",
                      "| --- | --- | --- | --- | --- |"]
            for r in q["kv_cache"]:
                lines.append(f"| {r['segment_len']} | {r['kv_cache_dtype']} | {_fmt(100 * r['top1_agreement'], 2)}% "
                             f"| {_fmt(r['perplexity'], 4)} | {_fmt(r['reference_perplexity'], 4)} |")
    vk = result["vk"]
    lines += ["", f"V(k) = t(k+1 tokens) / t(1 token), target forward + logits, context {vk['context_len']}, "
              f"median of {vk['repeats']} paired repeats; t(1 token) median {vk['t1_ms_median']:.1f} ms", "",
              "| k | " + " | ".join(str(e["k"]) for e in vk["vk"]) + " |",
              "| --- |" + " --- |" * len(vk["vk"]),
              "| V(k) | " + " | ".join(f"{e['v']:.2f}" for e in vk["vk"]) + " |",
              "| t(k+1) ms | " + " | ".join(f"{e['t_ms_median']:.0f}" for e in vk["vk"]) + " |"]
    rows = list(result.get("decode_breakdown") or []) + [r["draft_breakdown"] for r in result.get("speculative") or []
                                                          if "draft_breakdown" in r]
    if rows:
        lines += ["", "one decode step (forward + logits): time in the linear kernels and outside, bytes read, and the "
                  "floor bytes / streaming read sets:", "",
                  "| model | context | step ms | linears ms | outside ms | weights + KV MB | read GB/s | floor ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            lines.append(f"| {r['role']} | {r['context_len']} | {r['step_ms']:.2f} | {r['linear_ms']:.2f} | "
                         f"{r['outside_ms']:.2f} | {r['weight_mb']:.0f} + {r['kv_mb']:.1f} | {r['bandwidth_gbs']:.1f} | "
                         f"{r['floor_ms']:.2f} |")
    pre = result.get("prefill")
    if pre:
        ours = pre["specserve"]
        line = f"prefill of {ours['tokens']}-token prompts (median of {len(ours['tok_s'])}): specserve {ours['tok_s_median']:.1f} tok/s"
        if "llama_cpp" in pre:
            line += (f", llama.cpp prompt processing {pre['llama_cpp']['tok_s_median']:.1f} tok/s "
                     f"(ratio {ours['tok_s_median'] / pre['llama_cpp']['tok_s_median']:.2f})")
        lines += ["", line]
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """PNG of V(k), and with speculation runs a second panel of speedup and acceptance length by k;
    returns a note instead when matplotlib is missing."""
    plt, note = load_pyplot(path)
    if plt is None:
        return note
    vk, spec = result["vk"], result.get("speculative") or []
    fig, axes = plt.subplots(1, 2 if spec else 1, figsize=(10 if spec else 5, 3.5), squeeze=False)
    ax = axes[0][0]
    ks = [e["k"] for e in vk["vk"]]
    ax.plot(ks, [e["v"] for e in vk["vk"]], marker="o", label="V(k) measured")
    ax.plot(ks, [k + 1 for k in ks], ls="--", color="grey", label="k+1 (no batching gain)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set_xlabel("k (draft tokens verified)")
    ax.set_ylabel("t(k+1 tokens) / t(1 token)")
    ax.set_title("verify cost of the target")
    ax.legend()
    if spec:
        ax = axes[0][1]
        sk = [r["k"] for r in spec]
        ax.plot(sk, [r["speedup_decode_median"] for r in spec], marker="o", label="decode speedup vs none")
        ax.plot(sk, [r["spec_decode"]["mean_acceptance_length"] for r in spec], marker="s",
                label="mean acceptance length")
        ax.axhline(1.0, color="black", lw=0.5)
        ax.set_xlabel("k (num_speculative_tokens)")
        ax.set_title(f"draft {spec[0]['draft']}")
        ax.set_xticks(sk)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
