"""``specserve bench-serve``: throughput and latency of the OpenAI server under concurrent load.

For each mode (``none``: the server started with ``--no-speculation``; ``spec``: with the draft model
and k of the engine flags) the benchmark launches ``specserve serve`` as a subprocess, waits for
``GET /health`` and sends one warm-up request; then for each concurrency level c it runs
``--num-requests`` requests with at most c in flight (an asyncio semaphore) on every mode in turn
before the next level (the servers run side by side and idle while the other is measured, so
drift of a shared machine over the run hits both modes alike; ``--sequential`` runs one whole
server after the other, with half the memory), and finally stops the servers. With ``--repeats R``
each level runs R rounds on every mode, the order of the modes reversed every other round (none,
spec, spec, none, ...: a linear drift cancels); a level's output tokens/s is then the median over
its rounds, its latency percentiles are over the requests of all rounds. Request i
sends HumanEval prompt ``i % n`` (mixed prompt lengths) to ``POST /v1/completions`` with
``stream: true``, ``temperature: 0``, ``max_tokens`` and ``ignore_eos: true``, so every request
produces exactly ``--max-tokens`` tokens.

Measured per request (client clock, ``time.perf_counter``):

- **TTFT**: request sent -> first server-sent chunk with non-empty text.
- **TPOT** (time per output token): ``(t_last_token - t_first_token) / (completion_tokens - 1)``,
  with ``completion_tokens`` from the ``usage`` of the final chunk. With speculation several tokens
  may arrive in one chunk; TPOT still counts every token.
- **end-to-end latency**: request sent -> stream finished.

Per concurrency level: output tokens/s = all completion tokens / wall time of the level (first request
sent -> last stream finished), median and p99 of TTFT and TPOT, and, from the deltas of the server's
Prometheus counters over the level, the acceptance rate = accepted draft tokens / proposed draft tokens
(and the mean acceptance length, tokens per verify step with the bonus token, when the
``specserve_spec_decode_acceptance_length`` histogram is exported). Speedup is ``spec`` output tokens/s
over ``none`` output tokens/s at the same concurrency, measured in the same run. Greedy decoding with
speculation is lossless, so each request's text in ``spec`` mode is compared with the same request's
text in ``none`` mode.

``--base-url`` benchmarks a server that is already running (one mode, nothing launched).

The client is :mod:`~specserve.benchmarks.completions_client`, the launched server
:mod:`~specserve.benchmarks.server_process`, the figures :mod:`~specserve.benchmarks.serve_bench_stats`
and the report :mod:`~specserve.benchmarks.serve_bench_report`.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import os
import shlex
import signal
import sys
import tempfile
import threading
from urllib.parse import urlparse

from specserve.benchmarks.completions_client import ServerError, run_level, served_model, scrape_metrics
from specserve.plotting import write_results
from specserve.benchmarks.server_process import HOST, ServerProcess
from specserve.benchmarks.serve_bench_report import render_markdown, write_plot
from specserve.benchmarks.serve_bench_stats import (add_speedups, combine_rounds, mode_texts, request_tpot,
                                                    spec_metrics_delta, summarize_level, text_agreement)

MODES = ("none", "spec")
WARMUP_TOKENS = 8


# ----------------------------------------------------------------------------------------- args

def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    """bench-serve flags (the engine flags --model/--dtype/... are added by the CLI)."""
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="comma-separated numbers of requests in flight (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per concurrency level (default: max(c, 8): every level keeps c requests in flight)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens per request, EOS ignored (default: %(default)s)")
    p.add_argument("--port", type=int, default=8011, help="port of the launched server (default: %(default)s)")
    p.add_argument("--modes", default="none,spec",
                   help="comma list of none (server with --no-speculation) and spec (with the draft model) "
                        "(default: %(default)s)")
    p.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for the server's /health (default: %(default)s)")
    p.add_argument("--base-url", default=None,
                   help="benchmark this already running server (e.g. http://127.0.0.1:8000) in one mode, "
                        "launching nothing")
    p.add_argument("--sequential", action="store_true",
                   help="run the modes one server after the other (half the memory); by default both servers "
                        "run side by side, idle in turn, and each concurrency level is measured on every mode "
                        "before the next level, so machine drift hits the modes alike")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds per level on every mode, the modes' order reversed every other round; "
                        "output tok/s is the median over rounds (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="PNG plot of output tokens/s and TPOT vs concurrency (needs matplotlib)")


def parse_concurrency(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; every level must be a positive integer."""
    levels = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            c = int(part)
        except ValueError:
            raise ValueError(f"--concurrency: {part!r} is not an integer (in {text!r})") from None
        if c < 1:
            raise ValueError(f"--concurrency: {c} must be >= 1 (in {text!r})")
        levels.append(c)
    if len(set(levels)) != len(levels):
        raise ValueError(f"--concurrency {text!r} repeats a level")
    return levels


