"""A/B of decode-step time against another commit: each side in its own process, rounds alternating.

For every round and side, a fresh process imports that side's ``specserve`` (a git worktree of the
commit), builds the target (and a draft model through the speculative config, as served), and
times, at each context: one decode step of the target (forward + logits of one token), one of the
draft, and the target over k + 1 tokens (a verify: V(k) = its time over the one-token step's).
Reported: the median over rounds of each side's per-round median, with the rounds' min-max, and
the ratio. Run (about a minute a round and side)::

    python scripts/step_ab.py --baseline 2a5e881 --rounds 5 --contexts 100,1000 --json ab.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r'''
import json, statistics, sys, time
from specserve.entrypoints.llm import LLM
model, draft, contexts, k, steps = sys.argv[1], sys.argv[2], [int(c) for c in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5])
spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "adaptive": False} if draft else None
llm = LLM(model, quantization="int4", speculative_config=spec, max_model_len=max(contexts) + 64)
engine = llm.llm_engine
out = {}


def scratch(ctx, role):
    """Pages for ctx + k + 1 tokens and a forward over them: the engine's scratch sequence, or on
    a baseline from before it, a negative seq id in the block manager and the runner."""
    if hasattr(engine, "scratch_sequence"):
        return engine.scratch_sequence(ctx + k + 1, model=role)
    import contextlib
    from specserve.worker.model_runner import ModelInput

    @contextlib.contextmanager
    def old():
        runner = engine.runner if role == "target" else engine.worker.proposer.runner
        seq = -3_000_000 - ctx
        engine.block_manager.allocate(seq, ctx + k + 1)
        table = engine.block_manager.block_table(seq)

        class Seq:
            model = runner.model
            forward = staticmethod(lambda ids, start: runner.forward([ModelInput(ids, start, table)]).hidden_states)
            logits = staticmethod(runner.compute_logits)
        try:
            yield Seq
        finally:
            engine.block_manager.free(seq)
    return old()


for ctx in contexts:
    for name in (["target", "draft"] if spec else ["target"]):
        with scratch(ctx, name) as seq:
            vocab = seq.model.config.vocab_size
            seq.forward([(1000 + 7 * i) % vocab for i in range(ctx)], 0)
            def timed(m):
                t = time.perf_counter()
                seq.logits(seq.forward([5] * m, ctx), list(range(m)))
                return time.perf_counter() - t
            for _ in range(3):
                timed(1), timed(k + 1)
            one, many = [], []
            for _ in range(steps):
                one.append(timed(1))
                if name == "target":
                    many.append(timed(k + 1))
            out[f"{name}_step_ms@{ctx}"] = 1e3 * statistics.median(one)
            if many:
                out[f"target_verify_ms@{ctx}"] = 1e3 * statistics.median(many)
                out[f"V({k})@{ctx}"] = statistics.median(m / o for m, o in zip(many, one))
print("RESULT " + json.dumps(out))
'''


def worktree(commit: str) -> Path:
    """A git worktree of ``commit`` in a temporary folder (removed by the caller's process exit)."""
    path = Path(tempfile.mkdtemp(prefix="specserve-ab-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), commit], check=True,
                   capture_output=True)
    return path


def measure(tree: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", MEASURE, args.model, args.draft or "", args.contexts, str(args.k),
                           str(args.steps)], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"the measurement in {tree} failed:\n{proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", required=True, help="the commit to compare against")
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="'' for the target alone")
    p.add_argument("--contexts", default="100,1000")
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per figure and process")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    trees = {"baseline": worktree(args.baseline), "current": ROOT}
    runs: dict[str, list[dict]] = {"baseline": [], "current": []}
    for r in range(args.rounds):
        order = ["baseline", "current"] if r % 2 == 0 else ["current", "baseline"]
        for side in order:
            runs[side].append(measure(trees[side], args))
            print(f"round {r + 1} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    summary = {}
    for key in runs["current"][0]:
        row = {}
        for side in ("baseline", "current"):
            vals = [run[key] for run in runs[side] if key in run]
            row[side] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
        row["ratio"] = row["current"]["median"] / row["baseline"]["median"]
        summary[key] = row
        print(f"{key:24s} baseline {row['baseline']['median']:7.2f} [{row['baseline']['min']:.2f}-"
              f"{row['baseline']['max']:.2f}]  current {row['current']['median']:7.2f} [{row['current']['min']:.2f}-"
              f"{row['current']['max']:.2f}]  current / baseline {row['ratio']:.3f}")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["baseline"])], check=False)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
