"""Draft trees: shapes, construction, attention masks, positions and acceptance.

A draft tree holds the sequence's newest token as its root (node 0) and draft tokens below it, in
breadth-first order (a node's parent always comes before it). The target verifies every node in
one forward: node i sits at position ``context_len + depth(i)`` and attends to the whole context
plus its own ancestors (:func:`tree_attention_mask`); the mask covers the draft block only, so the
context stays plainly causal (SpecInfer, Miao et al. 2024, section 4: tree-based parallel
decoding). The target's distribution at node i is
that of the token after the path root..i.

Two ways to shape a tree:

- **static** (EAGLE-1, Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
  Uncertainty", section 4.2): a fixed list of paths of child ranks; ``(0, 1)`` is the second most
  likely child of the most likely first token. :data:`EAGLE1_TREE` is EAGLE-1's default shape.
- **dynamic** (EAGLE-2, Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic
  Draft Trees", section 4): expand the ``topk`` children of each of the ``topk`` best nodes of the
  last level, by cumulative draft log-probability, for ``depth`` levels; then keep the
  ``num_draft_tokens`` best nodes of all. Cumulative log-probabilities only fall along a path, so
  the kept set holds every kept node's ancestors.

Acceptance (:func:`accept_tree`) walks down from the root. Greedy: follow the child whose token is
the target's argmax. Sampled: the children of a node are deterministic proposals (the draft's top
tokens, not samples), so each is a one-hot draft distribution: try them in order, accept child x
with probability ``p(x)`` under the current residual ``p``, else set ``p(x) = 0`` and renormalize;
when none is accepted draw the final token from the residual (multi-candidate recursive rejection
sampling, Miao et al. 2024, "SpecInfer", section 4.2, with one-hot proposals). Every emitted token
then follows the target's distribution exactly: the chance of emitting x at a node is ``p(x)``
whether x is a child or not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from specserve.config import EAGLE1_TREE, TreeSpec  # noqa: F401  (tree shapes are configuration)
from specserve.kv_cache.kv_cache import move_kv_slots

if TYPE_CHECKING:
    from specserve.structured_output import GrammarState

@dataclass
class DraftTree:
    """One sequence's draft tree, root first, each node after its parent.

    Attributes:
        token_ids: ``[N + 1]`` token of each node; ``token_ids[0]`` is the newest sampled token.
        parents: ``[N + 1]`` parent of each node (``parents[0] = -1``, ``parents[i] < i``).
        scores: ``[N + 1]`` cumulative draft log-probability of the path to each node (root 0).
    """

    token_ids: list[int]
    parents: list[int]
    scores: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.parents) or not self.parents or self.parents[0] != -1:
            raise ValueError("a draft tree needs one parent per token and the root first (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents) if i):
            raise ValueError(f"every node's parent must come before it, got parents {self.parents}")
        if not self.scores:
            self.scores = [0.0] * len(self.parents)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def depths(self) -> list[int]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return d

    def children(self, node: int) -> list[int]:
        """Children of ``node`` in the order they were drafted (most likely first)."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def path(self, node: int) -> list[int]:
        """Nodes from the root's first child down to ``node`` (empty for the root)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def attention_mask(self) -> torch.Tensor:
        return tree_attention_mask(self.parents)

    def subtree(self, keep: list[bool]) -> "DraftTree":
        """The tree of the nodes with ``keep[i]`` (the root and every kept node's parent must be
        kept), in the same order, parents renumbered."""
        if not keep[0] or any(keep[i] and not keep[p] for i, p in enumerate(self.parents) if i):
            raise ValueError("a subtree keeps the root and the parent of every node it keeps")
        index = {}
        token_ids, parents, scores = [], [], []
        for i, k in enumerate(keep):
            if k:
                index[i] = len(token_ids)
                token_ids.append(self.token_ids[i])
                parents.append(-1 if i == 0 else index[self.parents[i]])
                scores.append(self.scores[i])
        return DraftTree(token_ids, parents, scores)

    def positions(self, start: int) -> list[int]:
        """Position of each node when the root sits at ``start``: ``start + depth``."""
        return [start + d for d in self.depths]


def grammar_subtree(tree: DraftTree, grammar: "GrammarState") -> DraftTree:
    """``tree`` without the nodes whose token the grammar refuses after the path above them, and
    their subtrees (structured output: such a node could never be accepted, and its row has no
    grammar state to mask with). Nothing follows an EOS node."""
    keep = [True] + [False] * (tree.num_nodes - 1)
    for i in range(1, tree.num_nodes):
        p = tree.parents[i]
        if keep[p] and not (p and grammar.is_eos(tree.token_ids[p])):
            mask = grammar.allowed_token_mask([tree.token_ids[n] for n in tree.path(p)])
            keep[i] = bool(mask[tree.token_ids[i]])
    return tree if all(keep) else tree.subtree(keep)


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """``[n, n]`` bool: ``mask[i, j]`` is True where node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        mask[i, i] = True
        if parents[i] >= 0:
            mask[i] |= mask[parents[i]]
    return mask


