"""A/B of this checkout against a baseline commit for a restructuring: same outputs, no slower host.

Each round runs, for the baseline (a git worktree of the commit) and then this checkout, each in
its own process and one after the other:

* ``specserve bench --methods ...`` (every speculation method on the benchmarks' prompts): the
  greedy token ids of every prompt (as one SHA-1 per method) and the acceptance length must be the
  same on both sides; decode and end-to-end tok/s are reported;
* ``python -m specserve.benchmarks.host_overhead``: the engine's Python time per decode step
  (wall time minus the model forwards), per method and batch size.

Reported: per side the median over rounds with the rounds' min-max, and whether every round of
both sides produced the same tokens. Run (about 8 minutes a round on 2 cores)::

    python scripts/commit_ab.py --baseline cf4a050 --rounds 5 --methods-rounds 2 --json ab.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from step_ab import ROOT, worktree   # scripts/ is on the path when a script runs

METHODS = ["bench", "--model", "qwen2.5-coder-0.5b-instruct", "--methods",
           "none,ngram,draft_model,mtp,eagle-static,eagle-dynamic", "--num-prompts", "4", "--specbench-prompts", "2",
           "--max-tokens", "48", "--num-speculative-tokens", "3", "--draft-quantization", "int8", "--tree-depth", "4",
           "--eagle-topk", "4", "--num-draft-tokens", "12", "--skip-hf"]
HOST = ["--model", "smollm2-135m-instruct"]


def run(side: Path, args: list[str], out: Path) -> dict:
    """One run in its own process, importing ``side``'s specserve (the working folder comes first)."""
    subprocess.run([sys.executable, "-c", "import sys; from specserve.entrypoints.cli import main; "
                    "sys.exit(main(sys.argv[1:]))", *args, "--json", str(out)] if args[0] == "bench" else
                   [sys.executable, "-m", "specserve.benchmarks.host_overhead", *args, "--json", str(out)],
                   cwd=side, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def methods_row(result: dict) -> dict:
    rows = {}
    for r in result["methods"]:
        tokens = json.dumps([p["token_ids"] for p in r["per_prompt"]])
        rows[r["method"]] = {"decode_tok_s_median": r["summary"]["decode_tok_s_median"],
                             "e2e_tok_s_aggregate": r["summary"]["e2e_tok_s_aggregate"],
                             "mean_acceptance_length": (r["spec_decode"] or {}).get("mean_acceptance_length"),
                             "token_ids_sha1": hashlib.sha1(tokens.encode()).hexdigest()}
    return rows


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True)
    p.add_argument("--rounds", type=int, default=5, help="host-overhead rounds (alternating)")
    p.add_argument("--methods-rounds", type=int, default=2, help="rounds of the methods bench (alternating)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    base = worktree(args.baseline)
    sides = {"baseline": base, "new": ROOT}
    tmp = Path(tempfile.mkdtemp(prefix="specserve-ab-out-"))
    methods = {s: [] for s in sides}
    host = {s: [] for s in sides}
    try:
        for i in range(max(args.rounds, args.methods_rounds)):
            for side, path in sides.items():
                if i < args.methods_rounds:
                    methods[side].append(methods_row(run(path, METHODS, tmp / f"m-{side}-{i}.json")))
                if i < args.rounds:
                    host[side].append(run(path, HOST, tmp / f"h-{side}-{i}.json"))
                print(f"round {i + 1} {side} done", file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    report = {"baseline": args.baseline, "new": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short",
                                                                "HEAD"], capture_output=True, text=True).stdout.strip(),
              "command_methods": "specserve " + " ".join(METHODS),
              "command_host": "python -m specserve.benchmarks.host_overhead " + " ".join(HOST),
              "methods": methods, "host_overhead": host}
    print("| method | acceptance length base / new | decode tok/s base / new | e2e tok/s base / new | same tokens |")
    print("| --- | --- | --- | --- | --- |")
    for m in methods["new"][0]:
        runs = [r[m] for s in sides for r in methods[s]]
        same = len({r["token_ids_sha1"] for r in runs}) == 1 and len({r["mean_acceptance_length"] for r in runs}) == 1
        cells = [" / ".join(spread([r[m][k] for r in methods[s]]) if k != "mean_acceptance_length" else
                            f"{methods[s][0][m][k] or 0:.2f}" for s in sides)
                 for k in ("mean_acceptance_length", "decode_tok_s_median", "e2e_tok_s_aggregate")]
        print(f"| {m} | {' | '.join(cells)} | {'yes' if same else 'NO'} |")
    print("\n| method | batch | host ms base | host ms new | step ms base | step ms new |")
    print("| --- | --- | --- | --- | --- | --- |")
    for j, row in enumerate(host["new"][0]["rows"]):
        cells = [spread([r["rows"][j][k] for r in host[s]]) for k in ("host_ms", "step_ms") for s in sides]
        print(f"| {row['method']} | {row['batch_size']} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
