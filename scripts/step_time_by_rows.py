"""Where a generation step's time goes on the quantized target: linears by row count, and the rest.

    python scripts/step_time_by_rows.py [--mtp] [--k 3] [--max-tokens 48]

Times every quantized linear call (wall clock, activation quantization included) of one greedy
generation with the int4 1.5B target, plain or `mtp` with the shipped head, after one warm-up
generation, and groups the calls by rows (M: 1 = decode or the head's draft step, k+1 = a full
verify, more = prefill) and by weight (the 151,936-row lm_head, the rest). What is not in a linear
(attention, norms, sampling, the engine's Python) is the remainder. Run it alone.
"""
import argparse
import collections
import time

from specserve.entrypoints.llm import LLM
from specserve.models.linear import QuantizedLinear
from specserve.sampling_params import SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtp", action="store_true", help="speculate with the shipped head")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens with --mtp")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": args.k} if args.mtp else None
    llm = LLM("qwen2.5-coder-1.5b-instruct", quantization="int4", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt = "def quicksort(arr):\n    \"\"\"Sort a list of integers.\"\"\"\n"
    llm.generate([prompt], params, use_tqdm=False)

    calls = collections.defaultdict(lambda: [0, 0.0])
    forward = QuantizedLinear.forward

    def timed(self, x):
        t = time.perf_counter()
        y = forward(self, x)
        rows = x.shape[0] if x.shape[0] <= 16 else "prefill"
        calls[(str(rows), "lm_head" if self.out_features > 100_000 else "body")][0] += 1
        calls[(str(rows), "lm_head" if self.out_features > 100_000 else "body")][1] += time.perf_counter() - t
        return y

    engine = llm.llm_engine
    steps, step = [0], type(engine).step

    def counted(self):
        steps[0] += 1
        return step(self)

    QuantizedLinear.forward, type(engine).step = timed, counted
    try:
        t = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        total = time.perf_counter() - t
    finally:
        QuantizedLinear.forward, type(engine).step = forward, step
    linear = sum(s for _, s in calls.values())
    print(f"{'mtp k=' + str(args.k) if args.mtp else 'plain'}: {args.max_tokens} tokens in {total:.3f} s, "
          f"{steps[0]} engine steps ({total / steps[0] * 1e3:.1f} ms per step)")
    print("| rows | weight | calls | ms | ms per call |")
    print("| --- | --- | --- | --- | --- |")
    for (rows, kind), (n, s) in sorted(calls.items(), key=lambda kv: (len(kv[0][0]), kv[0])):
        print(f"| {rows} | {kind} | {n} | {s * 1e3:.1f} | {s / n * 1e3:.3f} |")
    print(f"linears {linear:.3f} s, the rest {total - linear:.3f} s "
          f"({(total - linear) / steps[0] * 1e3:.1f} ms per step)")


if __name__ == "__main__":
    main()
