"""Adaptive speculation length: the controller against simulated costs with a known optimum, and
the engine's greedy output with it switched on."""
from __future__ import annotations

import random

import pytest

from specserve.entrypoints.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec_decode.adaptive import AdaptiveSpeculation
from tests.tiny_models import make_layer_skip_draft


def reference_and_adaptive_draft(target_dir, tmp_path, prompts, params, k):
    """The target's own outputs for ``prompts``, and an engine speculating with a noisy 3-layer
    draft of it under adaptive k <= ``k``."""
    draft = tmp_path / "draft"
    make_layer_skip_draft(target_dir, draft, keep_layers=3, noise=0.07)
    ref = LLM(target_dir).generate(prompts, params)
    return ref, LLM(target_dir, speculative_config={"method": "draft_model", "model": str(draft),
                                                    "num_speculative_tokens": k})


def step_time(batch: int, k: int, fixed: float, per_token: float, draft_per_token: float) -> float:
    """A CPU-like cost: weights read once per forward (``fixed``), compute per token; k draft forwards."""
    verify = fixed + per_token * batch * (k + 1)
    draft = k * (0.3 * fixed + draft_per_token * batch) if k else 0.0
    return verify + draft


def true_goodput(batch, k, alpha, **cost) -> float:
    expected = sum(alpha ** j for j in range(k + 1))  # 1 + alpha + ... + alpha^k
    return batch * expected / step_time(batch, k, **cost)


def simulate(ctrl: AdaptiveSpeculation, batch: int, alpha: float, steps: int, seed: int = 0, **cost):
    """Run ``steps`` decode steps; returns the tokens produced and the time spent."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    for _ in range(steps):
        k = ctrl.choose(batch)
        t = step_time(batch, k, **cost) * rng.uniform(0.95, 1.05)  # timing noise
        obs = []
        for _ in range(batch):
            m = 0
            while m < k and rng.random() < alpha:
                m += 1
            obs.append((k, m))
        if k:
            ctrl.observe_acceptance(obs)
        ctrl.observe_step(batch, k, t)
        tokens += sum(m + 1 for _, m in obs)
        seconds += t
    return tokens, seconds


COST = dict(fixed=0.20, per_token=0.004, draft_per_token=0.0015)   # 2-core CPU, 1.5B-like


@pytest.mark.parametrize("batch, alpha", [(1, 0.8), (2, 0.7), (16, 0.8), (64, 0.8), (64, 0.3), (1, 0.05)])
def test_converges_to_the_best_k(batch, alpha):
    max_k = 4
    ctrl = AdaptiveSpeculation(max_k)
    simulate(ctrl, batch, alpha, 300, **COST)
    scores = {k: true_goodput(batch, k, alpha, **COST) for k in range(max_k + 1)}
    best = max(scores, key=scores.get)
    chosen = ctrl.choose(batch)
    # speculation must beat k = 0 by min_gain: a k > 0 only slightly better may be passed over
    assert scores[chosen] >= 0.95 * scores[best] / ctrl.min_gain, (chosen, best, scores)
    if scores[best] > 1.15 * ctrl.min_gain * scores[0]:  # clearly above the bar
        assert chosen > 0
    if scores[0] == scores[best]:
        assert chosen == 0


@pytest.mark.parametrize("batch, alpha", [(1, 0.8), (64, 0.8), (64, 0.3), (1, 0.05)])
def test_never_slower_than_no_speculation(batch, alpha):
    """Over a run, including exploration, throughput is at least 97% of always-k=0 and of the best fixed k."""
    max_k = 4
    tokens, seconds = simulate(AdaptiveSpeculation(max_k), batch, alpha, 400, seed=1, **COST)
    achieved = tokens / seconds
    best_fixed = max(true_goodput(batch, k, alpha, **COST) for k in range(max_k + 1))
    assert achieved >= 0.97 * true_goodput(batch, 0, alpha, **COST)
    assert achieved >= 0.85 * best_fixed


def test_acceptance_estimate():
    ctrl = AdaptiveSpeculation(3, decay=1.0)
    ctrl.observe_acceptance([(3, 3)] * 60 + [(3, 1)] * 30 + [(3, 0)] * 10)
    # P(first 1 accepted) = .9, P(first 2) = .6, P(first 3) = .6, blended with 2 prior pseudo-counts
    assert ctrl.acceptance_prob(0) == pytest.approx((90 + 2 * 0.6) / 102)
    assert ctrl.acceptance_prob(2) == pytest.approx((60 + 2 * 0.6 ** 3) / 102)
    assert ctrl.expected_tokens(0) == 1.0
    assert ctrl.expected_tokens(3) == pytest.approx(1 + sum(ctrl.acceptance_prob(j) for j in range(3)))


def test_unsteady_steps_are_counted_not_timed():
    """A step whose draft caught up over a backlog is slow for reasons other than k."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    ctrl.observe_step(1, 0, 0.1)
    ctrl.observe_step(1, 2, 5.0, steady=False)   # catch-up over a prompt or a k = 0 stretch
    assert ctrl.estimated_time_per_seq(1, 2) is None and ctrl.chosen_counts == [1, 0, 1]
    ctrl.observe_step(1, 2, 0.12)
    assert ctrl.estimated_time_per_seq(1, 2) == pytest.approx(0.12)
    assert ctrl.estimated_time_per_seq(1, 1) == pytest.approx(0.11)  # interpolated


