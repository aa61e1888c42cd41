"""Draft trees: shapes, masks and positions on hand-built trees, construction against brute force,
acceptance against the exact target distribution, KV compaction."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from specserve.spec_decode.tree import (
    EAGLE1_TREE, DraftTree, TreeSpec, accept_tree, build_dynamic_trees, build_static_trees,
    compact_accepted_kv, tree_attention_mask)


def chi_square_pvalue(observed: Counter, expected: dict, min_expected: float = 5.0) -> float:
    """One-sample chi-square goodness of fit; cells expected below ``min_expected`` are pooled."""
    n = sum(observed.values())
    assert set(observed) <= set(expected), set(observed) - set(expected)
    cells, pooled = [], [0.0, 0.0]
    for key, prob in expected.items():
        e = prob * n
        if e >= min_expected:
            cells.append((observed[key], e))
        else:
            pooled[0] += observed[key]
            pooled[1] += e
    if pooled[1] > 0:
        cells.append(tuple(pooled))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


# ----------------------------------------------------------------------------- shapes

def test_eagle1_preset():
    spec = TreeSpec.from_paths(EAGLE1_TREE)
    assert spec.num_draft_tokens == 25 and spec.depth == 5
    # node 1..4 are the root's top 4; (0, 0) is node 5, a child of node 1; (3, 0) of node 4
    assert spec.parents[:6] == (-1, 0, 0, 0, 0, 1) and spec.ranks[:6] == (0, 0, 1, 2, 3, 0)
    assert spec.paths[11] == (3, 0) and spec.parents[12] == 4
    assert spec.paths[-1] == (0, 0, 0, 0, 1) and spec.parents[-1] == spec.paths.index((0, 0, 0, 0)) + 1


def test_spec_from_unsorted_paths_and_chain():
    spec = TreeSpec.from_paths([[1, 0], [0], [1], [0, 0, 0], [0, 0]])
    assert spec.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    assert spec.parents == (-1, 0, 0, 1, 2, 3)
    assert TreeSpec.chain(3).parents == (-1, 0, 1, 2)


@pytest.mark.parametrize("paths, match", [
    ([], "at least one"), ([[0], [0, 1, 0]], "no parent"), ([[0], [0]], "twice"),
    ([[-1]], "ranks >= 0"), ([[]], "non-empty"), (["ab"], "list of child ranks")])
def test_bad_static_trees(paths, match):
    with pytest.raises(ValueError, match=match):
        TreeSpec.from_paths(paths)


def test_mask_and_positions_hand_built():
    #        0
    #      1   2
    #     3 4   5
    tree = DraftTree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 1, 2])
    assert tree.attention_mask().int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 0, 1, 0, 0, 1]]
    assert tree.positions(7) == [7, 8, 8, 9, 9, 9]
    assert tree.children(1) == [3, 4] and tree.path(4) == [1, 4] and tree.path(0) == []
    assert torch.equal(tree_attention_mask([-1, 0, 1]), torch.tril(torch.ones(3, 3, dtype=torch.bool)))
    with pytest.raises(ValueError, match="parent must come before"):
        DraftTree([1, 2, 3], [-1, 2, 0])


# ----------------------------------------------------------------------------- building

V = 7


def fake_logprobs(token: int) -> torch.Tensor:
    """Deterministic draft log-probabilities after ``token``: distinct, so ranks are unambiguous."""
    g = torch.Generator().manual_seed(1000 + token)
    return torch.log_softmax(torch.randn(V, generator=g, dtype=torch.float64) * 2, dim=-1).float()


def expand(items):
    return torch.stack([fake_logprobs(item.token) for item in items])


def top(lp: torch.Tensor, rank: int) -> int:
    return int(torch.argsort(lp, descending=True)[rank])


def test_static_tree_follows_ranks():
    spec = TreeSpec.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 1, 0)])
    roots = [3, 5]
    root_lp = torch.stack([fake_logprobs(100), fake_logprobs(101)])
    calls = []

    def recording(items):
        calls.append(items)
        return expand(items)

    trees = build_static_trees(roots, root_lp, spec, recording)
    for b, tree in enumerate(trees):
        t1, t2 = top(root_lp[b], 0), top(root_lp[b], 1)
        t11, t12 = top(fake_logprobs(t1), 0), top(fake_logprobs(t1), 1)
        t21 = top(fake_logprobs(t2), 0)
        t121 = top(fake_logprobs(t12), 0)
        assert tree.token_ids == [roots[b], t1, t2, t11, t12, t21, t121]
        assert tree.parents == list(spec.parents)
        assert tree.scores[4] == pytest.approx(float(root_lp[b][t1]) + float(fake_logprobs(t1)[t12]))
    # one draft call per level that has children: depth 1 (nodes 1, 2 of both), depth 2 (node 4)
    assert [[(it.seq, it.node, it.parent) for it in c] for c in calls] == [
        [(0, 1, 0), (0, 2, 0), (1, 1, 0), (1, 2, 0)], [(0, 4, 1), (1, 4, 1)]]
    # a depth limit cuts deeper nodes
    cut = build_static_trees(roots, root_lp, spec, expand, limits=[1, 2])
    assert cut[0].parents == [-1, 0, 0] and cut[1].parents == [-1, 0, 0, 1, 1, 2]


def brute_force_dynamic(root_lp: torch.Tensor, depth: int, topk: int, n: int) -> list[tuple[float, tuple[int, ...]]]:
    """EAGLE-2's selection written out over token paths: every level expands the topk children of
    the topk best paths of the level before; the n best paths of all are kept."""
    level = [(float(v), (int(t),)) for v, t in zip(*torch.topk(root_lp, topk))]
    everything = list(level)
    for _ in range(depth - 1):
        frontier = sorted(level, key=lambda x: -x[0])[:topk]
        level = []
        for score, path in frontier:
            lp = fake_logprobs(path[-1])
            for v, t in zip(*torch.topk(lp, topk)):
                level.append((score + float(v), path + (int(t),)))
        everything += level
    return sorted(everything, key=lambda x: -x[0])[:n]


@pytest.mark.parametrize("depth, topk, n", [(1, 3, 2), (3, 2, 5), (4, 3, 10), (5, 4, 60)])
def test_dynamic_tree_keeps_the_best_paths(depth, topk, n):
    root_lp = fake_logprobs(200)
    (tree,) = build_dynamic_trees([9], root_lp[None], depth, topk, n, expand)
    want = brute_force_dynamic(root_lp, depth, topk, n)
    got = sorted(((tree.scores[i], tuple(tree.token_ids[j] for j in tree.path(i)))
                  for i in range(1, tree.num_nodes)), key=lambda x: -x[0])
    assert len(got) == len(want)
    assert [p for _, p in got] == [p for _, p in want]
    assert [s for s, _ in got] == pytest.approx([s for s, _ in want], abs=1e-5)
    depths = tree.depths
    assert depths == sorted(depths) and max(depths) <= depth
    assert build_dynamic_trees([9], root_lp[None], depth, topk, n, expand, limits=[0])[0].num_nodes == 1


# ----------------------------------------------------------------------------- acceptance

def test_greedy_acceptance_hand_case():
    tree = DraftTree([10, 1, 2, 3, 4], [-1, 0, 0, 2, 2])
    probs = torch.zeros(5, 6)
    probs[0, 2] = 1.0      # root -> 2 (node 2, the second child)
    probs[2, 4] = 1.0      # node 2 -> 4 (node 4)
    probs[4, 5] = 1.0      # node 4 is a leaf: bonus 5
    out = accept_tree(tree, probs, greedy=True)
    assert out.accepted_nodes == [2, 4] and out.output_token_ids == [2, 4, 5]
    probs[0] = 0
    probs[0, 0] = 1.0      # no child has token 0: recovered token 0, nothing accepted
    assert accept_tree(tree, probs, greedy=True).output_token_ids == [0]


def test_sampled_acceptance_follows_the_target():
    """Exact distribution of the emitted tokens: the first is p_root; after an accepted child c
    the second is p_c (one of c's children or, at a leaf, the bonus token). 60k draws,
    chi-square against the exact joint."""
    g = torch.Generator().manual_seed(0)
    vocab = 5
    #        0 (root, token 9)
    #   1 (tok 0)  2 (tok 3)  3 (tok 1)
    #   4 (tok 2)  5 (tok 0)
    tree = DraftTree([9, 0, 3, 1, 2, 0], [-1, 0, 0, 0, 1, 1])
    probs = torch.softmax(torch.randn(6, vocab, generator=g) * 1.5, dim=-1)
    node_of_first = {0: 1, 3: 2, 1: 3}
    expected = {}
    for x in range(vocab):
        c = node_of_first.get(x)
        if c is not None:
            for y in range(vocab):
                expected[(x, y)] = float(probs[0, x] * probs[c, y])
        else:
            expected[(x,)] = float(probs[0, x])
    counts, lengths = Counter(), Counter()
    draws = 60_000
    for _ in range(draws):
        out = accept_tree(tree, probs, greedy=False, generator=g)
        counts[tuple(out.output_token_ids[:2])] += 1
        lengths[len(out.accepted_nodes)] += 1
    assert chi_square_pvalue(counts, expected) > 1e-3
    assert lengths[2] > 0 and lengths[1] > 0 and lengths[0] > 0


def test_wrong_residual_is_caught():
    """Drawing the final token from p instead of the residual (rejected children removed) must fail
    the same test."""
    g = torch.Generator().manual_seed(1)
    tree = DraftTree([9, 0, 3], [-1, 0, 0])
    probs = torch.tensor([[0.5, 0.1, 0.1, 0.2, 0.1], [0.2] * 5, [0.2] * 5])
    expected = {(x,): float(probs[0, x]) for x in range(5)}

    def wrong(tree, p, generator):
        # accept children with probability p(x), then draw from p (not the residual)
        for c in tree.children(0):
            if float(torch.rand((), generator=generator)) < float(p[0, tree.token_ids[c]]):
                return tree.token_ids[c]
        return int(torch.multinomial(p[0], 1, generator=generator))

    right = Counter((accept_tree(tree, probs, False, g).output_token_ids[0],) for _ in range(20_000))
    bad = Counter((wrong(tree, probs, g),) for _ in range(20_000))
    assert chi_square_pvalue(right, expected) > 1e-3
    assert chi_square_pvalue(bad, expected) < 1e-6


def test_seeded_acceptance_is_reproducible():
    tree = DraftTree([9, 0, 3, 1], [-1, 0, 0, 1])
    probs = torch.softmax(torch.randn(4, 5, generator=torch.Generator().manual_seed(3)), dim=-1)
    runs = [[accept_tree(tree, probs, False, torch.Generator().manual_seed(s)).output_token_ids for s in range(50)]
            for _ in range(2)]
    assert runs[0] == runs[1]


# ----------------------------------------------------------------------------- KV

def test_compact_accepted_kv():
    layers, blocks, bs = 2, 3, 4
    key = torch.arange(layers * blocks * bs, dtype=torch.float32).view(layers, blocks, bs, 1, 1).repeat(1, 1, 1, 2, 3)
    value = -key.clone()
    # a tree of 5 nodes verified at slots: root 5, nodes 6, 7, 8 (page 1), 0 (page 0: next page)
    slots = torch.tensor([5, 6, 7, 0, 1], dtype=torch.int64)
    before = key.clone()
    compact_accepted_kv(key, value, slots, [2, 4])     # accepted path: node 2 (slot 7), node 4 (slot 1)
    flat, flat_before = key.view(layers, -1, 2, 3), before.view(layers, -1, 2, 3)
    assert torch.equal(flat[:, 6], flat_before[:, 7]) and torch.equal(flat[:, 7], flat_before[:, 1])
    assert torch.equal(value.view(layers, -1, 2, 3)[:, 6], -flat_before[:, 7])
    untouched = [s for s in range(blocks * bs) if s not in (6, 7)]
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])
    compact_accepted_kv(key, value, slots, [1])        # already in place: nothing moves
    assert torch.equal(flat[:, 6], flat_before[:, 7])
