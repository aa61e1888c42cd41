"""``specserve bench --methods``: every speculation method on one target, same prompts, same run.

For each method in ``--methods`` (``none``, ``ngram``, ``draft_model``, ``mtp``, ``eagle-static``,
``eagle-dynamic``) one engine is built, run greedily over the same prompts (the first
``--num-prompts`` HumanEval prompts, which the shipped head never trained on, and
``--specbench-prompts`` Spec-Bench first turns spread over its categories, through the chat
template), ``--max-tokens`` tokens each with EOS ignored, ``--batch-size`` at a time, and freed
before the next. k is fixed (adaptive speculation off) so the table shows each method itself;
with ``--adaptive`` each speculative method runs as ``generate`` and ``serve`` run it by default,
k chosen per step (0 = off) up to ``--num-speculative-tokens`` (:mod:`specserve.spec_decode.adaptive`),
so the table shows what a user of that method gets on this machine.
Reported per method: mean acceptance length (tokens per verify step, bonus included), decode
tokens/s (median over prompts), end-to-end tokens/s (aggregate), both as speedups over ``none`` in
the same run, whether every greedy output equals ``none``'s, and with ``--adaptive`` the decode
steps the controller ran at each k (``adaptive_steps_per_k``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys
from pathlib import Path

from specserve.plotting import load_pyplot, write_results

METHODS = ("none", "ngram", "draft_model", "mtp", "eagle-static", "eagle-dynamic")


def parse_methods(text: str) -> list[str]:
    """Raises ValueError naming an unknown method."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ValueError(f"--methods {text!r}: unknown {bad or 'empty'}; choose from {', '.join(METHODS)}")
    return methods


def method_config(method: str, args: argparse.Namespace) -> dict | None:
    """The ``speculative_config`` of one method row (None for ``none``)."""
    cfg = _method_config(method, args)
    if cfg is not None:
        cfg["adaptive"] = bool(getattr(args, "adaptive", False))
    return cfg


def _method_config(method: str, args: argparse.Namespace) -> dict | None:
    from specserve.config import DEFAULT_DRAFT

    k = args.num_speculative_tokens
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    if method == "draft_model":
        return {"method": "draft_model", "model": args.speculative_model or DEFAULT_DRAFT,
                "num_speculative_tokens": k, "draft_quantization": args.draft_quantization,
                "draft_vocab_size": getattr(args, "draft_vocab_size", None)}
    from specserve.models.registry import shipped_head_for

    head = args.head or shipped_head_for(args.model)
    if head is None:
        raise ValueError(f"--methods {method} needs a draft head for {args.model!r}: pass --head")
    dq = args.draft_quantization   # a head's linears too (None: the target's layout, as served)
    if method == "mtp":
        return {"method": "mtp", "model": head, "num_speculative_tokens": k, "draft_quantization": dq}
    if method == "eagle-static":
        return {"method": "eagle", "model": head, "draft_quantization": dq,
                "speculative_token_tree": args.speculative_token_tree or "eagle1"}
    return {"method": "eagle", "model": head, "num_speculative_tokens": args.tree_depth,
            "eagle_topk": args.eagle_topk, "num_draft_tokens": args.num_draft_tokens, "draft_quantization": dq}


