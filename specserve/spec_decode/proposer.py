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

from specserve.engine.request import Request, sampling_metadata
from specserve.sample.sampler import compute_probs, draw


@dataclass
class DraftProposal:
    """``draft_token_ids [B, K]`` int64 (row b uses its first ``num_draft_tokens[b]``; padding 0) and
    ``draft_probs [B, K, V]`` float32, the distribution each draft token was drawn from, over the
    target's vocabulary (the rejection sampler divides by it), or None when every draft token was
    chosen deterministically (its distribution is one-hot: n-gram lookup)."""

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    num_draft_tokens: list[int]


class Proposer(ABC):
    """Proposes draft tokens for sequences whose prompt is fully computed.

    Class attributes: ``uses_target_hidden_states`` (the engine calls
    :meth:`observe_target_hidden_states` after every target forward) and ``cheap_catch_up``
    (catching up over a whole prompt costs little, so the engine lets the proposer follow every
    prompt and never leaves a sequence behind).
    """

    uses_target_hidden_states: bool = False
    cheap_catch_up: bool = False
    proposes_trees: bool = False   # True: the engine calls propose_trees and verifies a tree
    supports_sync_free: bool = False   # True: the engine may run its sync-free chain step (MTP)

    def num_lookahead_tokens(self, k: int) -> int:
        """Cache slots a speculative step with k drafts may write past the newest token's: the
        k drafts and the bonus token (a tree proposer: its largest tree)."""
        return k + 1

    def steady_catch_up(self, k: int) -> int:
        """The most tokens a catch-up covers in steady speculation at k drafts (a larger one is a
        backlog, and the step's time is not k's cost): the bonus/recovered token and the last draft."""
        return 2

    def observe_target_hidden_states(self, req: Request, first_position: int, hidden: torch.Tensor) -> None:
        """The target computed ``req``'s positions ``first_position ...``: their final hidden
        states ``hidden [n, H]`` (only called when ``uses_target_hidden_states``)."""

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



class ChainProposer(Proposer):
    """A proposer that drafts a chain one token at a time: the first from the logits its catch-up
    carried (:meth:`_carried_logits`), each later one from one batched step over every sequence
    still drafting (:meth:`_next_logits`). Subclasses set ``vocab_size`` (the target's)."""

    vocab_size: int

    @abstractmethod
    def _carried_logits(self, req: Request) -> torch.Tensor:
        """``[V]`` logits of ``req``'s first draft token, left by the last catch-up."""

    @abstractmethod
    def _next_logits(self, reqs: list[Request], active: list[int], histories: list[list[int]], j: int) -> torch.Tensor:
        """``[len(active), V]`` logits of draft j (j >= 1) of ``reqs[i]`` for i in ``active``, whose
        ``histories[i][-1]`` is draft j-1."""

    def _start_chain(self, reqs: list[Request]) -> None:
        """Called once before a chain is drafted."""

    def propose(self, reqs: list[Request], num_draft_tokens: list[int]) -> DraftProposal:
        b, k = len(reqs), max(num_draft_tokens, default=0)
        draft_ids = torch.zeros(b, k, dtype=torch.int64)
        draft_probs = torch.zeros(b, k, self.vocab_size, dtype=torch.float32)
        histories = [list(r.output_token_ids) for r in reqs]
        self._start_chain(reqs)
        for j in range(k):
            active = [i for i in range(b) if num_draft_tokens[i] > j]
            if j == 0:
                logits = torch.stack([self._carried_logits(reqs[i]) for i in active])
            else:
                logits = self._next_logits(reqs, active, histories, j)
            draw_draft_tokens(logits, reqs, histories, active, j, draft_ids, draft_probs)
        return DraftProposal(draft_ids, draft_probs, list(num_draft_tokens))

def draw_draft_tokens(logits: torch.Tensor, reqs: list[Request], histories: list[list[int]], active: list[int],
                      j: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor) -> None:
    """Draw draft token j of the ``active`` rows from their draft logits ``[A, V]`` with each
    request's own sampling parameters (drafts so far count as output for penalties): fills
    ``draft_ids[active, j]`` and ``draft_probs[active, j]`` (the distribution drawn from) and
    appends the tokens to ``histories``."""
    md = sampling_metadata([reqs[i] for i in active], [histories[i] for i in active])
    q = compute_probs(logits, md)                     # [A, V]
    tokens = draw(q, md.is_greedy, md.generators)   # [A]
    rows = torch.tensor(active, dtype=torch.int64)
    draft_ids[rows, j] = tokens
    draft_probs[rows, j] = q
    for i, t in zip(active, tokens.tolist()):
        histories[i].append(t)
