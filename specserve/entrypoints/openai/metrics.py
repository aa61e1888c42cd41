"""Prometheus metrics of the server (``GET /metrics``), on a registry of its own.

Names follow vLLM's with a ``specserve_`` prefix. Times are seconds. Updated on the engine's loop
thread (prometheus_client is thread-safe).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.metrics import StepStats
from specserve.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class ServerMetrics:
    """Args:
        num_speculative_tokens: the configured k (sets the acceptance-length buckets 1 .. k+1); 0
            when speculation is off.
    """

    def __init__(self, num_speculative_tokens: int = 0):
        self.registry = r = CollectorRegistry()
        self.num_requests_running = Gauge("specserve_num_requests_running",
                                          "Sequences in the running batch", registry=r)
        self.num_requests_waiting = Gauge("specserve_num_requests_waiting",
                                          "Sequences waiting to be scheduled", registry=r)
        self.kv_cache_usage = Gauge("specserve_kv_cache_usage_perc",
                                    "Fraction of KV cache pages in use (0-1)", registry=r)
        self.num_preemptions = Counter("specserve_num_preemptions", "Sequences preempted", registry=r)
        self.connections_dropped = Counter("specserve_connections_dropped", "Connections dropped for a slow or "
                                           "silent client (head_timeout, body_timeout)", ["reason"], registry=r)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("specserve_time_per_output_token_seconds",
                              "Time per output token after the first, per request", buckets=_TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.prefix_cache_hit_tokens = Counter("specserve_prefix_cache_hit_tokens",
                                               "Prompt tokens of finished requests found in the prefix cache",
                                               registry=r)
        self.generation_tokens = Counter("specserve_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.request_success = Counter("specserve_request_success", "Finished requests",
                                       ["finished_reason"], registry=r)
        self.num_draft_tokens = Counter("specserve_spec_decode_num_draft_tokens", "Draft tokens proposed",
                                        registry=r)
        self.num_accepted_tokens = Counter("specserve_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by verification", registry=r)
        k = max(num_speculative_tokens, 1)
        self.acceptance_length = Histogram(
            "specserve_spec_decode_acceptance_length",
            "Tokens emitted per sequence per verify step (accepted drafts + 1)",
            buckets=tuple(float(i) for i in range(1, k + 2)), registry=r)
        self.decode_steps = Counter("specserve_spec_decode_steps",
                                    "Decode-only steps by the number of draft tokens chosen (0 = off)",
                                    ["num_speculative_tokens"], registry=r)

    def connection_dropped(self, reason: str) -> None:
        """A client that did not send its request's head or body in time (any thread)."""
        self.connections_dropped.labels(reason).inc()

    def set_gauges(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Requests running / waiting and the KV pool's used share, as they are now."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_cache_usage.set(kv_cache_usage)

    def on_step(self, stats: StepStats) -> None:
        self.set_gauges(stats.num_running, stats.num_waiting, stats.kv_cache_usage)
        if stats.num_preempted:
            self.num_preemptions.inc(stats.num_preempted)
        if stats.num_speculative_tokens is not None:
            self.decode_steps.labels(str(stats.num_speculative_tokens)).inc()
        for num_draft, num_accepted in stats.acceptance:
            self.num_draft_tokens.inc(num_draft)
            self.num_accepted_tokens.inc(num_accepted)
            self.acceptance_length.observe(num_accepted + 1)

    def on_finished(self, out: RequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.prefix_cache_hit_tokens.inc(out.num_cached_tokens)
        num_out = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.inc(num_out)
        for c in out.outputs:
            self.request_success.labels(c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            longest = max(len(c.token_ids) for c in out.outputs)
            if m.first_token_time is not None and longest > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
