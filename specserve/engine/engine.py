"""The engine: one step loop of schedule -> run the model -> sample -> commit.

``LLMEngine.step()`` asks the scheduler for a batch, runs the target over every scheduled token,
samples a token for each request whose prompt is fully computed, detokenizes, applies the stop
rules and frees the pages of finished requests.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from specserve.config import SchedulerConfig, SpeculativeConfig
from specserve.engine.request import Request, sampling_metadata
from specserve.engine.runner import ModelInput, ModelRunner
from specserve.engine.scheduler import Scheduler
from specserve.kv_cache.block_manager import BlockManager
from specserve.kv_cache.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import LoadedModel, load_model
from specserve.models.quantization import check_quantization, to_device
from specserve.metrics import SpecDecodeStats, StepStats
from specserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from specserve.sample.rejection import rejection_sample, rejection_sample_tensors
from specserve.sample.sampler import Sampler, SamplingMetadata, compute_probs, gather_logprobs, make_generator
from specserve.spec_decode.adaptive import AdaptiveSpeculation
from specserve.spec_decode.proposer import Proposer
from specserve.spec_decode.tree import accept_tree, compact_accepted_kv
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineArgs:
    """Everything needed to build an engine (vLLM's argument names).

    ``kv_cache_memory_gb`` sizes the page pool when ``num_blocks`` is not given. ``quantization``
    (vLLM's name): ``"none"`` (float weights), ``"int8"`` or ``"int4"`` (batch-invariant integer
    linears, :mod:`specserve.models.quantization`); the draft's is ``speculative_config``'s
    ``draft_quantization`` (default: the same as the target's).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    max_model_len: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    device: str = "cpu"
    speculative_config: SpeculativeConfig | dict | None = None
    quantization: str = "none"

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        self.quantization = check_quantization(self.quantization)
        if self.quantization != "none":
            if self.dtype != "float32":
                raise ValueError(f"quantization {self.quantization!r} runs float32 activations; "
                                 f"use dtype float32, not {self.dtype!r}")
            if self.device != "cpu":
                raise ValueError(f"quantization {self.quantization!r} has CPU kernels only; "
                                 f"device {self.device!r} has none (use quantization 'none')")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass
class _Verified:
    """One verify step's outcome, per request: ``output_token_ids`` (accepted drafts + the
    recovered or bonus token), ``num_accepted``, ``num_drafted`` (chain: drafts; tree: its depth),
    ``rows``: for each emitted token, the verify row whose distribution it was drawn from (also the
    rows whose target hidden states the proposer keeps); ``hidden_states [rows, H]`` and
    ``logprobs`` of the verify forward; ``draft_end``: clock time drafting ended."""

    output_token_ids: list[list[int]]
    num_accepted: list[int]
    num_drafted: list[int]
    rows: list[list[int]]
    hidden_states: torch.Tensor
    logprobs: object
    draft_end: float


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
        dtype = _DTYPES[args.dtype]
        torch.manual_seed(args.seed)
        loaded = loaded if loaded is not None else load_model(args.model, dtype=dtype, quantization=args.quantization)
        self.load_stats = loaded.load_stats
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        weights = to_device(loaded.weights, args.device, dtype)
        self.model = LlamaForCausalLM(self.model_config, weights, args.quantization).eval()
        # [V, H] tensors for heads that share them (the model's lm_head may be prepacked or
        # quantized: a head dequantizes it when it is built, see spec_decode._load_head)
        self.target_embedding = weights["model.embed_tokens.weight"]
        self.target_lm_head = weights.get("lm_head.weight", self.target_embedding)
        cfg = self.model_config
        max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        if args.num_blocks is None:
            # the memory budget, but never more pages than max_num_seqs full-length sequences use
            by_memory = KVCache.num_blocks_for_memory(int(args.kv_cache_memory_gb * 2**30), cfg.num_hidden_layers,
                                                      args.block_size, cfg.num_key_value_heads, cfg.head_dim, dtype)
            by_use = args.max_num_seqs * -(-max_len // args.block_size)
            num_blocks = max(1, min(by_memory, by_use))
        else:
            num_blocks = args.num_blocks
        # A lone request must always fit in the pool, or preemption could never make room for it.
        self.max_model_len = min(max_len, num_blocks * args.block_size)
        self.scheduler_config = SchedulerConfig(args.max_num_seqs, max(args.max_num_batched_tokens, 1),
                                                self.max_model_len)
        self.block_manager = BlockManager(num_blocks, args.block_size)
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, args.block_size,
                                cfg.num_key_value_heads, cfg.head_dim, dtype, args.device)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager)
        self.sampler = Sampler()
        self.spec_config = args.speculative_config
        self.proposer: Proposer | None = None
        self.spec_stats = SpecDecodeStats()
        self.spec_controller: AdaptiveSpeculation | None = None
        if self.spec_config is not None:
            from specserve.spec_decode import build_proposer
            self.proposer = build_proposer(self, loaded_draft)
            if self.spec_config.adaptive:
                self.spec_controller = AdaptiveSpeculation(self.spec_config.num_speculative_tokens)
        if not self._proposer_reads_hidden:
            self.target_lm_head = None   # only heads need the unpacked copy
        self.requests: dict[str, list[Request]] = {}
        self.last_step_stats: StepStats | None = None
        self._step_acceptance: list[tuple[int, int]] = []
        # seq_id -> request whose draft prefill waits for the controller's estimate at its batch size
        self._draft_deferred: dict[int, Request] = {}
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Check one request before it enters the engine; returns its prompt token ids.

        Raises:
            ValueError: empty prompt, token id outside the vocabulary, prompt too long for
                max_model_len, or params that are not ``SamplingParams``; the message names the value.
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
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: "
                             f"it must be shorter to leave room for output")
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
            seqs.append(Request(request_id, next(self._seq_ids), ids, params, make_generator(seed),
                                self.model_config.eos_token_ids, index=i, prompt=text, arrival_time=now))
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
    def num_speculative_tokens(self) -> int:
        return self.spec_config.num_speculative_tokens if self.proposer is not None else 0

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that advanced.

        Decode-only batches speculate when a proposer is configured, with the k chosen for this
        batch size by :class:`~specserve.spec_decode.adaptive.AdaptiveSpeculation` (0 = a plain
        decode step; the proposer then does no work and catches up when it next speculates).
        Batches with a prefill use ordinary sampling.
        """
        k_max = self.num_speculative_tokens
        # a speculative step writes the newest token, k drafts and (in the draft) the bonus token
        sched = self.scheduler.schedule(
            num_lookahead_tokens=self.proposer.num_lookahead_tokens(k_max) if k_max else 0)
        if self.proposer is not None:
            for req in sched.preempted:
                self.proposer.reset(req)
                self._draft_deferred.pop(req.seq_id, None)
        if not sched.scheduled:
            self.last_step_stats = None
            return []
        t0 = time.perf_counter()
        self._step_acceptance = []
        k = None
        if self.proposer is not None and sched.is_decode_only:
            reqs = [s.request for s in sched.scheduled]
            if self._draft_deferred:
                self._follow_deferred(reqs)
                t0 = time.perf_counter()   # the draft's late prefill is its own cost, not the step's
            eligible = [self._draft_keeps_up(r) for r in reqs]
            if self.spec_controller is not None:
                k = self.spec_controller.choose(len(reqs), all(eligible))
            else:
                k = k_max
            steady = True
            if k > 0 and self._sync_free_ok(reqs, eligible, k):
                advanced, steady = self._sync_free_step(reqs, k)
            elif k > 0:
                advanced, steady = self._speculative_step(reqs, eligible, k)
            else:
                advanced = self._sampling_step(sched)
            if self.spec_controller is not None:
                self.spec_controller.observe_step(len(reqs), k, time.perf_counter() - t0, steady)
        else:
            # a prefill or mixed step: the draft follows a prompt only where speculating on it
            # later is expected to repay the draft's prefill
            follow = []
            if self.proposer is not None:
                for s in sched.scheduled:
                    decision = self._draft_should_follow(s.request)
                    if decision:
                        follow.append(s.request)
                    elif decision is None:
                        self._draft_deferred[s.request.seq_id] = s.request
            t_fwd = time.perf_counter()
            advanced = self._sampling_step(sched)
            if self.spec_controller is not None:
                self.spec_controller.observe_target_prefill(
                    sum(s.num_new_tokens for s in sched.scheduled), time.perf_counter() - t_fwd)
            self._draft_prefill([r for r in follow if not r.is_finished])
        self.last_step_stats = StepStats(
            len(sched.scheduled), len(self.scheduler.running), len(self.scheduler.waiting), len(sched.preempted),
            self.block_manager.usage, k, self._step_acceptance, time.perf_counter() - t0)
        return self._outputs({r.request_id for r in advanced})

    def _sampling_step(self, sched) -> list[Request]:
        """One target forward over every scheduled token; one sampled token per finished prompt."""
        inputs = [ModelInput(s.token_ids, s.context_len, self.block_manager.block_table(s.request.seq_id))
                  for s in sched.scheduled]
        fwd = self.runner.forward(inputs)
        if self._proposer_reads_hidden:
            for s, last in zip(sched.scheduled, fwd.last_rows):
                n = s.num_new_tokens
                self.proposer.observe_target_hidden_states(s.request, s.context_len, fwd.hidden_states[last - n + 1:last + 1])
        sampling = [(s.request, row) for s, row in zip(sched.scheduled, fwd.last_rows) if s.samples]
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        if not sampling:
            return []
        reqs = [r for r, _ in sampling]
        logits = self.runner.compute_logits(fwd.hidden_states, [row for _, row in sampling])
        out = self.sampler(logits, sampling_metadata(reqs, device=self.runner.device))
        tokens = out.sampled_token_ids.tolist()
        for i, req in enumerate(reqs):
            self.append_token(req, tokens[i], self._logprob_entry(out, i, req))
        return reqs

    @property
    def _proposer_reads_hidden(self) -> bool:
        return self.proposer is not None and self.proposer.uses_target_hidden_states

    def _draft_prefill(self, reqs: list[Request]) -> None:
        """The draft catches up over ``reqs``' prompts (and tokens decoded without it); the
        controller learns the cost per token."""
        if not reqs:
            return
        t0 = time.perf_counter()
        before = sum(self.proposer.num_computed_tokens(r) for r in reqs)
        self.proposer.catch_up(reqs)
        if self.spec_controller is not None:
            done = sum(self.proposer.num_computed_tokens(r) for r in reqs) - before
            self.spec_controller.observe_draft_prefill(done, time.perf_counter() - t0)

    def _follow_deferred(self, reqs: list[Request]) -> None:
        """Decide the draft prefills that waited for an estimate at this batch size: the draft
        catches up now over the requests worth following; those not worth it are dropped."""
        follow = []
        for req in reqs:
            if req.seq_id not in self._draft_deferred:
                continue
            decision = self._follow_decision(req, len(reqs))
            if decision is not None:
                del self._draft_deferred[req.seq_id]
                if decision:
                    follow.append(req)
        self._draft_prefill(follow)

    def _draft_should_follow(self, req: Request) -> bool | None:
        """Whether the draft prefills along with ``req`` in this prefill/mixed step: it must not
        have fallen behind, and the controller must expect speculation to repay the prefill
        (always, for a proposer whose catch-up is cheap: a one-layer head). None: decide later,
        in the first decode-only step (``_draft_deferred``): always for a prompt the draft has not
        started, so the draft's prefill never delays the first token and is weighed at the batch
        size the request really decodes in (requests of one wave arrive a step apart), and
        whenever the controller cannot tell yet at this batch size."""
        if req.seq_id in self._draft_deferred:
            return None
        if not self._draft_keeps_up(req):
            return False
        if self.spec_controller is None or self.proposer.cheap_catch_up:
            return True
        if self.proposer.num_computed_tokens(req) == 0:
            return None
        batch_size = min(len(self.scheduler.running) + len(self.scheduler.waiting), self.scheduler.config.max_num_seqs)
        return self._follow_decision(req, batch_size)

    def _follow_decision(self, req: Request, batch_size: int) -> bool | None:
        """The controller's :meth:`~AdaptiveSpeculation.worth_following` for ``req``."""
        remaining = self.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            remaining = min(remaining, req.params.max_tokens - len(req.output_token_ids))
        todo = req.num_tokens - self.proposer.num_computed_tokens(req)
        return self.spec_controller.worth_following(batch_size, remaining, todo)

    def _draft_keeps_up(self, req: Request) -> bool:
        """Whether the proposer is close enough behind ``req``'s computed tokens to catch up in a
        step. A sequence it fell far behind (speculation was off for it a while) is left to decode
        without speculation: catching up would cost a draft prefill."""
        if self.proposer.cheap_catch_up:
            return True
        lag = req.num_computed_tokens - self.proposer.num_computed_tokens(req)
        return lag <= 4 * (self.num_speculative_tokens + 1)

    def _num_draft_tokens(self, req: Request, k: int) -> int:
        """At most k drafts for this request now: never past max_tokens, max_model_len or the draft's reach."""
        k = min(k, self.proposer.max_num_draft_tokens(req),
                self.max_model_len - req.num_tokens)
        if req.params.max_tokens is not None:
            k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        return max(0, k)

    def _speculative_step(self, reqs: list[Request], eligible: list[bool], k: int) -> tuple[list[Request], bool]:
        """catch up -> propose -> verify (one target forward over each sequence's drafts: a chain
        of k or a tree k levels deep) -> accept -> commit. Returns the requests and whether the step
        was steady: the proposer caught up over no more than what the last speculative step left
        (bonus/recovered token + last draft)."""
        t0 = time.perf_counter()
        caught_up = self.proposer.catch_up([r for r, e in zip(reqs, eligible) if e])
        ks = [self._num_draft_tokens(r, k) if e else 0 for r, e in zip(reqs, eligible)]
        # a step timed as k's cost: every sequence could draft and some did, after no more
        # catch-up than usual (a step where only some draft would look cheaper than k costs)
        steady = caught_up <= self.proposer.steady_catch_up(k) and all(eligible) and any(ks)
        verify = self._verify_trees if self.proposer.proposes_trees else self._verify_chains
        v = verify(reqs, ks)
        t2 = time.perf_counter()
        for i, r in enumerate(reqs):
            m = v.num_accepted[i]
            rows = v.rows[i]    # per emitted token, the verify row whose distribution it came from
            if self._proposer_reads_hidden:  # the newest token and the accepted drafts
                self.proposer.observe_target_hidden_states(r, r.num_computed_tokens, v.hidden_states[rows])
            r.num_computed_tokens += 1 + m  # newest token + accepted drafts now have valid KV
            r.spec_stats.observe(v.num_drafted[i], m)
            self.spec_stats.observe(v.num_drafted[i], m)
            for j, token in enumerate(v.output_token_ids[i]):
                entry = self._logprob_entry(v.logprobs, rows[j], r) if v.logprobs is not None else None
                if self.append_token(r, token, entry):
                    break
            if not r.is_finished:
                self.block_manager.truncate(r.seq_id, r.num_tokens)  # roll rejected slots back
            self.proposer.on_verified(r, m)
        self._step_acceptance = [(v.num_drafted[i], v.num_accepted[i]) for i in range(len(reqs))]
        if self.spec_controller is not None:
            # drafts asked for but not found count as rejected: the controller weighs what k yields
            self.spec_controller.observe_acceptance([(ks[i], v.num_accepted[i]) for i in range(len(reqs))])
        self.spec_stats.draft_time_s += v.draft_end - t0
        self.spec_stats.verify_time_s += t2 - v.draft_end
        return reqs, steady

    def _sync_free_ok(self, reqs: list[Request], eligible: list[bool], k: int) -> bool:
        """Whether this decode step can run :meth:`_sync_free_step`: a proposer that supports it,
        every sequence followed, some drafting, none asking for logprobs or penalties (their
        histories would need the drafts on the host)."""
        if not (self.proposer.supports_sync_free and all(eligible)):
            return False
        if any(r.params.logprobs is not None or r.params.has_penalties for r in reqs):
            return False
        return any(self._num_draft_tokens(r, k) > 0 for r in reqs)

    def _sync_free_step(self, reqs: list[Request], k: int) -> tuple[list[Request], bool]:
        """An MTP step whose accepted lengths, next tokens and head refill stay on the device
        (../shared/SEED.md section 9): draft chain -> one target forward over the newest token and
        the drafts -> rejection sampling to tensors -> the head re-runs over every verified row
        with the target's hidden states and the tokens that follow them, its next first-draft
        logits picked by the accepted lengths on the device. The host reads one tensor, the
        accepted lengths and tokens, to commit them (detokenize, stop rules, pages). Returns the
        requests and whether the step was steady (see :meth:`_speculative_step`)."""
        t0 = time.perf_counter()
        prop, device = self.proposer, self.runner.device
        # after a prefill or a plain step the head catches up from the target's features first
        steady = prop.catch_up(reqs) <= prop.steady_catch_up(k)
        ks = [self._num_draft_tokens(r, k) for r in reqs]
        kmax = max(ks)
        if kmax == 0 or not prop.has_carried_logits(reqs):
            return self._speculative_step(reqs, [True] * len(reqs), k)
        md = sampling_metadata(reqs, device=device)
        drafts, draft_probs = prop.draft_chain_tensors(reqs, kmax, md)          # [B, K], [B, K, V]
        draft_end = time.perf_counter()
        newest = torch.tensor([r.all_token_ids[-1] for r in reqs], dtype=torch.int64).to(device)
        ctx = [r.num_computed_tokens for r in reqs]
        qlens = [n + 1 for n in ks]
        # sequence i's verified rows are entries [i, 0 .. ks[i]] of a [B, kmax + 1] block (newest
        # token, then drafts): one gather picks them all, for the inputs and for the next tokens
        flat = torch.tensor([i * (kmax + 1) + j for i, q in enumerate(qlens) for j in range(q)]).to(device)
        ids = torch.cat([newest.unsqueeze(1), drafts], dim=1).view(-1)[flat]
        positions = [p for c, q in zip(ctx, qlens) for p in range(c, c + q)]
        hidden = self.runner.forward_tensors(ids, positions, [self.block_manager.block_table(r.seq_id) for r in reqs],
                                             ctx, qlens)
        logits = self.runner.compute_logits(hidden, list(range(len(positions))))   # [sum(k+1), V]
        probs = compute_probs(logits, sampling_metadata([r for r, q in zip(reqs, qlens) for _ in range(q)],
                                                        device=device))
        starts = [sum(qlens[:i]) for i in range(len(reqs))]
        rows = torch.tensor([[s + min(j, n) for j in range(kmax + 1)] for s, n in zip(starts, ks)])
        target_probs = probs[rows.to(device)]                                   # [B, K + 1, V]
        num_acc, out = rejection_sample_tensors(drafts, ks, draft_probs, target_probs, md.is_greedy, md.generators)
        next_ids = out.reshape(-1)[flat].clamp(min=0)                           # -1 pads rejected rows
        prop.refill_in_step(reqs, hidden, next_ids, qlens, num_acc)
        verified = torch.cat([num_acc.unsqueeze(1), out], dim=1).tolist()      # the step's one host read
        t2 = time.perf_counter()
        for i, r in enumerate(reqs):
            m = verified[i][0]
            first = r.num_computed_tokens
            r.num_computed_tokens += 1 + m
            r.spec_stats.observe(ks[i], m)
            self.spec_stats.observe(ks[i], m)
            for token in verified[i][1:m + 2]:
                if self.append_token(r, token):
                    break
            if not r.is_finished:
                self.block_manager.truncate(r.seq_id, r.num_tokens)
                prop.commit_sync_free(r, first, m)
        self._step_acceptance = [(ks[i], verified[i][0]) for i in range(len(reqs))]
        if self.spec_controller is not None:
            self.spec_controller.observe_acceptance(self._step_acceptance)
        self.spec_stats.draft_time_s += draft_end - t0
        self.spec_stats.verify_time_s += t2 - draft_end
        self.spec_stats.num_sync_free_steps += 1
        return reqs, steady

    def _verify_chains(self, reqs: list[Request], ks: list[int]) -> "_Verified":
        """Draft chains of ``ks[i]`` tokens, verify them in one target forward, accept by
        rejection sampling (:func:`~specserve.sample.rejection.rejection_sample`)."""
        proposal = self.proposer.propose(reqs, ks)
        ks = proposal.num_draft_tokens   # a proposer may find fewer (ngram: no match)
        drafts = proposal.draft_token_ids.tolist()
        draft_end = time.perf_counter()
        inputs = [ModelInput([r.all_token_ids[-1]] + drafts[i][:ks[i]], r.num_computed_tokens,
                             self.block_manager.block_table(r.seq_id)) for i, r in enumerate(reqs)]
        fwd = self.runner.forward(inputs)
        num_rows = sum(k + 1 for k in ks)
        logits = self.runner.compute_logits(fwd.hidden_states, list(range(num_rows)))  # [sum(k+1), V]
        # one sampling row per (request, position): position j sees the drafts before it as output
        row_reqs = [r for i, r in enumerate(reqs) for _ in range(ks[i] + 1)]
        histories = None   # only penalties read the histories
        if any(r.params.has_penalties for r in reqs):
            histories = [r.output_token_ids + drafts[i][:j] for i, r in enumerate(reqs) for j in range(ks[i] + 1)]
        md = sampling_metadata(row_reqs, histories, self.runner.device)
        probs = compute_probs(logits, md)  # [sum(k+1), V]
        kmax = proposal.draft_token_ids.shape[1]
        target_probs = probs.new_zeros(len(reqs), kmax + 1, probs.shape[1])
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k + 1)
        for i, k in enumerate(ks):
            target_probs[i, :k + 1] = probs[starts[i]:starts[i + 1]]
        greedy = torch.tensor([r.params.greedy for r in reqs])
        result = rejection_sample(proposal.draft_token_ids, ks, proposal.draft_probs, target_probs, greedy,
                                  [r.generator for r in reqs])
        rows = [list(range(starts[i], starts[i] + m + 1)) for i, m in enumerate(result.num_accepted)]
        return _Verified(result.output_token_ids, result.num_accepted, list(ks), rows, fwd.hidden_states,
                         self._spec_logprobs(logits, rows, result.output_token_ids, md), draft_end)

    def _verify_trees(self, reqs: list[Request], depths: list[int]) -> "_Verified":
        """Draft trees at most ``depths[i]`` levels deep, verify every node in one target forward
        (tree attention on the draft block, positions root + depth), accept the longest path the
        target agrees with (:func:`~specserve.spec_decode.tree.accept_tree`) and move its KV
        entries to the sequence's next slots."""
        bm = self.block_manager
        tables = [bm.block_table(r.seq_id) for r in reqs]
        # the whole tree must fit the reserved slots (not so only next to max_model_len)
        depths = [d if bm.num_tokens(r.seq_id) >= r.num_tokens + self.proposer.max_tree_nodes else 0
                  for d, r in zip(depths, reqs)]
        trees = self.proposer.propose_trees(reqs, depths)
        draft_end = time.perf_counter()
        inputs = [ModelInput(t.token_ids, r.num_computed_tokens, table, t.positions(r.num_computed_tokens))
                  for t, r, table in zip(trees, reqs, tables)]
        fwd = self.runner.forward(inputs, tree_masks=[t.attention_mask() for t in trees])
        starts = [0]
        for t in trees:
            starts.append(starts[-1] + t.num_nodes)
        logits = self.runner.compute_logits(fwd.hidden_states, list(range(starts[-1])))  # [sum(N+1), V]
        row_reqs = [r for t, r in zip(trees, reqs) for _ in range(t.num_nodes)]
        histories = None   # penalties see the path's drafts as output; nothing else reads histories
        if any(r.params.has_penalties for r in reqs):
            histories = [r.output_token_ids + [t.token_ids[n] for n in t.path(node)]
                         for t, r in zip(trees, reqs) for node in range(t.num_nodes)]
        md = sampling_metadata(row_reqs, histories, self.runner.device)
        probs = compute_probs(logits, md)
        emitted, accepted, drafted, rows = [], [], [], []
        for i, (t, r) in enumerate(zip(trees, reqs)):
            acc = accept_tree(t, probs[starts[i]:starts[i + 1]], r.params.greedy, r.generator)
            ctx = r.num_computed_tokens
            slots = torch.tensor(bm.slot_mapping(r.seq_id, ctx, ctx + t.num_nodes), dtype=torch.int64)
            compact_accepted_kv(self.kv_cache.key_cache, self.kv_cache.value_cache, slots, acc.accepted_nodes)
            emitted.append(acc.output_token_ids)
            accepted.append(len(acc.accepted_nodes))
            drafted.append(max(t.depths))
            rows.append([starts[i]] + [starts[i] + n for n in acc.accepted_nodes])
        return _Verified(emitted, accepted, drafted, rows, fwd.hidden_states,
                         self._spec_logprobs(logits, rows, emitted, md), draft_end)

    @staticmethod
    def _spec_logprobs(logits, rows: list[list[int]], emitted: list[list[int]], md: SamplingMetadata):
        """Logprobs of the emitted tokens (request i's j-th token was drawn at ``logits`` row
        ``rows[i][j]``), indexed like ``logits`` rows; None when no request asked for logprobs."""
        if md.max_num_logprobs <= 0 and not md.return_logprobs:
            return None
        chosen = torch.zeros(logits.shape[0], dtype=torch.int64)
        for r, toks in zip(rows, emitted):
            chosen[torch.tensor(r[:len(toks)], dtype=torch.int64)] = torch.tensor(toks, dtype=torch.int64)
        return gather_logprobs(logits, chosen, md)

    @staticmethod
    def _logprob_entry(out, i: int, req: Request) -> tuple[float, dict[int, float]] | None:
        if req.params.logprobs is None or out.logprobs is None:
            return None
        top: dict[int, float] = {}
        if out.top_logprobs is not None and req.params.logprobs > 0:
            ids, vals = out.top_logprobs
            k = req.params.logprobs
            top = dict(zip(ids[i, :k].tolist(), vals[i, :k].tolist()))
        return float(out.logprobs[i]), top

    # ------------------------------------------------------------------ commit
    def append_token(self, req: Request, token: int, logprob: tuple[float, dict[int, float]] | None = None) -> bool:
        """Commit one sampled token to ``req`` and apply every stop rule. Returns True if it finished.

        Finish rules, in order: a stop token id or EOS (the token is kept in ``token_ids``, its text
        is not), a completed stop string (text cut before it), ``max_tokens``, ``max_model_len``.
        """
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.output_token_ids.append(token)
        if logprob is not None and req.logprobs is not None:
            lp, top = logprob
            entry = {t: Logprob(v, rank=r + 1) for r, (t, v) in enumerate(top.items())}
            entry.setdefault(token, Logprob(lp))
            req.logprobs.append(entry)
            req.cumulative_logprob += lp
        params = req.params
        if token in req.stop_token_ids or token in req.eos_token_ids:
            keep = params.include_stop_str_in_output and token in req.stop_token_ids
            req.text = self._detokenize(req, req.output_token_ids if keep else req.output_token_ids[:-1])
            self._finish(req, "stop", token if token in req.stop_token_ids else None)
            return True
        prev_len = len(req.text)
        req.text = self._detokenize(req, req.output_token_ids)
        if params.stop and self._check_stop_strings(req, prev_len):
            return True
        if params.max_tokens is not None and len(req.output_token_ids) >= params.max_tokens:
            self._finish(req, "length")
        elif req.num_tokens >= self.max_model_len:
            self._finish(req, "length")
        return req.is_finished

    def _detokenize(self, req: Request, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=req.params.skip_special_tokens)

    def _check_stop_strings(self, req: Request, prev_len: int) -> bool:
        """Cut ``req.text`` at the first stop string completed by the newest token."""
        best = None
        for stop in req.params.stop:
            idx = req.text.find(stop, max(0, prev_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        idx, stop = best
        req.text = req.text[:idx + len(stop)] if req.params.include_stop_str_in_output else req.text[:idx]
        self._finish(req, "stop", stop)
        return True

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(req)
        req.finish(reason, stop_reason)
        if self.proposer is not None:
            self.proposer.reset(req)
            self._draft_deferred.pop(req.seq_id, None)

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
                             finished, metrics)
