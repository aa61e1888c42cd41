"""EAGLE tree speculation and n-gram speculation in the engine: greedy output equals the target's
for every tree shape and batch, sampled output follows the target's distribution, and KV pages
come back."""
from __future__ import annotations

import pytest

import specserve.spec_decode.worker as worker_mod
from specserve.entrypoints.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.ngram import find_ngram_continuation
from tests.test_mtp import PROMPTS
from tests.test_spec_distribution import N, joint_pvalues

TREES = {
    "chain3": {"speculative_token_tree": [[0], [0, 0], [0, 0, 0]]},
    "wide": {"speculative_token_tree": [[0], [1], [2], [3], [4], [5], [0, 0], [1, 0], [5, 0]]},
    "eagle1": {"speculative_token_tree": "eagle1"},
    "dynamic_d3_k2_n5": {"num_speculative_tokens": 3, "eagle_topk": 2, "num_draft_tokens": 5},
    "dynamic_d5_k6_n24": {"num_speculative_tokens": 5, "eagle_topk": 6, "num_draft_tokens": 24},
}


@pytest.fixture(scope="module")
def head_dir(trained_tiny_head):
    return trained_tiny_head


@pytest.fixture(scope="module")
def greedy_reference(tiny_qwen2_dir):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = LLM(tiny_qwen2_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return params, [o.outputs[0].token_ids for o in out]


@pytest.mark.parametrize("tree", list(TREES))
def test_eagle_greedy_equals_no_speculation(tiny_qwen2_dir, head_dir, greedy_reference, tree, monkeypatch):
    params, ref = greedy_reference
    moved = []
    real_moves = worker_mod.accepted_kv_moves

    def spy(slots, accepted):
        moves = real_moves(slots, accepted)
        moved.append(moves is not None)   # not already in place
        return moves

    monkeypatch.setattr(worker_mod, "accepted_kv_moves", spy)
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "eagle", "model": str(head_dir), "adaptive": False,
                                                   **TREES[tree]})
    for batch in ([PROMPTS[4]], PROMPTS):   # batch 1, then 8 prompts of mixed lengths
        out = spec.generate([{"prompt_token_ids": p} for p in batch], params)
        assert [o.outputs[0].token_ids for o in out] == [ref[PROMPTS.index(p)] for p in batch]
    eng = spec.llm_engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.spec_stats.num_verify_steps > 0 and eng.spec_stats.num_accepted_tokens > 0
    if tree != "chain3":
        assert any(moved), "no accepted path left the first branch: the KV move went untested"


@pytest.mark.parametrize("tree", ["eagle1", "dynamic_d5_k6_n24"])
def test_eagle3_head_trees_greedy_equal_no_speculation(tiny_qwen2_dir, trained_tiny_eagle3_head, greedy_reference,
                                                       tree):
    """An EAGLE-3 head (the target's fused layers, its own lm_head) drafting static and dynamic trees."""
    params, ref = greedy_reference
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "eagle", "model": trained_tiny_eagle3_head,
                                                   "adaptive": False, **TREES[tree]})
    for batch in ([PROMPTS[4]], PROMPTS):
        out = spec.generate([{"prompt_token_ids": p} for p in batch], params)
        assert [o.outputs[0].token_ids for o in out] == [ref[PROMPTS.index(p)] for p in batch]
    st = spec.llm_engine.spec_stats
    # a trained head's drafts are accepted: eagle1's static tree 0.50-0.52 tokens a step on this tiny
    # target (fused or reference layer), the dynamic tree 0.74
    assert st.num_accepted_tokens / st.num_verify_steps > 0.45   # a trained head's drafts are accepted


def test_eagle_static_tree_sets_the_depth(tiny_qwen2_dir, head_dir):
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "eagle", "model": str(head_dir),
                                                  "speculative_token_tree": "eagle1"})
    assert llm.llm_engine.spec_config.num_speculative_tokens == 5
    assert llm.llm_engine.proposer.max_tree_nodes == 25


@pytest.mark.parametrize("cfg, match", [
    ({"speculative_token_tree": "[(0,), (0, 1, 1)]"}, "no parent"),
    ({"speculative_token_tree": "medusa"}, "'eagle1' or a list of paths"),
    ({"eagle_topk": 0}, "eagle_topk"),
    ({"num_draft_tokens": -2}, "num_draft_tokens")])
