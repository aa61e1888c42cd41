"""Host overhead per engine step: wall time of ``LLMEngine.step()`` minus the time spent inside
model forwards (target, draft or head) and the lm_head.

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
import time
from contextlib import contextmanager

from specserve.entrypoints.llm import LLM
from specserve.models.draft_head import DraftHead
from specserve.models.llama import LlamaForCausalLM
from specserve.results import write_json
from specserve.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@contextmanager
def model_timer():
    """Accumulate seconds spent in every model forward and lm_head call (target, draft, head)."""
    spent = [0.0]
    patched = [(LlamaForCausalLM, "forward"), (LlamaForCausalLM, "compute_logits"), (DraftHead, "forward"),
               (DraftHead, "compute_logits")]
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
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
