"""The client ``specserve bench-serve`` loads a server with: streamed ``POST /v1/completions``
requests, at most c in flight (an asyncio semaphore), each timed on the client clock
(``time.perf_counter``); and the server's ``/metrics`` and ``/v1/models``."""
from __future__ import annotations

import asyncio
import json
import sys
import time

from specserve.benchmarks.serve_bench_stats import parse_prometheus


class ServerError(RuntimeError):
    """The server did not start, died, or answered a request with an error."""


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


async def run_level(base_url: str, model: str, prompts: list[str], n: int, concurrency: int,
                    max_tokens: int, desc: str) -> tuple[list[dict], float]:
    """``n`` requests, request i with prompt ``i % len(prompts)``, at most ``concurrency`` in flight;
    the per-request records (in request order) and the wall time (first sent -> last finished)."""
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


def http_get(base_url: str, path: str, timeout: float = 10.0):
    """``GET base_url + path``, ignoring proxy settings of the environment."""
    import httpx

    return httpx.get(base_url + path, timeout=timeout, trust_env=False)


def scrape_metrics(base_url: str) -> dict[str, float] | None:
    """The server's /metrics, parsed; None when it has none."""
    import httpx

    try:
        r = http_get(base_url, "/metrics")
    except httpx.HTTPError:
        return None
    return parse_prometheus(r.text) if r.status_code == 200 else None


def served_model(base_url: str, fallback: str) -> str:
    """The first model id of /v1/models (the name requests must use), else ``fallback``."""
    import httpx

    try:
        data = http_get(base_url, "/v1/models").json().get("data") or []
        return data[0]["id"] if data else fallback
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return fallback
