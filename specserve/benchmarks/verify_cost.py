"""The target's verify cost V(k), and where one decode step's time goes, for ``specserve bench``.

**V(k)** = t(target forward over k+1 new tokens + their logits) / t(one-token decode forward + its
logits), on a sequence with ``--context-len`` tokens already in the KV cache; for each repeat and k
the one-token step is timed right before the (k+1)-token one and the ratio of the pair is kept; the
median over ``--repeats`` pairs is reported. Speculation pays when ``tau > V(k) + k c``.
"""
from __future__ import annotations

import statistics
import sys
import time



def step_breakdown(engine, role: str, context_len: int) -> dict:
    """One decode step of the engine's target (``role="draft"``: its draft model) at
    ``context_len``: time in the linears and outside, bytes read and the floor they set
    (:func:`specserve.benchmarks.host_overhead.decode_breakdown`)."""
    from specserve.benchmarks.host_overhead import decode_breakdown, read_bandwidth_gbs

    with engine.scratch_sequence(context_len + 1, model=role) as seq:
        return {"role": role, **decode_breakdown(seq, context_len, read_bandwidth_gbs(256), repeats=20)}


def measure_vk(engine, context_ids: list[int], max_k: int, repeats: int, warmup: int = 2) -> dict:
    """V(k) for k = 1..max_k with ``context_ids`` prefilled (see module doc)."""
    from tqdm import tqdm

    ctx = len(context_ids)
    vocab = engine.model_config.vocab_size
    new_ids = [(context_ids[i % ctx] if ctx else 0) % vocab for i in range(max_k + 1)]
    with engine.scratch_sequence(ctx + max_k + 1) as seq:
        seq.forward(list(context_ids), 0)  # prefill

        def timed(m: int) -> float:
            t = time.perf_counter()
            seq.logits(seq.forward(new_ids[:m], ctx), list(range(m)))
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
    return {
        "context_len": ctx, "repeats": repeats,
        "t1_ms_median": 1000 * statistics.median(t1_all),
        "vk": [{"k": k, "tokens": k + 1, "v": statistics.median(ratios[k]),
                "t_ms_median": 1000 * statistics.median(tk_all[k]),
                "ratios": ratios[k]} for k in range(1, max_k + 1)],
    }