def test_bad_max_k():
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveSpeculation(0)


def test_engine_greedy_exact_with_adaptive_k(tiny_qwen2_dir, tmp_path):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 5, 17, 40, 90, 7, 33, 64)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ref, spec = reference_and_adaptive_draft(tiny_qwen2_dir, tmp_path, prompts, params, k=4)
    ctrl = spec.llm_engine.spec_controller
    # force exploration of every k on the way: the output may not depend on it
    ctrl.explore_interval, ctrl.explore_margin, ctrl.min_gain = 2, 0.0, 0.0
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert sum(1 for c in ctrl.chosen_counts if c) >= 3, ctrl.chosen_counts
    assert spec.llm_engine.block_manager.num_free_blocks == spec.llm_engine.block_manager.num_blocks


def test_larger_batches_inherit_speculation_off():
    """Once a batch size has measured k = 0 as best, larger unmeasured ones start with k = 0 and the
    draft does not follow their prompts; smaller unmeasured ones still do, so they get measured."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    for _ in range(4):
        ctrl.observe_step(16, 0, 1.0)
        ctrl.observe_step(16, 2, 3.5)     # per sequence: 3.5x the time for ~2.2x the tokens
    assert ctrl.saving_per_token(16) == 0.0 and ctrl.saving_per_token(64) == 0.0
    assert not ctrl.worth_following(16, 1000, 1) and not ctrl.worth_following(40, 1000, 1)
    assert ctrl.choose(64) == 0
    assert ctrl.saving_per_token(1) is None and ctrl.worth_following(1, 10, 1000)
    assert ctrl.choose(1) in (0, 2)


def test_draft_follows_a_prompt_only_when_its_prefill_is_repaid():
    """Hand-computed: batch 1, a plain step 1.0 s, a k = 2 step 1.2 s, no acceptance measured (the
    prior 0.6 per draft): E(2) = 1 + 0.6 + 0.36 = 1.96 tokens, so a token costs 1.0 s without
    speculation and 1.2 / 1.96 s with it: a saving of 1 - 1.2/1.96 = 0.387755 s per token. The draft
    prefilled 100 tokens in 2.0 s: a 200-token prompt costs 4.0 s, repaid by 11 tokens, not by 10."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    ctrl.observe_step(1, 0, 1.0)
    ctrl.observe_step(1, 2, 1.2)
    assert ctrl.saving_per_token(1) == pytest.approx(1 - 1.2 / 1.96)
    assert ctrl.worth_following(1, 11, 200)        # before any prefill is measured: cost 0
    ctrl.observe_draft_prefill(100, 2.0)
    assert ctrl.draft_prefill_s_per_token == pytest.approx(0.02)
    assert ctrl.worth_following(1, 11, 200) and not ctrl.worth_following(1, 10, 200)
    ctrl.observe_draft_prefill(100, 4.0)           # EMA 0.3: 0.7 * 0.02 + 0.3 * 0.04 = 0.026 s/token
    assert ctrl.draft_prefill_s_per_token == pytest.approx(0.026)