# ------------------------------------------------------------------------------------- building

@dataclass(frozen=True)
class ExpandItem:
    """A node whose children the draft must score: sequence ``seq``, node ``node`` with token
    ``token``, child of ``parent`` (root: node 0, parent -1). Node ids are those of the tree being
    built (static) or of the candidate list (dynamic, root 0); the draft keys its per-node state
    (the feature a node's children read) by ``(seq, node)``."""

    seq: int
    node: int
    parent: int
    token: int


Expand = Callable[[list[ExpandItem]], torch.Tensor]
"""``expand(items) -> [len(items), V]`` draft log-probabilities of the children of each item's node
(the caller runs the draft over those nodes, one batched forward per tree level)."""


def build_static_trees(roots: list[int], root_logprobs: torch.Tensor, spec: TreeSpec,
                       expand: Expand, limits: list[int] | None = None) -> list[DraftTree]:
    """Fill ``spec``'s shape for each sequence: a node's children are its top tokens by draft
    log-probability, in rank order.

    Args:
        roots: ``[B]`` the newest token of each sequence.
        root_logprobs: ``[B, V]`` draft log-probabilities of the first draft token.
        spec: the shape.
        expand: see :data:`Expand`; called once per depth >= 2 for every node that has children.
        limits: per sequence, the deepest level allowed (nodes deeper are dropped).
    """
    b = len(roots)
    trees = [DraftTree([roots[i]], [-1]) for i in range(b)]
    node_of: list[dict[int, int]] = [{0: 0} for _ in range(b)]    # spec node -> tree node
    spec_of: list[dict[int, int]] = [{0: 0} for _ in range(b)]    # tree node -> spec node
    num_children: dict[int, int] = {}
    for n in range(1, len(spec.parents)):
        num_children[spec.parents[n]] = max(num_children.get(spec.parents[n], 0), spec.ranks[n] + 1)
    depth_of = [0] * len(spec.parents)
    for n in range(1, len(spec.parents)):
        depth_of[n] = depth_of[spec.parents[n]] + 1
    # per (sequence, tree node): the top tokens and log-probabilities of its children
    tops: dict[tuple[int, int], tuple[list[float], list[int]]] = {}
    values, tokens = _top(root_logprobs, num_children[0])
    for i in range(b):
        tops[(i, 0)] = (values[i], tokens[i])
    for depth in range(1, spec.depth + 1):
        level = [n for n in range(1, len(spec.parents)) if depth_of[n] == depth]
        need = []
        for i in range(b):
            if limits is not None and depth > limits[i]:
                continue
            tree = trees[i]
            for n in level:
                parent = node_of[i][spec.parents[n]]
                values, tokens = tops[(i, parent)]
                tree.token_ids.append(tokens[spec.ranks[n]])
                tree.parents.append(parent)
                tree.scores.append(tree.scores[parent] + values[spec.ranks[n]])
                node = tree.num_nodes - 1
                node_of[i][n], spec_of[i][node] = node, n
                if n in num_children and (limits is None or depth < limits[i]):
                    need.append(ExpandItem(i, node, parent, tree.token_ids[node]))
        if need:
            widths = [num_children[spec_of[item.seq][item.node]] for item in need]
            values, tokens = _top(expand(need), max(widths))
            for item, w, v, t in zip(need, widths, values, tokens):
                tops[(item.seq, item.node)] = (v[:w], t[:w])
    return trees


