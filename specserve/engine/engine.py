"""The engine: one step loop of schedule -> execute -> commit.

``LLMEngine.step()`` asks the scheduler for a batch and turns it into one
:class:`~specserve.worker.step.StepBatch`; the worker (the target worker, or the speculative worker
around it) executes it and returns one :class:`~specserve.worker.step.StepResult`, which the
engine commits in one place: tokens, detokenization, stop rules, progress in the KV cache, pages,
statistics. The engine knows no speculation method: that is the worker's business.
"""
from __future__ import annotations

import itertools
import logging
import time
import weakref

import torch

from specserve.config import DEFAULT_MODEL, DTYPES, EngineArgs, SchedulerConfig, resolve_kv_cache_dtype
from specserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from specserve.engine.request import Request
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache.block_manager import BlockManager
from specserve.kv_cache.kv_cache import KVCache
from specserve.metrics import SpecDecodeStats, StepStats
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import LoadedModel, load_model
from specserve.models.quantization import to_device
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.sample.sampler import make_generator
from specserve.sampling_params import SamplingParams
from specserve.structured_output import GrammarCompiler
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step import LogprobEntry, StepResult
from specserve.worker.target_worker import TargetWorker

logger = logging.getLogger(__name__)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}
__all__ = ["DEFAULT_MODEL", "EngineArgs", "LLMEngine"]


