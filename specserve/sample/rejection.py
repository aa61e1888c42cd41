"""Lossless acceptance of chain drafts: speculative rejection sampling.

Leviathan, Kalman & Matias 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1 / Appendix A.1; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling", Algorithm 2. For draft token ``d_j`` proposed from the draft distribution
``q_j`` and the target distribution ``p_j`` at the same position:

- accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``;
- at the first rejection, emit a *recovered* token drawn from ``norm(max(0, p_j - q_j))`` and stop;
- when all drafts are accepted, emit a *bonus* token drawn from ``p_{k+1}``.

Every emitted token then follows the target's distribution exactly. Greedy decoding is the special
case where ``p`` and ``q`` are one-hot: a draft is accepted iff it equals the target's argmax, and the
recovered or bonus token is the target's argmax. ``p`` and ``q`` must be the distributions *after*
each request's logits processors (``specserve.sample.sampler.compute_probs``).

Terms: *accepted tokens* are draft tokens kept; the *recovered* token replaces the first rejected
draft; the *bonus* token follows a fully accepted draft. A step emits ``num_accepted + 1`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from specserve.sample.sampler import draw


@dataclass
class RejectionOutput:
    """``output_token_ids[b]``: accepted draft tokens of row b, then its recovered or bonus token.
    ``num_accepted[b]``: how many draft tokens row b kept (0 .. num_draft_tokens[b])."""

    output_token_ids: list[list[int]]
    num_accepted: list[int]


def recovery_distribution(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p - q))`` over the last dim; falls back to ``p`` where ``p <= q`` everywhere
    (then rejection has probability 0, so the fallback is only hit through rounding)."""
    residual = (p - q).clamp_(min=0)
    total = residual.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp(min=torch.finfo(p.dtype).tiny), p)


def rejection_sample(draft_token_ids: Tensor, num_draft_tokens: list[int], draft_probs: Tensor | None,
                     target_probs: Tensor, greedy: Tensor,
                     generators: list[torch.Generator | None]) -> RejectionOutput:
    """Accept a prefix of each row's draft and emit one recovered or bonus token.

    Args:
        draft_token_ids: ``[B, K]`` int64 proposed tokens (row b uses its first ``num_draft_tokens[b]``).
        num_draft_tokens: per row, ``0 <= n_b <= K``.
        draft_probs: ``[B, K, V]`` float32, ``q_j``: the distribution each draft token was drawn from;
            None for deterministic proposals (n-gram lookup), whose ``q_j`` is one-hot at ``d_j``:
            a draft is then accepted with probability ``p_j(d_j)`` and the residual is ``p_j``
            without ``d_j``, with no ``[B, K, V]`` tensor built.
        target_probs: ``[B, K + 1, V]`` float32, ``p_j``: the target's distribution at each draft
            position, plus the position after the last draft (bonus).
        greedy: ``[B]`` bool (host), rows decoded by argmax (no random numbers are drawn for them).
        generators: per row, its own generator (seeded request) or None (shared default generator).
            Every draw of a seeded row comes from its generator, so its tokens do not depend on the
            other rows.
    Returns:
        :class:`RejectionOutput`.
    """
    num_acc, out = rejection_sample_tensors(draft_token_ids, num_draft_tokens, draft_probs, target_probs,
                                            greedy.tolist(), generators)
    num_acc_list = num_acc.tolist()
    rows = out.tolist()
    return RejectionOutput([rows[i][:num_acc_list[i] + 1] for i in range(len(rows))], num_acc_list)


def rejection_sample_tensors(draft_token_ids: Tensor, num_draft_tokens: list[int], draft_probs: Tensor | None,
                             target_probs: Tensor, is_greedy: list[bool],
                             generators: list[torch.Generator | None]) -> tuple[Tensor, Tensor]:
    """:func:`rejection_sample` without reading anything back to the host (the sync-free step).

    Args are those of :func:`rejection_sample`, with ``is_greedy`` a host list.
    Returns:
        ``num_accepted [B]`` int64 and ``output_token_ids [B, K + 1]`` int64: row b's first
        ``num_accepted[b]`` entries are its accepted drafts, entry ``num_accepted[b]`` its recovered
        or bonus token, the rest -1.
    """
    b, k = draft_token_ids.shape
    device = target_probs.device
    greedy = torch.tensor(is_greedy, dtype=torch.bool).to(device, non_blocking=True)
    num_draft = torch.tensor(num_draft_tokens, dtype=torch.int64).to(device, non_blocking=True)  # [B]
    if k == 0:
        num_acc = torch.zeros(b, dtype=torch.int64, device=device)
    else:
        ids = draft_token_ids.unsqueeze(-1)                                   # [B, K, 1]
        p_d = target_probs[:, :k].gather(-1, ids).squeeze(-1)                 # [B, K]
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs.gather(-1, ids).squeeze(-1)  # [B, K]
        u = torch.zeros(b, k, dtype=torch.float32, device=device)
        gen_rows = [i for i, g in enumerate(is_greedy) if not g]
        shared = [i for i in gen_rows if generators[i] is None]
        if shared:
            u[shared] = torch.rand(len(shared), k, device=device)
        for i in gen_rows:  # a seeded row draws exactly its own count: independent of the batch's k
            if generators[i] is not None and num_draft_tokens[i] > 0:
                u[i, :num_draft_tokens[i]] = torch.rand(num_draft_tokens[i], generator=generators[i], device=device)
        # accept iff u < p/q, written without a division; greedy rows accept iff p(d) == 1.
        accept = torch.where(greedy.unsqueeze(1), p_d > 0.5, u * q_d < p_d)   # [B, K]
        valid = torch.arange(k, device=device).unsqueeze(0) < num_draft.unsqueeze(1)
        accept &= valid
        num_acc = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)           # [B] length of accepted prefix
    rows = torch.arange(b, device=device)
    p_last = target_probs[rows, num_acc]                                      # [B, V]
    if k > 0:   # rows that stopped at a rejection draw from the residual
        rejected = (num_acc < num_draft).unsqueeze(1)
        at = num_acc.clamp(max=k - 1)
        if draft_probs is None:   # one-hot at the rejected draft
            q_last = torch.zeros_like(p_last).scatter_(1, draft_token_ids[rows, at].unsqueeze(1), 1.0)
        else:
            q_last = draft_probs[rows, at]
        final_dist = torch.where(rejected, recovery_distribution(p_last, q_last), p_last)
    else:
        final_dist = p_last
    final = draw(final_dist, is_greedy, generators)                           # [B]
    out = torch.full((b, k + 1), -1, dtype=torch.int64, device=device)
    keep = torch.arange(k + 1, device=device).unsqueeze(0) < num_acc.unsqueeze(1)
    out[:, :k] = torch.where(keep[:, :k], draft_token_ids, out[:, :k])
    out.scatter_(1, num_acc.unsqueeze(1), final.unsqueeze(1))
    return num_acc, out
