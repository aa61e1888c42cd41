"""Attention metadata for one flattened, ragged batch.

A batch holds ``B`` sequences whose new tokens are concatenated into ``T`` rows. Sequence ``b``
contributes ``query_lens[b]`` new tokens (1 for decode, k+1 for a speculative verify, the prompt or
a chunk of it for prefill) on top of ``seq_lens[b] - query_lens[b]`` tokens already in the paged KV
cache. The same metadata serves both backends (``cpu_backend.py``'s kernels and ``torch_backend.py``'s
PyTorch reference): block tables and slot mappings name pages, never tensors of one model, so
target and draft share it. Its fields are those a paged-attention library planning from block tables
(FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``, say) would read; no such backend exists yet.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def slot_ids(block_table: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """``[end - start]`` int64 flat cache slots (``page * block_size + offset``) of a sequence's
    indices ``start .. end - 1`` under its ``block_table``."""
    pos = torch.arange(start, end, dtype=torch.int64)
    return torch.tensor(block_table, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size


@dataclass
class AttentionMetadata:
    """Attributes:
        query_start_loc: ``[B + 1]`` int64, cumulative query lengths; rows of sequence ``b`` are
            ``query_start_loc[b]:query_start_loc[b + 1]``. Kept on the host as a list too.
        seq_lens: ``[B]`` host ints, KV length of each sequence after this step's tokens are written.
        block_tables: ``[B, max_num_blocks]`` int32, page ids (padded with 0).
        slot_mapping: ``[T]`` int64, flat cache slot (``page * block_size + offset``) of each new token.
        kv_slot_ids: per sequence, ``[seq_lens[b]]`` int64 slots of all its tokens in position order
            (the PyTorch backend gathers K/V through them; the kernels read them flattened, ``AttentionPlan``).
        tree_masks: optional, per sequence ``[query_len, block_len]`` bool or None, where the
            *draft block* is the last ``block_len >= query_len`` tokens of the sequence (the new
            tokens last). ``True`` where a new token may attend to a block token. Everything before
            the block stays plainly visible: the mask covers the draft block only (tree
            verification: ``block_len = query_len``; a draft head growing a tree level by level
            also sees its earlier levels). None means causal among the new tokens.
        block_size: tokens per page.
    """

    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    kv_slot_ids: list[torch.Tensor]
    block_size: int
    tree_masks: list[torch.Tensor | None] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, tree_masks: list[torch.Tensor | None] | None = None,
              device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build metadata from host bookkeeping.

        Args:
            block_tables: per sequence, its page ids (must cover ``context_lens[b] + query_lens[b]``).
            context_lens: tokens of each sequence already in the cache.
            query_lens: new tokens of each sequence in this batch (>= 1).
            block_size: tokens per page.
            tree_masks: see the class docstring.
        Raises:
            ValueError: when a block table is too short for its sequence.
        """
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        kv_slot_ids, new_slots = [], []
        for table, ctx, total in zip(block_tables, context_lens, seq_lens):
            if len(table) * block_size < total:
                raise ValueError(f"block table of {len(table)} pages cannot hold {total} tokens")
            slots = slot_ids(table, 0, total, block_size)  # [total]
            kv_slot_ids.append(slots.to(device))
            new_slots.append(slots[ctx:])
        width = max((len(t) for t in block_tables), default=0)
        bt = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, t in enumerate(block_tables):
            bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        slot_mapping = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.int64)
        return cls(query_start_loc=starts, seq_lens=seq_lens, block_tables=bt.to(device),
                   slot_mapping=slot_mapping.to(device), kv_slot_ids=kv_slot_ids,
                   block_size=block_size, tree_masks=tree_masks)
