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

from specserve.models.draft_head import DraftHead
from specserve.sample.sampler import SamplingMetadata
from specserve.spec_decode.mtp import MTPProposer
from specserve.spec_decode.proposer import DraftProposal, TreeProposal
from specserve.spec_decode.tree import ExpandItem, TreeSpec, build_dynamic_trees, build_static_trees
from specserve.worker.step import StepBatch


class EagleProposer(MTPProposer):
    """Args:
        head, num_blocks, block_size, target_vocab_size, device: as :class:`MTPProposer`.
        tree: a static shape, or None for EAGLE-2 dynamic trees.
        depth: dynamic trees: levels grown (static: the shape's depth).
        topk: dynamic trees: children per expanded node and nodes expanded per level.
        num_draft_tokens: dynamic trees: nodes kept (static: the shape's size).
    """

    def __init__(self, head: DraftHead, num_blocks: int, block_size: int, target_vocab_size: int,
                 device: torch.device | str = "cpu", tree: TreeSpec | None = None, depth: int = 4,
                 topk: int = 4, num_draft_tokens: int = 12):
        super().__init__(head, num_blocks, block_size, target_vocab_size, device)
        self.tree = tree
        self.depth = tree.depth if tree is not None else depth
        self.topk = topk
        self.max_tree_nodes = tree.num_draft_tokens if tree is not None else num_draft_tokens

    def num_lookahead_tokens(self, k: int) -> int:
        return self.max_tree_nodes + 1   # the target writes the root and every node

    def propose_on_device(self, batch: StepBatch, num_draft_tokens: list[int],
                          md: SamplingMetadata) -> DraftProposal | None:
        return None   # trees are built on the host

    def propose(self, batch: StepBatch, num_draft_tokens: list[int]) -> TreeProposal:
        """One draft tree per sequence, at most ``num_draft_tokens[b]`` levels deep (0: the root
        alone). Node order is breadth-first; a tree's nodes take the cache slots after its root's."""
        depth_limits = num_draft_tokens
        roots = [toks[-1] for toks in batch.token_ids]
        states = [self._state(seq_id) for seq_id in batch.seq_ids]
        vocab = self.vocab_size
        root_lp = torch.stack([torch.log_softmax(st.logits.float(), -1) if st.logits is not None
                               else torch.full((vocab,), float("-inf")) for st in states])
        limits = [d if st.logits is not None else 0 for d, st in zip(depth_limits, states)]
        # structured output: a node's children are drawn from the draft masked by the grammar's
        # state after the node's path (refused nodes get -inf and the worker cuts them)
        grammars = batch.grammars if batch.any_grammar else None
        path_of: dict[tuple[int, int], tuple[int, ...]] = {(b, 0): () for b in range(len(batch))}
        if grammars is not None:
            for b, g in enumerate(grammars):
                if g is not None:
                    root_lp[b].masked_fill_(~g.allowed_token_mask(()), float("-inf"))
        features = {(b, 0): st.last_hidden for b, st in enumerate(states)}
        depth_of = {(b, 0): 0 for b in range(len(batch))}
        parent_of: dict[tuple[int, int], int] = {}
        written: list[list[int]] = [[] for _ in range(len(batch))]     # head rows in the scratch block, in order

        def expand(items: list[ExpandItem]) -> torch.Tensor:
            order = sorted(range(len(items)), key=lambda j: items[j].seq)   # rows grouped by sequence
            by_seq: dict[int, list[ExpandItem]] = {}
            for j in order:
                by_seq.setdefault(items[j].seq, []).append(items[j])
            hidden, tokens, positions, masks, starts, lens, tables = [], [], [], [], [], [], []
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
                    positions.append(batch.num_tokens(b) - 2 + depth_of[key])
                masks.append(mask)
                starts.append(batch.num_tokens(b) - 1 + len(block))
                lens.append(len(new))
                tables.append(batch.block_tables[b])
                written[b] = block + new
            out = self._run(torch.stack(hidden), tokens, tables, starts, lens, positions, masks)
            row = 0
            for b, group in by_seq.items():
                for it in group:
                    features[(b, it.node)] = out[row]
                    row += 1
            logprobs = torch.log_softmax(self._target_logits(out).float(), dim=-1)
            back = torch.empty(len(items), dtype=torch.int64)
            back[torch.tensor(order)] = torch.arange(len(items))
            logprobs = logprobs[back]
            if grammars is not None:
                for j, it in enumerate(items):
                    path = path_of[(it.seq, it.node)] = path_of[(it.seq, it.parent)] + (it.token,)
                    if grammars[it.seq] is not None:
                        logprobs[j].masked_fill_(~grammars[it.seq].allowed_token_mask(path), float("-inf"))
            return logprobs

        if self.tree is not None:
            return TreeProposal(build_static_trees(roots, root_lp, self.tree, expand, limits))
        return TreeProposal(build_dynamic_trees(roots, root_lp, self.depth, self.topk, self.max_tree_nodes,
                                                expand, limits))
