"""Batched token sampler.

Pipeline (``compute_probs``): penalties -> grammar mask -> temperature -> top-k -> top-p -> min-p ->
softmax.
``compute_probs`` is THE definition of "the distribution we sample from": speculative decoding
calls it for both the target and the draft model, and ``sample`` draws from its output.

Conventions: ``B`` = number of logits rows (one per sequence/position), ``V`` = vocabulary size.
All rows are independent: a row's result never depends on the other rows in the batch (this holds
bitwise on CPU, and for randomness because each seeded row draws from its own generator).

Tie rules (documented choices):
  * top-k keeps every token whose logit is >= the k-th largest value, so ties at the boundary may
    keep more than k tokens (deterministic, independent of sort order).
  * top-p works on a stable descending sort, so among tokens of equal probability at the boundary
    the lower token id is kept first.
  * greedy picks the lowest token id among equal maxima.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from specserve.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
# Tolerance on the cumulative probability when deciding that top_p has been "reached", so that
# e.g. probs [0.5, 0.3, ...] with top_p=0.8 stops after two tokens despite rounding.
_TOP_P_EPS = 1e-6


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """Return a generator seeded with ``seed``, or None (= use the shared default RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingMetadata:
    """Per-row sampling settings for a [B, V] logits batch. Build with ``SamplingMetadata.build``.

    temperature: [B] float32, 0 for greedy rows. top_k: [B] int64, 0 = off. top_p, min_p: [B]
    float32. repetition/presence/frequency_penalty: [B] float32. prompt_token_ids and
    output_token_ids: per-row token lists, read only by penalties (held, not copied: build the
    metadata right before sampling, as every caller does). generators: per-row generator or
    None (shared default RNG). max_num_logprobs: K top logprobs to return (0 = none).
    return_logprobs: return the sampled token's logprob (implied by max_num_logprobs > 0).
    allowed_token_mask: [B, V] bool, the tokens each row's grammar allows (structured output;
    rows without one all True), or None when no row has a grammar.
    """

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    repetition_penalty: Tensor
    presence_penalty: Tensor
    frequency_penalty: Tensor
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]
    max_num_logprobs: int = 0
    # True when some row asked for logprobs (even logprobs=0: just the sampled token's).
    return_logprobs: bool = False
    # Host-side facts about the rows, known from the params when built, so that processing a batch
    # never reads a device tensor back (a GPU sync); derived from the tensors when not given.
    is_greedy: list[bool] | None = None
    any_top_k: bool | None = None
    any_top_p: bool | None = None
    any_min_p: bool | None = None
    any_penalties: bool | None = None
    allowed_token_mask: Tensor | None = None

    def __post_init__(self) -> None:
        if self.is_greedy is None:
            self.is_greedy = (self.temperature < _GREEDY_EPS).tolist()
        if self.any_top_k is None:
            self.any_top_k = bool((self.top_k > 0).any())
        if self.any_top_p is None:
            self.any_top_p = bool((self.top_p < 1.0).any())
        if self.any_min_p is None:
            self.any_min_p = bool((self.min_p > 0).any())
        if self.any_penalties is None:
            self.any_penalties = bool((self.repetition_penalty != 1.0).any() or (self.presence_penalty != 0.0).any()
                                      or (self.frequency_penalty != 0.0).any())

    @classmethod
    def build(cls, params: list[SamplingParams], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], generators: list[torch.Generator | None],
              device: str | torch.device = "cpu",
              allowed_token_masks: list[Tensor | None] | None = None) -> "SamplingMetadata":
        """One row per entry of ``params`` (repeat a request's params for each of its rows);
        ``allowed_token_masks``: per row a ``[V]`` bool grammar mask or None (no constraint)."""
        b = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == b):
            raise ValueError("params, prompt_token_ids, output_token_ids and generators must have "
                             f"equal lengths, got {b}, {len(prompt_token_ids)}, "
                             f"{len(output_token_ids)}, {len(generators)}")

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            temperature=f32([0.0 if p.greedy else p.temperature for p in params]),
            top_k=torch.tensor([p.effective_top_k for p in params], dtype=torch.int64,
                               device=device),
            top_p=f32([p.top_p for p in params]),
            min_p=f32([p.min_p for p in params]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            # held, not copied: copying every row's prompt and output each step cost O(B x length)
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
            generators=list(generators),
            max_num_logprobs=max([p.logprobs or 0 for p in params], default=0),
            return_logprobs=any(p.logprobs is not None for p in params),
            is_greedy=[p.greedy for p in params],
            any_top_k=any(p.effective_top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            any_penalties=any(p.has_penalties for p in params),
            allowed_token_mask=_stack_masks(allowed_token_masks, device),
        )

    @property
    def greedy_mask(self) -> Tensor:
        """[B] bool: rows decoded by argmax."""
        return self.temperature < _GREEDY_EPS


def _stack_masks(masks: list[Tensor | None] | None, device) -> Tensor | None:
    """``[B, V]`` bool from per-row masks (None rows allow everything); None when no row has one."""
    if not masks or all(m is None for m in masks):
        return None
    v = next(m for m in masks if m is not None).numel()
    every = torch.ones(v, dtype=torch.bool)
    return torch.stack([every if m is None else m for m in masks]).to(device, non_blocking=True)


def apply_allowed_tokens(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Set the logits of tokens a row's grammar refuses to -inf. [B, V] -> [B, V] (structured output)."""
    if md.allowed_token_mask is None:
        return logits
    return logits.masked_fill(~md.allowed_token_mask, float("-inf"))


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> Tensor:
    """[B, V] int64 occurrence counts of each token id per row (scatter_add, no loop over V)."""
    b = len(token_lists)
    max_len = max((len(t) for t in token_lists), default=0)
    # Pad with an extra bucket id V that is dropped afterwards.
    padded = torch.full((b, max(max_len, 1)), vocab_size, dtype=torch.int64)
    for i, toks in enumerate(token_lists):
        if toks:
            padded[i, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
    padded = padded.to(device)
    counts = torch.zeros(b, vocab_size + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Repetition, frequency and presence penalties. logits [B, V] float32 -> new [B, V] float32.

    Repetition (HF/vLLM): for each token seen in the prompt OR output, positive logits are divided
    by the penalty and non-positive ones multiplied by it. Then, for OUTPUT tokens only,
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.
    """
    if not md.any_penalties:
        return logits
    v = logits.shape[-1]
    out_counts = _token_counts(md.output_token_ids, v, logits.device)
    seen = (_token_counts(md.prompt_token_ids, v, logits.device) > 0) | (out_counts > 0)
    rp = md.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rp, logits * rp)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * out_counts.to(logits.dtype)
    logits = logits - md.presence_penalty.unsqueeze(1) * (out_counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Divide each row by its temperature. [B, V] float32 -> [B, V]; greedy rows are left as is."""
    temp = torch.where(md.greedy_mask, torch.ones_like(md.temperature), md.temperature)
    return logits / temp.unsqueeze(1)


def apply_top_k_top_p(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Mask (to -inf) tokens outside top-k and then outside top-p. [B, V] -> [B, V].

    top-k keeps all tokens >= the k-th largest logit (ties at the boundary are all kept).
    top-p is applied to the softmax of the top-k-filtered logits: it keeps the smallest prefix of
    the (stable) descending order whose cumulative probability reaches top_p, always >= 1 token.
    Rows with top_k == 0 / top_p >= 1 are untouched.
    """
    v = logits.shape[-1]
    if not (md.any_top_k or md.any_top_p):
        return logits
    use_k = md.top_k > 0
    use_p = md.top_p < 1.0
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True, stable=True)
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if md.any_top_k:
        k = md.top_k.clamp(1, v).unsqueeze(1)
        kth = sorted_logits.gather(1, k - 1)  # [B, 1]
        drop_k = use_k.unsqueeze(1) & (logits < kth)
        logits = logits.masked_fill(drop_k, neg_inf)
        # Kept tokens form a prefix of the sorted order, so mask the sorted copy the same way.
        sorted_logits = sorted_logits.masked_fill(use_k.unsqueeze(1) & (sorted_logits < kth),
                                                  neg_inf)
    if md.any_top_p:
        sorted_probs = sorted_logits.softmax(dim=-1).to(torch.float64)
        exclusive_cum = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before token
        top_p = md.top_p.to(torch.float64).unsqueeze(1)
        drop_sorted = exclusive_cum >= top_p - _TOP_P_EPS
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop_sorted &= use_p.unsqueeze(1)
        drop_p = torch.zeros_like(drop_sorted).scatter_(1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop_p, neg_inf)
    return logits


def apply_min_p(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """Mask tokens with probability < min_p * max probability (softmax of ``logits``). [B,V]->[B,V]."""
    if not md.any_min_p:
        return logits
    use = md.min_p > 0
    probs = logits.softmax(dim=-1)
    threshold = md.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    drop = use.unsqueeze(1) & (probs < threshold)
    return logits.masked_fill(drop, float("-inf"))


def argmax_lowest(x: Tensor) -> Tensor:
    """[B, V] -> [B] int64: index of the row maximum, the lowest id among ties.

    ``torch.argmax`` returns the first maximal index (documented), so no [B, V] index tensor is
    built (that cost several ms per call over a verify batch's rows at V ~ 150k)."""
    return x.argmax(dim=-1)


def compute_probs(logits: Tensor, md: SamplingMetadata) -> Tensor:
    """The processed distribution we sample from. logits [B, V] (any float) -> probs [B, V] float32.

    penalties -> grammar mask -> temperature -> top-k/top-p -> min-p -> softmax. Greedy rows get the
    one-hot of the argmax (lowest id on ties) of the penalized, masked logits.
    """
    logits = apply_allowed_tokens(apply_penalties(logits.to(torch.float32), md), md)
    greedy = md.greedy_mask
    greedy_ids = argmax_lowest(logits) if any(md.is_greedy) else None
    if all(md.is_greedy):   # every row one-hot: no distribution to build
        return torch.zeros_like(logits).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
    x = apply_temperature(logits, md)
    x = apply_top_k_top_p(x, md)
    x = apply_min_p(x, md)
    probs = x.softmax(dim=-1)
    if greedy_ids is not None:
        one_hot = torch.zeros_like(probs).scatter_(1, greedy_ids.unsqueeze(1), 1.0)
        probs = torch.where(greedy.unsqueeze(1), one_hot, probs)
    return probs


def sample(probs: Tensor, md: SamplingMetadata) -> Tensor:
    """Draw one token per row. probs [B, V] float32 -> token ids [B] int64 (see :func:`draw`)."""
    return draw(probs, md.is_greedy, md.generators)


def draw(probs: Tensor, is_greedy: list[bool], generators: list[torch.Generator | None]) -> Tensor:
    """One token per row of ``probs [B, V]`` -> ``[B]`` int64 (no value is read back to the host).

    Greedy rows (``is_greedy[b]``) take the argmax (lowest id on ties). Random rows use the
    exponential race ``argmax(probs / E)``, E ~ Exp(1) of shape [V] drawn from the row's own
    generator, so a seeded row's draw is independent of the rest of the batch; unseeded rows
    (generator None) share the default generator (one batched draw).
    """
    b, v = probs.shape
    out = argmax_lowest(probs)
    if all(is_greedy):
        return out
    noise = torch.ones(b, v, dtype=torch.float32, device=probs.device)
    unseeded = [i for i in range(b) if not is_greedy[i] and generators[i] is None]
    if unseeded:  # one batched draw from the shared default generator
        noise[unseeded] = torch.empty(len(unseeded), v, dtype=torch.float32,
                                      device=probs.device).exponential_()
    for i in range(b):  # loop over seeded rows (never over the vocabulary)
        g = generators[i]
        if not is_greedy[i] and g is not None:
            noise[i] = torch.empty(v, dtype=torch.float32, device=g.device).exponential_(generator=g)
    noise.clamp_(min=torch.finfo(torch.float32).tiny)  # guard against an exact 0 draw
    drawn = (probs / noise).argmax(dim=-1)
    greedy = torch.tensor(is_greedy, dtype=torch.bool).to(probs.device, non_blocking=True)
    return torch.where(greedy, out, drawn)


class SamplerOutput(NamedTuple):
    """sampled_token_ids [B] int64; logprobs [B] float32 (log-prob of the sampled token) or None;
    top_logprobs (ids [B, K] int64, values [B, K] float32) or None."""

    sampled_token_ids: Tensor
    logprobs: Tensor | None
    top_logprobs: tuple[Tensor, Tensor] | None


class Sampler:
    """logits [B, V] + metadata -> SamplerOutput.

    Logprobs follow vLLM's default: log_softmax of the RAW logits (before penalties/temperature).
    The sampled token's logprob is returned when ``md.return_logprobs`` or
    ``md.max_num_logprobs > 0``; the top-K pair only when ``md.max_num_logprobs > 0``.
    """

    def __call__(self, logits: Tensor, md: SamplingMetadata) -> SamplerOutput:
        if all(md.is_greedy):   # compute_probs' one-hot is at this argmax: skip the distribution
            token_ids = argmax_lowest(apply_allowed_tokens(apply_penalties(logits.to(torch.float32), md), md))
        else:
            token_ids = sample(compute_probs(logits, md), md)
        return gather_logprobs(logits, token_ids, md)


def gather_logprobs(logits: Tensor, token_ids: Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Package ``token_ids [B]`` chosen for ``logits [B, V]`` with the logprobs ``md`` asks for:
    the chosen token's and the top ``md.max_num_logprobs``, from log_softmax of the raw logits."""
    if md.max_num_logprobs <= 0 and not md.return_logprobs:
        return SamplerOutput(token_ids, None, None)
    raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    sampled_lp = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    if md.max_num_logprobs <= 0:
        return SamplerOutput(token_ids, sampled_lp, None)
    k = min(md.max_num_logprobs, logits.shape[-1])
    top_vals, top_ids = raw_logprobs.topk(k, dim=-1)
    return SamplerOutput(token_ids, sampled_lp, (top_ids, top_vals))
