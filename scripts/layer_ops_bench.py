"""The fused layer's native ops against their candidates (docs/decoder_layer.md), and the attention
kernel by context and cache dtype.

1. Residual add + RMSNorm and SiLU-mul at 1, 4 and 64 rows: PyTorch eager, ``torch.compile``
   (inductor, ``dynamic=True``) of the same code, and our kernels; first, how many of 256 rows
   each computes alone (a decode row) with other bits than inside the 256 (a verify's rows).
2. ``paged_attention`` for one decode row (12 query heads over 2 KV heads of 128, the 1.5B's) at
   100, 1,000 and 4,000 keys, float32 and float16 caches: "warm" repeats one layer's cache, "cold"
   cycles through 28 layers' caches (more than the last-level cache holds, as a real step does).

Run (about a minute, alone on the machine)::

    python scripts/layer_ops_bench.py
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from specserve.kernels import attention_ops, quant_ops


def per_call_us(f, n: int = 2000) -> float:
    for _ in range(50):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


def rms(h, d, w):
    x = h + d
    return x, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def silu_mul(gu):
    g, u = gu.chunk(2, -1)
    return F.silu(g) * u


def compiled_row_independence() -> str:
    """How many of 256 rows a compiled RMSNorm computes alone (a decode row) with other bits than
    inside 256 rows (a verify's or a prefill's), and the same for eager PyTorch and ours."""
    crms = torch.compile(rms, dynamic=True)
    ops = quant_ops()
    w, h, d = torch.randn(1536), torch.randn(256, 1536), torch.randn(256, 1536)
    runs = {"eager": lambda a, b: rms(a, b, w)[1], "compiled": lambda a, b: crms(a, b, w)[1],
            "ours": lambda a, b: ops.rms_norm_rows(a, b, w, 1e-6, False)[1]}
    counts = {}
    for name, f in runs.items():
        full = f(h, d)
        counts[name] = sum(not torch.equal(f(h[i:i + 1], d[i:i + 1]), full[i:i + 1]) for i in range(256))
    return ", ".join(f"{name} {n}/256" for name, n in counts.items())


def candidates() -> None:
    ops = quant_ops()
    crms, csilu = torch.compile(rms, dynamic=True), torch.compile(silu_mul, dynamic=True)
    w = torch.randn(1536)
    print("rows | RMSNorm eager / compiled / ours (ours quantized) | SiLU-mul eager / compiled / ours, us")
    for m in (1, 4, 64):
        h, d, gu = torch.randn(m, 1536), torch.randn(m, 1536), torch.randn(m, 2 * 8960)
        print(f"{m:4d} | {per_call_us(lambda: rms(h, d, w)):.1f} / {per_call_us(lambda: crms(h, d, w)):.1f} / "
              f"{per_call_us(lambda: ops.rms_norm_rows(h, d, w, 1e-6, False)):.1f} "
              f"({per_call_us(lambda: ops.rms_norm_rows(h, d, w, 1e-6, True)):.1f}) | "
              f"{per_call_us(lambda: silu_mul(gu)):.1f} / {per_call_us(lambda: csilu(gu)):.1f} / "
              f"{per_call_us(lambda: ops.silu_mul_rows(gu, False)):.1f}")



def attention() -> None:
    ops = attention_ops()
    q = torch.randn(1, 12, 128)
    print("keys | cache | warm us a layer | cold us a layer (28 layers cycled)")
    for ctx in (100, 1000, 4000):
        rows = (torch.arange(ctx + 1), torch.zeros(1, dtype=torch.int64), torch.tensor([ctx + 1]),
                torch.zeros(1, dtype=torch.int64), torch.zeros(1, 0, dtype=torch.uint8))
        for dt in (torch.float32, torch.float16):
            layers = [(torch.randn(ctx + 64, 2, 128).to(dt), torch.randn(ctx + 64, 2, 128).to(dt)) for _ in range(28)]
            kc, vc = layers[0]
            warm = per_call_us(lambda: ops.paged_attention(q, kc, vc, *rows, 0.088), 300)
            times = []
            for _ in range(10):
                for k, v in layers:
                    t = time.perf_counter()
                    ops.paged_attention(q, k, v, *rows, 0.088)
                    times.append(time.perf_counter() - t)
            print(f"{ctx:5d} | {str(dt).removeprefix('torch.'):8s} | {warm:7.1f} | {1e6 * statistics.median(times):7.1f}")


if __name__ == "__main__":
    print(f"RMSNorm rows alone with other bits than inside 256 rows: {compiled_row_independence()}")
    candidates()
    attention()
