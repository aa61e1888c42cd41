"""The interface every speculation method implements for the speculative worker.

A proposer keeps whatever per-sequence state it needs (a draft KV cache, carried logits), keyed by
``seq_id``, and sees sequences only as rows of a :class:`~specserve.worker.step.StepBatch`. The
speculative worker (:mod:`specserve.spec_decode.worker`) drives it at three points of a
speculative step: :meth:`Proposer.catch_up` first, so its state covers every token of the decode
batch (after a prefill, after steps that did not speculate, after the last verification), then
:meth:`Proposer.propose` (drafts as chains or trees), and :meth:`Proposer.on_verified` once the
target accepted some. Steps that do not speculate never call it, so a proposer costs nothing while
speculation is off. Adding a method is one proposer module and an entry in
:data:`specserve.spec_decode.PROPOSER_BUILDERS`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specserve.sample.sampler import SamplingMetadata, compute_probs, draw
from specserve.spec_decode.tree import DraftTree
from specserve.worker.step import StepBatch


@dataclass
class DraftProposal:
    """Chains: ``draft_token_ids [B, K]`` int64 (row b uses its first ``num_draft_tokens[b]``;
    padding 0) and ``draft_probs [B, K, V]`` float32, the distribution each draft token was drawn
    from, over the target's vocabulary (the rejection sampler divides by it), or None when every
    draft token was chosen deterministically (its distribution is one-hot: n-gram lookup)."""

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None
    num_draft_tokens: list[int]


@dataclass
class TreeProposal:
    """Trees: one :class:`~specserve.spec_decode.tree.DraftTree` per sequence (root = its newest
    token; a tree of the root alone drafts nothing)."""

    trees: list[DraftTree]


class Proposer(ABC):
    """Proposes draft tokens for sequences whose prompt is fully computed.

    Class attributes: ``uses_target_hidden_states`` (the worker calls
    :meth:`observe_target_hidden_states` after every target forward), ``cheap_catch_up``
    (catching up over a whole prompt costs little, so the worker lets the proposer follow every
    prompt and never leaves a sequence behind) and ``aux_hidden_state_layers`` (target layers whose
    input residual stream the proposer reads too, EAGLE-3: the engine makes the target return
    them after its final hidden states).
    """

    uses_target_hidden_states: bool = False
    cheap_catch_up: bool = False
    aux_hidden_state_layers: tuple[int, ...] = ()
    # prefix caching: tokens past position p that the proposer's cache entry at p depends on
    kv_lookahead: int = 0

    def num_valid_kv_tokens(self, seq_id: int) -> int | None:
        """Leading positions of the sequence whose entries in the proposer's paged cache are final
        (never rewritten while the sequence lives); None: the proposer keeps no paged cache."""
        return None

    def adopt_cached_prefix(self, seq_id: int, num_tokens: int) -> None:
        """A new sequence starts on cached pages whose first ``num_tokens`` positions already hold
        the proposer's entries (pages are marked draft-valid only where :meth:`num_valid_kv_tokens`
        covered them): start its state there, as if it had caught up over them."""

    def num_lookahead_tokens(self, k: int) -> int:
        """Cache slots a speculative step with k drafts may write past the newest token's: the
        k drafts and the bonus token (a tree proposer: its largest tree)."""
        return k + 1

    def steady_catch_up(self, k: int) -> int:
        """The most tokens a catch-up covers in steady speculation at k drafts (a larger one is a
        backlog, and the step's time is not k's cost): the bonus/recovered token and the last draft."""
        return 2

    def observe_target_hidden_states(self, seq_id: int, first_position: int, hidden: torch.Tensor) -> None:
        """The target computed positions ``first_position ...`` of sequence ``seq_id``: their final
        hidden states ``hidden [n, H]``, followed by those of ``aux_hidden_state_layers`` when there
        are any (``[n, (1 + layers) H]``; only called when ``uses_target_hidden_states``)."""

    @abstractmethod
    def num_computed_tokens(self, seq_id: int) -> int:
        """Tokens of the sequence the proposer has processed (its state covers them)."""

    @abstractmethod
    def max_num_draft_tokens(self, batch: StepBatch, b: int) -> int:
        """How many draft tokens this proposer can make for sequence b now (0 = cannot speculate)."""

    @abstractmethod
    def catch_up(self, batch: StepBatch) -> int:
        """Bring per-sequence state up to date with every computed token of each sequence of
        ``batch`` (a decoding sequence: its newest token too). Returns the most tokens caught up
        for one sequence (0: nothing to do)."""

    @abstractmethod
    def propose(self, batch: StepBatch, num_draft_tokens: list[int]) -> DraftProposal | TreeProposal:
        """Draft up to ``num_draft_tokens[b]`` tokens (a tree: levels) after sequence b's newest token."""

    def propose_on_device(self, batch: StepBatch, num_draft_tokens: list[int],
                          md: SamplingMetadata) -> DraftProposal | None:
        """Chains drafted without reading anything back to the host, for the sync-free step: every
        row drafts ``max(num_draft_tokens)`` tokens with the sampling settings ``md`` (one row per
        sequence; no penalties). None (the default): this proposer cannot, this step."""
        return None

    def refill(self, batch: StepBatch, target_hidden: torch.Tensor, next_token_ids: torch.Tensor,
               query_lens: list[int], num_accepted: torch.Tensor) -> None:
        """Sync-free step only, right after verification and before the host knows what was
        accepted: rebuild the proposer's state from the target's hidden states ``[T, H]`` of the
        verified rows (``query_lens[b]`` per sequence: newest token, then drafts) and the tokens
        that follow them ``[T]`` (accepted drafts, recovered or bonus token, then padding);
        ``num_accepted [B]`` on the device."""
        raise NotImplementedError(f"{type(self).__name__} has no sync-free step")

    @abstractmethod
    def on_verified(self, seq_id: int, first_position: int, num_accepted: int, refilled: bool = False) -> None:
        """The target kept ``num_accepted`` of the drafts proposed after the newest token at
        ``first_position``; ``refilled``: :meth:`refill` already ran for this step."""

    @abstractmethod
    def reset(self, seq_id: int) -> None:
        """Forget the sequence's state (it finished, was aborted or preempted)."""



