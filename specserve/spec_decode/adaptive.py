"""Adaptive speculation length: choose k for every decode step so speculation never slows decoding.

Verification is nearly free only while the target is memory-bound: at batch 1 a forward over k+1
tokens costs little more than over one, but a large decode batch is compute-bound and every draft
token costs about as much as a real one. So the speculation length is chosen per step by *goodput*
(Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language Models Using
Goodput", section 4): for a batch of B sequences and k drafts,

    goodput(B, k) = B * E(k) / T(B, k),     E(k) = 1 + sum_{j=1..k} P(the first j drafts accepted)

with k = 0 meaning a plain decode step (the proposer does no work at all). ``E`` comes from measured
acceptance (counts decayed so they follow the traffic); ``T`` is the measured wall time of whole
decode steps (draft, verify, sampling, commit) kept per batch-size bucket and k, per sequence.
A k never measured in a bucket is estimated by linear interpolation in k between measured ones;
before any measurement the bucket tries k = 0 and the configured maximum first. Every
``explore_interval`` steps the runner-up is measured again when its estimate comes within
``explore_margin`` of the bar it must clear, so estimates follow a growing context.

Speculation switches on in a bucket only where its estimated goodput beats k = 0's by ``min_gain``
(1.15) and, once on, stays on while it beats it by ``keep_gain`` (1.05): single k > 0 step times
vary by +-15% on a busy CPU, and one threshold between them made a batch-1 server flip
speculation off on noise, while a low single threshold let it run where it barely paid and the
draft's prompt prefill then made the server slower. A bucket whose maximum k is measured for the
first time after the draft has prefilled every sequence of the batch counts as on: that prefill
is paid. (Serving run H, 1.5B target, 0.5B draft: at batch 4 the draft prefilled the batch, k = 2
ran 3 steps, and the 1.3 bar switched it off, throwing the prefill away.) The bar was 1.3 while a
0.5B draft cost 0.4-1.0 of a target step; with the fused layer it costs a third, k = 3 steps of the
README's main job measured 1.3x plain, right at that bar, and speculation stayed off (0.98x plain
end to end, 2026-12-07): now 1.15.

While speculation is off its estimates freeze (no drafts, no acceptance counts, no k > 0 times),
so an off decision made on the prior acceptance after one exploration (two verify steps at batch
1) would last forever. So while fewer than ``min_acceptance_observations`` drafts have been
verified, the runner-up re-measurement of a bucket that is off takes its best k > 0 whatever its
estimate, until the acceptance estimate rests on its own observations.

The draft's prefill of each new prompt is not part of a decode step, yet it is the largest cost
of speculating in a busy server (for a 0.5B draft of a 1.5B target, a third of the target's own
prefill). :meth:`worth_following` lets the draft prefill a prompt only when the request's
remaining tokens times the estimated per-token saving repay the measured prefill cost. At a batch
size not measured yet, the decision waits (the draft follows later, catching up in one go) until
the batch's plain step is timed: the cost of a k-draft step there is then extrapolated from a
smaller measured batch, linearly in the tokens the target verifies. Each extra verified token is
charged the target's measured *prefill* cost per token, not the far lower marginal cost two plain
steps show: a forward over a few tokens is bound by reading the weights, one over many by compute,
and the verify of a larger batch runs beyond the token counts measured. (1.5B target on 2 cores:
plain steps of 1 and 4 tokens both take ~0.2 s, yet a k = 2 step costs 0.37 s at batch 1 and 0.455
s at batch 4.) The estimate is thus pessimistic, as "never slower" wants. A sequence the draft did
not follow decodes without speculation.

Steps whose cost is not k's own (the draft catching up over a whole prompt, or over the tokens
decoded while speculation was off) are counted but not timed: the engine passes ``steady=False``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Arm:
    time_per_seq_s: float | None = None   # EMA of step time / batch size, seconds


@dataclass
class _Bucket:
    arms: list[_Arm]
    steps: int = 0
    batch_size: float = 0.0                # EMA of the batch sizes timed in this bucket
    speculating: bool = False              # on: the last decision chose a k > 0, or the draft followed all
    explore: int | None = None             # an arm being measured: run it twice, record the second
    explore_left: int = 0


@dataclass
class AdaptiveSpeculation:
    """Goodput-maximizing choice of the number of draft tokens per decode step.

    Args:
        max_k: the configured ``num_speculative_tokens`` (the largest k ever chosen).
        ema: weight of a new step-time measurement in its running average (0, 1].
        decay: factor applied to the acceptance counts at every observed step, in (0, 1].
        explore_interval: decode steps of a bucket between re-measurements of the runner-up.
        explore_margin: the runner-up is re-measured only if its estimated goodput is at least this
            fraction of the best one's.
        min_acceptance_observations: while fewer drafts than this have been verified (the
            acceptance estimate is still mostly its prior), a bucket with speculation off measures
            its best k > 0 again at every runner-up re-measurement, whatever its estimate.
        min_gain: speculation switches on in a bucket only where its estimated goodput beats no
            speculation's by this factor, a margin for measurement noise and for costs outside
            decode steps (the draft's prompt prefill is also weighed per request, by
            :meth:`worth_following`).
        keep_gain: once on, speculation stays on while its estimate beats k = 0 by this factor
            (hysteresis: a batch-1 server with one threshold of 1.3 flipped speculation off as its
            k = 2 step-time estimate moved between 0.42 and 0.55 s, 1.5B target, 0.5B draft).
        prior_acceptance: assumed per-draft acceptance before any is measured.
    """

    max_k: int
    ema: float = 0.3
    decay: float = 0.98
    explore_interval: int = 16
    explore_margin: float = 0.9
    min_acceptance_observations: int = 8
    min_gain: float = 1.15
    keep_gain: float = 1.05
    prior_acceptance: float = 0.6
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    _accepted: list[float] = field(default_factory=list)   # [max_k] decayed count: first j+1 drafts accepted
    _drafted: list[float] = field(default_factory=list)    # [max_k] decayed count: j+1 drafts proposed
    chosen_counts: list[int] = field(default_factory=list)  # [max_k + 1] decode steps run with each k
    draft_prefill_s_per_token: float | None = None          # EMA of the draft's prompt prefill cost
    target_prefill_s_per_token: float | None = None         # EMA of the target's prefill cost per token
    min_prefill_tokens: int = 32                            # smaller prefill steps are not timed

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        if not 0 < self.keep_gain <= self.min_gain:
            raise ValueError(f"keep_gain must be in (0, min_gain={self.min_gain}], got {self.keep_gain}")
        self._accepted = [0.0] * self.max_k
        self._drafted = [0.0] * self.max_k
        self.chosen_counts = [0] * (self.max_k + 1)

    # ------------------------------------------------------------------ estimates
    def acceptance_prob(self, j: int) -> float:
        """Estimated P(the first j+1 drafts are all accepted), j = 0 .. max_k - 1.

        The measured ratio is blended with ``prior_acceptance ** (j+1)`` through two pseudo-counts.
        """
        prior = self.prior_acceptance ** (j + 1)
        return (self._accepted[j] + 2.0 * prior) / (self._drafted[j] + 2.0)

    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a sequence gains from one step with k drafts (1 at k = 0)."""
        return 1.0 + sum(self.acceptance_prob(j) for j in range(k))

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        """Batch sizes 1..8 each have their own bucket (per-sequence cost still changes fast there,
        and arms must be compared at the same size); above, powers of two: 9-16, 17-32, ..."""
        b = max(batch_size, 1)
        return b if b <= 8 else 8 + math.ceil(math.log2(b)) - 3

    def _bucket(self, batch_size: int) -> _Bucket:
        b = self.bucket_of(batch_size)
        if b not in self._buckets:
            self._buckets[b] = _Bucket([_Arm() for _ in range(self.max_k + 1)])
        return self._buckets[b]

    def estimated_time_per_seq(self, batch_size: int, k: int) -> float | None:
        """Measured (or, between measured k's, interpolated) step seconds per sequence; None if unknown."""
        return self._time_in(self._bucket(batch_size), k)

    def _time_in(self, bucket: _Bucket, k: int) -> float | None:
        arms = bucket.arms
        if arms[k].time_per_seq_s is not None:
            return arms[k].time_per_seq_s
        lo = next((j for j in range(k - 1, -1, -1) if arms[j].time_per_seq_s is not None), None)
        hi = next((j for j in range(k + 1, self.max_k + 1) if arms[j].time_per_seq_s is not None), None)
        if lo is None or hi is None:
            return None
        t_lo, t_hi = arms[lo].time_per_seq_s, arms[hi].time_per_seq_s
        return t_lo + (t_hi - t_lo) * (k - lo) / (hi - lo)

    def goodput(self, batch_size: int, k: int) -> float | None:
        """Estimated tokens per second per sequence of a step with k drafts; None if unknown."""
        return self.goodput_in(self._bucket(batch_size), k)

    def measured_gain(self, batch_size: int = 1) -> tuple[float, int] | None:
        """``(gain, k)``: the best goodput among the k > 0 timed at ``batch_size`` over k = 0's
        (the speedup of a decode step speculating at k over a plain one, acceptance included);
        None until k = 0 and some k > 0 are timed there."""
        bucket = self._bucket(batch_size)
        plain = self.goodput_in(bucket, 0) if bucket.arms[0].time_per_seq_s is not None else None
        timed = [(self.goodput_in(bucket, k), k) for k in range(1, self.max_k + 1)
                 if bucket.arms[k].time_per_seq_s is not None]
        if not plain or not timed:
            return None
        best, k = max(timed)
        return best / plain, k

    def goodput_in(self, bucket: _Bucket, k: int) -> float | None:
        t = self._time_in(bucket, k)
        return None if t is None or t <= 0 else self.expected_tokens(k) / t

    # ------------------------------------------------------------------ decisions
    def _best(self, scores: list[float | None], speculating: bool = False) -> int | None:
        """The k to run given goodput estimates: speculation must beat k = 0 by ``min_gain`` to
        switch on, by ``keep_gain`` to stay on (``speculating``); None while k = 0 or the maximum
        k is unmeasured."""
        if scores[0] is None or scores[self.max_k] is None:
            return None
        best = max(range(1, self.max_k + 1), key=lambda k: scores[k] if scores[k] is not None else -1.0)
        bar = self.keep_gain if speculating else self.min_gain
        return best if scores[best] is not None and scores[best] >= bar * scores[0] else 0

    def _bucket_scores(self, b: int) -> list[float | None]:
        return [self.goodput_in(self._buckets[b], k) for k in range(self.max_k + 1)]

    def _measured_below(self, b: int) -> int | None:
        """The largest bucket below ``b`` that has measured both k = 0 and the maximum k."""
        return next((x for x in sorted(self._buckets, reverse=True)
                     if x < b and self._best(self._bucket_scores(x)) is not None), None)

    def _extrapolated_scores(self, b: int) -> list[float | None] | None:
        """Goodput estimates for bucket ``b`` whose k = 0 is measured but whose maximum k is not:
        a k-draft step costs the nearest smaller measured bucket's k-draft step plus, for each
        extra sequence, (k + 1) target tokens at the target's prefill cost per token (or the
        marginal per-token cost the two buckets' plain steps show, if higher or if no prefill is
        timed yet) and k draft tokens at the draft's prefill cost per token (0 before any is
        measured). None when that is not computable."""
        own = self._buckets.get(b)
        below = self._measured_below(b)
        if own is None or own.arms[0].time_per_seq_s is None or below is None:
            return None
        small = self._buckets[below]
        n, n_small = own.batch_size, small.batch_size
        if n <= n_small:
            return None
        t0 = own.arms[0].time_per_seq_s * n
        marginal = max(0.0, (t0 - small.arms[0].time_per_seq_s * n_small) / (n - n_small),
                       self.target_prefill_s_per_token or 0.0)
        scores: list[float | None] = [self.expected_tokens(0) * n / t0]
        draft_per_token = self.draft_prefill_s_per_token or 0.0
        for k in range(1, self.max_k + 1):
            tk = self._time_in(small, k) * n_small + (marginal * (k + 1) + draft_per_token * k) * (n - n_small)
            scores.append(self.expected_tokens(k) * n / tk)
        return scores

    def _decision(self, b: int) -> int | None:
        """The k bucket ``b``'s estimates choose (measured, else extrapolated); None if unknown."""
        own = self._buckets.get(b)
        if own is not None:
            best = self._best(self._bucket_scores(b), own.speculating)
            if best is not None:
                return best
        scores = self._extrapolated_scores(b)
        return None if scores is None else self._best(scores)

    def _presumed_off(self, batch_size: int) -> bool:
        """True when this bucket has not measured speculation but its estimate (extrapolated from
        its plain step, or else a smaller batch's decision) says it does not pay: verification
        only gets relatively dearer as the batch grows."""
        b = self.bucket_of(batch_size)
        if self._bucket(batch_size).arms[self.max_k].time_per_seq_s is not None:
            return False
        decision = self._decision(b)
        if decision is None:
            below = self._measured_below(b)
            decision = None if below is None else self._decision(below)
        return decision == 0

    def saving_per_token(self, batch_size: int) -> float | None:
        """Estimated wall seconds a sequence saves per generated token by speculating at
        ``batch_size`` with the best k, against k = 0: ``1/goodput(0) - 1/goodput(best)``; 0 where
        k = 0 is best (or a smaller batch found it best). Measured goodputs where the bucket has
        them, else extrapolated from its plain step (:meth:`_extrapolated_scores`). None while
        unknown: this batch size's plain step is unmeasured, or nothing is measured at all."""
        b = self.bucket_of(batch_size)
        own = self._buckets.get(b)
        scores, best = None, None
        if own is not None:
            scores = self._bucket_scores(b)
            best = self._best(scores, own.speculating)
        if best is None:
            scores = self._extrapolated_scores(b)
            best = None if scores is None else self._best(scores)
        if best is None:
            below = self._measured_below(b)
            return 0.0 if below is not None and self._decision(below) == 0 else None
        return 0.0 if best == 0 else 1.0 / scores[0] - 1.0 / scores[best]

    def worth_following(self, batch_size: int, remaining_tokens: int, num_prompt_tokens: int) -> bool | None:
        """Whether the draft should prefill a new prompt, so the sequence can speculate later.

        The draft's prefill is paid now, in full, by every running sequence; speculation pays back
        ``saving_per_token`` on each of the ``remaining_tokens`` the sequence may still generate.
        The draft follows when the expected saving exceeds the measured prefill cost, and always
        while nothing is measured yet (speculation must be measured somewhere).

        Args:
            batch_size: the number of sequences the request will decode alongside (itself included).
            remaining_tokens: tokens the request may still generate (max_tokens minus its output).
            num_prompt_tokens: tokens the draft would have to prefill.
        Returns:
            True / False, or None: not known yet (a smaller batch has measured speculation but
            this one's plain step is unmeasured); ask again after a few decode steps.
        """
        saving = self.saving_per_token(batch_size)
        if saving is None:
            return None if self._measured_below(self.bucket_of(batch_size)) is not None else True
        if saving <= 0.0:
            return False
        cost = (self.draft_prefill_s_per_token or 0.0) * num_prompt_tokens
        return remaining_tokens * saving > cost

    def observe_draft_prefill(self, num_tokens: int, seconds: float) -> None:
        """Record the wall time of the draft prefilling ``num_tokens`` prompt tokens."""
        if num_tokens > 0:
            self.draft_prefill_s_per_token = self._ema(self.draft_prefill_s_per_token, seconds / num_tokens)

    def observe_target_prefill(self, num_tokens: int, seconds: float) -> None:
        """Record the wall time of a target forward over ``num_tokens`` tokens of a prefill (or
        mixed prefill + decode) step; steps under ``min_prefill_tokens`` tokens are skipped (their
        time is mostly reading the weights, not the per-token compute this measures)."""
        if num_tokens >= self.min_prefill_tokens:
            self.target_prefill_s_per_token = self._ema(self.target_prefill_s_per_token, seconds / num_tokens)

    def _ema(self, prev: float | None, value: float) -> float:
        return value if prev is None else (1 - self.ema) * prev + self.ema * value

    def choose(self, batch_size: int, all_can_draft: bool = True) -> int:
        """k for the next decode step of ``batch_size`` sequences (0 = do not speculate).

        ``all_can_draft=False``: the draft does not follow some of the sequences, so a step with
        k > 0 could not be timed as k's cost; an unmeasured k > 0 is then not explored (the step
        runs with k = 0) rather than explored forever without a measurement.
        """
        bucket = self._bucket(batch_size)
        if bucket.explore is not None and bucket.explore_left > 0:
            if bucket.explore == 0 or all_can_draft:
                return bucket.explore
            bucket.explore, bucket.explore_left = None, 0
        if self._presumed_off(batch_size):
            return 0
        for k in (0, self.max_k):  # the two ends first: every other k can then be interpolated
            if bucket.arms[k].time_per_seq_s is None:
                if k == 0:
                    return self._start_explore(bucket, 0)
                if not all_can_draft:
                    return 0
                # The draft has prefilled every sequence of the batch: that cost is sunk, so the
                # first measurement only has to show speculation pays by keep_gain, not min_gain.
                bucket.speculating = True
                return self._start_explore(bucket, k)
        scores = {k: self.goodput(batch_size, k) for k in range(self.max_k + 1)}
        best = self._best([scores[k] for k in range(self.max_k + 1)], bucket.speculating)
        bucket.speculating = best > 0
        if bucket.steps % self.explore_interval == self.explore_interval - 1:
            runner_up = self._runner_up(scores, best)
            if runner_up is not None and (runner_up == 0 or all_can_draft):
                return self._start_explore(bucket, runner_up)
        return best

    def _runner_up(self, scores: dict[int, float], best: int) -> int | None:
        """The k worth measuring again: the next best, if its estimate comes within
        ``explore_margin`` of the bar it must clear (the best's goodput, or min_gain times k = 0's),
        or, with speculation off, whatever its estimate while acceptance is mostly the prior's."""
        others = sorted((k for k in scores if k != best), key=lambda k: -scores[k])
        if not others:
            return None
        bar = scores[best] * (self.min_gain if best == 0 else 1.0)   # k = 0 best: speculation is off
        prior_only = best == 0 and self._drafted[0] < self.min_acceptance_observations
        return others[0] if prior_only or scores[others[0]] >= self.explore_margin * bar else None

    @staticmethod
    def _start_explore(bucket: _Bucket, k: int) -> int:
        bucket.explore, bucket.explore_left = k, 2
        return k

    def observe_step(self, batch_size: int, k: int, step_time_s: float, steady: bool = True) -> None:
        """Record the wall time of one decode step that ran with k drafts for ``batch_size`` sequences.

        ``steady=False``: the step also did one-off work (the draft caught up over a backlog), so it
        counts as a step of k but its time is not k's cost.
        """
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        self.chosen_counts[k] += 1
        first_of_two = False
        if bucket.explore == k and bucket.explore_left > 0:
            first_of_two = bucket.explore_left == 2 and bucket.arms[k].time_per_seq_s is None
            bucket.explore_left -= 1
            if bucket.explore_left == 0:
                bucket.explore = None
        # An arm's very first step is not timed (its exploration runs it twice, the second timed):
        # it may pay one-off costs (the first one-row forward after a prefill, the draft's first
        # steps), and the EMA would keep a first estimate far off for many steps.
        if not steady or first_of_two:
            return
        arm = bucket.arms[k]
        bucket.batch_size = self._ema(bucket.batch_size or None, float(batch_size))
        arm.time_per_seq_s = self._ema(arm.time_per_seq_s, step_time_s / max(batch_size, 1))

    def observe_acceptance(self, observations: list[tuple[int, int]]) -> None:
        """Record one verify step: ``(num_draft_tokens, num_accepted)`` for each sequence."""
        for j in range(self.max_k):
            self._accepted[j] *= self.decay
            self._drafted[j] *= self.decay
        for num_draft, num_accepted in observations:
            for j in range(min(num_draft, self.max_k)):
                self._drafted[j] += 1.0
                self._accepted[j] += float(j < num_accepted)