def parse_modes(text: str) -> list[str]:
    """``"none,spec"`` -> ``["none", "spec"]``; only the names in ``MODES``, each once."""
    modes = [m.strip() for m in str(text).split(",")]
    for m in modes:
        if m not in MODES:
            raise ValueError(f"--modes: unknown mode {m!r} (in {text!r}); choose from {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes {text!r} repeats a mode")
    return modes


def requests_for(concurrency: int, num_requests: int | None) -> int:
    """Requests run at one level: ``--num-requests`` when given, else ``max(c, 8)``."""
    return max(concurrency, 8) if num_requests is None else num_requests


def check_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """Validate the flags; returns (concurrency levels, modes). Raises ValueError naming a bad value."""
    levels = parse_concurrency(args.concurrency)
    modes = parse_modes(args.modes)
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and (args.sequential or args.base_url is not None):
        raise ValueError(f"--repeats {args.repeats} needs the modes interleaved (not --sequential or --base-url)")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if not args.server_timeout > 0:
        raise ValueError(f"--server-timeout must be > 0, got {args.server_timeout}")
    if args.base_url is not None:
        u = urlparse(args.base_url)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise ValueError(f"--base-url {args.base_url!r} is not an http(s) URL")
        if len(modes) != 1:
            modes = ["server"]  # one server, one unnamed mode
    elif "spec" in modes and getattr(args, "no_speculation", False):
        raise ValueError(f"--no-speculation contradicts --modes {args.modes!r}; use --modes none")
    elif "spec" in modes and _draft_config(args) is None:
        raise ValueError(f"--modes {args.modes!r} includes spec but no draft model is given "
                         f"(--speculative-model) for --model {args.model!r}")
    return levels, modes


def _draft_config(args: argparse.Namespace) -> dict | None:
    from specserve.entrypoints.args import speculative_config

    return speculative_config(argparse.Namespace(**{**vars(args), "no_speculation": False}))


# engine flags passed to the server as given (those the CLI does not define are skipped)
SERVER_FLAGS = ("model", "dtype", "quantization", "max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens",
                "kv_cache_memory_gb", "num_blocks", "enable_prefix_caching")
NEGATABLE_FLAGS = ("enable_prefix_caching",)   # on by default: passed as --no-... when off
DRAFT_FLAGS = ("speculative_model", "speculative_method", "num_speculative_tokens", "draft_quantization",
               "no_adaptive_speculation", "prompt_lookup_max", "prompt_lookup_min", "speculative_token_tree",
               "eagle_topk", "num_draft_tokens")
ENGINE_FLAGS = SERVER_FLAGS + DRAFT_FLAGS
BENCH_FLAGS = ("concurrency", "num_requests", "max_tokens", "port", "modes", "server_timeout", "base_url",
               "sequential", "repeats", "json", "plot")



def _flags(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    out = []
    for name in names:
        value = getattr(args, name, None)
        if value is False and name in NEGATABLE_FLAGS:
            out.append(f"--no-{name.replace('_', '-')}")
        elif value is not None and value is not False:
            out += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return out


def command_line(args: argparse.Namespace) -> str:
    """The run as one shell line, ``specserve bench-serve --model ... --concurrency ...`` (every flag)."""
    return shlex.join(["specserve", "bench-serve"] + _flags(args, ENGINE_FLAGS) + _flags(args, BENCH_FLAGS))


def server_argv(args: argparse.Namespace, mode: str, port: int) -> list[str]:
    """``specserve serve`` flags for one mode: the engine flags as given, the draft only in ``spec``."""
    argv = ["serve"] + _flags(args, SERVER_FLAGS + (DRAFT_FLAGS if mode == "spec" else ()))
    if mode == "none":
        argv.append("--no-speculation")
    return argv + ["--host", HOST, "--port", str(port)]


# ----------------------------------------------------------------------------------------- runs

def _start_server(args: argparse.Namespace, mode: str, port: int) -> ServerProcess:
    argv = server_argv(args, mode, port)
    log_path = os.path.join(tempfile.gettempdir(), f"specserve-bench-serve-{mode}-{port}.log")
    print(f"starting: specserve {shlex.join(argv)} (log: {log_path})", file=sys.stderr)
    return ServerProcess(argv, port, args.server_timeout, log_path)


def bench_interleaved(args: argparse.Namespace, modes: list[str], prompts: list[str], levels: list[int]) -> list[dict]:
    """Every mode's server up at once (ports ``--port``, ``--port`` + 1, ...); each level runs on
    every mode in turn before the next level, the other servers idle. Returns one run per mode."""
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(_start_server(args, mode, args.port + i)) for i, mode in enumerate(modes)]
        runs = []
        for mode, server in zip(modes, servers):
            run = bench_mode(server.base_url, args.model, prompts, [], args.num_requests, args.max_tokens, mode)
            run["server_command"] = shlex.join(["specserve"] + server.argv)
            runs.append(run)
        for c in levels:
            rounds: list[list[dict]] = [[] for _ in runs]
            for r in range(args.repeats):
                order = list(range(len(runs)))[::-1 if r % 2 else 1]
                for i in order:
                    rounds[i].append(measure_level(servers[i].base_url, runs[i]["served_model"], prompts, c,
                                                   args.num_requests, args.max_tokens, runs[i]["mode"]))
            for run, level_rounds in zip(runs, rounds):
                run["levels"].append(combine_rounds(level_rounds))
    return runs


