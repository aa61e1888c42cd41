"""The contract between the engine and whatever executes its steps.

The engine holds one :class:`Worker`: the :class:`~specserve.worker.target_worker.TargetWorker`
without speculation, the :class:`~specserve.spec_decode.worker.SpeculativeWorker` with it. The
scheduler sends it one :class:`~specserve.worker.step.StepBatch` a step (the sequences freed since
the last one and those admitted on cached pages travel in it) and gets one
:class:`~specserve.worker.step.StepResult` back; the block manager reads, once at construction,
how far a page's entries look ahead and whether a cached prefix needs the proposer's entries too,
and asks at page-publishing time how far the proposer's entries are final.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from specserve.worker.step import StepBatch, StepResult


@runtime_checkable
class Worker(Protocol):
    """What the engine, the scheduler and the block manager use of a worker.

    Attributes:
        proposer: the speculation method's proposer (None: no speculation).
        controller: the adaptive-k controller (None: no speculation or a fixed k).
        num_speculative_tokens: k of the next speculative step (the largest k when adaptive; 0
            without speculation).
        kv_lookahead: tokens past its page that a page's KV entries depend on (1 for a head that
            reads the next token's embedding; prefix-cache keys hold them).
        prefix_needs_draft: a cached prefix is usable only where the proposer's entries exist too
            (a head reads the target's hidden states, which a cache hit does not recompute).
    """

    proposer: Any
    controller: Any
    num_speculative_tokens: int
    kv_lookahead: int
    prefix_needs_draft: bool

    def num_lookahead_tokens(self) -> int:
        """Cache slots past a sequence's newest token that one step may write (k drafts and the
        bonus token; a tree: its largest tree; 0 without speculation)."""

    def set_num_speculative_tokens(self, k: int) -> None:
        """Draft ``k`` tokens a step from now on (the largest k when adaptive).

        Raises:
            ValueError: ``k`` < 1, or a worker that does not speculate.
        """

    def num_valid_draft_tokens(self, seq_id: int, num_computed_tokens: int) -> int:
        """Leading positions of ``seq_id`` whose proposer entries are final, at most
        ``num_computed_tokens`` (all of them without a proposer)."""

    def execute(self, batch: StepBatch) -> StepResult:
        """Forget ``batch.freed_seq_ids``, start ``batch.cached_prefixes`` on their cached pages,
        then run one step over the batch's sequences."""
