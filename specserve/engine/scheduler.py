"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Pure Python bookkeeping over :class:`~specserve.kv_cache.BlockManager` (no tensors). One rule
covers prefill, chunked prefill, decode and recompute after preemption: each step a request's
computed tokens catch up with its tokens (prompt + output), within the step's token budget.
Running requests go first, oldest first; waiting ones are admitted first come, first served.
When pages run out, the newest running request is preempted: its pages are freed and it is
recomputed later. With prefix caching a request is admitted with the longest chain of cached pages
that starts its tokens (after preemption too): its computed tokens start there. :meth:`Scheduler.step_batch` hands the choice to the workers as one
:class:`~specserve.worker.step.StepBatch` (lists only; its flat tensors are made on first use).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specserve.config import SchedulerConfig
from specserve.engine.request import Request, RequestStatus
from specserve.kv_cache.block_manager import BlockManager
from specserve.worker.step import StepBatch


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
            grammars=[r.grammar for r in reqs] if any(r.grammar is not None for r in reqs) else None)

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

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request's pages and drop it from the queues."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.block_manager.has_seq(req.seq_id):
            self.block_manager.free(req.seq_id)