def bench_mode(base_url: str, model: str, prompts: list[str], levels: list[int], num_requests: int | None,
               max_tokens: int, mode: str) -> dict:
    """Warm-up, then every concurrency level against a healthy server; per-level figures and requests."""
    served = served_model(base_url, model)
    asyncio.run(run_level(base_url, served, prompts, 1, 1, min(WARMUP_TOKENS, max_tokens), f"{mode} warm-up"))
    out = {"mode": mode, "served_model": served, "levels": []}
    for c in levels:
        out["levels"].append(measure_level(base_url, served, prompts, c, num_requests, max_tokens, mode))
    return out


def measure_level(base_url: str, served: str, prompts: list[str], c: int, num_requests: int | None,
                  max_tokens: int, mode: str) -> dict:
    """One concurrency level against one server: its figures and requests."""
    n = requests_for(c, num_requests)
    before = scrape_metrics(base_url)
    records, wall = asyncio.run(run_level(base_url, served, prompts, n, c, max_tokens, f"{mode} c={c}"))
    level = {"concurrency": c, **summarize_level(records, wall),
             "spec_decode": spec_metrics_delta(before, scrape_metrics(base_url))}
    level["requests"] = [{"index": r["index"], "prompt_index": r["prompt_index"],
                          "ttft_s": None if r["t_first"] is None else r["t_first"] - r["t_sent"],
                          "tpot_ms": None if request_tpot(r) is None else 1000 * request_tpot(r),
                          "e2e_s": r["t_done"] - r["t_sent"], "completion_tokens": r["completion_tokens"],
                          "text": r["text"]} for r in records]
    print(f"{mode} c={c}: {level['output_tok_s']:.2f} output tok/s, {level['output_tokens']} tokens "
          f"in {wall:.1f} s", file=sys.stderr)
    return level


# ----------------------------------------------------------------------------------------- main

def _sigterm_as_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; prints the table, writes --json/--plot. Returns the exit code."""
    from specserve.benchmarks.machine import machine_info
    from specserve.data.corpora import HUMANEVAL_SIZE, humaneval_prompts

    levels, modes = check_args(args)
    max_n = max(requests_for(c, args.num_requests) for c in levels)
    prompts = humaneval_prompts(min(max_n, HUMANEVAL_SIZE))
    draft = _draft_config(args) if args.base_url is None else None
    result: dict = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command_line(args),
        "machine": machine_info(),
        "config": {"model": args.model, "dtype": args.dtype, "quantization": getattr(args, "quantization", None),
                   "max_model_len": args.max_model_len,
                   "speculative_model": draft.get("model") if draft else None,
                   "speculative_method": draft["method"] if draft else None,
                   "num_speculative_tokens": draft["num_speculative_tokens"] if draft else None,
                   "draft_quantization": args.draft_quantization,
                   "adaptive_speculation": (not getattr(args, "no_adaptive_speculation", True)) if draft else None,
                   "modes": modes, "concurrency": levels,
                   "num_requests": {str(c): requests_for(c, args.num_requests) for c in levels},
                   "max_tokens": args.max_tokens, "num_prompts": len(prompts), "prompts": "HumanEval",
                   "greedy": True, "ignore_eos": True, "streamed": True, "base_url": args.base_url},
        "runs": [],
    }
    print(f"specserve bench-serve: {args.model}, modes {','.join(modes)}, concurrency {args.concurrency}, "
          f"{args.max_tokens} tokens per request", file=sys.stderr)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:  # SIGTERM unwinds like Ctrl-C, so the server is stopped on the way out
        old_handler = signal.signal(signal.SIGTERM, _sigterm_as_exit)
    try:
        if args.base_url is not None:
            result["runs"].append(bench_mode(args.base_url.rstrip("/"), args.model, prompts, levels,
                                             args.num_requests, args.max_tokens, modes[0]))
        elif args.sequential:
            for mode in modes:
                with _start_server(args, mode, args.port) as server:
                    run = bench_mode(server.base_url, args.model, prompts, levels, args.num_requests,
                                     args.max_tokens, mode)
                run["server_command"] = shlex.join(["specserve"] + server.argv)
                result["runs"].append(run)
        else:
            result["runs"] += bench_interleaved(args, modes, prompts, levels)
    except ServerError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 1
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old_handler)

    add_speedups(result)
    texts = {run["mode"]: mode_texts(run) for run in result["runs"]}
    if "none" in texts and "spec" in texts:
        result["agreement"] = text_agreement(texts["none"], texts["spec"])
    print(render_markdown(result))
    write_results(result, args.json, args.plot, write_plot)
    return 0
