"""The int4 1.5B target with this checkout's kernels against another commit's, in one process.

    python scripts/kernel_ab_engine.py [--against COMMIT] [--mtp [--k 3]] [--decode-only] [--max-k 0] [--rounds 4] [--json F]

Every quantized linear's kernel and the paged-attention kernel are swapped between runs (the old
kernel runs on the row-major weights of commits before the packed layout, kept beside the packed),
alternating old / new per round (the same weights, so the machine's drift hits both): a greedy
48-token generation (plain decode, or `mtp` with k = 3 and the shipped head: verifies of k + 1
rows), and unless --decode-only the time to first token of a 1,024-token prompt (standard-library
text, one generated token: the serving prefill) and the hidden-state precompute's forward (4
segments of 512 standard-library tokens with the fused layers 2, 14, 25, as `train-head` runs it);
with --max-k, also `specserve bench`'s verify cost V(k) for k = 1..max-k (context 100 tokens). Prints medians; the generated tokens must be
equal (the kernels' bits are). Run it alone.
"""
import argparse
import gc
import json
import statistics
import time

import torch

from kernel_bench import build_other, build_other_attention

from specserve.attention import cpu_backend
from specserve.benchmarks.verify_cost import measure_vk
from specserve.entrypoints.llm import LLM
from specserve.kernels import attention_ops, quant_ops
from specserve.models.linear import QuantizedLinear
from specserve.sampling_params import SamplingParams
from specserve.data.corpora import stdlib_documents
from specserve.training.hidden_states import _run_segments


def row_major_forward(lin: QuantizedLinear, ops):
    """``lin``'s forward on a kernel of the row-major layout (commits before the packed one)."""
    parts = lin.parts

    def forward(x):
        out = torch.empty(x.shape[0], lin.out_features, dtype=torch.float32)
        x = x.float().contiguous()
        xq, dx, bsum = ops.quantize_rows(x)
        for q, col0, bias in zip(parts, lin.offsets, lin._part_bias):
            if q.layout == "int4":
                ops.q4_matmul(xq, dx, bsum, q.qs, q.sc, q.mn, q.d, q.dmin, bias, out, col0)
            else:
                ops.q8_matmul(xq, dx, q.qs, q.sc, q.d, bias, out, col0)
        return out
    return forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="2a5e881", help="the commit whose kernel is 'old'")
    ap.add_argument("--mtp", action="store_true", help="generate with method mtp (the shipped head)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens with --mtp")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill timings")
    ap.add_argument("--max-k", type=int, default=0, help="also V(k) for k = 1..max-k (0: none)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json", default=None, help="write every timing to this JSON file")
    args = ap.parse_args()
    spec = {"method": "mtp", "num_speculative_tokens": args.k} if args.mtp else None
    # no prefix caching: every round prefills the same prompts again
    llm = LLM("qwen2.5-coder-1.5b-instruct", quantization="int4", speculative_config=spec, enable_prefix_caching=False)
    builds = {"old": build_other(args.against), "new": quant_ops()}
    attention = {"old": build_other_attention(args.against), "new": attention_ops()}
    linears = [m for m in gc.get_objects() if isinstance(m, QuantizedLinear)]
    forwards = {"new": {id(lin): lin.forward for lin in linears},
                "old": {id(lin): row_major_forward(lin, builds["old"]) for lin in linears}}
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    prompt = "def quicksort(arr):\n    \"\"\"Sort a list of integers.\"\"\"\n"
    ids = [t for _, d in stdlib_documents(llm.get_tokenizer(), max_tokens=4000) for t in d]
    segments = [ids[i * 512:(i + 1) * 512] for i in range(4)]
    long_prompt = {"prompt_token_ids": ids[2048:2048 + 1024]}
    one = SamplingParams(temperature=0, max_tokens=1)
    engine = llm.llm_engine
    gen, pre, ttft, tokens = {k: [] for k in builds}, {k: [] for k in builds}, {k: [] for k in builds}, {}
    vk = {name: {k: [] for k in range(1, args.max_k + 1)} for name in builds}
    for _ in range(args.rounds):
        for name, ops in builds.items():
            for lin in linears:
                lin.forward = forwards[name][id(lin)]
            cpu_backend._kernel = lambda module=attention[name]: module
            t = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)
            gen[name].append(time.perf_counter() - t)
            tokens.setdefault(name, out[0].outputs[0].token_ids)
            if args.max_k:
                for row in measure_vk(engine, ids[:100], args.max_k, repeats=3)["vk"]:
                    vk[name][row["k"]].append(row["v"])
            if args.decode_only:
                continue
            t = time.perf_counter()
            out = llm.generate([long_prompt], one, use_tqdm=False)
            ttft[name].append(time.perf_counter() - t)
            tokens.setdefault(name + " first", out[0].outputs[0].token_ids)
            if not args.mtp:
                previous, engine.aux_hidden_state_layers = engine.aux_hidden_state_layers, (2, 14, 25)
                t = time.perf_counter()
                _run_segments(engine, segments, 20)
                pre[name].append(time.perf_counter() - t)
                engine.aux_hidden_state_layers = previous
    def spread(xs, f=lambda x: x):
        vals = sorted(f(x) for x in xs)
        return f"{statistics.median(vals):.2f} [{vals[0]:.2f}-{vals[-1]:.2f}]"
    for name in builds:
        line = f"{name}: {f'mtp k={args.k}' if args.mtp else 'plain'} {spread(gen[name], lambda g: 48 / g)} tok/s"
        if ttft[name]:
            line += f", time to first token of 1,024 prompt tokens {spread(ttft[name])} s"
        if pre[name]:
            line += f", precompute prefill {spread(pre[name], lambda t: 2048 / t)} tok/s"
        if args.max_k:
            line += ", V(k) " + ", ".join(spread(v) for v in vk[name].values())
        print(line + f" (median [min-max] of {args.rounds} rounds)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"against": args.against, "mtp": args.mtp, "k": args.k, "rounds": args.rounds,
                       "generate_s": gen, "ttft_1024_s": ttft, "precompute_2048_s": pre,
                       "vk": {n: {str(k): v for k, v in d.items()} for n, d in vk.items()}}, f, indent=1)
    print("same tokens:", all(tokens[k] == tokens[k.replace("old", "new")] for k in tokens if k.startswith("old")))


if __name__ == "__main__":
    main()
