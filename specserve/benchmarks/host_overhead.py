"""Where a step's time goes.

**Host overhead per engine step** (default): wall time of ``LLMEngine.step()`` minus the time spent
inside model forwards (target, draft or head) and the lm_head.

**Decode-step breakdown** (``--decode-breakdown``): for one decode forward (plus its logits) of the
target and of a draft model, at given contexts: the time inside the linear kernels (the matmul calls
alone), the time outside them (norms, rotary, KV write, attention, activations, dispatch), the bytes
one step must read (weights and KV entries) and the machine's streaming read bandwidth, hence the
floor ``bytes / bandwidth`` a step cannot beat and how far above it the step is. Run::

    python -m specserve.benchmarks.host_overhead --decode-breakdown --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --quantization int4 --contexts 100,1000

A model small enough that its forward is cheap (SmolLM2-135M) shows what the engine's Python costs
per step: scheduling, packing the batch, sampling metadata, proposer bookkeeping, detokenization and
stop rules. Run::

    python -m specserve.benchmarks.host_overhead --model smollm2-135m-instruct --json out.json

Each configuration (method x batch size) decodes ``--max-tokens`` tokens for every prompt; steps with
a prefill are left out. Figures are medians over decode steps, in milliseconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from specserve.entrypoints.llm import LLM
from specserve.models.draft_head import DraftHead
from specserve.models.linear import BatchInvariantLinear, QuantizedLinear
from specserve.models.llama import LlamaForCausalLM
from specserve.results import write_json
from specserve.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@contextmanager
def time_spent_in(patched: list[tuple[type, str]]):
    """Accumulate seconds spent in the methods ``patched`` (``(class, name)`` pairs); yields a
    one-element list holding the total."""
    spent = [0.0]
    originals = [getattr(cls, name) for cls, name in patched]

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    for (cls, name), fn in zip(patched, originals):
        setattr(cls, name, timed(fn))
    try:
        yield spent
    finally:
        for (cls, name), fn in zip(patched, originals):
            setattr(cls, name, fn)


def model_timer():
    """Seconds spent in every model forward and lm_head call (target, draft, head)."""
    return time_spent_in([(LlamaForCausalLM, "forward"), (LlamaForCausalLM, "compute_logits"),
                          (DraftHead, "forward"), (DraftHead, "compute_logits")])


def linear_timer():
    """Seconds spent in the linear kernels (quantized matmuls, float linears)."""
    return time_spent_in([(QuantizedLinear, "forward_quantized"), (BatchInvariantLinear, "forward")])


def next_step_is_decode(engine) -> bool:
    """Whether the engine's next step decodes only (nothing waits, every running sequence has all
    but its newest token in the cache)."""
    sched = engine.scheduler
    return not sched.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running)


def measure(llm: LLM, batch_size: int, max_tokens: int) -> dict:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"r{i}", PROMPT * (1 + i % 3), params)
    steps = []
    with model_timer() as spent:
        while engine.has_unfinished_requests():
            decode = next_step_is_decode(engine)
            before = spent[0]
            t = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - t
            if decode:
                steps.append((wall, wall - (spent[0] - before)))
    return {"batch_size": batch_size, "num_steps": len(steps),
            "step_ms": 1e3 * statistics.median(s[0] for s in steps),
            "host_ms": 1e3 * statistics.median(s[1] for s in steps)}


def read_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5, ops=None) -> float:
    """GB/s of one streaming read of ``megabytes`` MB on every thread (best of ``repeats``; the
    kernels' ``stream_read``, the loads the matmuls issue; ``ops``: a kernel build, default ours)."""
    from specserve.kernels import quant_ops

    ops = ops or quant_ops()
    buf = torch.ones(megabytes << 20, dtype=torch.uint8)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        ops.stream_read(buf)
        best = max(best, buf.numel() / (time.perf_counter() - t) / 1e9)
    return best


def step_bytes(seq, context_len: int) -> tuple[int, int]:
    """``(weight bytes, KV bytes)`` one decode step of ``seq``'s model (a
    :class:`~specserve.engine.scoring.ScratchSequence`) reads at ``context_len``: every linear's
    weights (the lm_head included) and the keys and values of the context."""
    model, kv = seq.model, seq.kv_cache
    weights = sum(m.nbytes for m in model.modules() if isinstance(m, (QuantizedLinear, BatchInvariantLinear)))
    per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * kv.key_cache.element_size()
    return weights, per_token * (context_len + 1)


def decode_breakdown(seq, context_len: int, bandwidth_gbs: float, repeats: int = 30) -> dict:
    """One decode forward + logits of ``seq``'s model (a
    :class:`~specserve.engine.scoring.ScratchSequence` of ``context_len + 1`` tokens) at
    ``context_len`` tokens of context (prefilled here): medians over ``repeats`` steps, in ms."""
    vocab = seq.model.config.vocab_size
    seq.forward([(1000 + 7 * i) % vocab for i in range(context_len)], 0)

    def step() -> float:
        t = time.perf_counter()
        seq.logits(seq.forward([5], context_len), [0])
        return time.perf_counter() - t

    for _ in range(5):
        step()
    totals, linears = [], []
    with linear_timer() as spent:
        for _ in range(repeats):
            before = spent[0]
            totals.append(step())
            linears.append(spent[0] - before)
    weights, kv = step_bytes(seq, context_len)
    total, lin = statistics.median(totals), statistics.median(linears)
    floor = (weights + kv) / (bandwidth_gbs * 1e9)
    return {"context_len": context_len, "step_ms": 1e3 * total, "step_ms_min": 1e3 * min(totals),
            "step_ms_max": 1e3 * max(totals), "linear_ms": 1e3 * lin, "outside_ms": 1e3 * (total - lin),
            "weight_mb": weights / 1e6, "kv_mb": kv / 1e6, "bandwidth_gbs": bandwidth_gbs,
            "floor_ms": 1e3 * floor, "above_floor_ms": 1e3 * (total - floor),
            "linear_read_gbs": weights / lin / 1e9 if lin else None}


def run_decode_breakdown(args) -> list[dict]:
    """``--decode-breakdown``: the target's and the draft's decode steps at each context."""
    contexts = [int(c) for c in args.contexts.split(",")]
    bw = read_bandwidth_gbs()
    print(f"streaming read: {bw:.1f} GB/s", flush=True)
    spec = None
    if args.draft:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 3,
                "draft_vocab_size": args.draft_vocab_size}
    llm = LLM(args.model, quantization=args.quantization, speculative_config=spec,
              kv_cache_dtype=args.kv_cache_dtype, max_model_len=max(contexts) + 64)
    engine = llm.llm_engine
    models = [("target", args.model)] + ([("draft", args.draft)] if spec is not None else [])
    rows = []
    for ctx in contexts:
        for role, name in models:
            with engine.scratch_sequence(ctx + 1, model=role) as seq:
                row = {"role": role, "model": name, **decode_breakdown(seq, ctx, bw, args.steps)}
                rows.append(row)
                print(f"{role:6s} ctx {ctx:5d}: step {row['step_ms']:6.2f} ms [{row['step_ms_min']:.2f}-"
                      f"{row['step_ms_max']:.2f}]  linears {row['linear_ms']:6.2f}  outside {row['outside_ms']:5.2f}  "
                      f"reads {row['weight_mb']:6.1f} + {row['kv_mb']:5.1f} MB  floor {row['floor_ms']:6.2f} ms  "
                      f"above floor {row['above_floor_ms']:+5.2f} ms", flush=True)
    return rows


