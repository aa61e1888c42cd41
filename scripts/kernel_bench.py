"""Time the int4 / int8 kernels of this checkout against those of another commit, side by side.

    python scripts/kernel_bench.py [--against COMMIT] [--threads 2] [--rounds 15] [--rows 1,4] [--cold-mb 512]

Both builds run in one process, alternating batches of max(3, 100 / M) calls within each case
(median over --rounds alternations, activation quantization included), on random weights of the
1.5B target's shapes. The weights' integers are random bytes to the timing, so one quantized
tensor serves both orders. Prints ms per call, old / new. With --cold-mb, each batch instead
calls once on each of enough copies of the weight to fill that many MB, so that every call reads
its weight from memory, as a decode step does (one weight in a loop stays in the L2 / L3 cache);
take several times the last-level cache (`lscpu`): at 1.7x it, some reads still hit it.
Run it alone: two torch processes on two cores slow each other far more than 2x.
"""
import argparse
import dataclasses
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from specserve.kernels import build_attention_ops, build_quant_ops, cpu_has_vnni, quant_ops
from specserve.models.quantization import quantize

SHAPES = [(8960, 1536), (1536, 8960), (2048, 1536)]
ROWS = [1, 4, 16, 64, 128, 256]   # 128: the smallest int8 call on AMX tiles


def other_source(commit: str, name: str = "quant_linear.cpp") -> Path:
    """``specserve/kernels/<name>`` as of ``commit``, written to a new temporary folder."""
    src = subprocess.run(["git", "show", f"{commit}:specserve/kernels/{name}"], check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="kernel_bench_")) / name
    path.write_text(src)
    return path


def build_other(commit: str):
    return build_quant_ops(vnni=cpu_has_vnni(), source=other_source(commit))


def build_other_attention(commit: str):
    return build_attention_ops(other_source(commit, "paged_attention.cpp"))


def copies(q, megabytes: float) -> list:
    """``q`` and copies of it, enough to hold ``megabytes`` MB of weights (at least one)."""
    fields = [f.name for f in dataclasses.fields(q) if isinstance(getattr(q, f.name), torch.Tensor)]
    nbytes = sum(getattr(q, f).numel() * getattr(q, f).element_size() for f in fields)
    count = max(1, int(megabytes * 1e6 // nbytes))
    return [q] + [dataclasses.replace(q, **{f: getattr(q, f).clone() for f in fields}) for _ in range(count - 1)]


def time_pair(builds, layout, weights, x, out, rounds: int) -> list[float]:
    """Median seconds per call of each build, the builds alternating call batch by call batch for
    ``rounds`` rounds (so the machine's drift hits them alike). A batch calls once per weight of
    ``weights`` (copies of one, to read from memory), or max(3, 100 / M) times on a single one."""
    def run(ops, q):
        xq, dx, bsum = ops.quantize_rows(x)
        if layout == "int4":
            ops.q4_matmul(xq, dx, bsum, q.qs, q.sc, q.mn, q.d, q.dmin, None, out, 0)
        else:
            ops.q8_matmul(xq, dx, q.qs, q.sc, q.d, None, out, 0)
    for ops in builds:
        for _ in range(3):
            run(ops, weights[0])
    batch = weights if len(weights) > 1 else weights * max(3, 100 // x.shape[0])
    times = [[] for _ in builds]
    for _ in range(rounds):
        for ops, t_ops in zip(builds, times):
            t = time.perf_counter()
            for q in batch:
                run(ops, q)
            t_ops.append((time.perf_counter() - t) / len(batch))
    return [statistics.median(t) for t in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="31577c4", help="the commit whose kernel is 'old' (default: the GGUF-order kernel)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15, help="alternations of the two builds per case")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="activation rows M per call (comma-separated)")
    ap.add_argument("--cold-mb", type=float, default=0.0,
                    help="rotate over copies of each weight filling this many MB, so that each call reads it from memory")
    args = ap.parse_args()
    rows = [int(m) for m in args.rows.split(",")]
    old, new = build_other(args.against), quant_ops()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print("| weight (N x K) | layout | " + " | ".join(f"M = {m}" for m in rows) + " |")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        for layout in ("int4", "int8"):
            weights, cells = copies(quantize(w, layout), args.cold_mb), []
            for m in rows:
                x, out = torch.randn(m, k), torch.empty(m, n)
                t_old, t_new = time_pair((old, new), layout, weights, x, out, args.rounds)
                cells.append(f"{t_old * 1e3:.3g} / {t_new * 1e3:.3g}")
            print(f"| {n} x {k} | {layout} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