def logprob_dict(token: int, logprob: float, top: dict[int, float]) -> dict[int, Logprob]:
    """One position's ``{token id: Logprob}``: the top tokens with their ranks (1 = most likely),
    and ``token`` (the chosen or given one) with its logprob, ranked only if it is among them."""
    entry = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(top.items())}
    entry.setdefault(token, Logprob(logprob))
    return entry


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
        self.args = args
        self.tp = None   # the tensor-parallel ranks (specserve.distributed), when tensor_parallel_size > 1
        if args.tensor_parallel_size > 1:
            from specserve.distributed.launcher import TensorParallelLauncher

            self.tp = TensorParallelLauncher(args.tensor_parallel_size, args.device, args.distributed_timeout_s)
            # the workers stop when the engine is collected, at exit, or at shutdown(), whichever is first
            weakref.finalize(self, self.tp.shutdown)
        try:
            self._build(args, loaded, loaded_draft)
        except BaseException:   # a failed constructor leaves no worker behind
            self.shutdown()
            raise

    def _build(self, args: EngineArgs, loaded: LoadedModel | None, loaded_draft: LoadedModel | None) -> None:
        dtype = TORCH_DTYPES[args.dtype]
        kv_dtype = TORCH_DTYPES[resolve_kv_cache_dtype(args.kv_cache_dtype, args.dtype, args.device)]
        torch.manual_seed(args.seed)
        loaded = loaded if loaded is not None else load_model(args.model, dtype=dtype, quantization=args.quantization)
        self.load_stats = loaded.load_stats
        self.model_config = cfg = loaded.config
        self.tokenizer = loaded.tokenizer
        self.grammar_compiler = GrammarCompiler(loaded.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
        shards = None
        kv_heads = cfg.num_key_value_heads
        if self.tp is not None:   # checked before anything starts
            from specserve.distributed.sharding import plan_shard

            shards = [plan_shard(cfg, r, self.tp.world_size, args.quantization != "none")
                      for r in range(self.tp.world_size)]
            kv_heads = max(s.num_kv_heads for s in shards)
        # under tensor parallelism the full weights stay on the host: each rank moves its shard
        weights = to_device(loaded.weights, args.device if self.tp is None else "cpu", dtype)
        max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if args.num_blocks is None:
            # the memory budget, but never more pages than max_num_seqs full-length sequences use
            by_memory = KVCache.num_blocks_for_memory(int(args.kv_cache_memory_gb * 2**30), cfg.num_hidden_layers,
                                                      args.block_size, kv_heads, cfg.head_dim, kv_dtype)
            by_use = args.max_num_seqs * -(-max_len // args.block_size)
            num_blocks = max(1, min(by_memory, by_use))
        else:
            num_blocks = args.num_blocks
        # A lone request must always fit in the pool, or preemption could never make room for it.
        self.max_model_len = min(max_len, num_blocks * args.block_size)
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens,
                                                self.max_model_len)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        if self.tp is None:
            self.model = LlamaForCausalLM(cfg, weights, args.quantization).eval()
            self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, args.block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, kv_dtype, args.device)
            runner = ModelRunner(self.model, self.kv_cache)
        else:
            self.model, self.kv_cache, runner = self._start_tensor_parallel(weights, shards, num_blocks, dtype, kv_dtype)
            weights = to_device({k: weights[k] for k in ("model.embed_tokens.weight", "lm_head.weight") if k in weights},
                                args.device, dtype)   # what a draft head shares with the target
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.target_worker = TargetWorker(runner)
        self.spec_config = args.speculative_config
        self.worker = self.target_worker
        if self.spec_config is not None:
            from specserve.spec_decode import TargetInfo, build_proposer
            from specserve.spec_decode.worker import SpeculativeWorker

            # a head shares the target's [V, H] embedding and lm_head (the latter dequantized by
            # the head's builder if quantized); nothing keeps them once the proposer is built
            target = TargetInfo(cfg, self.tokenizer, dtype, args.device, args.quantization, num_blocks,
                                args.block_size, weights["model.embed_tokens.weight"],
                                weights.get("lm_head.weight", weights["model.embed_tokens.weight"]), kv_dtype)
            proposer = build_proposer(self.spec_config, target, loaded_draft)
            self.model.aux_hidden_state_layers = proposer.aux_hidden_state_layers
            self.worker = SpeculativeWorker(self.target_worker, proposer, self.spec_config)
            if self.tp is not None:   # the draft lives on the leader: it drafts with the workers' cores too
                self.worker.draft_context = self.tp.leader_alone
        self.block_manager.lookahead = self.worker.kv_lookahead
        self.block_manager.require_draft_valid = self.worker.prefix_needs_draft
        self.spec_stats = SpecDecodeStats()
        # called with (requests, StepResult) for every step before it is committed (hidden-state capture)
        self.step_observers: list = []
        self.requests: dict[str, list[Request]] = {}
        self.last_step_stats: StepStats | None = None
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()

    def _start_tensor_parallel(self, weights: dict, shards: list, num_blocks: int, dtype: torch.dtype,
                               kv_dtype: torch.dtype):
        """Start (or, under torchrun, join) the ranks and build this rank's shard. Rank 0 returns its
        model, KV cache and :class:`~specserve.distributed.runner.TensorParallelRunner`; any other
        rank serves rank 0 until it shuts down and then ends the process (``SystemExit(0)``)."""
        from specserve.distributed.launcher import STARTUP_TIMEOUT_S, build_rank
        from specserve.distributed.runner import TensorParallelRunner, run_worker
        from specserve.distributed.sharding import shard_weights

        tp, args, cfg = self.tp, self.args, self.model_config
        common = dict(config=cfg, quantization=args.quantization, num_blocks=num_blocks, block_size=args.block_size,
                      dtype=dtype, kv_dtype=kv_dtype)
        builds = None
        if not tp.external:   # spawned workers get their shards through shared memory
            builds = {r: dict(common, weights=shard_weights(cfg, weights, shards[r]), shard=shards[r],
                              device=args.device) for r in range(1, tp.world_size)}
        group = tp.start(builds)
        builds = None
        model, kv_cache = build_rank(group, weights=shard_weights(cfg, weights, shards[tp.rank]), shard=shards[tp.rank],
                                     device=group.device, **common)
        group.ready(STARTUP_TIMEOUT_S)
        if not tp.is_leader:
            try:
                run_worker(model, kv_cache, group)
            finally:
                tp.shutdown()
            raise SystemExit(0)
        tp.runner = TensorParallelRunner(model, kv_cache, group)
        return model, kv_cache, tp.runner

    def shutdown(self, polite: bool = True) -> None:
        """Stop the tensor-parallel workers (nothing to do without them). Idempotent.

        ``polite=False``: kill them without a message (another thread may still be in a step)."""
        if self.tp is not None:
            self.tp.shutdown(polite)

    def health(self) -> str | None:
        """What stops the engine from serving (a lost tensor-parallel rank), or None. Any thread."""
        err = self.tp.problem() if self.tp is not None else None
        return None if err is None else str(err)

    def keepalive(self, idle_s: float = 600.0) -> None:
        """Called while idle: ping the workers when nothing was sent for ``idle_s`` seconds, so their
        wait for the next step never times out."""
        runner = self.tp.runner if self.tp is not None else None
        if runner is not None and time.monotonic() - runner.channel.last_sent > idle_s:
            self.tp.check()
            runner.keepalive()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check one request before it enters the engine; returns its prompt token ids.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt too long for
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
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be <= the vocabulary size {vocab}, got {k}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"it must be shorter to leave room for output")
        if params.structured_outputs is not None:
            self.grammar_compiler.compile(params.structured_outputs)   # cached: add_request reuses it
        return ids

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
        text = prompt if isinstance(prompt, str) else None
        now = time.perf_counter()
        seqs = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Request(request_id, next(self._seq_ids), ids, params, make_generator(seed),
                          self.model_config.eos_token_ids, index=i, prompt=text, arrival_time=now)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
            if params.structured_outputs is not None:
                seq.grammar = self.grammar_compiler.new_state(params.structured_outputs)
            seqs.append(seq)
        self.requests[request_id] = seqs
        for s in seqs:
            self.scheduler.add(s)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request at any moment and give back all its pages. Unknown ids are ignored."""
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ------------------------------------------------------------------ step
    @property
    def proposer(self):
        """The speculation method's proposer (None without speculation)."""
        return getattr(self.worker, "proposer", None)

    @property
    def spec_controller(self):
        """The adaptive-k controller (None without speculation or with ``adaptive=False``)."""
        return getattr(self.worker, "controller", None)

    @property
    def runner(self):
        """The target's :class:`~specserve.worker.model_runner.ModelRunner` (offline uses: hidden-state
        precomputation, teacher forcing)."""
        return self.target_worker.runner

    @property
    def num_speculative_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens if self.spec_config is not None else 0

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that advanced.

        schedule (with room for the worker's lookahead: drafts and the bonus token) -> one
        :class:`StepBatch` -> ``worker.execute`` -> :meth:`_commit` of its :class:`StepResult`.
        """
        sched = self.scheduler.schedule(num_lookahead_tokens=self.worker.num_lookahead_tokens())
        if sched.preempted:
            self.worker.free([r.seq_id for r in sched.preempted])
        for req in sched.cached:
            self.worker.adopt_cached_prefix(req.seq_id, req.num_computed_tokens, req.num_draft_cached_tokens)
        if not sched.scheduled:
            self.last_step_stats = None
            return []
        if self.tp is not None:
            self.tp.check()     # a lost rank fails the step here, with its exit code
        t0 = time.perf_counter()
        reqs = [s.request for s in sched.scheduled]
        result = self.worker.execute(self.scheduler.step_batch(sched))
        advanced = self._commit(reqs, result)
        self.last_step_stats = StepStats(
            len(reqs), len(self.scheduler.running), len(self.scheduler.waiting), len(sched.preempted),
            self.block_manager.usage, result.num_speculative_tokens, result.acceptance, time.perf_counter() - t0)
        return self._outputs({r.request_id for r in advanced})

    # ------------------------------------------------------------------ commit
    def _commit(self, reqs: list[Request], result: StepResult) -> list[Request]:
        """Apply one step's result, the only place the engine's state changes after a step:
        progress in the KV cache, new tokens with their stop rules, the pages a verification
        reserved but did not use, statistics. Returns the requests that got tokens."""
        for observe in self.step_observers:
            observe(reqs, result)
        advanced = []
        for b, req in enumerate(reqs):
            req.num_computed_tokens += result.num_computed_tokens[b]
            if result.verified:
                drafted, accepted = result.num_draft_tokens[b], result.num_accepted_tokens[b]
                req.spec_stats.observe(drafted, accepted)
                self.spec_stats.observe(drafted, accepted)
            if result.prompt_logprobs is not None and result.prompt_logprobs[b] is not None:
                first, entries = result.prompt_logprobs[b]
                for i, (lp, top) in enumerate(entries, start=first):
                    if i == len(req.prompt_logprobs):   # a recompute after preemption scores them again
                        req.prompt_logprobs.append(logprob_dict(req.prompt_token_ids[i], lp, top))
            tokens = result.new_token_ids[b]
            if tokens and req.params.max_tokens == 0:   # the prompt alone was asked for
                self._finish(req, "length")
                req.text = ""
                advanced.append(req)
                continue
            logprobs = result.logprobs[b] if result.logprobs is not None else None
            for j, token in enumerate(tokens):
                if self.append_token(req, token, logprobs[j] if logprobs is not None else None):
                    break
            if not req.is_finished:
                if result.verified:
                    self.block_manager.truncate(req.seq_id, req.num_tokens)   # roll rejected slots back
                self._cache_pages(req)
            if tokens:
                advanced.append(req)
        if result.verified:
            self.spec_stats.draft_time_s += result.draft_time_s
            self.spec_stats.verify_time_s += result.verify_time_s
            self.spec_stats.num_sync_free_steps += int(result.sync_free)
        return advanced

    def append_token(self, req: Request, token: int, logprob: LogprobEntry | None = None) -> bool:
        """Commit one sampled token to ``req`` and apply every stop rule. Returns True if it finished.

        Finish rules, in order: a stop token id or EOS (the token is kept in ``token_ids``, its text
        is not), a completed stop string (text cut before it), ``max_tokens``, ``max_model_len``.
        Detokenization and the stop-string search are incremental: their cost per token does not
        grow with the output.
        """
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.append_output(token)
        if logprob is not None and req.logprobs is not None:
            lp, top = logprob
            req.logprobs.append(logprob_dict(token, lp, top))
            req.cumulative_logprob += lp
        params = req.params
        detok = req.detokenizer
        if req.grammar is not None and not req.grammar.is_eos(token) and not req.grammar.accept(token):
            # every sampled row was masked by this state: llguidance hit a limit it checks only
            # while consuming (a regex repeat too large to expand, say); the request ends with the
            # reason, which the server reports as an error
            reason = req.grammar.error or f"the grammar refused token {token}"
            logger.warning("request %s: the output constraint failed at output token %d: %s", req.request_id,
                           len(req.output_token_ids), reason)
            req.text = detok.final_text()
            self._finish(req, "abort", f"output constraint failed: {reason}")
            return True
        if token in req.stop_token_ids or token in req.eos_token_ids:
            if params.include_stop_str_in_output and token in req.stop_token_ids:
                detok.add(token)
            req.text = detok.final_text()
            self._finish(req, "stop", token if token in req.stop_token_ids else None)
            return True
        prev_len = len(detok.text)
        detok.add(token)
        req.text = detok.text
        if params.stop:
            hit = find_stop_string(req.text, params.stop, prev_len)
            if hit is not None:
                idx, stop = hit
                req.text = req.text[:idx + len(stop)] if params.include_stop_str_in_output else req.text[:idx]
                self._finish(req, "stop", stop)
                return True
        if params.max_tokens is not None and len(req.output_token_ids) >= params.max_tokens:
            self._finish(req, "length")
        elif req.num_tokens >= self.max_model_len:
            self._finish(req, "length")
        if req.is_finished:
            req.text = detok.final_text()
        return req.is_finished

    def _cache_pages(self, req: Request) -> None:
        """Register the request's full pages that the target's entries now cover, draft-valid
        where the proposer's do too (prefix caching)."""
        bm = self.block_manager
        if bm.enable_prefix_caching and not req.skip_prefix_cache and bm.has_seq(req.seq_id):
            bm.cache_full_pages(req.seq_id, req.token_ids, req.num_computed_tokens,
                                self.worker.num_valid_draft_tokens(req.seq_id, req.num_computed_tokens))

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``); returns the pages unregistered."""
        return self.block_manager.reset_prefix_cache()

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self._cache_pages(req)   # what it computed stays reusable after its pages are released
        self.scheduler.finish(req)
        req.finish(reason, stop_reason)
        self.worker.free([req.seq_id])

    # ------------------------------------------------------------------ outputs
    def _outputs(self, request_ids: set[str]) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            seqs = self.requests.get(rid)
            if not seqs:
                continue
            out = self.make_output(seqs)
            if out.finished:
                del self.requests[rid]
            outs.append(out)
        return outs

    @staticmethod
    def make_output(seqs: list[Request]) -> RequestOutput:
        first = seqs[0]
        completions = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.output_token_ids),
            cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in seqs]
        finished = all(s.is_finished for s in seqs)
        first_token = min((s.first_token_time for s in seqs if s.first_token_time is not None), default=None)
        metrics = RequestMetrics(first.arrival_time, first_token,
                                 max((s.finished_time or 0.0) for s in seqs) if finished else None,
                                 spec_decode=first.spec_stats if len(seqs) == 1 else None)
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids, completions,
                             finished, metrics, num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=first.prompt_logprobs)