def benchmark_prompts(tokenizer, num_humaneval: int, num_specbench: int) -> list[tuple[str, list[int]]]:
    """``(name, token ids)``: HumanEval/0.. raw, then Spec-Bench first turns through the chat
    template, spread over the held-out questions (every n-th, so all categories appear; never
    trained on, see :func:`~specserve.training.corpus.spec_bench_eval_questions`)."""
    from specserve.data.corpora import humaneval_prompts, spec_bench_eval_questions

    out = [(f"HumanEval/{i}", list(tokenizer.encode(p)))
           for i, p in enumerate(humaneval_prompts(num_humaneval) if num_humaneval else [])]
    if num_specbench:
        questions = spec_bench_eval_questions()
        step = max(1, len(questions) // num_specbench)
        for qid, text in questions[::step][:num_specbench]:
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append((f"spec_bench/{qid}", list(tokenizer.encode(chat))))
    return out


def run_methods_bench(args: argparse.Namespace) -> int:
    from specserve.benchmarks.bench import _engine_args
    from specserve.benchmarks.engine_runs import agreement, bench_specserve
    from specserve.benchmarks.machine import load_average, machine_info
    from specserve.engine.engine import LLMEngine

    methods = parse_methods(args.methods)
    configs = {m: method_config(m, args) for m in methods}   # bad flags fail before any model loads
    started = datetime.datetime.now().astimezone()
    result: dict = {"date": started.isoformat(timespec="seconds"), "machine": machine_info(),
                    "command": " ".join(["specserve"] + sys.argv[1:]),
                    "config": {"model": args.model, "dtype": args.dtype, "max_tokens": args.max_tokens,
                               "batch_size": args.batch_size, "greedy": True, "ignore_eos": True},
                    "methods": []}
    prompts = None
    baseline = None
    for method in methods:
        engine = LLMEngine(_engine_args(args, configs[method]))
        if prompts is None:
            prompts = benchmark_prompts(engine.tokenizer, args.num_prompts, args.specbench_prompts)
            result["config"]["prompts"] = [name for name, _ in prompts]
            result["config"]["prompt_tokens"] = [len(ids) for _, ids in prompts]
        print(f"specserve bench --methods: {method} ({len(prompts)} prompts x {args.max_tokens} tokens)",
              file=sys.stderr)
        r = bench_specserve(engine, [ids for _, ids in prompts], args.max_tokens, args.batch_size)
        r["method"], r["speculative_config"] = method, configs[method]
        r["spec_decode"] = engine.spec_stats.as_dict() if engine.proposer is not None else None
        # --adaptive: decode steps the controller ran with each k = 0..max (the warm-up's included)
        ctrl = engine.spec_controller
        r["adaptive_steps_per_k"] = list(ctrl.chosen_counts) if ctrl is not None else None
        r["load_average"] = load_average()
        if baseline is None and method == "none":
            baseline = r
        result["methods"].append(r)
        del engine
        gc.collect()
    base = baseline["summary"] if baseline is not None else None
    for r in result["methods"]:
        s = r["summary"]
        r["speedup_decode_median"] = s["decode_tok_s_median"] / base["decode_tok_s_median"] if base else None
        r["speedup_e2e_aggregate"] = s["e2e_tok_s_aggregate"] / base["e2e_tok_s_aggregate"] if base else None
        r["agreement_with_none"] = agreement(baseline["per_prompt"], r["per_prompt"]) if baseline else None
    print(render_methods_markdown(result))
    write_results(result, args.json, args.plot, write_methods_plot)
    return 0


def _describe(r: dict) -> str:
    cfg = r["speculative_config"] or {}
    if not cfg:
        return "-"
    if r["method"] == "eagle-static":
        tree = cfg.get("speculative_token_tree")
        drafts = f"tree {tree}" if isinstance(tree, str) else f"tree of {len(tree)} nodes"
    elif r["method"] == "eagle-dynamic":
        drafts = f"depth {cfg['num_speculative_tokens']}, top-k {cfg['eagle_topk']}, {cfg['num_draft_tokens']} nodes"
    else:
        drafts = f"k = {cfg['num_speculative_tokens']}"
    # adaptive: the controller picks each step's k (0 = off) up to the configured one
    return f"{drafts}, adaptive (at most)" if cfg.get("adaptive") else drafts


def render_methods_markdown(result: dict) -> str:
    lines = ["| method | drafts | mean acceptance length | decode tok/s (median) | speedup | "
             "e2e tok/s | e2e speedup | greedy = none |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["methods"]:
        s, sd = r["summary"], r.get("spec_decode") or {}
        al = sd.get("mean_acceptance_length")
        agree = r.get("agreement_with_none") or {}
        lines.append(f"| {r['method']} | {_describe(r)} | {'-' if al is None else f'{al:.2f}'} | "
                     f"{s['decode_tok_s_median']:.2f} | {r['speedup_decode_median'] or 0:.2f}x | "
                     f"{s['e2e_tok_s_aggregate']:.2f} | {r['speedup_e2e_aggregate'] or 0:.2f}x | "
                     f"{agree.get('identical_prompts', '-')}/{agree.get('prompts', '-')} |")
    return "\n".join(lines)


def write_methods_plot(result: dict, path: str) -> str | None:
    """Bars of acceptance length and decode speedup per method; a note instead without matplotlib."""
    plt, note = load_pyplot(path)
    if plt is None:
        return note
    rows = result["methods"]
    names = [r["method"] for r in rows]
    al = [(r.get("spec_decode") or {}).get("mean_acceptance_length") or 1.0 for r in rows]
    speed = [r["speedup_decode_median"] or 0.0 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    axes[0].bar(names, al, color="tab:blue")
    axes[0].set_ylabel("mean acceptance length (tokens / verify)")
    axes[1].bar(names, speed, color="tab:green")
    axes[1].axhline(1.0, color="gray", lw=0.8, ls="--")
    axes[1].set_ylabel("decode speedup over none")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{result['config']['model']} {result['config']['dtype']}, batch {result['config']['batch_size']}")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
