"""Prompt-lookup (n-gram) speculation: drafts copied from the sequence's own earlier tokens.

Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``method="ngram"``. No model and no training: the
last ``n`` tokens of the sequence (``prompt_lookup_max >= n >= prompt_lookup_min``, longest first)
are searched for in its earlier tokens (prompt and output), and the up to k tokens that followed
the most recent earlier occurrence are proposed. Code edits, quoting and summaries repeat their
input, so acceptance is high there and about zero elsewhere; a sequence without a match drafts
nothing that step and decodes normally inside the same verify batch.

The proposal is deterministic, so its distribution ``q`` is one-hot on the draft token: rejection
sampling then accepts a draft with probability ``p(d)`` and on rejection draws from ``p`` with
``d`` removed (renormalized), which keeps the output distributed as the target's.
"""
from __future__ import annotations

import torch

from specserve.spec_decode.proposer import DraftProposal, Proposer
from specserve.worker.step import StepBatch


def find_ngram_continuation(token_ids: list[int] | torch.Tensor, max_ngram: int, min_ngram: int,
                            num_tokens: int) -> list[int]:
    """The tokens that followed the most recent earlier occurrence of the sequence's last n tokens.

    Args:
        token_ids: ``[L]`` the whole sequence, newest token last.
        max_ngram / min_ngram: suffix lengths tried, longest first (``1 <= min_ngram <= max_ngram``).
        num_tokens: at most this many tokens are returned.
    Returns:
        Up to ``num_tokens`` token ids (empty when no suffix of those lengths occurred before).
    """
    ids = torch.as_tensor(token_ids, dtype=torch.int64)
    length = ids.numel()
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = ids[length - n:]
        # windows starting at 0 .. L-n-1: each is followed by at least one token
        windows = ids[:length - 1].unfold(0, n, 1)                          # [L - n, n]
        hits = (windows == suffix).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return ids[start:start + num_tokens].tolist()
    return []


class NgramProposer(Proposer):
    """Args:
        prompt_lookup_max / prompt_lookup_min: n-gram lengths matched, longest first.
    """

    cheap_catch_up = True   # nothing to prefill: every sequence can draft at once

    def __init__(self, prompt_lookup_max: int, prompt_lookup_min: int):
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    def steady_catch_up(self, k: int) -> int:
        return 0

    def num_computed_tokens(self, seq_id: int) -> int:
        return 1 << 62   # no state: always caught up

    def max_num_draft_tokens(self, batch: StepBatch, b: int) -> int:
        return batch.num_tokens(b)   # the worker clips to max_tokens / max_model_len

    def propose(self, batch: StepBatch, num_draft_tokens: list[int]) -> DraftProposal:
        drafts = [find_ngram_continuation(toks, self.prompt_lookup_max, self.prompt_lookup_min, k) if k else []
                  for toks, k in zip(batch.token_ids, num_draft_tokens)]
        k = max((len(d) for d in drafts), default=0)
        draft_ids = torch.zeros(len(batch), k, dtype=torch.int64)
        for i, d in enumerate(drafts):
            if d:
                draft_ids[i, :len(d)] = torch.tensor(d, dtype=torch.int64)
        # lookup is deterministic: each draft's distribution is one-hot, left implicit
        return DraftProposal(draft_ids, None, [len(d) for d in drafts])

    def on_verified(self, seq_id: int, first_position: int, num_accepted: int, refilled: bool = False) -> None:
        pass

    def catch_up(self, batch: StepBatch) -> int:
        return 0

    def reset(self, seq_id: int) -> None:
        pass
