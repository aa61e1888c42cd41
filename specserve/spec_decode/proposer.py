"""The interface every speculation method implements for the engine's step loop.

A proposer keeps whatever per-sequence state it needs (a draft KV cache, carried logits) and is
driven by the engine at three points of a speculative step: ``catch_up`` first, so its state
covers every token of the decode batch (after a prefill, after steps that did not speculate, after
the last verification), then ``propose``, and ``on_verified`` after acceptance. Steps that do not
speculate never call it, so a proposer costs nothing while speculation is off.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.engine.request import Request


@dataclass
class DraftProposal:
    """``draft_token_ids [B, K]`` int64 (row b uses its first ``num_draft_tokens[b]``; padding 0) and
    ``draft_probs [B, K, V]`` float32, the distribution each draft token was drawn from, over the
    target's vocabulary (the rejection sampler divides by it)."""

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor
    num_draft_tokens: list[int]


class Proposer(ABC):
    """Proposes draft tokens for sequences whose prompt is fully computed."""

    @abstractmethod
    def num_computed_tokens(self, req: Request) -> int:
        """Tokens of ``req`` the proposer has processed (its state covers them)."""

    @abstractmethod
    def max_num_draft_tokens(self, req: Request) -> int:
        """How many draft tokens this proposer can make for ``req`` now (0 = cannot speculate)."""

    @abstractmethod
    def propose(self, reqs: list[Request], num_draft_tokens: list[int]) -> DraftProposal:
        """Draft ``num_draft_tokens[b]`` tokens after each request's newest token."""

    @abstractmethod
    def on_verified(self, req: Request, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the drafts proposed for ``req`` this step."""

    @abstractmethod
    def catch_up(self, reqs: list[Request]) -> int:
        """Bring per-sequence state up to date with all of each request's tokens (newest included).
        Returns the most tokens caught up for one sequence (0: nothing to do)."""

    @abstractmethod
    def reset(self, req: Request) -> None:
        """Forget ``req``'s state (it finished, was aborted or preempted)."""
