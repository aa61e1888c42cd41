"""Decode step time without and with tensor parallelism, and where a sharded step's time goes.

For each tensor-parallel size (TP = 1: one process with all the machine's threads; TP = N: N ranks
sharing them, ``cores / N`` threads each) and each batch size, ``batch_size`` requests decode
``--max-tokens`` tokens; steps with a prefill are left out. Reported per decode step (medians, ms):
wall time, and for TP > 1 the leader's time inside each collective (all-reduces after attention
and MLP, the logits' all-gather, the step message's broadcast; waiting for the slower rank is
counted there) and the rest (its own compute and the host's work), with the bytes each collective
moved. Run::

    python -m specserve.benchmarks.tensor_parallel --model qwen2.5-coder-1.5b-instruct -q int4 \\
        --tp-sizes 1,2 --batch-sizes 1,8 --json docs/bench/tensor_parallel_cpu.json

On a GPU machine the same command with ``--device cuda -q none --dtype bfloat16`` measures NCCL
(``scripts/tensor_parallel_gpu.sh``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
from tqdm.auto import tqdm

from specserve.benchmarks.host_overhead import next_step_is_decode
from specserve.entrypoints.llm import LLM
from specserve.results import write_json
from specserve.sampling_params import SamplingParams

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def measure(llm: LLM, batch_size: int, max_tokens: int) -> dict:
    """Decode ``batch_size`` requests; per decode step: wall ms and (TP > 1) the collectives' share."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"b{batch_size}-{i}-{time.monotonic_ns()}", PROMPT * (1 + i % 3), params)
    steps, comms, sent, used = [], [], [], []
    while engine.has_unfinished_requests():
        before = engine.target.communication_stats()   # None on one rank
        decode = next_step_is_decode(engine)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not decode:
            continue
        steps.append(dt)
        if before is not None:
            after = engine.target.communication_stats()
            delta = {k: [v[i] - before["collectives"].get(k, [0, 0, 0.0])[i] for i in range(3)]
                     for k, v in after["collectives"].items()}
            comms.append({k: v for k, v in delta.items() if k != "start-up barrier"})
            sent.append(after["bytes_sent"] - before["bytes_sent"])
            used.append(after["bytes_used"] - before["bytes_used"])
    out = {"batch_size": batch_size, "decode_steps": len(steps), "step_ms": 1e3 * statistics.median(steps),
           "decode_tok_s": batch_size / statistics.median(steps)}
    if comms:
        for op in sorted(comms[0]):
            out[f"{op}_ms"] = 1e3 * statistics.median(c[op][2] for c in comms)
            out[f"{op}_calls"] = statistics.median(c[op][0] for c in comms)
            out[f"{op}_bytes"] = statistics.median(c[op][1] for c in comms)
        out["collectives_ms"] = sum(out[f"{op}_ms"] for op in comms[0])
        out["rest_ms"] = out["step_ms"] - out["collectives_ms"]
        out["broadcast_bytes_sent"] = statistics.median(sent)
        out["broadcast_bytes_used"] = statistics.median(used)
    return out


def plot(reports: list[dict], path: str) -> None:
    """Stacked bars per (model, batch size, TP): the leader's time in collectives and the rest."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(5 * len(reports), 3.8), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        labels, rest, comm = [], [], []
        for r in rep["results"]:
            labels.append(f"bs {r['batch_size']}\nTP {r['tensor_parallel_size']}")
            comm.append(r.get("collectives_ms", 0.0))
            rest.append(r["step_ms"] - comm[-1])
        ax.bar(labels, rest, label="compute + host")
        ax.bar(labels, comm, bottom=rest, label="collectives (incl. waiting)")
        ax.set_title(f"{rep['model']} ({rep['quantization']})", fontsize=9)
        ax.set_ylabel("decode step, ms (median)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"tensor parallelism on {reports[0]['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--quantization", "-q", default="int4")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median run is kept")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="a PNG of the step time split (compute vs collectives)")
    args = p.parse_args(argv)
    cores = os.cpu_count() or 1
    results = []
    sizes = [int(x) for x in args.tp_sizes.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    bar = tqdm(total=len(sizes) * len(batches) * args.repeats, desc="tensor-parallel bench")
    for tp in sizes:
        torch.set_num_threads(cores)   # a TP = 1 engine uses every core; the launcher splits them for TP > 1
        with LLM(args.model, quantization=args.quantization, dtype=args.dtype, device=args.device,
                 tensor_parallel_size=tp, max_model_len=1024) as llm:
            measure(llm, 1, 4)   # warm-up
            for bs in batches:
                runs = []
                for _ in range(args.repeats):
                    runs.append(measure(llm, bs, args.max_tokens))
                    bar.update(1)
                best = sorted(runs, key=lambda r: r["step_ms"])[len(runs) // 2]
                best.update(tensor_parallel_size=tp, threads_per_rank=torch.get_num_threads(),
                            runs_step_ms=[r["step_ms"] for r in runs])
                results.append(best)
                print(json.dumps(best))
    bar.close()
    report = {"command": "python -m specserve.benchmarks.tensor_parallel " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "quantization": args.quantization, "dtype": args.dtype, "device": args.device,
              "max_tokens": args.max_tokens, "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
              "torch": torch.__version__, "results": results}
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot([report], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
