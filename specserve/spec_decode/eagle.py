"""EAGLE tree speculation: a one-layer head drafts a tree of tokens from the target's hidden states.

The head, its KV and the refill from the target's features after every verification are those of
:mod:`specserve.spec_decode.mtp` (catch-up, ``observe_target_hidden_states``); only drafting
differs. Instead of one chain, the head grows a tree level by level
(:mod:`specserve.spec_decode.tree`): a static shape (EAGLE-1) or a dynamic one (EAGLE-2). Each
level is one batched head forward over the nodes being expanded, every node reading its parent's
predicted hidden state and its own token, at position ``root + depth - 1`` (the position of the
hidden state it reads). The head's tree rows are written to scratch slots after the sequence (the
pages the scheduler reserved for the target's tree) and attend to the head's context plus their
ancestors' rows; the next catch-up overwrites them with rows computed from the target's features.
"""
from __future__ import annotations

import torch

from specserve.engine.request import Request
from specserve.kv_cache.block_manager import BlockManager
from specserve.models.draft_head import DraftHead
from specserve.spec_decode.mtp import MTPProposer
from specserve.spec_decode.tree import (DraftTree, ExpandItem, TreeSpec, build_dynamic_trees,
                                        build_static_trees)


class EagleProposer(MTPProposer):
    """Args:
        head, block_manager, target_vocab_size, device: as :class:`MTPProposer`.
        tree: a static shape, or None for EAGLE-2 dynamic trees.
        depth: dynamic trees: levels grown (static: the shape's depth).
        topk: dynamic trees: children per expanded node and nodes expanded per level.
        num_draft_tokens: dynamic trees: nodes kept (static: the shape's size).
    """

    proposes_trees = True
    supports_sync_free = False

    def __init__(self, head: DraftHead, block_manager: BlockManager, target_vocab_size: int,
                 device: torch.device | str = "cpu", tree: TreeSpec | None = None, depth: int = 4,
                 topk: int = 4, num_draft_tokens: int = 12):
        super().__init__(head, block_manager, target_vocab_size, device)
        self.tree = tree
        self.depth = tree.depth if tree is not None else depth
        self.topk = topk
        self.max_tree_nodes = tree.num_draft_tokens if tree is not None else num_draft_tokens

    def num_lookahead_tokens(self, k: int) -> int:
        return self.max_tree_nodes + 1   # the target writes the root and every node

    def propose_trees(self, reqs: list[Request], depth_limits: list[int]) -> list[DraftTree]:
        """One draft tree per request, at most ``depth_limits[b]`` levels deep (0: the root alone).

        Node order is breadth-first; a tree's nodes take the cache slots after its root's."""
        roots = [r.all_token_ids[-1] for r in reqs]
        states = [self._state(r) for r in reqs]
        vocab = self.vocab_size
        root_lp = torch.stack([torch.log_softmax(st.logits.float(), -1) if st.logits is not None
                               else torch.full((vocab,), float("-inf")) for st in states])
        limits = [d if st.logits is not None else 0 for d, st in zip(depth_limits, states)]
        features = {(b, 0): st.last_hidden for b, st in enumerate(states)}
        depth_of = {(b, 0): 0 for b in range(len(reqs))}
        parent_of: dict[tuple[int, int], int] = {}
        written: list[list[int]] = [[] for _ in reqs]     # head rows in the scratch block, in order

        def expand(items: list[ExpandItem]) -> torch.Tensor:
            order = sorted(range(len(items)), key=lambda j: items[j].seq)   # rows grouped by sequence
            by_seq: dict[int, list[ExpandItem]] = {}
            for j in order:
                by_seq.setdefault(items[j].seq, []).append(items[j])
            hidden, tokens, positions, masks, starts, lens, seq_reqs = [], [], [], [], [], [], []
            for b, group in by_seq.items():
                block = written[b]
                new = [it.node for it in group]
                index = {node: i for i, node in enumerate(block + new)}
                mask = torch.zeros(len(new), len(block) + len(new), dtype=torch.bool)
                for row, it in enumerate(group):
                    key = (b, it.node)
                    parent_of[key] = it.parent
                    depth_of[key] = depth_of[(b, it.parent)] + 1
                    node = it.node
                    while node != 0:          # the node and its ancestors below the root
                        mask[row, index[node]] = True
                        node = parent_of[(b, node)]
                    hidden.append(features[(b, it.parent)])
                    tokens.append(it.token)
                    positions.append(reqs[b].num_tokens - 2 + depth_of[key])
                masks.append(mask)
                starts.append(reqs[b].num_tokens - 1 + len(block))
                lens.append(len(new))
                seq_reqs.append(reqs[b])
                written[b] = block + new
            out = self._run(torch.stack(hidden), tokens, seq_reqs, starts, lens, positions, masks)
            row = 0
            for b, group in by_seq.items():
                for it in group:
                    features[(b, it.node)] = out[row]
                    row += 1
            logprobs = torch.log_softmax(self._target_logits(out).float(), dim=-1)
            back = torch.empty(len(items), dtype=torch.int64)
            back[torch.tensor(order)] = torch.arange(len(items))
            return logprobs[back]

        if self.tree is not None:
            return build_static_trees(roots, root_lp, self.tree, expand, limits)
        return build_dynamic_trees(roots, root_lp, self.depth, self.topk, self.max_tree_nodes, expand, limits)
