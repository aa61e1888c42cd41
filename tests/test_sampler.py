"""Tests for SamplingParams and the batched sampler, on small hand-computed cases."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specserve.sample.sampler import (Sampler, SamplingMetadata, apply_min_p, apply_penalties,
                                      apply_temperature, apply_top_k_top_p, compute_probs,
                                      make_generator, sample)
from specserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def md_for(params, prompts=None, outputs=None, gens=None):
    """Metadata for a list of SamplingParams (or one), with empty histories by default."""
    if isinstance(params, SamplingParams):
        params = [params]
    b = len(params)
    return SamplingMetadata.build(params, prompts or [[] for _ in range(b)],
                                  outputs or [[] for _ in range(b)], gens or [None] * b)


def row(values):
    return torch.tensor([values], dtype=torch.float32)


def log_probs_row(probs):
    return torch.log(torch.tensor([probs], dtype=torch.float64)).float()


def kept(logits):
    """Indices of the non-masked entries of a [1, V] tensor."""
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


# ---------------------------------------------------------------- top-k / top-p / min-p

def test_top_k_keeps_k_largest():
    logits = row([1.0, 3.0, 2.0, 0.5, 2.5])
    out = apply_top_k_top_p(logits, md_for(SamplingParams(top_k=2)))
    expected = row([NEG_INF, 3.0, NEG_INF, NEG_INF, 2.5])
    assert torch.equal(out, expected)


def test_top_k_ties_at_boundary_keep_all_equal_values():
    logits = row([1.0, 3.0, 2.0, 2.0, 0.0])
    out = apply_top_k_top_p(logits, md_for(SamplingParams(top_k=2)))
    assert kept(out) == [1, 2, 3]


@pytest.mark.parametrize("top_k", [0, -1, 5, 100, 2**63, 10**30])  # past int64: found by the server fuzz
def test_top_k_disabled_or_larger_than_vocab_keeps_all(top_k):
    logits = row([1.0, 3.0, 2.0, 0.5, 2.5])
    assert torch.equal(apply_top_k_top_p(logits, md_for(SamplingParams(top_k=top_k))), logits)


@pytest.mark.parametrize("top_p,expected", [(0.8, [0, 1]), (0.81, [0, 1, 2]), (0.5, [0]),
                                            (0.01, [0]), (1e-9, [0]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_smallest_set_reaching_mass(top_p, expected):
    logits = log_probs_row([0.5, 0.3, 0.15, 0.05])
    out = apply_top_k_top_p(logits, md_for(SamplingParams(top_p=top_p)))
    assert kept(out) == expected


def test_top_p_independent_of_token_order():
    # same probabilities, shuffled ids: 0.3 -> id 0, 0.05 -> id 1, 0.5 -> id 2, 0.15 -> id 3
    logits = log_probs_row([0.3, 0.05, 0.5, 0.15])
    out = apply_top_k_top_p(logits, md_for(SamplingParams(top_p=0.81)))
    assert kept(out) == [0, 2, 3]


def test_top_p_applies_to_top_k_renormalized_distribution():
    # after top-k=2: [0.4, 0.3] -> [0.571, 0.429]; top_p=0.5 is reached by the first token alone.
    # (top-p on the un-renormalized probs would have kept two tokens.)
    logits = log_probs_row([0.4, 0.3, 0.2, 0.1])
    out = apply_top_k_top_p(logits, md_for(SamplingParams(top_k=2, top_p=0.5)))
    assert kept(out) == [0]


@pytest.mark.parametrize("min_p,expected", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]),
                                            (0.5, [0, 1]), (1.0, [0])])
def test_min_p_relative_to_max_probability(min_p, expected):
    # probs [0.5, 0.3, 0.15, 0.05]: threshold = min_p * 0.5
    logits = log_probs_row([0.5, 0.3, 0.15, 0.05])
    out = apply_min_p(logits, md_for(SamplingParams(min_p=min_p)))
    assert kept(out) == expected
    assert torch.equal(out[0, expected], logits[0, expected])


# ---------------------------------------------------------------- penalties / temperature

def test_repetition_penalty_positive_and_negative_logits():
    logits = row([2.0, -1.0, 0.5, -3.0, 1.0, 0.0])
    md = md_for(SamplingParams(repetition_penalty=2.0), prompts=[[0, 5]], outputs=[[1, 1]])
    out = apply_penalties(logits, md)
    # seen: 0 (prompt, 2/2), 1 (output, -1*2), 5 (prompt, 0*2); unseen untouched
    assert torch.equal(out, row([1.0, -2.0, 0.5, -3.0, 1.0, 0.0]))


def test_repetition_penalty_below_one_boosts():
    out = apply_penalties(row([2.0, -1.0]), md_for(SamplingParams(repetition_penalty=0.5),
                                                   outputs=[[0, 1]]))
    assert torch.equal(out, row([4.0, -0.5]))


def test_frequency_and_presence_penalties_on_output_only():
    logits = torch.zeros(1, 5)
    md = md_for(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
                prompts=[[0, 0, 3]], outputs=[[2, 2, 2, 4]])
    out = apply_penalties(logits, md)
    # token 2: count 3 -> -(0.5*3 + 1) = -2.5; token 4: count 1 -> -1.5; prompt tokens untouched
    assert torch.equal(out, row([0.0, 0.0, -2.5, 0.0, -1.5]))


def test_negative_presence_frequency_penalties_encourage():
    md = md_for(SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), outputs=[[1, 1]])
    assert torch.equal(apply_penalties(torch.zeros(1, 3), md), row([0.0, 4.0, 0.0]))


def test_repetition_then_frequency_presence():
    logits = torch.ones(1, 5)
    md = md_for(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0),
                prompts=[[0]], outputs=[[2, 2, 2, 4]])
    out = apply_penalties(logits, md)
    assert torch.equal(out, row([0.5, 1.0, 0.5 - 2.5, 1.0, 0.5 - 1.5]))


def test_penalties_per_row_histories():
    logits = torch.ones(2, 3)
    md = md_for([SamplingParams(presence_penalty=1.0), SamplingParams(frequency_penalty=1.0)],
                outputs=[[0, 0], [2, 2, 1]])
    assert torch.equal(apply_penalties(logits, md), torch.tensor([[0.0, 1, 1], [1, 0, -1]]))


def test_temperature_scaling():
    logits = row([1.0, 2.0, 3.0])
    md = md_for(SamplingParams(temperature=0.5))
    assert torch.equal(apply_temperature(logits, md), row([2.0, 4.0, 6.0]))
    probs = compute_probs(logits, md)
    assert torch.allclose(probs, torch.softmax(row([2.0, 4.0, 6.0]), -1))
    assert probs.dtype == torch.float32


def test_order_penalties_before_temperature():
    # penalties first: [1-1, 0] / 0.5 = [0, 0] -> uniform. (temperature first: [2, 0]-1 -> not.)
    md = md_for(SamplingParams(temperature=0.5, presence_penalty=1.0), outputs=[[0]])
    assert torch.allclose(compute_probs(row([1.0, 0.0]), md), row([0.5, 0.5]))


def test_order_temperature_before_min_p():
    # T=2 flattens [0.5, 0.3, 0.2] to ratios-to-max [1, 0.775, 0.632]: min_p=0.7 keeps 2 tokens;
    # min-p before temperature would see ratios [1, 0.6, 0.4] and keep 1.
    md = md_for(SamplingParams(temperature=2.0, min_p=0.7))
    probs = compute_probs(log_probs_row([0.5, 0.3, 0.2]), md)
    s = math.sqrt(0.5) + math.sqrt(0.3)
    assert torch.allclose(probs, row([math.sqrt(0.5) / s, math.sqrt(0.3) / s, 0.0]))


def test_compute_probs_top_k_top_p_renormalized():
    probs = compute_probs(log_probs_row([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]),
                          md_for(SamplingParams(top_k=4, top_p=0.8)))
    assert torch.allclose(probs, row([0.5, 0.3125, 0.1875, 0, 0, 0]))


# ---------------------------------------------------------------- greedy

def test_greedy_ties_pick_lowest_id():
    md = md_for(SamplingParams(temperature=0.0))
    probs = compute_probs(row([1.0, 3.0, 3.0, 0.0]), md)
    assert torch.equal(probs, row([0.0, 1.0, 0.0, 0.0]))
    assert sample(probs, md).tolist() == [1]


def test_greedy_uses_penalized_logits_and_ignores_truncation():
    md = md_for(SamplingParams(temperature=1e-6, repetition_penalty=2.0, top_k=1, min_p=1.0),
                outputs=[[0]])
    probs = compute_probs(row([3.0, 2.9, 1.0]), md)  # penalized: [1.5, 2.9, 1.0]
    assert torch.equal(probs, row([0.0, 1.0, 0.0]))
    assert md.temperature.tolist() == [0.0]


def test_greedy_sample_output_and_default_params_greedy_flag():
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(temperature=0.0, n=4).n == 4  # n > 1 with greedy allowed
    out = Sampler()(row([0.0, 5.0, 5.0]), md_for(SamplingParams(temperature=0)))
    assert out.sampled_token_ids.tolist() == [1] and out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


# ---------------------------------------------------------------- batching / seeds

MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6, seed=1),
    SamplingParams(min_p=0.1, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05, frequency_penalty=0.4,
                   presence_penalty=-0.3, seed=7),
    SamplingParams(),
]


def test_mixed_batch_equals_rows_alone_bitwise():
    torch.manual_seed(0)
    logits = torch.randn(len(MIXED), 64) * 3
    prompts = [[1, 2, 3], [], [5, 5], [7, 8, 9, 1], [3], [60, 61]]
    outputs = [[4, 4], [1], [], [8, 8, 2], [0, 0, 0, 9], []]
    batch = compute_probs(logits, md_for(MIXED, prompts, outputs))
    for i, p in enumerate(MIXED):
        alone = compute_probs(logits[i:i + 1], md_for(p, [prompts[i]], [outputs[i]]))
        assert torch.equal(batch[i:i + 1], alone), i
    assert torch.allclose(batch.sum(-1), torch.ones(len(MIXED)))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 6), v=st.integers(2, 40))
def test_probs_rows_independent_property(seed, b, v):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, v, generator=g) * 4
    params = [MIXED[int(torch.randint(len(MIXED), (1,), generator=g))] for _ in range(b)]
    outputs = [torch.randint(v, (3,), generator=g).tolist() for _ in range(b)]
    batch = compute_probs(logits, md_for(params, outputs=outputs))
    for i in range(b):
        assert torch.equal(batch[i:i + 1], compute_probs(logits[i:i + 1],
                                                         md_for(params[i], outputs=[outputs[i]])))
    assert torch.all(batch >= 0) and torch.allclose(batch.sum(-1), torch.ones(b))


def _draw_seq(probs_row, seed, steps, batch_idx=None, batch_size=8):
    """Tokens drawn for a row seeded with ``seed``, alone or at ``batch_idx`` of a mixed batch."""
    p = SamplingParams(seed=seed)
    gens = [make_generator(seed)]
    if batch_idx is None:
        probs, params = probs_row, [p]
    else:
        others = [SamplingParams(seed=100 + j if j % 2 else None, temperature=0.5 + j / 10)
                  for j in range(batch_size)]
        params = others[:batch_idx] + [p] + others[batch_idx + 1:]
        gens = [make_generator(q.seed) for q in params]
        probs = probs_row.repeat(batch_size, 1)
        probs[:, 0] += torch.arange(batch_size) * 0.01  # other rows differ
        probs[batch_idx] = probs_row[0]
    md = md_for(params, gens=gens)
    row_i = 0 if batch_idx is None else batch_idx
    return [int(sample(probs, md)[row_i]) for _ in range(steps)]


def test_same_seed_same_tokens_alone_and_in_batch():
    probs = torch.full((1, 100), 0.01)
    alone = _draw_seq(probs, seed=1234, steps=20)
    assert alone == _draw_seq(probs, seed=1234, steps=20)
    for idx in (0, 3, 7):
        assert _draw_seq(probs, seed=1234, steps=20, batch_idx=idx) == alone
    assert len(set(alone)) > 5  # actually random


def test_different_seeds_differ():
    probs = torch.full((1, 1000), 1e-3)
    seqs = {tuple(_draw_seq(probs, seed=s, steps=20)) for s in range(5)}
    assert len(seqs) == 5


def test_sampler_seeded_rows_unaffected_by_unseeded_neighbors():
    logits = torch.zeros(3, 50)
    params = [SamplingParams(), SamplingParams(seed=3), SamplingParams()]
    a = Sampler()(logits, md_for(params, gens=[None, make_generator(3), None]))
    b = Sampler()(logits[1:2], md_for(params[1], gens=[make_generator(3)]))
    assert a.sampled_token_ids[1] == b.sampled_token_ids[0]


def test_make_generator():
    assert make_generator(None) is None
    assert torch.equal(torch.rand(4, generator=make_generator(5)),
                       torch.rand(4, generator=make_generator(5)))


# ---------------------------------------------------------------- statistics

def _chi_square(counts, expected_probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected_probs))


# Upper 0.001 critical values of the chi-square distribution by degrees of freedom.
CHI2_CRIT_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def _empirical_counts(logits_row, params, n, seed):
    md = md_for([params] * n, gens=[make_generator(seed)] * n)  # one generator for all draws
    probs = compute_probs(logits_row.repeat(n, 1), md)
    tokens = sample(probs, md)
    return torch.bincount(tokens, minlength=logits_row.shape[-1]).tolist()


def test_chi_square_known_distribution():
    target = [0.35, 0.25, 0.2, 0.1, 0.07, 0.03]
    n = 20_000
    counts = _empirical_counts(log_probs_row(target), SamplingParams(), n, seed=2024)
    assert sum(counts) == n
    assert _chi_square(counts, target, n) < CHI2_CRIT_001[len(target) - 1]


def test_chi_square_after_top_k_top_p_truncation():
    raw = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
    n = 20_000
    counts = _empirical_counts(log_probs_row(raw), SamplingParams(top_k=4, top_p=0.8), n, seed=7)
    # top-k=4 -> mass 0.9, renormalized [.444, .278, .167, .111]; cumulative reaches 0.8 at 3 tokens
    truncated = [0.4 / 0.8, 0.25 / 0.8, 0.15 / 0.8]
    assert counts[3:] == [0, 0, 0]
    assert _chi_square(counts[:3], truncated, n) < CHI2_CRIT_001[2]


def test_chi_square_with_temperature():
    raw = [0.5, 0.3, 0.2]
    n = 20_000
    counts = _empirical_counts(log_probs_row(raw), SamplingParams(temperature=2.0), n, seed=11)
    s = sum(math.sqrt(p) for p in raw)
    assert _chi_square(counts, [math.sqrt(p) / s for p in raw], n) < CHI2_CRIT_001[2]


# ---------------------------------------------------------------- logprobs

def test_logprobs_from_raw_logits():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5, seed=1),
              SamplingParams(logprobs=1, temperature=0.0),
              SamplingParams(logprobs=0, top_k=2, seed=2)]
    md = md_for(params, outputs=[[0, 1], [2], []],
                gens=[make_generator(1), None, make_generator(2)])
    out = Sampler()(logits, md)
    ref = torch.log_softmax(logits, -1)
    ids = out.sampled_token_ids
    assert out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprobs, ref[torch.arange(3), ids])
    top_ids, top_vals = out.top_logprobs
    assert top_ids.shape == (3, 3) and top_ids.dtype == torch.int64
    assert torch.equal(top_ids, ref.argsort(-1, descending=True)[:, :3])
    assert torch.equal(top_vals, ref.gather(1, top_ids))


def test_logprobs_hand_values():
    logits = row([0.0, math.log(3.0)])  # probs [0.25, 0.75]
    out = Sampler()(logits, md_for(SamplingParams(temperature=0.0, logprobs=1)))
    assert out.sampled_token_ids.tolist() == [1]
    assert out.logprobs.item() == pytest.approx(math.log(0.75))
    assert out.top_logprobs[0].tolist() == [[1]]
    assert out.top_logprobs[1][0, 0].item() == pytest.approx(math.log(0.75))


def test_logprobs_zero_returns_only_sampled():
    out = Sampler()(row([0.0, 1.0]), md_for(SamplingParams(temperature=0.0, logprobs=0)))
    assert out.logprobs is not None and out.top_logprobs is None


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", -0.1),
    ("min_p", 1.1), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5), ("max_tokens", True), ("max_tokens", -3), ("prompt_logprobs", -1), ("n", 0), ("logprobs", -1),
])
def test_params_invalid_values(field, value):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: value})
    assert field in str(exc.value) and str(value) in str(exc.value)


def test_params_invalid_stop_entries():
    with pytest.raises(ValueError, match="42"):
        SamplingParams(stop=["ok", 42])
    with pytest.raises(ValueError, match="non-empty"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="-7"):
        SamplingParams(stop_token_ids=[1, -7])


def test_params_defaults_and_normalization():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b"), stop_token_ids=(3,)).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None).max_tokens is None
    for v in (0.0, 2.0, -2.0):
        SamplingParams(presence_penalty=v, frequency_penalty=v)
    SamplingParams(top_p=1.0, min_p=1.0, top_k=-1, temperature=0.0)


def test_metadata_build():
    params = [SamplingParams(top_k=-1, logprobs=2), SamplingParams(temperature=0, top_k=3)]
    md = md_for(params)
    assert md.top_k.tolist() == [0, 3] and md.top_k.dtype == torch.int64
    assert md.temperature.tolist() == [1.0, 0.0] and md.temperature.dtype == torch.float32
    assert md.max_num_logprobs == 2 and md.return_logprobs
    assert md.greedy_mask.tolist() == [False, True]
    with pytest.raises(ValueError):
        SamplingMetadata.build(params, [[]], [[], []], [None, None])


def test_sampler_greedy_batch_equals_the_argmax_of_compute_probs():
    """An all-greedy batch skips building the distribution: its tokens must be those of
    compute_probs' one-hot (penalized logits, lowest id on ties, truncation ignored)."""
    torch.manual_seed(0)
    logits = torch.randint(-3, 4, (6, 50)).float()      # many ties
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.7),
              SamplingParams(temperature=0, frequency_penalty=0.9, presence_penalty=0.5),
              SamplingParams(temperature=1e-6, top_k=2, min_p=0.5), SamplingParams(temperature=0, top_p=0.1),
              SamplingParams(temperature=0, repetition_penalty=0.6)]
    outputs = [[1, 2], [3, 3, 7], [int(logits[2].argmax())] * 3, [], [9], [4, 5]]
    md = md_for(params, prompts=[[0], [1, 2], [], [5], [], [6]], outputs=outputs)
    want = compute_probs(logits, md).argmax(dim=-1)     # one-hot rows: argmax is the token
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, want)


def test_argmax_lowest_takes_the_first_of_tied_maxima():
    """Brute force over rows with many ties at a real vocabulary size, -inf rows and positions."""
    from specserve.sample.sampler import argmax_lowest

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 3, (5, 151_936), generator=g).float()
    x[1, 100_000:] = 7.0                       # ties in the upper half only
    x[2] = float("-inf")                       # all equal
    x[3, -1] = 9.0                             # the last id alone
    want = [r.index(max(r)) for r in x.tolist()]          # the first maximal index, by brute force
    assert argmax_lowest(x).tolist() == want
    assert want[1] == 100_000 and want[2] == 0 and want[3] == 151_935
