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
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shlex
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from specserve.benchmarks.plotting import load_pyplot, write_results

MODES = ("none", "spec")
HOST = "127.0.0.1"
WARMUP_TOKENS = 8
HUMANEVAL_SIZE = 164
METRIC_DRAFT = "specserve_spec_decode_num_draft_tokens_total"
METRIC_ACCEPTED = "specserve_spec_decode_num_accepted_tokens_total"
METRIC_ACC_LEN = "specserve_spec_decode_acceptance_length"  # histogram: _sum / _count
METRIC_STEPS = "specserve_spec_decode_steps_total"  # decode-only steps by the k chosen (0 = off)


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error."""


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


# ----------------------------------------------------------------------------------------- stats

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
    """One level's figures from its rounds (each as :func:`measure_level` returns it): output tok/s
    is the median of the rounds', TTFT / TPOT / end-to-end percentiles are over every request,
    token and step counts are summed; the requests carry their ``round``, and ``rounds`` keeps
    each round's tok/s and wall time."""
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


# ----------------------------------------------------------------------------------------- client

async def _one_request(client, url: str, body: dict) -> dict:
    """Stream one completion; timings, usage tokens and text."""
    t_sent = time.perf_counter()
    t_first = t_last = None
    text, usage = [], None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise ServerError(f"POST {url} -> HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise ServerError(f"POST {url}: error in stream: {chunk['error']}")
            now = time.perf_counter()
            piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if piece:
                t_first = now if t_first is None else t_first
                t_last = now
                text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    n = usage.get("completion_tokens") if usage else None
    return {"t_sent": t_sent, "t_first": t_first, "t_last": t_last, "t_done": time.perf_counter(),
            "completion_tokens": n, "text": "".join(text)}


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    """The /v1/completions request: streamed, greedy, exactly ``max_tokens`` tokens."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}


async def _run_level(base_url: str, model: str, prompts: list[str], n: int, concurrency: int,
                     max_tokens: int, desc: str) -> tuple[list[dict], float]:
    import httpx
    from tqdm import tqdm

    sem = asyncio.Semaphore(concurrency)
    url = base_url + "/v1/completions"
    bar = tqdm(total=n, desc=desc, unit="req", file=sys.stderr)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async with httpx.AsyncClient(timeout=None, limits=limits, trust_env=False) as client:
        async def task(i: int) -> dict:
            async with sem:
                r = await _one_request(client, url, completion_body(model, prompts[i % len(prompts)], max_tokens))
            r["index"], r["prompt_index"] = i, i % len(prompts)
            bar.update(1)
            return r

        t0 = time.perf_counter()
        try:
            records = await asyncio.gather(*(task(i) for i in range(n)))
        except httpx.HTTPError as e:  # connection refused / dropped mid-stream: the server failed
            raise ServerError(f"{url}: {type(e).__name__}: {e}") from e
        finally:
            bar.close()
        wall = time.perf_counter() - t0
    return list(records), wall


def _get(base_url: str, path: str, timeout: float = 10.0):
    import httpx

    return httpx.get(base_url + path, timeout=timeout, trust_env=False)


def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """The server's /metrics, parsed; None when it has none."""
    import httpx

    try:
        r = _get(base_url, "/metrics")
    except httpx.HTTPError:
        return None
    return parse_prometheus(r.text) if r.status_code == 200 else None


def served_model(base_url: str, fallback: str) -> str:
    """The first model id of /v1/models (the name requests must use), else ``fallback``."""
    import httpx

    try:
        data = _get(base_url, "/v1/models").json().get("data") or []
        return data[0]["id"] if data else fallback
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return fallback


# ----------------------------------------------------------------------------------------- server

def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def _log_tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


class ServerProcess:
    """``specserve serve`` in a subprocess (output to a log file); a context manager that always stops it."""

    def __init__(self, argv: list[str], port: int, timeout_s: float, log_path: str):
        self.argv, self.port, self.timeout_s, self.log_path = argv, port, timeout_s, log_path
        self.base_url = f"http://{HOST}:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        import httpx

        if _port_in_use(self.port):
            raise ValueError(f"port {self.port} is already in use (pick another with --port)")
        log = open(self.log_path, "w")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "specserve.entrypoints.cli"] + self.argv,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            deadline = time.monotonic() + self.timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"the server exited with code {self.proc.returncode} before it was ready; "
                                      f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
                try:
                    if _get(self.base_url, "/health", timeout=2.0).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerError(f"no healthy server at {self.base_url} after --server-timeout "
                                      f"{self.timeout_s:g} s; last lines of {self.log_path}:\n"
                                      f"{_log_tail(self.log_path)}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s; waits until the process is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


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
    asyncio.run(_run_level(base_url, served, prompts, 1, 1, min(WARMUP_TOKENS, max_tokens), f"{mode} warm-up"))
    out = {"mode": mode, "served_model": served, "levels": []}
    for c in levels:
        out["levels"].append(measure_level(base_url, served, prompts, c, num_requests, max_tokens, mode))
    return out


def measure_level(base_url: str, served: str, prompts: list[str], c: int, num_requests: int | None,
                  max_tokens: int, mode: str) -> dict:
    """One concurrency level against one server: its figures and requests."""
    n = requests_for(c, num_requests)
    before = scrape_metrics(base_url)
    records, wall = asyncio.run(_run_level(base_url, served, prompts, n, c, max_tokens, f"{mode} c={c}"))
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


# ----------------------------------------------------------------------------------------- report

def _fmt(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _fmt_rounds(xs: list[float]) -> str:
    """`` (a, b, ...)``: each round's figure after the combined one; empty for a single round."""
    return " (" + ", ".join(_fmt(x) for x in xs) + ")" if len(xs) > 1 else ""


def render_markdown(result: dict) -> str:
    """Header lines and one table row per mode x concurrency."""
    cfg, mach = result["config"], result["machine"]
    draft = ""
    if "spec" in cfg["modes"]:
        draft = (f", draft {cfg['speculative_model']} k={cfg['num_speculative_tokens']}"
                 + (" (adaptive: k chosen per step, up to this)" if cfg.get("adaptive_speculation") else ""))
    lines = [
        f"machine: {mach['cpu']}, {mach['cpu_count']} cpus; torch {mach['torch']}",
        f"model: {cfg['model']}, dtype {cfg['dtype']}{draft}; prompts: HumanEval (request i -> prompt i mod "
        f"{cfg['num_prompts']}), {cfg['max_tokens']} tokens per request (EOS ignored), greedy, streamed",
        "",
        "| mode | concurrency | requests | output tok/s | speedup vs none | TTFT median (s) | TTFT p99 (s) "
        "| TPOT median (ms) | TPOT p99 (ms) | acceptance rate | mean acceptance length | decode steps by k |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in result["runs"]:
        for lv in run["levels"]:
            sd = lv.get("spec_decode") or {}
            tok_s = _fmt(lv["output_tok_s"]) + _fmt_rounds([r["output_tok_s"] for r in lv.get("rounds", [])])
            speedup = _fmt(lv.get("speedup_vs_none")) + _fmt_rounds(lv.get("round_speedups", []))
            by_k = sd.get("decode_steps_by_k") or {}
            steps = ", ".join(f"k={k}: {n:g}" for k, n in sorted(by_k.items(), key=lambda kv: -int(kv[0])))
            lines.append(f"| {run['mode']} | {lv['concurrency']} | {lv['num_requests']} | {tok_s} "
                         f"| {speedup} | {_fmt(lv['ttft_median_s'], 3)} "
                         f"| {_fmt(lv['ttft_p99_s'], 3)} | {_fmt(lv['tpot_median_ms'], 1)} "
                         f"| {_fmt(lv['tpot_p99_ms'], 1)} | {_fmt(sd.get('acceptance_rate'))} "
                         f"| {_fmt(sd.get('mean_acceptance_length'))} | {steps or '-'} |")
    a = result.get("agreement")
    if a:
        lines += ["", f"greedy texts of spec identical to none on {a['identical']}/{a['total']} requests"
                  + (" (differences: " + ", ".join(f"{d['request']} at char {d['first_diff_char']}"
                                                  for d in a["differences"][:10]) + ")" if a["differences"] else "")]
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """PNG: output tokens/s, median TPOT and the speedup over ``none`` vs concurrency, one line per
    mode (log2 x), each round as a dot;
    returns a note instead when matplotlib is missing."""
    plt, note = load_pyplot(path)
    if plt is None:
        return note
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 3.8))
    for run in result["runs"]:
        cs = [lv["concurrency"] for lv in run["levels"]]
        line, = ax1.plot(cs, [lv["output_tok_s"] for lv in run["levels"]], marker="o", label=run["mode"])
        ax2.plot(cs, [lv["tpot_median_ms"] for lv in run["levels"]], marker="o", label=run["mode"])
        if run["mode"] != "none" and any(lv.get("speedup_vs_none") for lv in run["levels"]):
            ax3.plot(cs, [lv.get("speedup_vs_none") for lv in run["levels"]], marker="o",
                     color=line.get_color(), label=f"{run['mode']} / none")
        for lv in run["levels"]:  # each round as a faint dot around the median
            for ax, ys in ((ax1, [r["output_tok_s"] for r in lv.get("rounds", [])]),
                           (ax3, lv.get("round_speedups", []))):
                ax.scatter([lv["concurrency"]] * len(ys), ys, s=12, color=line.get_color(), alpha=0.4)
    ax3.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
    cfg = result["config"]
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "median TPOT (ms)"), (ax3, "output tok/s ratio")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(cfg["concurrency"])
        ax.set_xticklabels([str(c) for c in cfg["concurrency"]])
        if ax is not ax3:
            ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    quant = f" {cfg['quantization']}" if cfg.get("quantization") else ""
    ax1.set_title(f"{cfg['model']}{quant}, {cfg['max_tokens']} tokens/request")
    ax2.set_title("time per output token")
    ax3.set_title("speedup vs none (dots: paired rounds)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------- main

def _sigterm_as_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_serve_bench(args: argparse.Namespace) -> int:
    """Run the benchmark the flags describe; prints the table, writes --json/--plot. Returns the exit code."""
    from specserve.benchmarks.machine import machine_info
    from specserve.training.corpus import humaneval_prompts

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