def test_unmeasured_batch_size_waits_then_extrapolates():
    """Batch 1 measured (plain step 1.0 s, k = 2 step 1.2 s, E(2) = 1.96: speculation on). Batch 2 or
    4 unmeasured: the follow decision waits (None). Once batch 2's plain step is timed at 1.1 s, a
    token costs 0.1 s more per extra sequence, so its k = 2 step is 1.2 + 0.1 * 3 * (2 - 1) = 1.5 s:
    goodput 2 * 1.96 / 1.5 = 2.6133 against 2 / 1.1 = 1.8182 (1.44x, above 1.3): on, saving
    1/1.8182 - 1/2.6133 = 0.16735 s per token. Batch 4's plain step at 1.6 s: a token costs 0.2 s
    more per sequence, k = 2 step 1.2 + 0.2 * 3 * 3 = 3.0 s, goodput 4 * 1.96 / 3.0 = 2.6133
    against 4 / 1.6 = 2.5 (1.045x): off, so the draft does not follow and k = 2 is not explored."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    ctrl.observe_step(1, 0, 1.0)
    ctrl.observe_step(1, 2, 1.2)
    assert ctrl.worth_following(2, 100, 10) is None and ctrl.worth_following(4, 100, 10) is None
    ctrl.observe_step(2, 0, 1.1)
    assert ctrl.saving_per_token(2) == pytest.approx(0.16735, abs=1e-5)
    assert ctrl.worth_following(2, 100, 10) is True
    assert ctrl.choose(2) == 2                    # the extrapolation says on: k = 2 gets measured
    ctrl.observe_step(4, 0, 1.6)
    assert ctrl.saving_per_token(4) == 0.0 and ctrl.worth_following(4, 1000, 1) is False
    assert ctrl.choose(4) == 0
    # nothing measured below batch 1: the draft follows, so speculation gets measured somewhere
    assert AdaptiveSpeculation(2).worth_following(1, 10, 1000) is True


def test_extrapolation_counts_the_draft_tokens():
    """As above, batch 1 measured (plain 1.0 s, k = 2 1.2 s, E(2) = 1.96) and batch 2's plain step
    1.1 s, but the draft has also been seen to prefill at 0.05 s per token: each extra sequence adds
    3 target tokens at 0.1 s and 2 draft tokens at 0.05 s, so batch 2's k = 2 step is
    1.2 + 0.3 + 0.1 = 1.6 s: goodput 2 * 1.96 / 1.6 = 2.45 against 1.8182 (1.3475x, still on),
    saving 1/1.8182 - 1/2.45 = 0.14184 s per token. At 0.1 s per draft token the step is 1.7 s:
    2.3059 (1.268x): off."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    ctrl.observe_step(1, 0, 1.0)
    ctrl.observe_step(1, 2, 1.2)
    ctrl.observe_step(2, 0, 1.1)
    ctrl.draft_prefill_s_per_token = 0.05
    assert ctrl.saving_per_token(2) == pytest.approx(1.1 / 2 - 1.6 / (2 * 1.96), abs=1e-9)
    assert ctrl.saving_per_token(2) == pytest.approx(0.14184, abs=1e-5)
    ctrl.draft_prefill_s_per_token = 0.1
    assert ctrl.saving_per_token(2) == 0.0 and ctrl.choose(2) == 0


def test_extrapolation_charges_verified_tokens_at_the_prefill_cost():
    """As above (batch 1: plain 1.0 s, k = 2 1.2 s, E(2) = 1.96; batch 2 plain 1.1 s), but the
    target has prefilled at 0.15 s per token, more than the 0.1 s the plain steps show: batch 2's
    k = 2 step is 1.2 + 0.15 * 3 = 1.65 s, goodput 2 * 1.96 / 1.65 = 2.3758 against 1.8182 (1.307x):
    on. At 0.2 s per token, 1.8 s: 2.1778 (1.198x): off. Prefill steps under 32 tokens are not timed."""
    ctrl = AdaptiveSpeculation(2, ema=1.0, min_gain=1.3)
    ctrl.observe_step(1, 0, 1.0)
    ctrl.observe_step(1, 2, 1.2)
    ctrl.observe_step(2, 0, 1.1)
    ctrl.observe_target_prefill(31, 31 * 5.0)
    assert ctrl.target_prefill_s_per_token is None
    ctrl.observe_target_prefill(100, 15.0)
    assert ctrl.saving_per_token(2) == pytest.approx(1.1 / 2 - 1.65 / (2 * 1.96), abs=1e-9)
    ctrl.observe_target_prefill(100, 20.0)
    assert ctrl.saving_per_token(2) == 0.0 and ctrl.choose(2) == 0
    ctrl.observe_target_prefill(100, 1.0)          # cheaper than the plain steps' 0.1 s: those win
    assert ctrl.saving_per_token(2) == pytest.approx(0.16735, abs=1e-5)