def test_bad_eagle_config(tiny_qwen2_dir, head_dir, cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_qwen2_dir, speculative_config={"method": "eagle", "model": str(head_dir), **cfg})


def test_tree_on_another_method_is_refused(tiny_qwen2_dir, head_dir):
    with pytest.raises(ValueError, match="speculative_token_tree is for method 'eagle'"):
        LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head_dir),
                                                "speculative_token_tree": "eagle1"})


# ----------------------------------------------------------------------------- sampling

@pytest.fixture(scope="module")
def sampling_engines(tiny_qwen2_dir, head_dir):
    base = LLM(tiny_qwen2_dir, max_num_seqs=256)
    tree = LLM(tiny_qwen2_dir, max_num_seqs=256, speculative_config={
        "method": "eagle", "model": str(head_dir), "adaptive": False,
        "speculative_token_tree": [[0], [1], [2], [3], [0, 0], [0, 1], [1, 0]]})
    return base, tree


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["t1", "t08_topk20_topp09"])
def test_tree_sampling_matches_no_speculation(sampling_engines, kw):
    base, tree = sampling_engines
    stats = tree.llm_engine.spec_stats
    before = (stats.num_verify_steps, stats.num_accepted_tokens)
    pvalues = joint_pvalues(base, tree, **kw)
    assert stats.num_verify_steps - before[0] >= N
    assert stats.num_accepted_tokens - before[1] > N // 20     # trees were really accepted from
    assert min(pvalues) > 1e-3


def test_tree_sampling_with_a_wrong_residual_fails(sampling_engines, monkeypatch):
    """Drawing the final token from p instead of the residual (rejected children removed) must
    fail the test above: the statistical test has the power to see it."""
    import torch
    from specserve.spec_decode import tree as tree_mod

    real_multinomial = torch.multinomial

    def wrong_accept(tree, target_probs, greedy, generator=None):
        out = real_accept(tree, target_probs, greedy, generator)
        if greedy:
            return out
        node = out.accepted_nodes[-1] if out.accepted_nodes else 0
        p = target_probs[node].double()
        final = int(real_multinomial(p / p.sum(), 1, generator=generator))
        return tree_mod.TreeAcceptance(out.accepted_nodes, out.output_token_ids[:-1] + [final])

    real_accept = tree_mod.accept_tree
    monkeypatch.setattr(worker_mod, "accept_tree", wrong_accept)
    base, tree = sampling_engines
    assert min(joint_pvalues(base, tree, temperature=1.0)) < 1e-3


# ----------------------------------------------------------------------------- n-gram

def test_ngram_lookup_hand_cases():
    assert find_ngram_continuation([1, 2, 3, 4, 1, 2], 3, 1, 5) == [3, 4, 1, 2]
    # the longest suffix first ([1, 2] matches at 0 and 3), the most recent occurrence of it
    assert find_ngram_continuation([1, 2, 3, 1, 2, 9, 1, 2], 3, 1, 2) == [9, 1]
    assert find_ngram_continuation([1, 2, 3, 1, 2, 9, 7, 2], 3, 2, 2) == []    # only a 1-gram matches
    assert find_ngram_continuation([1, 2, 3, 1, 2, 9, 7, 2], 3, 1, 2) == [9, 7]
    assert find_ngram_continuation([5, 6, 7], 3, 1, 2) == []
    assert find_ngram_continuation([1], 3, 1, 2) == [] and find_ngram_continuation([1, 1], 3, 1, 0) == []


# Sampled n-gram output: its drafts are one-hot proposals, whose rejection sampling is tested exactly
# in tests/test_rejection.py ("one_hot_draft").


def test_ngram_greedy_equals_no_speculation(tiny_qwen2_dir, greedy_reference):
    params, ref = greedy_reference
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                   "adaptive": False, "prompt_lookup_max": 3})
    for batch in ([PROMPTS[4]], PROMPTS):
        out = spec.generate([{"prompt_token_ids": p} for p in batch], params)
        assert [o.outputs[0].token_ids for o in out] == [ref[PROMPTS.index(p)] for p in batch]
    eng = spec.llm_engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    assert eng.spec_stats.num_draft_tokens > 0 and eng.spec_stats.num_accepted_tokens > 0
