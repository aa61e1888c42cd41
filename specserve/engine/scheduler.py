"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Pure Python bookkeeping over :class:`~specserve.kv_cache.BlockManager` (no tensors). One rule
covers prefill, chunked prefill, decode and recompute after preemption: each step a request's
computed tokens catch up with its tokens (prompt + output), within the step's token budget.
Running requests go first, oldest first; waiting ones are admitted first come, first served.
When pages run out, the newest running request is preempted: its pages are freed and it is
recomputed later. With prefix caching a request is admitted with the longest chain of cached pages
that starts its tokens (after preemption too): its computed tokens start there.
:meth:`Scheduler.step_batch` hands the choice to the worker as one
:class:`~specserve.worker.step.StepBatch` (lists only; its flat tensors are made on first use), and
:meth:`Scheduler.update_from_output` takes its :class:`~specserve.worker.step.StepResult` back:
the scheduler alone moves a request's tokens and pages (progress, rollback of rejected drafts,
prefix-cache publishing) and finishes it on the token rules (EOS, stop token ids, ``max_tokens``,
``max_model_len``, a failed output constraint). Text rules (stop strings) belong to the
:class:`~specserve.engine.output_processor.OutputProcessor`, which ends a request through
:meth:`Scheduler.finish`.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from specserve.config import SchedulerConfig
from specserve.engine.request import Request, RequestStatus
from specserve.kv_cache.block_manager import BlockManager
from specserve.metrics import SpecDecodeStats, StepStats
from specserve.worker.step import StepBatch, StepResult

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """``num_new_tokens`` tokens of ``request``, starting at ``request.num_computed_tokens``."""

    request: Request
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # requests admitted this step on cached pages: their first ``num_computed_tokens`` tokens
    cached: list[Request] = field(default_factory=list)


