"""The int4 / int8 kernels against this machine's roofline.

    python scripts/roofline.py [--rows 1,2,4,5,8,13,16,64,256] [--against COMMIT] [--json F] [--plot F.png]

Measures, on all threads (`--threads`, default 2):
- the int8 dot-product peak: a tight loop of ten independent `vpdpbusd` chains in the kernels'
  build (512-bit where the kernels use it), printed as G multiply-adds per second;
- the streaming read bandwidth (one pass over a 1 GiB tensor, best of 5);
- each kernel's G MAC/s at every M, on the 1.5B target's largest shapes, weights read from memory
  (each call takes the next of enough copies to fill --cold-mb MB, several times the L3), against
  its roofline min(peak, M x bandwidth / bytes per weight), the bytes per weight being the packed
  layout's (scales included).
With --against, the kernel of that commit (row-major layout) is timed in the same process,
alternating with this one. Run it alone: two processes on two cores slow each other.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time

import torch

from specserve.benchmarks.host_overhead import read_bandwidth_gbs
from specserve.kernels import build_quant_ops, cpu_runs_512bit_at_full_width, quant_ops
from specserve.models.quantization import quantize
from specserve.models.weight_packing import PackedWeight

SHAPES = [(17920, 1536), (1536, 8960)]   # the 1.5B's fused gate/up and its down projection
ROWS = [1, 2, 4, 5, 8, 13, 16, 64, 256]


def cpu_name() -> str:
    """The CPU's model name and the vector extensions the kernels care about."""
    name, flags = platform.processor() or "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not name:
                name = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    ext = [f for f in ("avx2", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return f"{name} ({', '.join(ext)})"


def dot_peak(ops) -> float:
    """G MAC/s of the tight dot-product loop (best of 5 calls of ~0.1 s)."""
    ops.int8_dot_peak(1000)
    best = 0.0
    for _ in range(5):
        iters = 50_000_000
        t = time.perf_counter()
        macs = ops.int8_dot_peak(iters)
        best = max(best, macs / (time.perf_counter() - t) / 1e9)
    return best


def copies(obj, megabytes: float) -> list:
    """``obj`` (a dataclass of tensors) and copies of it filling ``megabytes`` MB (at least one)."""
    fields = [f.name for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]
    nbytes = sum(getattr(obj, f).numel() * getattr(obj, f).element_size() for f in fields)
    count = max(1, int(megabytes * 1e6 // nbytes))
    return [obj] + [dataclasses.replace(obj, **{f: getattr(obj, f).clone() for f in fields}) for _ in range(count - 1)]


def new_call(ops, layout):
    def run(x, p, out):
        xq, dx, bsum = ops.quantize_rows(x)
        if layout == "int4":
            ops.q4_matmul(xq, dx, bsum, p.wq, p.sc, p.mn, p.d, p.dmin, p.n, None, out, 0)
        elif layout == "int6":
            ops.q6_matmul(xq, dx, p.wq, p.sc, p.sc2, p.d, p.n, None, out, 0)
        else:
            ops.q8_matmul(xq, dx, p.wq, p.sc, p.corr, p.d, p.n, None, out, 0)
    return run


def old_call(ops, layout):   # the row-major kernels (before the packed layout; Q6_K as int8)
    def run(x, q, out):
        xq, dx, bsum = ops.quantize_rows(x)
        if layout == "int4":
            ops.q4_matmul(xq, dx, bsum, q.qs, q.sc, q.mn, q.d, q.dmin, None, out, 0)
        else:
            ops.q8_matmul(xq, dx, q.qs, q.sc, q.d, None, out, 0)
    return run


def time_calls(runs, weights, x, out, rounds: int, budget_s: float) -> list[float]:
    """Median seconds per call of each (run, weights) pair, alternating in rounds; each round calls
    once per weight copy (cold reads), as many copies as fit ``budget_s`` for the slowest."""
    for run, ws in zip(runs, weights):
        run(x, ws[0], out)
    t = time.perf_counter()
    runs[0](x, weights[0][0], out)
    per = max(time.perf_counter() - t, 1e-6)
    n = max(2, min(len(weights[0]), int(budget_s / per / rounds / len(runs))))
    times = [[] for _ in runs]
    for _ in range(rounds):
        for run, ws, ts in zip(runs, weights, times):
            t = time.perf_counter()
            for q in ws[:n]:
                run(x, q, out)
            ts.append((time.perf_counter() - t) / n)
    return [statistics.median(ts) for ts in times]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold-mb", type=float, default=384.0)
    ap.add_argument("--against", default=None, help="also time this commit's kernels (row-major layout)")
    ap.add_argument("--isa", choices=["native", "avx2", "vnni256", "vnni512"], default="native",
                    help="the kernels' build: native (what this CPU gets by default; --against: what that commit "
                         "chose), or one instruction set for both (default: %(default)s)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write G MAC/s against M with the roofline to this PNG")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isa = {"avx2": dict(vnni=False), "vnni256": dict(vnni=True, zmm=False), "vnni512": dict(vnni=True, zmm=True)}
    ops = quant_ops() if args.isa == "native" else build_quant_ops(**isa[args.isa])
    old = None
    if args.against:
        from kernel_bench import build_other, other_source   # scripts/kernel_bench.py
        old = (build_other(args.against) if args.isa == "native"
               else build_quant_ops(source=other_source(args.against), **isa[args.isa]))
    peak, bw = dot_peak(ops), read_bandwidth_gbs(1024, ops=ops)
    lanes = ops.tile_shapes()[0]
    print(f"CPU: {cpu_name()}; threads {args.threads}; build {args.isa}, kernels on {lanes * 32}-bit vectors "
          f"(512-bit at full width: {cpu_runs_512bit_at_full_width()})")
    print(f"int8 dot-product peak {peak:.0f} G MAC/s; streaming read {bw:.1f} GB/s")
    rows = [int(m) for m in args.rows.split(",")]
    results = []
    for n, k in SHAPES:
        w = torch.randn(n, k)
        for layout in ("int4", "int6", "int8"):
            if layout == "int6":   # Q6_K's integer range in the int8 layout (the values do not matter to the timing)
                q8 = quantize(w, "int8")
                qt = dataclasses.replace(q8, layout="int6", qs=q8.qs.clamp(-32, 31))
            else:
                qt = quantize(w, layout)
            packed = PackedWeight.pack(qt)
            bpw = packed.nbytes / (n * k)
            new_w = copies(packed, args.cold_mb)
            # the row-major kernels hold Q6_K's integers as int8
            old_w = copies(dataclasses.replace(qt, layout="int8") if layout == "int6" else qt, args.cold_mb) if old else None
            for m in rows:
                x, out = torch.randn(m, k), torch.empty(m, n)
                runs, ws = [new_call(ops, layout)], [new_w]
                if old:
                    runs.append(old_call(old, layout))
                    ws.append(old_w)
                ts = time_calls(runs, ws, x, out, args.rounds, budget_s=12.0)
                roof = min(peak, m * bw / bpw)
                gmacs = [m * n * k / t / 1e9 for t in ts]
                r = {"shape": [n, k], "layout": layout, "M": m, "bytes_per_weight": bpw, "ms": ts[0] * 1e3,
                     "gmacs": gmacs[0], "roofline_gmacs": roof, "of_roofline": gmacs[0] / roof, "of_peak": gmacs[0] / peak}
                if old:
                    r.update(old_ms=ts[1] * 1e3, old_gmacs=gmacs[1])
                results.append(r)
                print(f"{n}x{k} {layout} M={m:4d}: {ts[0] * 1e3:8.3f} ms {gmacs[0]:7.1f} G MAC/s = "
                      f"{100 * r['of_roofline']:5.1f}% of roofline {roof:6.0f}, {100 * r['of_peak']:5.1f}% of peak"
                      + (f"   | {args.against}: {ts[1] * 1e3:8.3f} ms {gmacs[1]:7.1f} G MAC/s" if old else ""), flush=True)
    doc = {"cpu": cpu_name(), "isa": args.isa, "threads": args.threads, "vector_bits": lanes * 32, "peak_gmacs": peak,
           "bandwidth_gbs": bw, "against": args.against, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot(doc, args.plot)


def plot(doc: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, layout in zip(axes, ("int4", "int6", "int8")):
        rs = [r for r in doc["results"] if r["layout"] == layout]
        for shape in {tuple(r["shape"]) for r in rs}:
            sel = [r for r in rs if tuple(r["shape"]) == shape]
            ms = [r["M"] for r in sel]
            ax.plot(ms, [r["gmacs"] for r in sel], "o-", label=f"{shape[0]}x{shape[1]}")
            if "old_gmacs" in sel[0]:
                ax.plot(ms, [r["old_gmacs"] for r in sel], "x--", label=f"{shape[0]}x{shape[1]} {doc['against']}")
            ax.plot(ms, [r["roofline_gmacs"] for r in sel], ":", color="gray")
        ax.axhline(doc["peak_gmacs"], color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{layout} (roofline dotted, peak {doc['peak_gmacs']:.0f} G MAC/s)")
        ax.set_xlabel("activation rows M")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("G multiply-adds / s")
    fig.suptitle(doc["cpu"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
