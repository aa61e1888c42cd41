"""Time the paged-attention kernel of this checkout against that of another commit, side by side.

    python scripts/attention_bench.py [--against COMMIT] [--rounds 7]

Both builds run in one process on the same inputs, alternating batches of calls (median over
--rounds alternations): prefills, a verify, a decode and trees on the 1.5B target's heads (12 query
heads, 2 kv heads, dim 128), plus small shapes that take the kernel's remainder paths. Slots are
shuffled, as pages are in a busy cache. Prints ms per call, old / new, and whether the outputs have
the same bits. Run it alone: two torch processes on two cores slow each other far more than 2x.
"""
import argparse
import statistics
import time

import torch
from kernel_bench import build_other_attention

from specserve.kernels import attention_ops


def case(rows: int, context: int, h: int, hkv: int, d: int, tree: bool = False) -> tuple:
    """paged_attention's arguments: ``rows`` causal rows after ``context`` keys, or a tree of
    ``rows`` nodes (random ancestor masks) after them."""
    n = context + rows
    slots = torch.randperm(n + 64)[:n]
    kc, vc, q = torch.randn(n + 64, hkv, d), torch.randn(n + 64, hkv, d), torch.randn(rows, h, d)
    start = torch.zeros(rows, dtype=torch.int64)
    if tree:
        prefix, block = torch.full((rows,), context), torch.full((rows,), rows)
        mask = (torch.rand(rows, rows) < 0.5).to(torch.uint8)
        mask[torch.arange(rows), torch.arange(rows)] = 1
    else:
        prefix, block = context + torch.arange(1, rows + 1), torch.zeros(rows, dtype=torch.int64)
        mask = torch.zeros(rows, 0, dtype=torch.uint8)
    return q, kc, vc, slots, start, prefix, block, mask, d ** -0.5


CASES = {
    "prefill 1024 tokens": (1024, 0, 12, 2, 128),
    "prefill 256 after 768": (256, 768, 12, 2, 128),
    "verify 5 after 1000": (5, 1000, 12, 2, 128),
    "decode after 1023": (1, 1023, 12, 2, 128),
    "tree of 16 after 500": (16, 500, 12, 2, 128, True),
    "prefill 77, 4 / 2 heads x 16": (77, 3, 4, 2, 16),
    "prefill 50, 7 / 1 heads x 24": (50, 9, 7, 1, 24),
    "tree of 9, 28 / 4 heads x 128": (9, 40, 28, 4, 128, True),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="188c35e", help="the commit whose kernel is 'old'")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    old = build_other_attention(args.against)
    builds = (old, attention_ops())
    torch.manual_seed(0)
    print("| case | old ms | new ms | old / new | same bits |")
    print("| --- | --- | --- | --- | --- |")
    for name, shape in CASES.items():
        inputs = case(*shape)
        same = torch.equal(old.paged_attention(*inputs), builds[1].paged_attention(*inputs))
        reps, times = max(1, 200 // shape[0]), ([], [])
        for _ in range(args.rounds):
            for ops, t_ops in zip(builds, times):
                t = time.perf_counter()
                for _ in range(reps):
                    ops.paged_attention(*inputs)
                t_ops.append((time.perf_counter() - t) / reps * 1e3)
        t_old, t_new = (statistics.median(t) for t in times)
        print(f"| {name} | {t_old:.3g} | {t_new:.3g} | {t_old / t_new:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
