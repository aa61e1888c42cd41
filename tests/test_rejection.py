"""Speculative rejection sampling: hand-checked greedy cases and chi-square tests of exactness."""
from __future__ import annotations

import pytest
import torch

from specserve.sample import rejection
from specserve.sample.rejection import rejection_sample

N = 20000  # samples per statistical test
V = 6


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; categories of probability 0 must stay empty."""
    observed = observed.double()
    expected = expected_probs.double() * observed.sum()
    zero = expected_probs == 0
    if bool((observed[zero] > 0).any()):
        return 0.0
    stat = ((observed[~zero] - expected[~zero]) ** 2 / expected[~zero]).sum()
    df = int((~zero).sum()) - 1
    if df == 0:  # a one-point distribution: matched exactly (the check above)
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def one_hot(i: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(i), V).float()


def dirichlet(g: torch.Generator) -> torch.Tensor:
    x = torch.empty(V).exponential_(generator=g)
    return x / x.sum()


def cases():
    g = torch.Generator().manual_seed(0)
    p1, q1, p2, q2 = (dirichlet(g) for _ in range(4))
    disjoint_p = torch.tensor([0, 0, 0, 0.2, 0.3, 0.5])
    disjoint_q = torch.tensor([0.6, 0.3, 0.1, 0, 0, 0])
    return {
        "random": (torch.stack([p1, p2, dirichlet(g)]), torch.stack([q1, q2])),
        "disjoint": (torch.stack([disjoint_p, disjoint_p, p1]), torch.stack([disjoint_q, disjoint_q])),
        "one_hot_draft": (torch.stack([p1, p2, p1]), torch.stack([one_hot(2), one_hot(4)])),
        "one_hot_target": (torch.stack([one_hot(1), one_hot(3), p2]), torch.stack([q1, q2])),
    }


def run_batch(p: torch.Tensor, q: torch.Tensor, seed: int = 0):
    """N independent rows sharing p ``[K+1, V]`` and q ``[K, V]``; drafts drawn from q."""
    k = q.shape[0]
    g = torch.Generator().manual_seed(seed + 1)
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=g) for j in range(k)], 1)
    torch.manual_seed(seed)
    return rejection_sample(drafts, [k] * N, q.expand(N, k, V).contiguous(), p.expand(N, k + 1, V).contiguous(),
                            torch.zeros(N, dtype=torch.bool), [None] * N)


@pytest.mark.parametrize("name", list(cases()))
def test_first_token_follows_target(name):
    p, q = cases()[name]
    out = run_batch(p, q)
    first = torch.tensor([t[0] for t in out.output_token_ids])
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p[0]) > 1e-3
    # the acceptance rate of the first draft is sum_x min(p, q) (Leviathan et al., section 3.3)
    alpha = torch.minimum(p[0], q[0]).sum().item()
    rate = sum(n > 0 for n in out.num_accepted) / N
    assert abs(rate - alpha) < 5 * (alpha * (1 - alpha) / N) ** 0.5 + 1e-9


def test_second_token_after_accepted_first_follows_target():
    p, q = cases()["random"]
    out = run_batch(p, q, seed=3)
    second = torch.tensor([t[1] for t, n in zip(out.output_token_ids, out.num_accepted) if n >= 1])
    assert len(second) > 2000
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p[1]) > 1e-3


def test_wrong_sampler_is_caught(monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) biases the output: the test must see it."""
    monkeypatch.setattr(rejection, "recovery_distribution", lambda p, q: p)
    p, q = cases()["random"]
    out = run_batch(p, q)
    first = torch.tensor([t[0] for t in out.output_token_ids])
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p[0]) < 1e-3


def test_greedy_hand_cases():
    target = torch.stack([one_hot(t) for t in [5, 1, 2, 0]]).unsqueeze(0)  # argmax 5, 1, 2, bonus 0
    draft = torch.stack([one_hot(t) for t in [5, 1, 3]]).unsqueeze(0)
    out = rejection_sample(torch.tensor([[5, 1, 3]]), [3], draft, target, torch.tensor([True]), [None])
    assert out.output_token_ids == [[5, 1, 2]] and out.num_accepted == [2]
    draft_all = torch.stack([one_hot(t) for t in [5, 1, 2]]).unsqueeze(0)
    out = rejection_sample(torch.tensor([[5, 1, 2]]), [3], draft_all, target, torch.tensor([True]), [None])
    assert out.output_token_ids == [[5, 1, 2, 0]] and out.num_accepted == [3]
    # ragged rows: the second row drafts one token only, its bonus comes from position 1
    two = torch.cat([target, target])
    drafts = torch.tensor([[4, 1, 2], [5, 0, 0]])
    q = torch.stack([torch.stack([one_hot(t) for t in row]) for row in drafts.tolist()])
    out = rejection_sample(drafts, [3, 1], q, two, torch.tensor([True, True]), [None, None])
    assert out.output_token_ids == [[5], [5, 1]] and out.num_accepted == [0, 1]
    # no draft at all: the target's own token
    out = rejection_sample(torch.zeros(1, 0, dtype=torch.long), [0], torch.zeros(1, 0, V), target[:, :1],
                           torch.tensor([True]), [None])
    assert out.output_token_ids == [[5]]


