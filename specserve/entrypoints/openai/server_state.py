"""What the server's routes share: the running engine, the front end's tokenizer and its thread, the
served model's name, the limits and the metrics."""
from __future__ import annotations

import asyncio
import copy
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from specserve.entrypoints.async_engine import AsyncLLMEngine
from specserve.entrypoints.openai.connections import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEAD_TIMEOUT_S
from specserve.entrypoints.openai.metrics import ServerMetrics

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    served_model_name: str
    max_queue_len: int
    metrics: ServerMetrics
    tokenizer: Any = None
    created: int = field(default_factory=lambda: int(time.time()))
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_key: str | None = None          # required on /v1/* (None: no key)
    protect_metrics: bool = False       # the key on /metrics too
    allowed_origins: list[str] = field(default_factory=list)   # CORS (none: closed)
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S   # a request's head must arrive within this
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S   # and then its body
    max_connections: int = 1024                      # beyond: 503 (uvicorn's limit_concurrency)
    shutdown_timeout_s: float = 30.0                 # in-flight requests' time to finish at shutdown
    draining: bool = False                           # shutting down: new requests get 503

    def __post_init__(self) -> None:
        if self.tokenizer is None:  # the front end's own copy: HF tokenizers are not thread-safe
            self.tokenizer = copy.deepcopy(self.engine.engine.tokenizer)
        # prompts are tokenized and checked here, one at a time, off the event loop
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-tokenize")

    def close(self) -> None:
        """Stop the engine (and its workers) and the tokenizing thread."""
        self.engine.shutdown()
        self.prep.shutdown(wait=False)

    async def prepare(self, fn, *args):
        """Run ``fn(*args)`` (tokenization and validation) on the front end's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len


def make_server_state(engine, served_model_name: str, max_queue_len: int = 256,
                      max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, **access) -> ServerState:
    """Wrap an :class:`LLMEngine` for serving and start its loop thread. ``access``: ``api_key``,
    ``protect_metrics``, ``allowed_origins``, ``head_timeout_s``, ``body_timeout_s``,
    ``max_connections``, ``shutdown_timeout_s`` (:class:`ServerState`'s fields)."""
    metrics = ServerMetrics(engine.num_speculative_tokens)
    async_engine = AsyncLLMEngine(engine, on_step=metrics.on_step, on_finished=metrics.on_finished,
                                  on_gauges=metrics.set_gauges)
    async_engine.start()
    return ServerState(async_engine, served_model_name, max_queue_len, metrics, max_request_bytes=max_request_bytes,
                       **access)