class ChainProposer(Proposer):
    """A proposer that drafts a chain one token at a time: the first from the logits its catch-up
    carried (:meth:`_carried_logits`), each later one from one batched step over every sequence
    still drafting (:meth:`_next_logits`). Subclasses set ``vocab_size`` (the target's)."""

    vocab_size: int

    @abstractmethod
    def _carried_logits(self, seq_id: int) -> torch.Tensor:
        """``[V]`` logits of the sequence's first draft token, left by the last catch-up."""

    @abstractmethod
    def _next_logits(self, batch: StepBatch, active: list[int], histories: list[list[int]], j: int) -> torch.Tensor:
        """``[len(active), V]`` logits of draft j (j >= 1) of sequence b for b in ``active``, whose
        ``histories[b][-1]`` is draft j-1."""

    def _start_chain(self, batch: StepBatch) -> None:
        """Called once before a chain is drafted."""

    def propose(self, batch: StepBatch, num_draft_tokens: list[int]) -> DraftProposal:
        b, k = len(batch), max(num_draft_tokens, default=0)
        draft_ids = torch.zeros(b, k, dtype=torch.int64)
        draft_probs = torch.zeros(b, k, self.vocab_size, dtype=torch.float32)
        histories = [list(out) for out in batch.output_token_ids]
        self._start_chain(batch)
        for j in range(k):
            active = [i for i in range(b) if num_draft_tokens[i] > j]
            if j == 0:
                logits = torch.stack([self._carried_logits(batch.seq_ids[i]) for i in active])
            else:
                logits = self._next_logits(batch, active, histories, j)
            draw_draft_tokens(logits, batch, histories, active, j, draft_ids, draft_probs)
        return DraftProposal(draft_ids, draft_probs, list(num_draft_tokens))


def draw_draft_tokens(logits: torch.Tensor, batch: StepBatch, histories: list[list[int]], active: list[int],
                      j: int, draft_ids: torch.Tensor, draft_probs: torch.Tensor) -> None:
    """Draw draft token j of the ``active`` rows from their draft logits ``[A, V]`` with each
    sequence's own sampling parameters (drafts so far count as output for penalties, and a
    grammar masks them from its state after the drafts so far): fills
    ``draft_ids[active, j]`` and ``draft_probs[active, j]`` (the distribution drawn from) and
    appends the tokens to ``histories``."""
    md = batch.sampling_metadata(active, [histories[i] for i in active],
                                 drafts=[histories[i][len(batch.output_token_ids[i]):] for i in active]
                                 if batch.any_grammar else None)   # the grammar's state after the drafts
    q = compute_probs(logits, md)                     # [A, V]
    tokens = draw(q, md.is_greedy, md.generators)   # [A]
    rows = torch.tensor(active, dtype=torch.int64)
    draft_ids[rows, j] = tokens
    draft_probs[rows, j] = q
    for i, t in zip(active, tokens.tolist()):
        histories[i].append(t)