def test_seeded_row_independent_of_batch():
    p, q = cases()["random"]
    k = q.shape[0]
    drafts = torch.tensor([[2, 3]] * 8)

    def run(rows, gens):
        return rejection_sample(drafts[:rows], [k] * rows, q.expand(rows, k, V).contiguous(),
                                p.expand(rows, k + 1, V).contiguous(), torch.zeros(rows, dtype=torch.bool), gens)

    alone = run(1, [torch.Generator().manual_seed(77)]).output_token_ids
    gens = [torch.Generator().manual_seed(s) for s in range(7)] + [torch.Generator().manual_seed(77)]
    assert run(8, gens).output_token_ids[7] == alone[0]
    draws = {tuple(run(1, [torch.Generator().manual_seed(s)]).output_token_ids[0]) for s in range(30)}
    assert len(draws) > 1


def test_seeded_row_draws_do_not_depend_on_batch_k():
    """A row with 1 draft next to a row with 3 drafts draws as it would alone."""
    p, q = cases()["random"]
    p3 = torch.cat([p, p[:2]])       # [4, V]
    q3 = torch.cat([q, q[:1]])       # [3, V]
    one = rejection_sample(torch.tensor([[2]]), [1], q[:1].unsqueeze(0), p[:2].unsqueeze(0),
                           torch.tensor([False]), [torch.Generator().manual_seed(5)])
    both = rejection_sample(torch.tensor([[2, 0, 0], [1, 2, 3]]), [1, 3], torch.stack([q3, q3]),
                            torch.stack([p3, p3]), torch.tensor([False, False]),
                            [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)])
    assert both.output_token_ids[0] == one.output_token_ids[0]


def test_implicit_one_hot_draft_equals_dense_one_hot():
    """draft_probs=None (deterministic drafts, n-gram lookup) draws exactly what the explicit one-hot
    q gives, row for row under the same seeds: mixed draft counts, greedy and sampled rows, drafts
    the target gives probability 0 (always rejected)."""
    g = torch.Generator().manual_seed(3)
    rows, k = 64, 3
    p = torch.stack([torch.stack([dirichlet(g) for _ in range(k + 1)]) for _ in range(rows)])  # [rows, k+1, V]
    p[::5, 0] = torch.tensor([0.5, 0.5, 0, 0, 0, 0])   # and those rows draft token 2 there: p(d) = 0
    drafts = torch.randint(0, V, (rows, k), generator=g)
    drafts[::5, 0] = 2
    counts = [i % (k + 1) for i in range(rows)]
    greedy = torch.tensor([i % 7 == 0 for i in range(rows)])
    dense = torch.nn.functional.one_hot(drafts, V).float()

    def run(q):
        torch.manual_seed(11)
        return rejection_sample(drafts, counts, q, p, greedy,
                                [torch.Generator().manual_seed(i) if i % 3 == 0 else None for i in range(rows)])

    implicit, explicit = run(None), run(dense)
    assert implicit.output_token_ids == explicit.output_token_ids
    assert implicit.num_accepted == explicit.num_accepted
    assert all(implicit.num_accepted[i] == 0 for i in range(0, rows, 5) if counts[i] > 0)
    assert len(set(implicit.num_accepted)) > 1   # both accepted and rejected drafts were exercised


def test_implicit_one_hot_draft_follows_target():
    """A fixed draft token 4 with implicit one-hot q: the first emitted token follows p exactly
    (chi-square over N rows), and the second, when the draft was accepted, follows p2."""
    g = torch.Generator().manual_seed(8)
    p1, p2 = dirichlet(g), dirichlet(g)
    drafts = torch.full((N, 1), 4)
    torch.manual_seed(1)
    out = rejection_sample(drafts, [1] * N, None, torch.stack([p1, p2]).expand(N, 2, V).contiguous(),
                           torch.zeros(N, dtype=torch.bool), [None] * N)
    first = torch.tensor([o[0] for o in out.output_token_ids])
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p1) > 1e-3
    second = torch.tensor([o[1] for o in out.output_token_ids if len(o) == 2])
    assert abs(len(second) / N - float(p1[4])) < 4 * (float(p1[4] * (1 - p1[4])) / N) ** 0.5
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p2) > 1e-3