def _top(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """The k best of every row of ``logprobs [R, V]``, best first, as host lists: one topk and
    one read back for a whole tree level."""
    top = torch.topk(logprobs, k)
    return top.values.tolist(), top.indices.tolist()


def build_dynamic_trees(roots: list[int], root_logprobs: torch.Tensor, depth: int, topk: int,
                        num_draft_tokens: int, expand: Expand,
                        limits: list[int] | None = None) -> list[DraftTree]:
    """EAGLE-2 trees: ``depth`` levels, each expanding the ``topk`` children of the ``topk`` best
    nodes (by cumulative log-probability) of the level before; then the ``num_draft_tokens`` best
    nodes of all are kept (ties broken by creation order, so a kept node's ancestors are kept).

    Args are those of :func:`build_static_trees`; ``limits`` caps each tree's depth. Node ids given
    to ``expand`` are candidate ids (root 0, then creation order).
    """
    b = len(roots)
    # candidates per sequence: (cumulative score, token, parent id); id 0 is the root
    cands: list[list[tuple[float, int, int]]] = [[(0.0, roots[i], -1)] for i in range(b)]
    level: list[list[int]] = [[] for _ in range(b)]
    root_values, root_tokens = _top(root_logprobs, topk)
    for i in range(b):
        if limits is not None and limits[i] < 1:
            continue
        for v, t in zip(root_values[i], root_tokens[i]):
            cands[i].append((v, t, 0))
            level[i].append(len(cands[i]) - 1)
    for d in range(2, depth + 1):
        need = []
        for i in range(b):
            if limits is not None and d > limits[i]:
                continue
            frontier = sorted(level[i], key=lambda c: (-cands[i][c][0], c))[:topk]
            need += [ExpandItem(i, c, cands[i][c][2], cands[i][c][1]) for c in sorted(frontier)]
        level = [[] for _ in range(b)]
        if not need:
            break
        for item, values, tokens in zip(need, *_top(expand(need), topk)):
            base = cands[item.seq][item.node][0]
            for v, t in zip(values, tokens):
                cands[item.seq].append((base + v, t, item.node))
                level[item.seq].append(len(cands[item.seq]) - 1)
    trees = []
    for i in range(b):
        ranked = sorted(range(1, len(cands[i])), key=lambda c: (-cands[i][c][0], c))
        keep = set(ranked[:num_draft_tokens])
        for c in list(keep):          # equal scores could drop an ancestor: put it back
            p = cands[i][c][2]
            while p > 0 and p not in keep:
                keep.add(p)
                p = cands[i][p][2]
        depth_of = {0: 0}
        for c in sorted(keep):        # a parent is created before its children
            depth_of[c] = depth_of[cands[i][c][2]] + 1
        order = sorted(keep, key=lambda c: (depth_of[c], c))   # breadth-first
        index = {0: 0, **{c: n + 1 for n, c in enumerate(order)}}
        tree = DraftTree([roots[i]], [-1])
        for c in order:
            score, token, p = cands[i][c]
            tree.token_ids.append(token)
            tree.parents.append(index[p])
            tree.scores.append(score)
        trees.append(tree)
    return trees


# ------------------------------------------------------------------------------------- acceptance

@dataclass
class TreeAcceptance:
    """``accepted_nodes``: tree nodes of the accepted path (root excluded), top down;
    ``output_token_ids``: their tokens, then the recovered or bonus token."""

    accepted_nodes: list[int]
    output_token_ids: list[int]


def accept_tree(tree: DraftTree, target_probs: torch.Tensor, greedy: bool,
                generator: torch.Generator | None = None) -> TreeAcceptance:
    """Walk the tree from the root with the target's distributions (see the module docstring).

    Args:
        tree: the verified tree.
        target_probs: ``[N + 1, V]`` float32, the target's distribution after each node (after the
            request's logits processors; one-hot for greedy requests).
        greedy: follow the argmax; draw no random numbers.
        generator: the request's generator (seeded requests), else the default one.
    Returns:
        :class:`TreeAcceptance`.
    """
    node, accepted = 0, []
    argmax = target_probs.argmax(dim=-1).tolist() if greedy else None   # one read for the whole tree
    while True:
        kids = tree.children(node)
        p = target_probs[node]
        if greedy:
            best = argmax[node]
            nxt = next((c for c in kids if tree.token_ids[c] == best), None)
            if nxt is None:
                return TreeAcceptance(accepted, [tree.token_ids[n] for n in accepted] + [best])
            accepted.append(nxt)
            node = nxt
            continue
        residual = p.to(torch.float64).clone()
        nxt = None
        for c in kids:
            x = tree.token_ids[c]
            total = float(residual.sum())
            if total <= 0.0:
                break
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * total < float(residual[x]):
                nxt = c
                break
            residual[x] = 0.0
        if nxt is None:
            if float(residual.sum()) <= 0.0:   # only through rounding: the rejected mass was all
                residual = p.to(torch.float64)
            final = int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
            return TreeAcceptance(accepted, [tree.token_ids[n] for n in accepted] + [final])
        accepted.append(nxt)
        node = nxt


def accepted_kv_moves(slots: torch.Tensor, accepted_nodes: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where the K/V entries of the accepted path move so the sequence's cache reads as if the
    accepted tokens had been verified as a chain: ``(src, dst)`` slots, or None when nothing moves.

    Args:
        slots: ``[N + 1]`` int64 cache slot of each tree node as verified (node i at ``slots[i]``;
            the root's slot is followed by the slots the path moves to).
        accepted_nodes: accepted nodes, top down.
    """
    if not accepted_nodes:
        return None
    src = slots[torch.tensor(accepted_nodes, dtype=torch.int64)]
    dst = slots[1:1 + len(accepted_nodes)]
    if torch.equal(src, dst):       # the path was the first branch all the way: already in place
        return None
    return src, dst


def compact_accepted_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                        accepted_nodes: list[int]) -> None:
    """Move the accepted path's K/V entries in place (:func:`accepted_kv_moves`, :func:`move_kv_slots`)."""
    moves = accepted_kv_moves(slots, accepted_nodes)
    if moves is not None:
        move_kv_slots(key_cache, value_cache, *moves)
