"""``specserve bench-serve``'s figures: percentiles, per request TPOT, a concurrency level's figures
and the combination of its rounds, the speculation counters from the server's Prometheus
``/metrics``, the speedups over ``none``, and the greedy texts of two modes compared."""
from __future__ import annotations

import math
import statistics

METRIC_DRAFT = "specserve_spec_decode_num_draft_tokens_total"
METRIC_ACCEPTED = "specserve_spec_decode_num_accepted_tokens_total"
METRIC_ACC_LEN = "specserve_spec_decode_acceptance_length"  # histogram: _sum / _count
METRIC_STEPS = "specserve_spec_decode_steps_total"  # decode-only steps by the k chosen (0 = off)


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default);
    None for no data."""
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def request_tpot(r: dict) -> float | None:
    """Seconds per output token after the first, or None with fewer than two tokens."""
    n = r["completion_tokens"]
    if n is None or n < 2 or r["t_first"] is None:
        return None
    return (r["t_last"] - r["t_first"]) / (n - 1)


def summarize_level(records: list[dict], wall_s: float) -> dict:
    """Level figures from per-request records ``{"t_sent", "t_first", "t_last", "t_done",
    "completion_tokens"}`` (perf_counter seconds) and the level's wall time."""
    ttft = [r["t_first"] - r["t_sent"] for r in records if r["t_first"] is not None]
    tpot = [t for t in map(request_tpot, records) if t is not None]
    e2e = [r["t_done"] - r["t_sent"] for r in records]
    tokens = sum(r["completion_tokens"] or 0 for r in records)
    ms = lambda x: None if x is None else 1000 * x  # noqa: E731
    return {
        "num_requests": len(records), "output_tokens": tokens, "wall_s": wall_s,
        "output_tok_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_median_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_ms": ms(percentile(tpot, 50)), "tpot_p99_ms": ms(percentile(tpot, 99)),
        "e2e_median_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> ``{sample name: value summed over its label sets}``, plus each
    labelled sample under its own key ``name{k="v",...}`` (parsed by prometheus_client)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            if sample.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def spec_metrics_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Draft/accepted token counts over a level from two /metrics snapshots, the acceptance rate
    (accepted / drafted), with the histogram the mean acceptance length (tokens per sequence per verify
    step, bonus included), and the decode steps by the k the server chose; None where absent."""
    def delta(name: str) -> float | None:
        if before is None or after is None or name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    drafted, accepted = delta(METRIC_DRAFT), delta(METRIC_ACCEPTED)
    steps, length_sum = delta(METRIC_ACC_LEN + "_count"), delta(METRIC_ACC_LEN + "_sum")
    prefix = METRIC_STEPS + '{num_speculative_tokens="'
    by_k = {key[len(prefix):-2]: delta(key) for key in (after or {}) if key.startswith(prefix)}
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
            "verify_steps": steps,
            "mean_acceptance_length": length_sum / steps if steps and length_sum is not None else None,
            "decode_steps_by_k": {k: n for k, n in sorted(by_k.items(), key=lambda kv: (len(kv[0]), kv[0])) if n}}


def combine_rounds(rounds: list[dict]) -> dict:
    """One level's figures from its rounds (each as
    :func:`~specserve.benchmarks.serve_bench.measure_level` returns it): output tok/s is the median
    of the rounds', TTFT / TPOT / end-to-end percentiles are over every request, token and step
    counts are summed; the requests carry their ``round``, and ``rounds`` keeps each round's tok/s
    and wall time."""
    if len(rounds) == 1:
        return rounds[0]
    reqs = [{**r, "round": i} for i, lv in enumerate(rounds) for r in lv["requests"]]
    ttft = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
    tpot = [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None]
    e2e = [r["e2e_s"] for r in reqs]
    sds = [lv["spec_decode"] for lv in rounds]

    def total(key: str) -> float | None:
        vals = [sd.get(key) for sd in sds]
        return None if any(v is None for v in vals) else sum(vals)

    drafted, accepted, steps = total("draft_tokens"), total("accepted_tokens"), total("verify_steps")
    lengths = [sd.get("mean_acceptance_length") and sd["mean_acceptance_length"] * sd["verify_steps"] for sd in sds]
    by_k: dict[str, float] = {}
    for sd in sds:
        for k, n in (sd.get("decode_steps_by_k") or {}).items():
            by_k[k] = by_k.get(k, 0.0) + n
    return {
        "concurrency": rounds[0]["concurrency"], "num_requests": len(reqs),
        "output_tokens": sum(lv["output_tokens"] for lv in rounds), "wall_s": sum(lv["wall_s"] for lv in rounds),
        "output_tok_s": statistics.median(lv["output_tok_s"] for lv in rounds),
        "ttft_median_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "tpot_median_ms": percentile(tpot, 50), "tpot_p99_ms": percentile(tpot, 99),
        "e2e_median_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
        "spec_decode": {"draft_tokens": drafted, "accepted_tokens": accepted,
                        "acceptance_rate": accepted / drafted if drafted and accepted is not None else None,
                        "verify_steps": steps,
                        "mean_acceptance_length": sum(x or 0.0 for x in lengths) / steps if steps else None,
                        "decode_steps_by_k": by_k},
        "rounds": [{"output_tok_s": lv["output_tok_s"], "wall_s": lv["wall_s"]} for lv in rounds],
        "requests": reqs,
    }


def text_agreement(reference: dict, other: dict) -> dict:
    """Compare two modes' texts, each ``{"c<level>/<request>": text}``, on the keys both have."""
    keys = sorted(set(reference) & set(other))
    diffs = []
    for k in keys:
        a, b = reference[k], other[k]
        if a != b:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diffs.append({"request": k, "first_diff_char": pos})
    return {"identical": len(keys) - len(diffs), "total": len(keys), "differences": diffs}


def mode_texts(run: dict) -> dict[str, str]:
    """``{"c<level>/<request index>": text}`` (``c<level>/r<round>/<index>`` with rounds) for one mode's run."""
    return {f"c{lv['concurrency']}/" + (f"r{r['round']}/" if "round" in r else "") + str(r["index"]): r["text"]
            for lv in run["levels"] for r in lv["requests"]}


def add_speedups(result: dict) -> None:
    """Per level, output tok/s over the ``none`` mode's at the same concurrency (None without it).

    With rounds (``--repeats``), each round's ratio pairs the two modes measured next to each other
    in time (the order alternates, so slow drift of the machine falls on both), and the level's
    ``speedup_vs_none`` is the median of those paired ratios (``round_speedups``) rather than a
    ratio of medians that may come from different rounds."""
    base = {lv["concurrency"]: lv for run in result["runs"] if run["mode"] == "none" for lv in run["levels"]}
    for run in result["runs"]:
        for lv in run["levels"]:
            b = base.get(lv["concurrency"])
            if b is None or not b["output_tok_s"] or lv["output_tok_s"] is None:
                lv["speedup_vs_none"] = None
                continue
            mine, theirs = lv.get("rounds"), b.get("rounds")
            if lv is not b and mine and theirs and len(mine) == len(theirs):
                lv["round_speedups"] = [m["output_tok_s"] / t["output_tok_s"] for m, t in zip(mine, theirs)]
                lv["speedup_vs_none"] = statistics.median(lv["round_speedups"])
            else:
                lv.pop("round_speedups", None)
                lv["speedup_vs_none"] = lv["output_tok_s"] / b["output_tok_s"]
