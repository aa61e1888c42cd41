"""vLLM-shaped results of ``LLM.generate`` and of each engine step."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.metrics import SpecDecodeStats


@dataclass
class Logprob:
    """Log-probability (natural log, raw model distribution) of one token, with its rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    ``finish_reason`` is ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (max_tokens or
    the model's maximum length), ``"abort"`` or None while running. ``stop_reason`` is the stop
    string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings in seconds (``time.perf_counter`` clock) of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    spec_decode: "SpecDecodeStats | None" = None  # draft/accepted tokens of speculative steps

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # one {token id: Logprob} per prompt token (None for the first), with SamplingParams.prompt_logprobs
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    extra: dict = field(default_factory=dict)
