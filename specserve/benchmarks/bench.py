"""``specserve bench``: decode tokens/s and TTFT against HF transformers, and the verify cost V(k).

Three measurements, all greedy, on the same weights and prompts, in one process (so machine load
hits every engine alike: on a small shared machine, runs minutes apart differ by more than the
effects measured; BENCHMARKS.md reports ratios from one run):

1. **specserve** (``LLMEngine``, no speculation): the first ``--num-prompts`` HumanEval prompts, each
   generating exactly ``--max-tokens`` tokens (``ignore_eos``), ``--batch-size`` requests at a time.
   Per prompt: TTFT (request added -> first token) and decode tokens/s ``(n - 1) / (t_last - t_first)``.
2. **HF transformers** ``generate`` (``do_sample=False``, ``min_new_tokens = max_new_tokens = n``) on
   the same prompt token ids; token times come from a streamer (its first ``put`` is the prompt).
   Our engine is freed before the HF model is loaded, so only one copy of the weights is resident.
3. **V(k)** = t(target forward over k+1 new tokens + their logits) / t(one-token decode forward + its
   logits) at ``--context-len`` tokens of context, the median of ``--repeats`` paired repeats
   (:mod:`specserve.benchmarks.verify_cost`). Speculation pays when ``tau > V(k) + k c``.

This module holds the command's flags and flow and the measurements only it makes (speculation by
k, quality); our engine's timed runs are in :mod:`~specserve.benchmarks.engine_runs`, the peers in
:mod:`~specserve.benchmarks.hf_peer` and :mod:`~specserve.benchmarks.llama_cpp_peer`, the report
in :mod:`~specserve.benchmarks.bench_report`.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import sys

import torch

from specserve.benchmarks.bench_report import render_markdown, write_plot
from specserve.benchmarks.engine_runs import agreement, bench_specserve, measure_prefill, prefill_prompts
from specserve.benchmarks.hf_peer import bench_hf, load_hf_model
from specserve.benchmarks.llama_cpp_peer import gguf_path
from specserve.benchmarks.machine import load_average, machine_info
from specserve.plotting import write_results
from specserve.benchmarks.verify_cost import measure_vk, step_breakdown
from specserve.data.corpora import humaneval_prompts


# ----------------------------------------------------------------------------------------- args

def add_bench_args(p: argparse.ArgumentParser) -> None:
    """Bench-only flags (the engine flags --model/--dtype/... are added by the CLI)."""
    p.add_argument("--num-prompts", type=int, default=10, help="first N HumanEval prompts (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="new tokens per prompt, EOS ignored (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts run together (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per k for V(k) (default: %(default)s)")
    p.add_argument("--max-k", type=int, default=8, help="V(k) for k = 1..max_k (default: %(default)s)")
    p.add_argument("--context-len", type=int, default=100,
                   help="tokens already in the KV cache for V(k) (default: %(default)s)")
    p.add_argument("--prefill-len", type=int, default=0,
                   help="also the prefill rate of 3 distinct prompts of this many tokens (time to the first "
                        "token, one generated; with --peers llama.cpp its prompt processing of the same ids); "
                        "0: skip (default)")
    p.add_argument("--skip-hf", action="store_true", help="do not measure HF transformers generate")
    p.add_argument("--peers", default="hf",
                   help="peers measured in the same run, comma list of hf (transformers generate) and llama.cpp "
                        "(llama-cpp-python on the same GGUF files: plain, and speculative with the draft GGUF at "
                        "--spec-ks); default: %(default)s")
    p.add_argument("--quality", action="store_true",
                   help="also: teacher-forced top-1 agreement with the float32 target and perplexity of every "
                        "--quantization (none, int8, int4) on --quality-tokens tokens of HumanEval solutions and "
                        "Spec-Bench questions (and llama.cpp's with --peers llama.cpp)")
    p.add_argument("--quality-tokens", type=int, default=4000, help="tokens of the --quality text (default: %(default)s)")
    p.add_argument("--quality-kv-contexts", default="128,1024,4096",
                   help="--quality: also each --kv-cache-dtype (float32, float16, bfloat16) of the --quantization "
                        "target against float32 KV entries, on segments of these lengths (two each); '' skips "
                        "(default: %(default)s)")
    p.add_argument("--spec-ks", default="2,3,4",
                   help="with a draft (--speculative-model, or the default pair): k values to measure "
                        "speculation at, in the same run (default: %(default)s)")
    p.add_argument("--methods", default=None,
                   help="compare speculation methods instead (comma list of none, ngram, draft_model, mtp, "
                        "eagle-static, eagle-dynamic): same prompts, one engine each, k fixed")
    p.add_argument("--head", default=None,
                   help="--methods: the draft head for mtp/eagle (default: a shipped head for --model)")
    p.add_argument("--specbench-prompts", type=int, default=0,
                   help="--methods: Spec-Bench first turns added to the HumanEval prompts, from the 48 held out of head "
                        "training (default: %(default)s)")
    p.add_argument("--adaptive", action="store_true",
                   help="--methods: choose k per step (0 = off) up to --num-speculative-tokens, as generate and "
                        "serve do by default (adaptive speculation); default: k fixed, each method itself")
    p.add_argument("--tree-depth", type=int, default=4,
                   help="--methods eagle-dynamic: levels of the dynamic tree (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", metavar="PATH", default=None, help="PNG plot of V(k) (needs matplotlib)")


def _check_args(args: argparse.Namespace) -> None:
    unknown = sorted(set(_peers(args)) - {"hf", "llama.cpp"})
    if unknown:
        raise ValueError(f"unknown --peers {unknown}; choose from hf, llama.cpp")
    if getattr(args, "prefill_len", 0) < 0:
        raise ValueError(f"--prefill-len must be >= 0, got {args.prefill_len}")
    for name in ("num_prompts", "max_tokens", "batch_size", "repeats", "max_k", "context_len", "tree_depth",
                 "quality_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if getattr(args, "adaptive", False) and not args.methods:
        raise ValueError("--adaptive applies to --methods only (the k sweep of --spec-ks measures fixed k)")


def _peers(args: argparse.Namespace) -> list[str]:
    peers = [p.strip() for p in (getattr(args, "peers", None) or "").split(",") if p.strip()]
    return [p for p in peers if not (p == "hf" and getattr(args, "skip_hf", False))]


# ----------------------------------------------------------------------------------------- specserve

def _engine_args(args: argparse.Namespace, speculative_config: dict | None = None, **overrides):
    """The engine the CLI flags describe (every engine flag), with ``speculative_config`` as given."""
    from specserve.entrypoints.args import engine_args

    return engine_args(args, speculative_config=speculative_config, **overrides)


def bench_speculative(args: argparse.Namespace, spec_cfg: dict, prompt_ids: list[list[int]],
                      baseline: dict) -> list[dict]:
    """Draft-target speculation at each k of ``--spec-ks``, one engine, same prompts as ``baseline``.
    k is fixed for each run (adaptive speculation off): the table is speed as a function of k."""
    from specserve.engine.engine import LLMEngine

    ks = [int(k) for k in args.spec_ks.split(",") if k.strip()]
    engine = LLMEngine(_engine_args(args, dict(spec_cfg, num_speculative_tokens=ks[0], adaptive=False)))
    runs = []
    for k in ks:
        engine.set_num_speculative_tokens(k)
        engine.reset_spec_stats()
        r = bench_specserve(engine, prompt_ids, args.max_tokens, args.batch_size)
        r["k"], r["draft"] = k, spec_cfg.get("model") or spec_cfg["method"]
        r["spec_decode"] = engine.spec_stats.as_dict()
        r["agreement_with_no_speculation"] = agreement(baseline["per_prompt"], r["per_prompt"])
        r["speedup_decode_median"] = r["summary"]["decode_tok_s_median"] / baseline["summary"]["decode_tok_s_median"]
        r["speedup_e2e_aggregate"] = r["summary"]["e2e_tok_s_aggregate"] / baseline["summary"]["e2e_tok_s_aggregate"]
        runs.append(r)
    if getattr(engine.proposer, "runner", None) is not None:   # a draft model: its decode step, as the target's
        runs[0]["draft_breakdown"] = step_breakdown(engine, "draft", args.context_len)
    del engine
    gc.collect()
    return runs


def bench_quality(args: argparse.Namespace, with_llama_cpp: bool) -> dict:
    """Top-1 agreement with float32 and perplexity of each quantization (benchmarks/quality.py),
    one engine at a time (the previous one freed first)."""
    from specserve.benchmarks.quality import agreement_rate, quality_segments, teacher_forced
    from specserve.engine.engine import LLMEngine
    from specserve.models.linear import BatchInvariantLinear, QuantizedLinear

    rows, reference, segments = [], None, None
    for quantization in ("none", "int8", "int4"):   # float32 KV entries: the weights' effect alone
        engine = LLMEngine(_engine_args(args, None, quantization=quantization, kv_cache_dtype="float32"))
        if segments is None:
            segments = quality_segments(engine.tokenizer, args.quality_tokens)
        print(f"quality: {quantization}", file=sys.stderr)
        out = teacher_forced(engine, segments)
        reference = reference or out["argmax"]
        linears = [m for m in engine.target.model.modules() if isinstance(m, (BatchInvariantLinear, QuantizedLinear))]
        rows.append({"quantization": quantization, "top1_agreement": agreement_rate(out["argmax"], reference),
                     "perplexity": out["perplexity"], "linear_gb": sum(m.nbytes for m in linears) / 1e9})
        del engine
        gc.collect()
    if with_llama_cpp:
        from specserve.benchmarks.llama_cpp_peer import perplexity_llama_cpp

        lc = perplexity_llama_cpp(gguf_path(args.model), segments, torch.get_num_threads())
        rows.append({"quantization": "llama.cpp (its own GGUF kernels)",
                     "top1_agreement": agreement_rate(lc["argmax"], reference), "perplexity": lc["perplexity"]})
    return {"num_tokens": sum(len(s) - 1 for s in segments), "segment_len": len(segments[0]),
            "text": "HumanEval canonical solutions + Spec-Bench questions", "rows": rows,
            "kv_cache": bench_kv_quality(args)}


def bench_kv_quality(args: argparse.Namespace) -> list[dict]:
    """Each KV-cache dtype of the ``--quantization`` target against float32 entries: top-1 agreement
    and perplexity on two segments of each ``--quality-kv-contexts`` length (every position of a
    segment: contexts 0 .. length - 1)."""
    from specserve.benchmarks.quality import agreement_rate, quality_segments, teacher_forced
    from specserve.engine.engine import LLMEngine

    lengths = [int(x) for x in args.quality_kv_contexts.split(",") if x.strip()]
    rows = []
    for length in lengths:
        reference = None
        for kv in ("float32", "float16", "bfloat16"):
            engine = LLMEngine(_engine_args(args, None, kv_cache_dtype=kv, max_model_len=max(length + 16, 256)))
            segments = quality_segments(engine.tokenizer, 2 * length, length)
            print(f"quality: KV {kv}, segments of {length}", file=sys.stderr)
            out = teacher_forced(engine, segments)
            reference = reference or out
            rows.append({"segment_len": length, "kv_cache_dtype": kv, "quantization": args.quantization,
                         "top1_agreement": agreement_rate(out["argmax"], reference["argmax"]),
                         "perplexity": out["perplexity"], "reference_perplexity": reference["perplexity"]})
            del engine
            gc.collect()
    return rows


# ----------------------------------------------------------------------------------------- main

def run_bench(args: argparse.Namespace) -> int:
    from specserve.engine.engine import LLMEngine

    _check_args(args)
    if args.methods:
        from specserve.benchmarks.methods import run_methods_bench
        return run_methods_bench(args)
    prompts = humaneval_prompts(args.num_prompts)
    started = datetime.datetime.now().astimezone()
    engine = LLMEngine(_engine_args(args))
    prompt_ids = [list(engine.tokenizer.encode(p)) for p in prompts]
    too_long = [i for i, x in enumerate(prompt_ids) if len(x) + args.max_tokens > engine.max_model_len]
    if too_long:
        raise ValueError(f"HumanEval prompts {too_long} plus --max-tokens {args.max_tokens} exceed "
                         f"max_model_len {engine.max_model_len}")
    result: dict = {
        "date": started.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "config": {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
                   "num_prompts": args.num_prompts,
                   "prompts": f"HumanEval/0..{args.num_prompts - 1}", "max_tokens": args.max_tokens,
                   "batch_size": args.batch_size, "greedy": True, "ignore_eos": True,
                   "prompt_tokens": [len(x) for x in prompt_ids], "command": " ".join(["specserve"] + sys.argv[1:])},
    }
    print(f"specserve bench: {args.model} {args.dtype} quantization {args.quantization} "
          f"(load {engine.load_stats.get('seconds', 0):.1f} s, peak RSS {engine.load_stats.get('peak_rss_gb', 0):.2f} GiB), "
          f"{args.num_prompts} HumanEval prompts x "
          f"{args.max_tokens} tokens, batch size {args.batch_size}, torch threads {torch.get_num_threads()}",
          file=sys.stderr)
    loads = {"start": load_average()}
    result["load_average"] = loads
    result["load"] = engine.load_stats
    result["specserve"] = bench_specserve(engine, prompt_ids, args.max_tokens, args.batch_size)
    loads["after_specserve"] = load_average()
    context = [t for x in prompt_ids for t in x]
    while len(context) < args.context_len:
        context += context or [0]
    result["vk"] = measure_vk(engine, context[:args.context_len], args.max_k, args.repeats)
    result["decode_breakdown"] = [step_breakdown(engine, "target", args.context_len)]
    loads["after_vk"] = load_average()
    prefill = prefill_prompts(context, args.prefill_len) if args.prefill_len else []
    if prefill:
        result["prefill"] = {"specserve": measure_prefill(engine, prefill)}
    eos = list(engine.model_config.eos_token_ids)
    del engine
    gc.collect()
    from specserve.entrypoints.args import speculative_config
    spec_cfg = speculative_config(args)
    result["speculative"] = (bench_speculative(args, spec_cfg, prompt_ids, result["specserve"])
                             if spec_cfg and args.spec_ks.strip() else [])
    loads["after_speculative"] = load_average()

    if "llama.cpp" in _peers(args):
        from specserve.benchmarks.llama_cpp_peer import bench_llama_cpp

        ks = [int(k) for k in args.spec_ks.split(",") if k.strip()] if spec_cfg and spec_cfg.get("model") else []
        draft = gguf_path(spec_cfg["model"]) if ks and spec_cfg["method"] == "draft_model" else None
        print("llama.cpp peer: plain" + (f", speculative k={ks}" if draft else ""), file=sys.stderr)
        result["llama_cpp"] = bench_llama_cpp(gguf_path(args.model), prompt_ids, args.max_tokens,
                                              torch.get_num_threads(), draft, ks if draft else [])
        if prefill:
            from specserve.benchmarks.llama_cpp_peer import prefill_llama_cpp

            result["prefill"]["llama_cpp"] = prefill_llama_cpp(gguf_path(args.model), prefill, torch.get_num_threads())
        loads["after_llama_cpp"] = load_average()
    if args.quality:
        result["quality"] = bench_quality(args, "llama.cpp" in _peers(args))
        loads["after_quality"] = load_average()

    result["hf"] = None
    if "hf" in _peers(args):
        import transformers

        hf_model = load_hf_model(args.model, getattr(torch, args.dtype))
        pad_id = eos[0] if eos else 0
        result["hf"] = bench_hf(hf_model, prompt_ids, args.max_tokens, args.batch_size, pad_id)
        result["hf"]["transformers"] = transformers.__version__
        loads["after_hf"] = load_average()
        result["agreement"] = agreement(result["specserve"]["per_prompt"], result["hf"]["per_prompt"])
        del hf_model
        gc.collect()
        ours, hf = result["specserve"]["summary"], result["hf"]["summary"]
        result["decode_ratio_specserve_over_hf"] = ours["decode_tok_s_median"] / hf["decode_tok_s_median"]

    md = render_markdown(result)
    print(md)
    write_results(result, args.json, args.plot, write_plot, "V(k) plot")
    return 0
