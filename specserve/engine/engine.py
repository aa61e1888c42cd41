"""The engine: one step loop of schedule -> execute -> update -> outputs.

``LLMEngine.step()`` asks the :class:`~specserve.engine.scheduler.Scheduler` for a batch, which it
hands to the worker as one :class:`~specserve.worker.step.StepBatch`; the worker (the target
worker, or the speculative worker around it: :class:`~specserve.worker.base.Worker`) returns one
:class:`~specserve.worker.step.StepResult`. The scheduler applies it (tokens, pages, finishing) and
the :class:`~specserve.engine.output_processor.OutputProcessor` turns it into text and outputs.
The engine knows no speculation method and no parallelism: the worker and the
:class:`~specserve.worker.target.Target` handle do.
"""
from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from specserve.config import DEFAULT_MODEL, DTYPES, EngineArgs, SchedulerConfig, resolve_kv_cache_dtype
from specserve.distributed.target import build_target
from specserve.engine.input_processor import InputProcessor
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.engine.scoring import Scores, ScratchSequence, score_segments, scratch_sequences
from specserve.kv_cache.block_manager import BlockManager
from specserve.metrics import SpecDecodeStats, StepStats
from specserve.models.loader import LoadedModel, load_model
from specserve.outputs import RequestOutput
from specserve.sampling_params import SamplingParams
from specserve.worker.base import Worker
from specserve.worker.target_worker import TargetWorker

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
__all__ = ["DEFAULT_MODEL", "EngineArgs", "LLMEngine"]


