"""From what a caller sends to the engine's requests: tokenization, validation, one
:class:`~specserve.engine.request.Request` per completion (its generator, its grammar state).

Every check runs before anything is queued, so a bad request is refused whole with an error that
names the bad value and never reaches the scheduler.
"""
from __future__ import annotations

import time
from typing import Iterator

from specserve.config import ModelConfig
from specserve.engine.request import Request
from specserve.sample.sampler import make_generator
from specserve.sampling_params import SamplingParams
from specserve.structured_output import GrammarCompiler


class InputProcessor:
    """Args:
        tokenizer: a transformers tokenizer.
        config: the target's shape (vocabulary size, EOS ids).
        max_model_len: the longest sequence the engine serves (prompt + output).
    """

    def __init__(self, tokenizer, config: ModelConfig, max_model_len: int):
        self.tokenizer, self.config, self.max_model_len = tokenizer, config, max_model_len
        self.grammar_compiler = GrammarCompiler(tokenizer, config.vocab_size, config.eos_token_ids)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check one request; returns its prompt token ids.

        Raises:
            ValueError: empty prompt, token id (or stop token id) outside the vocabulary, prompt too long for
                max_model_len, params that are not ``SamplingParams``, or an invalid schema, regex
                or grammar in ``structured_outputs``; the message names the value.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty: give at least one character or token id")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError(f"prompt {prompt!r} has no tokens")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        over = [t for t in params.stop_token_ids or () if t >= vocab]
        if over:
            raise ValueError(f"stop_token_ids entry {over[0]} is outside the vocabulary [0, {vocab}): it could "
                             f"never be sampled")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be <= the vocabulary size {vocab}, got {k}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"it must be shorter to leave room for output")
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)   # cached: make_requests reuses it
        return ids

    def make_requests(self, request_id: str, prompt: str | list[int], prompt_token_ids: list[int],
                      params: SamplingParams, seq_ids: Iterator[int]) -> list[Request]:
        """The ``params.n`` sequences of a validated request (completion i seeded ``seed + i``),
        each with the next id of ``seq_ids``."""
        text = prompt if isinstance(prompt, str) else None
        now = time.perf_counter()
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Request(request_id, next(seq_ids), prompt_token_ids, params, make_generator(seed),
                          self.config.eos_token_ids, index=i, prompt=text, arrival_time=now)
            if params.structured_outputs is not None:
                seq.grammar = self.grammar_compiler.new_state(params.structured_outputs)
            seqs.append(seq)
        return seqs