class Scheduler:
    """Waiting and running queues over one shared page pool.

    Args:
        config: batch limits (sequences and tokens per step).
        block_manager: the page pool shared by target and draft.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.spec_stats = SpecDecodeStats()   # every verification's drafted and accepted tokens
        self._freed: list[int] = []           # seq ids the worker forgets at the next batch

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self, num_lookahead_tokens: int = 0) -> SchedulerOutput:
        """Pick this step's batch.

        Args:
            num_lookahead_tokens: extra slots to reserve for a decoding request (the k draft tokens a
                speculative step may add beyond its newest token).
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            want = self._slots_wanted(req, num_new, num_lookahead_tokens)
            while not bm.can_allocate(req.seq_id, want):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break  # req preempted itself: nothing newer is left to schedule
            bm.allocate(req.seq_id, want)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            i += 1
        while (self.waiting and not out.preempted and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            # the last token is always computed: its logits sample the next one
            hit = None if req.skip_prefix_cache else bm.match_prefix(req.token_ids, req.num_tokens - 1)
            cached = hit.num_tokens if hit is not None else 0
            num_new = min(req.num_tokens - cached, budget)
            req.num_computed_tokens = cached
            want = self._slots_wanted(req, num_new, num_lookahead_tokens)
            if not bm.can_allocate(req.seq_id, want, hit):
                req.num_computed_tokens = 0
                break
            bm.allocate(req.seq_id, want, hit)
            if bm.enable_prefix_caching and not req.skip_prefix_cache:
                bm.num_queried_tokens += req.num_tokens
                bm.num_hit_tokens += cached
            if cached:
                req.num_draft_cached_tokens = hit.num_draft_tokens
                out.cached.append(req)
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return out

    def step_batch(self, out: SchedulerOutput) -> StepBatch:
        """The :class:`StepBatch` of a schedule: what the workers see of the chosen sequences."""
        reqs = [s.request for s in out.scheduled]
        bm, max_len = self.block_manager, self.config.max_model_len
        max_new, max_draft = [], []
        for r in reqs:
            room = max_len - r.num_tokens if max_len else 1 << 62
            left = r.params.max_tokens - len(r.output_token_ids) if r.params.max_tokens is not None else 1 << 62
            max_new.append(min(room, left))
            max_draft.append(max(0, min(room, left - 1)))
        return StepBatch(
            seq_ids=[r.seq_id for r in reqs], prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs], token_ids=[r.token_ids for r in reqs],
            context_lens=[r.num_computed_tokens for r in reqs], query_lens=[s.num_new_tokens for s in out.scheduled],
            block_tables=[bm.block_table(r.seq_id) for r in reqs], params=[r.params for r in reqs],
            generators=[r.generator for r in reqs], max_new_tokens=max_new, max_draft_tokens=max_draft,
            block_size=bm.block_size,
            expected_batch_size=min(len(self.running) + len(self.waiting), self.config.max_num_seqs),
            grammars=[r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None,
            freed_seq_ids=self._take_freed(),
            cached_prefixes=[(r.seq_id, r.num_computed_tokens, r.num_draft_cached_tokens) for r in out.cached])

    def _take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed

    def _slots_wanted(self, req: Request, num_new: int, num_lookahead_tokens: int) -> int:
        """Slots ``req`` needs this step: its new tokens, plus the lookahead once it samples; never
        more than max_model_len (no token is ever written past it)."""
        samples = req.num_computed_tokens + num_new == req.num_tokens
        want = req.num_computed_tokens + num_new + (num_lookahead_tokens if samples else 0)
        return min(want, self.config.max_model_len) if self.config.max_model_len else want

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free ``req``'s pages and queue it (first) for recompute."""
        self.running.remove(req)
        if self.block_manager.has_seq(req.seq_id):
            self.block_manager.free(req.seq_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)
        self._freed.append(req.seq_id)

    # ------------------------------------------------------------------ after the step
    def step_stats(self, out: SchedulerOutput, result: StepResult, elapsed_s: float) -> StepStats:
        """The gauges and counters of the step just applied (``elapsed_s``: its execute + update)."""
        return StepStats(len(out.scheduled), len(self.running), len(self.waiting), len(out.preempted),
                         self.block_manager.usage, result.num_speculative_tokens, result.acceptance, elapsed_s)

    def update_from_output(self, requests: list[Request], result: StepResult) -> list[tuple[Request, int]]:
        """Apply one step's result to its requests (``requests[b]`` is row b of the batch): their
        KV progress, the tokens they got with the token stop rules, the slots a verification
        reserved but did not use, their full pages to the prefix cache, the speculation counters.

        Returns:
            ``(request, number of tokens appended)`` for each request that got tokens or finished
            this step (text and outputs are the output processor's).
        """
        updates = []
        for b, req in enumerate(requests):
            req.num_computed_tokens += result.num_computed_tokens[b]
            if result.verified:
                drafted, accepted = result.num_draft_tokens[b], result.num_accepted_tokens[b]
                req.spec_stats.observe(drafted, accepted)
                self.spec_stats.observe(drafted, accepted)
            tokens = result.new_token_ids[b]
            if tokens and req.params.max_tokens == 0:   # the prompt alone was asked for
                self.finish(req, "length")
                updates.append((req, 0))
                continue
            appended = 0
            for token in tokens:
                appended += 1
                if self._append_token(req, token):
                    break
            if not req.is_finished:
                if result.verified:
                    self.block_manager.truncate(req.seq_id, req.num_tokens)   # roll rejected slots back
                self._cache_pages(req)
            if tokens:
                updates.append((req, appended))
        if result.verified:
            self.spec_stats.draft_time_s += result.draft_time_s
            self.spec_stats.verify_time_s += result.verify_time_s
            self.spec_stats.num_sync_free_steps += int(result.sync_free)
        return updates

    def _append_token(self, req: Request, token: int) -> bool:
        """Append one sampled token and apply the token stop rules; True if ``req`` finished.

        In order: a token the output constraint refuses (abort), a stop token id or EOS (kept in
        the tokens), ``max_tokens``, ``max_model_len``.
        """
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        req.append_output(token)
        grammar = req.grammar
        if grammar is not None and not grammar.is_eos(token) and not grammar.accept(token):
            # every sampled row was masked by this state: llguidance hit a limit it checks only
            # while consuming (a regex repeat too large to expand, say); the request ends with the
            # reason, which the server reports as an error
            reason = grammar.error or f"the grammar refused token {token}"
            logger.warning("request %s: the output constraint failed at output token %d: %s", req.request_id,
                           len(req.output_token_ids), reason)
            self.finish(req, "abort", f"output constraint failed: {reason}")
        elif token in req.stop_token_ids or token in req.eos_token_ids:
            self.finish(req, "stop", token if token in req.stop_token_ids else None)
        elif req.params.max_tokens is not None and len(req.output_token_ids) >= req.params.max_tokens:
            self.finish(req, "length")
        elif self.config.max_model_len and req.num_tokens >= self.config.max_model_len:
            self.finish(req, "length")
        return req.is_finished

    def _cache_pages(self, req: Request) -> None:
        """Publish the request's full pages that the target's entries now cover (prefix caching;
        draft-valid where the worker's are final too)."""
        bm = self.block_manager
        if bm.enable_prefix_caching and not req.skip_prefix_cache and bm.has_seq(req.seq_id):
            bm.cache_full_pages(req.seq_id, req.token_ids, req.num_computed_tokens)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None,
               num_output_tokens: int | None = None) -> None:
        """End a request: publish what it computed to the prefix cache, release its pages, drop
        it from the queues, and tell the worker at the next batch. A finished request only takes
        the new reason (a stop string found in text the token rules already ended).

        Args:
            reason: ``"stop"``, ``"length"`` or ``"abort"``.
            stop_reason: the stop token id or stop string, or an abort's cause.
            num_output_tokens: keep only this many output tokens (a stop string ended the text
                inside tokens this step appended).
        """
        if num_output_tokens is not None and num_output_tokens < len(req.output_token_ids):
            del req.token_ids[req.num_prompt_tokens + num_output_tokens:]
            del req.output_token_ids[num_output_tokens:]
        if not req.is_finished:
            self._cache_pages(req)   # what it computed stays reusable after its pages are released
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            if self.block_manager.has_seq(req.seq_id):
                self.block_manager.free(req.seq_id)
            self._freed.append(req.seq_id)
        req.finish(reason, stop_reason)
