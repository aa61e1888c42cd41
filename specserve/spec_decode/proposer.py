"""The interface every speculation method implements for the engine's step loop.

A proposer keeps whatever per-sequence state it needs (a draft KV cache, carried logits) and is
driven by the engine at three points of a step: ``propose`` before the target verifies a
decode-only batch, ``on_verified`` after acceptance, and ``catch_up`` after every step (prefill,
mixed or speculative) so its state covers all of a sequence's tokens again.
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
    def max_num_draft_tokens(self, req: Request) -> int:
        """How many draft tokens this proposer can make for ``req`` now (0 = cannot speculate)."""

    @abstractmethod
    def propose(self, reqs: list[Request], num_draft_tokens: list[int]) -> DraftProposal:
        """Draft ``num_draft_tokens[b]`` tokens after each request's newest token."""

    @abstractmethod
    def on_verified(self, req: Request, num_accepted: int) -> None:
        """The target kept ``num_accepted`` of the drafts proposed for ``req`` this step."""

    @abstractmethod
    def catch_up(self, reqs: list[Request]) -> None:
        """Bring per-sequence state up to date with the target after a step."""

    @abstractmethod
    def reset(self, req: Request) -> None:
        """Forget ``req``'s state (it finished, was aborted or preempted)."""