def test_first_measurement_after_the_draft_followed_needs_only_keep_gain():
    """Once the draft has prefilled every sequence of a batch size, its maximum k is explored (run
    twice, the second timed) and kept while it beats k = 0 by keep_gain (1.05), not min_gain (1.3):
    that prefill is sunk. A bucket whose k was timed without that exploration still needs 1.3."""
    def fresh():
        return AdaptiveSpeculation(1, ema=1.0, decay=1.0, explore_interval=10**9, min_gain=1.3)

    e1 = fresh().expected_tokens(1)                # 1.6 with the prior alone
    for batch in (1, 3):                           # batch 3: no smaller batch has measured k = 1
        ctrl = fresh()
        for _ in range(2):                         # k = 0 explored first, twice
            assert ctrl.choose(batch) == 0
            ctrl.observe_step(batch, 0, 1.0 * batch)
        for _ in range(2):                         # then k = 1: 1.2x the goodput
            assert ctrl.choose(batch) == 1
            ctrl.observe_step(batch, 1, batch * e1 / 1.2)
        assert ctrl.choose(batch) == 1 and ctrl.saving_per_token(batch) == pytest.approx(1 - 1 / 1.2)
    direct = fresh()
    direct.observe_step(1, 0, 1.0)
    direct.observe_step(1, 1, e1 / 1.2)
    assert direct.choose(1) == 0
    # the draft did not follow every sequence: no exploration, and the bucket is not marked on
    late = fresh()
    late.observe_step(4, 0, 1.0)
    assert late.choose(4, all_can_draft=False) == 0 and not late._bucket(4).speculating


def test_hysteresis():
    """Speculation switches on above min_gain (1.3 here) and stays on down to keep_gain (1.05)."""
    ctrl = AdaptiveSpeculation(1, ema=1.0, decay=1.0, explore_interval=10**9, min_gain=1.3)
    e1 = ctrl.expected_tokens(1)                  # 1.6 with the prior alone
    ctrl.observe_step(1, 0, 1.0)
    ctrl.observe_step(1, 1, e1 / 1.2)             # 1.2x: not enough to switch on
    assert ctrl.choose(1) == 0
    ctrl.observe_step(1, 1, e1 / 1.4)             # 1.4x: on
    assert ctrl.choose(1) == 1
    ctrl.observe_step(1, 1, e1 / 1.2)             # 1.2x again: stays on
    assert ctrl.choose(1) == 1 and ctrl.saving_per_token(1) == pytest.approx(1 - 1 / 1.2)
    ctrl.observe_step(1, 1, e1 / 1.0)             # 1.0x: off
    assert ctrl.choose(1) == 0 and ctrl.saving_per_token(1) == 0.0
    with pytest.raises(ValueError, match="keep_gain"):
        AdaptiveSpeculation(2, keep_gain=1.5)


