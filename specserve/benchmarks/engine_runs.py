"""Timed runs of our engine (``LLMEngine``) over token-id prompts, for ``specserve bench``: the time
of every generated token, per prompt TTFT and decode tokens/s and their medians and aggregates
(:func:`summarize`, the peers' too), greedy agreement of two runs, and the prefill rate."""
from __future__ import annotations

import statistics
import sys
import time

from specserve.benchmarks.machine import load_average


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(records: list[dict], batches: list[dict]) -> dict:
    """Medians over prompts and aggregates over the whole run.

    records: per prompt ``{"n_tokens", "t0", "t_first", "t_last"}`` (perf_counter seconds).
    batches: per batch ``{"t0", "t_first", "t_last", "n_tokens"}`` (first/last token of any member).
    """
    ttft = [r["t_first"] - r["t0"] for r in records]
    decode = [(r["n_tokens"] - 1) / (r["t_last"] - r["t_first"])
              for r in records if r["n_tokens"] > 1 and r["t_last"] > r["t_first"]]
    e2e = [r["n_tokens"] / (r["t_last"] - r["t0"]) for r in records if r["t_last"] > r["t0"]]
    dec_tokens = sum(b["n_tokens"] - b["batch_size"] for b in batches)
    dec_time = sum(b["t_last"] - b["t_first"] for b in batches)
    wall = sum(b["t_last"] - b["t0"] for b in batches)
    return {
        "ttft_median_s": _median(ttft),
        "decode_tok_s_median": _median(decode),
        "decode_tok_s_aggregate": dec_tokens / dec_time if dec_time > 0 else None,
        "e2e_tok_s_median": _median(e2e),
        "e2e_tok_s_aggregate": sum(b["n_tokens"] for b in batches) / wall if wall > 0 else None,
        "total_tokens": sum(b["n_tokens"] for b in batches),
        "wall_s": wall,
    }


def _run_engine_batch(engine, batch: list[list[int]], max_tokens: int, tag: str) -> tuple[list[dict], dict]:
    """Run ``batch`` (prompt token id lists) to completion; per-request and batch timings."""
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    rec: dict[str, dict] = {}
    for j, ids in enumerate(batch):
        rid = f"{tag}-{j}"
        engine.add_request(rid, ids, params)
        rec[rid] = {"t0": t0, "t_first": None, "t_last": None, "n_tokens": 0, "token_ids": []}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            r = rec.get(out.request_id)
            if r is None:
                continue
            n = len(out.outputs[0].token_ids)
            if n > r["n_tokens"]:
                if r["t_first"] is None:
                    r["t_first"] = now
                r["t_last"] = now
                r["n_tokens"] = n
                r["token_ids"] = list(out.outputs[0].token_ids)
    records = [rec[f"{tag}-{j}"] for j in range(len(batch))]
    batch_rec = {"t0": t0, "t_first": min(r["t_first"] for r in records),
                 "t_last": max(r["t_last"] for r in records),
                 "n_tokens": sum(r["n_tokens"] for r in records), "batch_size": len(batch)}
    return records, batch_rec


def bench_specserve(engine, prompt_ids: list[list[int]], max_tokens: int, batch_size: int) -> dict:
    from tqdm import tqdm

    _run_engine_batch(engine, [prompt_ids[0]], min(4, max_tokens), "warmup")  # first-call setup costs
    records, batches = [], []
    bar = tqdm(total=len(prompt_ids) * max_tokens, desc="specserve", unit="tok", file=sys.stderr)
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        recs, b = _run_engine_batch(engine, chunk, max_tokens, f"p{start}")
        b["load_average"] = load_average()
        records += recs
        batches.append(b)
        bar.update(b["n_tokens"])
    bar.close()
    return {"summary": summarize(records, batches), "per_prompt": records, "batches": batches}


def prefill_prompts(pool: list[int], length: int, count: int = 3) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut from ``pool`` (repeated as needed) at different
    offsets, so that no prompt's first block is another's (no prefix-cache hits)."""
    if not pool:
        raise ValueError("no tokens to build prefill prompts from")
    tokens = pool * (-(-(length + 37 * count) // len(pool)))
    return [tokens[37 * i:37 * i + length] for i in range(count)]


def measure_prefill(engine, prompts: list[list[int]]) -> dict:
    """Prefill tokens/s of each prompt: its length over its time to first token (one generated token)."""
    _run_engine_batch(engine, [prompts[0][:64]], 1, "prefill-warmup")
    rates = []
    for i, ids in enumerate(prompts):
        (rec,), _ = _run_engine_batch(engine, [ids], 1, f"prefill-{i}")
        rates.append(len(ids) / (rec["t_first"] - rec["t0"]))
    return {"tokens": len(prompts[0]), "tok_s": rates, "tok_s_median": statistics.median(rates)}


def agreement(ours: list[dict], theirs: list[dict]) -> dict:
    """How many prompts produced identical greedy tokens, and the first divergence of the others."""
    same, first_diff = 0, []
    for a, b in zip(ours, theirs):
        x, y = a["token_ids"], b["token_ids"]
        if x == y:
            same += 1
        else:
            first_diff.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return {"identical_prompts": same, "prompts": len(ours), "first_divergence_positions": first_diff}