class LLMEngine:
    """Continuous-batching generation engine over one target model.

    Args:
        args: engine arguments.
        loaded: an already loaded target (skips :func:`load_model`; tests build tiny ones).
        loaded_draft: an already loaded draft model for ``speculative_config``.
    Raises:
        ValueError / ModelNotFoundError: for a bad model name or argument, naming the value; a
            draft whose tokenizer differs from the target's.
    """

    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None,
                 loaded_draft: LoadedModel | None = None):
        self.args, self.spec_config = args, args.speculative_config
        dtype = TORCH_DTYPES[args.dtype]
        kv_dtype = TORCH_DTYPES[resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, args.device)]
        torch.manual_seed(args.seed)
        loaded = loaded if loaded is not None else load_model(args.model, dtype=dtype, quantization=args.quantization)
        self.load_stats, self.model_config, self.tokenizer = loaded.load_stats, loaded.config, loaded.tokenizer
        self.target = build_target(args, loaded, dtype, kv_dtype)
        try:
            self.worker: Worker = self._build_worker(loaded_draft, dtype, kv_dtype)
        except BaseException:   # a failed constructor leaves no worker rank behind
            self.target.shutdown()
            raise
        self.target.shared_weights = None   # a head has taken what it shares
        self.max_model_len = self.target.max_model_len
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len)
        self.grammar_compiler = self.input_processor.grammar_compiler   # the server compiles schemas early
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len)
        self.block_manager = BlockManager(self.target.num_blocks, args.block_size, args.enable_prefix_caching,
                                          self.worker)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish)
        # called with (requests, StepResult) for every step before it is applied (hidden-state capture)
        self.step_observers: list = []
        self.last_step_stats: StepStats | None = None
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()

    def _build_worker(self, loaded_draft: LoadedModel | None, dtype: torch.dtype, kv_dtype: torch.dtype) -> Worker:
        """The target worker, wrapped by the speculative worker when ``speculative_config`` is set."""
        args, target, cfg = self.args, self.target, self.model_config
        worker = TargetWorker(target.runner)
        if self.spec_config is None:
            return worker
        from specserve.spec_decode import TargetInfo, build_proposer
        from specserve.spec_decode.worker import SpeculativeWorker

        shared = target.shared_weights
        embed = shared["model.embed_tokens.weight"]
        info = TargetInfo(cfg, self.tokenizer, dtype, args.device, args.quantization, target.num_blocks,
                          args.block_size, embed, shared.get("lm_head.weight", embed), kv_dtype)
        proposer = build_proposer(self.spec_config, info, loaded_draft)
        target.model.aux_hidden_state_layers = proposer.aux_hidden_state_layers
        return SpeculativeWorker(worker, proposer, self.spec_config, target.draft_context)

    # ------------------------------------------------------------------ life
    def shutdown(self, polite: bool = True) -> None:
        """Stop the target's worker ranks (nothing to do without tensor parallelism). Idempotent.

        ``polite=False``: kill them without a message (another thread may still be in a step)."""
        self.target.shutdown(polite)

    def health(self) -> str | None:
        """What stops the engine from serving (a lost tensor-parallel rank), or None. Any thread."""
        return self.target.health()

    def keepalive(self, idle_s: float = 600.0) -> None:
        """Called while idle: keeps the target's worker ranks waiting for the next step."""
        self.target.keepalive(idle_s)

    # ------------------------------------------------------------------ requests
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check one request before it enters the engine; returns its prompt token ids.

        Raises:
            ValueError: see :meth:`~specserve.engine.input_processor.InputProcessor.validate`.
        """
        return self.input_processor.validate(prompt, params)

    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams,
                    prompt_token_ids: list[int] | None = None) -> str:
        """Queue a request (``params.n`` sequences). Returns its id.

        Raises:
            ValueError: see :meth:`validate`; also a duplicate ``request_id``. Nothing is queued then.
        """
        ids = prompt_token_ids if prompt_token_ids is not None else self.validate(prompt, params)
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = self.input_processor.make_requests(request_id, prompt, ids, params, self._seq_ids)
        self.output_processor.add(request_id, seqs)
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any moment and give back all its pages. Unknown ids are ignored."""
        for seq in self.output_processor.pop(request_id):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def requests(self) -> dict[str, list[Request]]:
        """Request id -> its sequences, for every request not yet returned finished."""
        return self.output_processor.requests

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that got tokens."""
        sched = self.scheduler.schedule(num_lookahead_tokens=self.worker.num_lookahead_tokens())
        self.last_step_stats = None
        if not sched.scheduled:
            return []
        self.target.check()   # a lost tensor-parallel rank fails the step here
        t0, reqs = time.perf_counter(), [s.request for s in sched.scheduled]
        result = self.worker.execute(self.scheduler.step_batch(sched))
        for observe in self.step_observers:
            observe(reqs, result)
        self.scheduler.update_from_output(reqs, result)
        self.last_step_stats = self.scheduler.step_stats(sched, result, time.perf_counter() - t0)
        return self.output_processor.process(reqs, result)

    # ------------------------------------------------------------------ speculation
    @property
    def proposer(self):
        """The speculation method's proposer (None without speculation)."""
        return self.worker.proposer

    @property
    def spec_controller(self):
        """The adaptive-k controller (None without speculation or with ``adaptive=False``)."""
        return self.worker.controller

    @property
    def num_speculative_tokens(self) -> int:
        """k of the next speculative step (the largest k when adaptive; 0 without speculation)."""
        return self.worker.num_speculative_tokens

    def set_num_speculative_tokens(self, k: int) -> None:
        """Draft ``k`` tokens a step from the next step on (benchmarks sweep k on one engine).

        Raises:
            ValueError: ``k`` is not a positive int, or the engine runs without speculation.
        """
        self.worker.set_num_speculative_tokens(k)

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Every verification's drafted and accepted tokens, and the time spent drafting and verifying."""
        return self.scheduler.spec_stats

    def reset_spec_stats(self) -> None:
        self.scheduler.spec_stats = SpecDecodeStats()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``); returns the pages unregistered."""
        return self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ scoring
    def score(self, segments: list[list[int]]) -> Scores:
        """The target's final hidden states of token segments, each from position 0, in one forward
        outside any request (teacher forcing: head training data, quality checks).

        Returns:
            :class:`~specserve.engine.scoring.Scores`: ``hidden_states [sum L, H]`` (wider with
            auxiliary layers), and ``logits(rows)`` of its rows.
        Raises:
            NoFreeBlocksError: the segments do not fit in the free pages.
        """
        return score_segments(self, segments)

    @contextmanager
    def scratch_sequence(self, num_tokens: int, model: str = "target") -> Iterator[ScratchSequence]:
        """A context manager holding pages for ``num_tokens`` tokens outside any request, run
        through the target's (``model="draft"``: the draft model's) runner: measurements.

        Raises:
            ValueError: ``model="draft"`` without a draft model.
        """
        with scratch_sequences(self, [num_tokens], model) as seqs:
            yield seqs[0]

    def compute_logits(self, hidden_states: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``[len(rows), V]`` float32 target logits of rows of ``hidden_states`` (a step's or
        :meth:`score`'s; under tensor parallelism only the last forward's)."""
        return self.target.runner.compute_logits(hidden_states, rows)

    @property
    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """Layers whose entering residual stream the target's forward also returns (EAGLE-3 features)."""
        return self.target.model.aux_hidden_state_layers

    @aux_hidden_state_layers.setter
    def aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.target.model.aux_hidden_state_layers = tuple(layers)

    def new_seq_id(self) -> int:
        """A sequence id no request and no other scratch sequence uses."""
        return next(self._seq_ids)

