"""Evaluate a trained head through the inference engine's own speculative path (validated
through the real inference implementations of target and draft, not a training-time imitation).

Greedy generation on held-out prompts with ``method="mtp"`` and a fixed k gives, from the
engine's own counters: the acceptance length (tokens per target forward, bonus included), the
per-position acceptance (``P(draft j accepted | drafts 1..j-1 accepted)``), and the chain accuracy
``P(the first j drafts all accepted)`` for j = 1..k; under greedy decoding the first position's
acceptance is the head's next-token top-1 agreement with the target. With ``method="eagle"`` the
same head drafts EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2", section 4: expand the
``eagle_topk`` best nodes per level to depth k, verify the ``num_draft_tokens`` most probable) and
``chain_accuracy[j-1]`` is ``P(the accepted path is at least j deep)`` over all steps with a tree
(the engine counts a tree's depth as its drafts; a pruned tree may be shallower than k). ``check_exact`` also decodes
the prompts without speculation and counts the outputs that equal it token for token.
"""
from __future__ import annotations

from specserve.sampling_params import SamplingParams


def chain_accuracy(accepted_per_position: list[int], drafted_per_position: list[int]) -> list[float]:
    """``P(the first j drafts all accepted)`` for j = 1..k from the engine's per-position counts
    (a draft at position j is accepted only when every earlier one was)."""
    return [a / d if d else 0.0 for a, d in zip(accepted_per_position, drafted_per_position)]


def conditional_acceptance(chain: list[float]) -> list[float]:
    """``P(draft j accepted | drafts 1..j-1 accepted)`` from the chain accuracies."""
    return [c / prev if prev else 0.0 for c, prev in zip(chain, [1.0] + chain[:-1])]


def acceptance_length_stderr(chain: list[float], num_steps: int) -> float | None:
    """Standard error of the mean acceptance length over ``num_steps`` verification steps, from
    the chain accuracies ``P(the first j drafts all accepted)``, j = 1..k.

    A step accepts ``m`` drafts with ``P(m >= j) = chain[j-1]``, so ``E[m] = sum_j chain[j-1]`` and
    ``E[m^2] = sum_j (2j - 1) chain[j-1]``; the standard error is ``sqrt(Var(m) / num_steps)``. Steps
    are treated as independent: those of one prompt are correlated, so this is a lower bound.
    Returns None without steps.
    """
    if num_steps <= 0:
        return None
    mean = sum(chain)
    second = sum((2 * j - 1) * c for j, c in enumerate(chain, start=1))
    return max(second - mean * mean, 0.0) ** 0.5 / num_steps ** 0.5


HEAD_METHODS = ("mtp", "eagle")


def evaluate_head_in_engine(target: str, head: str, prompts: list[str], num_speculative_tokens: int = 4,
                            max_tokens: int = 64, dtype: str = "float32", llm=None,
                            quantization: str = "none", draft_quantization: str | None = None,
                            method: str = "mtp", eagle_topk: int = 4, num_draft_tokens: int = 12,
                            check_exact: bool = False) -> dict:
    """Generate greedily with the head drafting; returns acceptance metrics.

    Args:
        target: the target model name or folder.
        head: the head's folder or shipped name.
        prompts: held-out prompts (raw text).
        num_speculative_tokens: k, the chain's length (``"mtp"``) or the tree's depth (``"eagle"``).
        llm: an already built ``LLM`` with this head (tests); otherwise one is built.
        quantization: the target's (a head trained on the int4 target's features drafts for it).
        draft_quantization: the head's linears (None: the target's, as served; "none": float).
        method: ``"mtp"`` (a chain of k drafts) or ``"eagle"`` (EAGLE-2's dynamic tree).
        eagle_topk / num_draft_tokens: the tree's children per expanded node and verified nodes.
        check_exact: also generate without speculation (a second engine on the same target) and
            report how many outputs equal it token for token.
    Returns:
        ``{"acceptance_length", "acceptance_length_stderr", "top1", "per_position_acceptance",
        "chain_accuracy", "num_verify_steps", "num_draft_tokens", "num_accepted_tokens",
        "output_tokens", "output_token_ids", ...}``, with ``"exact"`` (outputs equal to no speculation) and
        ``"inexact_prompts"`` (their indices) when ``check_exact``.
    Raises:
        ValueError: an unknown ``method``.
    """
    from specserve.entrypoints.llm import LLM

    if method not in HEAD_METHODS:
        raise ValueError(f"method must be one of {HEAD_METHODS}, got {method!r}")
    if llm is None:
        spec = {"method": method, "model": head, "adaptive": False, "num_speculative_tokens": num_speculative_tokens,
                "draft_quantization": draft_quantization}
        if method == "eagle":
            spec.update(eagle_topk=eagle_topk, num_draft_tokens=num_draft_tokens)
        llm = LLM(target, dtype=dtype, quantization=quantization, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    outs = llm.generate(prompts, params, use_tqdm=True)
    st = llm.llm_engine.spec_stats
    steps = st.num_verify_steps
    accepted, drafted = st.accepted_per_position[:num_speculative_tokens], st.drafted_per_position[:num_speculative_tokens]
    if method == "eagle":
        # a tree step records its depth as its drafts, and a pruned dynamic tree is often shallower
        # than k: count every step with a tree, so chain[j-1] is P(the accepted path is >= j deep)
        drafted = drafted[:1] * len(drafted)
    chain = chain_accuracy(accepted, drafted)
    per_pos = conditional_acceptance(chain)
    result = {"method": method, "acceptance_length": 1 + st.num_accepted_tokens / steps if steps else None,
              "acceptance_length_stderr": acceptance_length_stderr(chain, steps),
              "top1": chain[0] if chain else None, "per_position_acceptance": per_pos, "chain_accuracy": chain,
              "num_verify_steps": steps, "num_draft_tokens": st.num_draft_tokens,
              "num_accepted_tokens": st.num_accepted_tokens,
              "accepted_per_position": accepted, "drafted_per_position": st.drafted_per_position[:num_speculative_tokens],
              "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "output_token_ids": [list(o.outputs[0].token_ids) for o in outs],
              "num_prompts": len(prompts), "max_tokens": max_tokens, "num_speculative_tokens": num_speculative_tokens,
              "draft_quantization": llm.llm_engine.proposer.head.quantization}
    if method == "eagle":
        result.update(eagle_topk=eagle_topk, num_draft_tokens_per_step=num_draft_tokens)
    if check_exact:
        plain = LLM(target, dtype=dtype, quantization=quantization)
        refs = plain.generate(prompts, params, use_tqdm=True)
        inexact = [i for i, (o, r) in enumerate(zip(outs, refs))
                   if list(o.outputs[0].token_ids) != list(r.outputs[0].token_ids)]
        result.update(exact=len(prompts) - len(inexact), inexact_prompts=inexact)
    return result