def plot_breakdown(rows: list[dict], path: str) -> str | None:
    """Stacked bars per model and context: the linears and the rest of a step, the floor marked.
    Returns a note instead of a plot where matplotlib is missing."""
    from specserve.plotting import load_pyplot

    plt, note = load_pyplot(path)
    if plt is None:
        return note
    labels = [f"{r['role']}\nctx {r['context_len']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(1.4 * len(rows) + 2, 4))
    ax.bar(x, [r["linear_ms"] for r in rows], label="linear kernels")
    ax.bar(x, [r["outside_ms"] for r in rows], bottom=[r["linear_ms"] for r in rows], label="everything else")
    ax.scatter(x, [r["floor_ms"] for r in rows], marker="_", s=900, color="black", zorder=3,
               label=f"floor: bytes / {rows[0]['bandwidth_gbs']:.0f} GB/s")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    p.add_argument("--steps", type=int, default=30, help="--decode-breakdown: timed steps per model and context")
    p.add_argument("--json", default=None)
    p.add_argument("--decode-breakdown", action="store_true",
                   help="per decode step of --model and --draft: time in the linears and outside, bytes read, floor")
    p.add_argument("--draft", default=None, help="--decode-breakdown: a draft model measured the same way")
    p.add_argument("--draft-vocab-size", type=int, default=None, help="--decode-breakdown: the draft's reduced vocabulary")
    p.add_argument("--quantization", default="int4")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--contexts", default="100,1000")
    p.add_argument("--plot", default=None, help="--decode-breakdown: also a bar chart (PNG) of the steps")
    args = p.parse_args(argv)
    if args.decode_breakdown:
        rows = run_decode_breakdown(args)
        if args.json:
            write_json(args.json, {"model": args.model, "draft": args.draft, "quantization": args.quantization,
                                   "kv_cache_dtype": args.kv_cache_dtype, "draft_vocab_size": args.draft_vocab_size,
                                   "rows": rows})
        if args.plot:
            note = plot_breakdown(rows, args.plot)
            print(note or f"plot written to {args.plot}", file=sys.stderr)
        return 0
    methods = {
        "none": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        "draft_model": {"method": "draft_model", "model": args.model, "num_speculative_tokens": 3, "adaptive": False},
    }
    rows = []
    for name, spec in methods.items():
        llm = LLM(args.model, speculative_config=spec)
        measure(llm, 1, 8)   # warm-up
        for bs in [int(b) for b in args.batch_sizes.split(",")]:
            runs = [measure(llm, bs, args.max_tokens) for _ in range(args.repeats)]
            row = {"method": name, "batch_size": bs,
                   "step_ms": statistics.median(r["step_ms"] for r in runs),
                   "host_ms": statistics.median(r["host_ms"] for r in runs)}
            rows.append(row)
            print(f"{name:12s} bs={bs:2d}  step {row['step_ms']:7.2f} ms  host {row['host_ms']:6.2f} ms", flush=True)
    if args.json:
        write_json(args.json, {"model": args.model, "max_tokens": args.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
