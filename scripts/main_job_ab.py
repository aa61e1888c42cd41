"""The README's main job (`specserve generate` defaults) against --no-speculation, per held-out prompt,
end to end (prefill included), both engines in one process, alternating, greedy, 96 tokens."""
import json, statistics, sys, time
from specserve.entrypoints.cli import build_parser
from specserve.entrypoints.args import engine_args
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams
PROMPTS = [
    "def merge_intervals(intervals):",
    "Explain in two sentences why the sky is blue.",
    "# Parse a CSV file and print the average of the second column\nimport csv\n",
    "Write a short story about a robot learning to paint.",
    "class LRUCache:\n    def __init__(self, capacity: int):",
]
def engine(extra):
    args = build_parser().parse_args(["generate", *extra, "x"])
    return LLMEngine(engine_args(args))
spec, plain = engine([]), engine(["--no-speculation"])
def run(e, prompt):
    e.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=96))
    t = time.perf_counter(); ids = None
    while e.has_unfinished_requests():
        for out in e.step():
            ids = out.outputs[0].token_ids
    return len(ids) / (time.perf_counter() - t), ids
run(spec, "warm up"); run(plain, "warm up")
rows = []
for p in PROMPTS:
    s_rates, p_rates = [], []
    for r in range(3):
        for e, acc in ((spec, s_rates), (plain, p_rates)) if r % 2 == 0 else ((plain, p_rates), (spec, s_rates)):
            rate, ids = run(e, p)
            acc.append(rate)
            if e is spec: sid = ids
            else: pid = ids
    rows.append({"prompt": p, "spec_tok_s": statistics.median(s_rates), "plain_tok_s": statistics.median(p_rates),
                 "ratio": statistics.median(s_rates) / statistics.median(p_rates), "greedy_equal": sid == pid,
                 "spec_runs": s_rates, "plain_runs": p_rates})
    print(json.dumps(rows[-1]), flush=True)
st = spec.spec_stats
print("mean acceptance length", st.mean_acceptance_length, "verify steps", st.num_verify_steps)
print("median ratio", statistics.median(r["ratio"] for r in rows), "min", min(r["ratio"] for r in rows))
json.dump(rows, open(sys.argv[1], "w"), indent=1)   # usage: python scripts/main_job_ab.py out.json
