"""One sequence being generated: its tokens, its progress through the model and its finish state."""
from __future__ import annotations

import enum
import time

import torch

from specserve.metrics import SpecDecodeStats
from specserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """A sequence (one of the ``n`` completions of a prompt).

    ``num_computed_tokens`` counts the tokens whose keys/values are in the paged cache. Each step the
    scheduler lets it catch up with ``num_tokens`` (prompt + output): a whole or chunked prefill, one
    decode token, or after preemption a recompute of everything. Pages are addressed by ``seq_id``.
    """

    def __init__(self, request_id: str, seq_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator | None, eos_token_ids: list[int], index: int = 0,
                 prompt: str | None = None, arrival_time: float | None = None):
        self.request_id = request_id
        self.seq_id = seq_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.token_ids: list[int] = list(prompt_token_ids)   # prompt + output, grown in place
        self.params = params
        self.generator = generator
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids or [])
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0   # prompt tokens found in the prefix cache at admission
        self.num_draft_cached_tokens = 0   # of those at the last admission, with the draft's entries too
        # prompt_logprobs: entry i for prompt token i (None for the first, which nothing predicts);
        # such a request computes every prompt position, so it skips the prefix cache
        self.prompt_logprobs: list[dict | None] | None = [None] if params.prompt_logprobs is not None else None
        self.skip_prefix_cache = params.prompt_logprobs is not None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text = ""           # detokenized output, cut at a stop string
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_preemptions = 0
        self.spec_stats = SpecDecodeStats()
        # structured output: the grammar's state at the committed output (the engine sets it)
        self.grammar = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output (the request's own list: read it, do not change it)."""
        return self.token_ids

    def append_output(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.perf_counter()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, {self.status.name})")
