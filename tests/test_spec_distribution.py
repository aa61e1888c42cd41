"""End to end, sampled output with speculation follows the target's distribution: the joint
frequencies of sampled tokens match those of the same engine without speculation."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve import LLM, SamplingParams
from tests.tiny_models import make_layer_skip_draft

N = 4000
BATCH = 250
PROMPT = {"prompt_token_ids": [17, 92, 5, 230, 41, 8]}


def homogeneity_pvalue(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Two-sample chi-square test that ``a`` and ``b`` come from one distribution; cells with fewer
    than ``min_count`` observations in total are pooled into one."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= min_count:
            cells.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    if sum(pooled) > 0:
        cells.append(tuple(pooled))
    stat = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def engines(tiny_qwen2_dir, tmp_path_factory):
    draft = tmp_path_factory.mktemp("dist_draft")
    make_layer_skip_draft(tiny_qwen2_dir, draft, keep_layers=3, noise=0.07)
    spec = LLM(tiny_qwen2_dir, max_num_seqs=256, speculative_config={
        "method": "draft_model", "adaptive": False, "model": str(draft), "num_speculative_tokens": 2})
    return LLM(tiny_qwen2_dir, max_num_seqs=256), spec


def joint_counts(llm: LLM, seed0: int, **kw) -> tuple[Counter, Counter]:
    """Counts of (t1, t2) and of (t2, t3) over N seeded requests. t1 comes from the prefill step;
    with speculation t2 and t3 come from one verify step (2 drafts)."""
    outs = []
    for start in range(0, N, BATCH):  # all of a batch prefill together, so every later step speculates
        params = [SamplingParams(seed=seed0 + i, max_tokens=4, ignore_eos=True, **kw)
                  for i in range(start, min(N, start + BATCH))]
        outs += llm.generate([PROMPT] * len(params), params)
    first = Counter(tuple(o.outputs[0].token_ids[:2]) for o in outs)
    second = Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs)
    return first, second


def joint_pvalues(base: LLM, spec: LLM, **kw) -> list[float]:
    """Homogeneity p-values of both joint counts: the target alone (seeds 0..N-1) against
    speculation (other seeds: independent samples)."""
    ref = joint_counts(base, 0, **kw)
    got = joint_counts(spec, 10 ** 6, **kw)
    return [homogeneity_pvalue(r, g) for r, g in zip(ref, got)]


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=1.0, top_k=20, top_p=0.8)],
                         ids=["t1", "topk20_topp08"])
def test_joint_of_sampled_tokens_matches_no_speculation(engines, kw):
    base, spec = engines
    stats = spec.llm_engine.spec_stats
    before = stats.drafted_per_position[1] if len(stats.drafted_per_position) > 1 else 0
    pvalues = joint_pvalues(base, spec, **kw)
    # every request's 2nd and 3rd tokens came from one verify step with 2 drafts
    assert stats.drafted_per_position[1] - before >= N
    assert min(pvalues) > 1e-3


def test_wrong_sampler_is_caught_end_to_end(engines, monkeypatch):
    """Resampling rejected positions from p instead of norm(max(0, p - q)) must fail the test above."""
    from specserve.sample import rejection
    monkeypatch.setattr(rejection, "recovery_distribution", lambda p, q: p)
    base, spec = engines
    assert min(joint_pvalues(base, spec, temperature=1.0)) < 1e-3


def test_reduced_draft_vocabulary_keeps_the_distribution(tiny_qwen2_dir, engines, tmp_path_factory, monkeypatch):
    """A draft scoring only part of the vocabulary (FR-Spec's frequent tokens, here a fixed third)
    proposes only those tokens, and sampled output still follows the target's distribution: its
    restricted distribution is the q of rejection sampling."""
    from specserve.spec_decode import draft_vocab

    vocab = 300
    counts = torch.zeros(vocab, dtype=torch.int64)
    counts[::3] = 1                                              # every third id is "frequent"
    monkeypatch.setattr(draft_vocab, "corpus_token_counts", lambda tokenizer, size: counts[:size])
    draft = tmp_path_factory.mktemp("dist_draft_vocab")
    make_layer_skip_draft(tiny_qwen2_dir, draft, keep_layers=3, noise=0.07)
    spec = LLM(tiny_qwen2_dir, max_num_seqs=256, speculative_config={
        "method": "draft_model", "adaptive": False, "model": str(draft), "num_speculative_tokens": 2,
        "draft_vocab_size": 100})
    rows = spec.llm_engine.worker.proposer.runner.model.lm_head_rows
    eos = spec.llm_engine.model_config.eos_token_ids
    assert rows.numel() == 100 and set(eos) <= set(rows.tolist())   # EOS always kept
    assert spec.llm_engine.worker.proposer.runner.model.lm_head.out_features == 100
    base, _ = engines
    assert min(joint_pvalues(base, spec, temperature=1.0)) > 1e-3
    allowed = set(rows.tolist())
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    proposer = spec.llm_engine.worker.proposer
    real = proposer._align
    proposed = []

    def spy(logits):
        full = real(logits)
        proposed.extend(full.argmax(-1).tolist())
        return full
    monkeypatch.setattr(proposer, "_align", spy)
    assert (spec.generate([PROMPT], greedy)[0].outputs[0].token_ids ==
            base.generate([PROMPT], greedy)[0].outputs[0].token_ids)
    assert proposed and set(proposed) <= allowed


def test_draft_vocab_size_is_checked():
    from specserve.config import SpeculativeConfig

    with pytest.raises(ValueError, match="draft_vocab_size must be an integer >= 2, got 0"):
        SpeculativeConfig(method="draft_model", model="x", draft_vocab_size=0)
    with pytest.raises(ValueError, match="draft_vocab_size is for method 'draft_model', not 'ngram'"):
        SpeculativeConfig(method="ngram", draft_vocab_size=100)