def test_engine_draft_skips_prompts_speculation_would_not_repay(tiny_qwen2_dir, tmp_path):
    """With k = 0 measured best at batch 1, the draft prefills no prompt and drafts nothing; the
    output is the target's own."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref, spec = reference_and_adaptive_draft(tiny_qwen2_dir, tmp_path, prompts, params, k=2)
    ctrl = spec.llm_engine.spec_controller
    for b in (1, 2):
        ctrl.observe_step(b, 0, 1.0 * b)
        ctrl.observe_step(b, 2, 5.0 * b)
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert spec.llm_engine.spec_stats.num_draft_tokens == 0
    assert ctrl.draft_prefill_s_per_token is None  # the draft never prefilled


def test_unmeasurable_speculation_is_not_explored():
    """While the draft does not follow every sequence of the batch, a k > 0 step could not be timed
    as k's cost: an unmeasured k > 0 is not tried (k = 0 runs), and a pending exploration of it is
    dropped; once every sequence can draft, it is measured."""
    ctrl = AdaptiveSpeculation(2, min_gain=1.3)
    assert ctrl.choose(16, all_can_draft=False) == 0          # k = 0 is measured first anyway
    ctrl.observe_step(16, 0, 1.0)
    ctrl.observe_step(16, 0, 1.0)
    for _ in range(5):
        assert ctrl.choose(16, all_can_draft=False) == 0
        ctrl.observe_step(16, 0, 1.0)
    assert ctrl.choose(16, all_can_draft=True) == 2           # now measurable: explored
    assert ctrl.choose(16, all_can_draft=False) == 0          # the draft lost a sequence: dropped
    assert ctrl._bucket(16).explore is None


@pytest.mark.parametrize("later", [True, False])
def test_engine_deferred_draft_prefill(tiny_qwen2_dir, tmp_path, later):
    """A new prompt is left to the target alone; the first decode step asks whether the draft
    should follow, and while the controller cannot tell (None) every later one asks again: on True
    the draft catches up over the prompt and the tokens decoded so far and speculation starts, on
    False it never drafts. Output is the target's."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 17)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref, spec = reference_and_adaptive_draft(tiny_qwen2_dir, tmp_path, prompts, params, k=2)
    engine = spec.llm_engine
    ctrl = engine.spec_controller
    calls = []

    def worth_following(batch_size, remaining_tokens, num_prompt_tokens):
        calls.append(num_prompt_tokens)
        return None if len(calls) <= 6 else later   # each request asked in two decode steps

    ctrl.worth_following = worth_following
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert calls[:3] == [6, 41, 18]                 # first asked in a decode step: prompt + 1st token
    assert calls[6] == 5 + 3                        # asked again: the prompt + the tokens decoded since
    assert (engine.spec_stats.num_draft_tokens > 0) == later
    assert (ctrl.draft_prefill_s_per_token is not None) == later
    assert not engine.worker._deferred
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_steps_where_nothing_can_draft_are_plain_steps(tiny_qwen2_dir, tmp_path):
    """After a long k = 0 stretch the draft is too far behind to follow the sequence; a later step
    where the controller would speculate has nothing to draft: it runs (and is counted) as a plain
    step, not as a verify step of zero drafts. Output is the target's."""
    prompt = [{"prompt_token_ids": list(range(3, 20))}]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, spec = reference_and_adaptive_draft(tiny_qwen2_dir, tmp_path, prompt, params, k=2)
    engine = spec.llm_engine
    ctrl = engine.spec_controller
    calls = []
    ctrl.worth_following = lambda *a: True
    ctrl.choose = lambda batch_size, all_can_draft=True: calls.append(all_can_draft) or (0 if len(calls) <= 20 else 2)
    out = spec.generate(prompt, params)
    assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    # asked only while the draft keeps up (lag <= 4 (k + 1) tokens): it fell behind inside the k = 0 stretch
    assert 4 * 3 <= len(calls) < 20 and all(calls)
    assert engine.spec_stats.num_verify_steps == 0 and engine.spec_stats.num_draft_tokens == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_measured_gain_is_the_best_timed_k_over_plain():
    """What `specserve generate` prints: the best timed k's goodput over k = 0's at batch 1."""
    ctrl = AdaptiveSpeculation(2, decay=1.0)
    assert ctrl.measured_gain(1) is None                    # nothing timed
    ctrl.observe_step(1, 0, 0.020)
    assert ctrl.measured_gain(1) is None                    # no k > 0 timed
    ctrl.observe_acceptance([(2, 2)] * 50 + [(2, 0)] * 50)
    ctrl.observe_step(1, 2, 0.030)
    gain, k = ctrl.measured_gain(1)
    assert k == 2 and gain == pytest.approx(ctrl.expected_tokens(2) / 0.030 / (1 / 0.020))


def test_an_off_decision_on_the_prior_acceptance_is_measured_again():
    """One exploration at batch 1 leaves two acceptance observations: an off decision then rests on
    the prior, so the best k > 0 is measured again at every runner-up re-measurement (every
    explore_interval steps), whatever its estimate, until enough drafts were verified; after that an
    off decision stands."""
    ctrl = AdaptiveSpeculation(2, ema=1.0, decay=1.0, explore_interval=16, explore_margin=10.0, prior_acceptance=0.1)
    for k, t in ((0, 1.0), (0, 1.0), (2, 2.0), (2, 2.0)):     # the two ends, explored twice each
        assert ctrl.choose(1) == k
        if k:
            ctrl.observe_acceptance([(2, 0)])
        ctrl.observe_step(1, k, t)
    chosen = []
    for _ in range(80):
        k = ctrl.choose(1)
        chosen.append(k)
        if k:
            ctrl.observe_acceptance([(2, 0)])          # drafts keep being rejected
        ctrl.observe_step(1, k, 2.0 if k else 1.0)
    assert chosen[:ctrl.explore_interval - 5].count(0) == ctrl.explore_interval - 5   # off meanwhile
    assert sum(k > 0 for k in chosen) >= 2                     # measured again
    verified = 2 + sum(k > 0 for k in chosen)
    assert verified <= ctrl.min_acceptance_observations + 2    # and no longer once the estimate is its own
    assert all(k == 0 for k in chosen[-ctrl.explore_interval:])
