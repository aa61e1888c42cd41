"""Time to first token for requests that repeat a long system prompt, with and without prefix caching.

Every request is the target's chat template over the same system prompt (``--system-tokens``
tokens of the standard library's ``textwrap`` source, after a one-line instruction) and a
different Spec-Bench question; requests run one at a time (batch size 1), speculation on. The
first request fills the cache; the others find the system prompt's full pages there. Reported:
TTFT of the first request and the median of the others (seconds), with caching on and off, their
ratio, and whether the outputs are equal (greedy: they must be). Run::

    python -m specserve.benchmarks.prefix_caching --json docs/bench/prefix_caching_cpu.json \\
        --plot docs/bench/prefix_caching_cpu.png
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import textwrap

from tqdm.auto import tqdm

from specserve.benchmarks.machine import machine_info
from specserve.config import DEFAULT_DRAFT, DEFAULT_MODEL, DEFAULT_QUANTIZATION
from specserve.entrypoints.llm import LLM
from specserve.results import write_json
from specserve.sampling_params import SamplingParams
from specserve.data.corpora import spec_bench_eval_questions

INSTRUCTION = "You answer questions. Here is a Python module for reference:\n\n"


def system_prompt(tokenizer, num_tokens: int) -> str:
    """The instruction and the start of ``textwrap``'s source, cut to ``num_tokens`` tokens."""
    ids = tokenizer.encode(INSTRUCTION + inspect.getsource(textwrap))
    if len(ids) < num_tokens:
        raise ValueError(f"--system-tokens {num_tokens}: the source has only {len(ids)} tokens")
    return tokenizer.decode(ids[:num_tokens])


def requests(tokenizer, num_tokens: int, num_requests: int) -> list[list[int]]:
    """Token ids of the chat prompts: the shared system message, then one question each."""
    system = system_prompt(tokenizer, num_tokens)
    questions = [q for _, q in spec_bench_eval_questions()[:num_requests]]
    return [list(tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": q}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for q in questions]


def run(args: argparse.Namespace, caching: bool, prompts: list[list[int]], bar) -> dict:
    """The prompts one at a time on a fresh engine; ``prompts`` empty: made first from its tokenizer."""
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    with LLM(args.model, quantization=args.quantization, speculative_config=json.loads(args.speculative_config),
             enable_prefix_caching=caching, max_model_len=4096) as llm:
        if not prompts:
            prompts.extend(requests(llm.llm_engine.tokenizer, args.system_tokens, args.num_requests))
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2))   # warm-up
        rows = []
        for ids in prompts:
            out = llm.generate([{"prompt_token_ids": ids}], params)[0]
            rows.append({"prompt_tokens": len(ids), "cached_tokens": out.num_cached_tokens,
                         "ttft_s": out.metrics.ttft, "token_ids": out.outputs[0].token_ids})
            bar.update(1)
    return {"enable_prefix_caching": caching, "requests": rows, "first_ttft_s": rows[0]["ttft_s"],
            "repeat_ttft_s": statistics.median(r["ttft_s"] for r in rows[1:])}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for res in report["results"]:
        ttft = [r["ttft_s"] for r in res["requests"]]
        ax.plot(range(1, len(ttft) + 1), ttft, marker="o",
                label="prefix caching " + ("on" if res["enable_prefix_caching"] else "off"))
    ax.set_xlabel("request (same system prompt, new question)")
    ax.set_ylabel("time to first token, s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report['model']} ({report['quantization']}), {report['system_tokens']}-token system prompt",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", "-q", default=DEFAULT_QUANTIZATION)
    p.add_argument("--speculative-config", default=json.dumps({"method": "draft_model", "model": DEFAULT_DRAFT}),
                   help="JSON, as the engine's speculative_config (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    if args.num_requests < 2:
        p.error(f"--num-requests must be >= 2 (one fills the cache), got {args.num_requests}")
    prompts: list[list[int]] = []
    bar = tqdm(total=2 * args.num_requests, desc="prefix-caching TTFT")
    results = [run(args, caching, prompts, bar) for caching in (False, True)]
    bar.close()
    off, on = results
    report = {"command": "python -m specserve.benchmarks.prefix_caching " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "quantization": args.quantization, "speculative_config": args.speculative_config,
              "system_tokens": args.system_tokens, "max_tokens": args.max_tokens, "batch_size": 1,
              "machine": machine_info(), "results": results,
              "repeat_ttft_speedup": off["repeat_ttft_s"] / on["repeat_ttft_s"],
              "outputs_equal": [r["token_ids"] for r in off["requests"]] == [r["token_ids"] for r in on["requests"]]}
    for res in results:
        print(f"prefix caching {'on ' if res['enable_prefix_caching'] else 'off'}: first TTFT "
              f"{res['first_ttft_s']:.3f} s, repeated-prefix TTFT (median of {len(prompts) - 1}) "
              f"{res['repeat_ttft_s']:.3f} s, cached tokens {[r['cached_tokens'] for r in res['requests']]}")
    print(f"repeated-prefix TTFT {report['repeat_ttft_speedup']:.1f}x faster; outputs equal: {report['outputs_equal']}")
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0 if report["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
