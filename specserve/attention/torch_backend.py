"""PyTorch attention over the paged KV cache (CPU and CUDA, any mask).

Every query row is computed by one ``scaled_dot_product_attention`` call over exactly the keys it
may see, in position order. A row's result is then a function of its own query and keys only: the
same whether it is decoded alone, verified among k+1 draft tokens, or part of a prefill. That is
the batch invariance exact speculative decoding needs (a batched masked kernel rounds a row
differently depending on how many rows and padded keys come with it). Rows of a prefill are
computed one by one too; on CPU the linear layers dominate prefill time, not this loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Paged attention reference backend.

    ``forward(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D], key_cache, value_cache, md)``
    writes the new keys/values into the caches at ``md.slot_mapping`` and returns ``[T, H, D]``.
    ``key_cache``/``value_cache`` are one layer's ``[num_blocks, block_size, Hkv, D]`` tensors.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new ``key``/``value [T, Hkv, D]`` at ``md.slot_mapping``; return the caches as
        flat ``[num_slots, Hkv, D]`` views."""
        flat_k = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_k.index_copy_(0, md.slot_mapping, key.to(flat_k.dtype))   # rounded to a 16-bit cache
        flat_v.index_copy_(0, md.slot_mapping, value.to(flat_v.dtype))
        return flat_k, flat_v

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        flat_k, flat_v = self.write_kv(key, value, key_cache, value_cache, md)
        out = torch.empty_like(query)
        gqa = self.num_heads != self.num_kv_heads
        starts = md.query_start_loc
        for b in range(md.num_seqs):
            q0, q1 = starts[b], starts[b + 1]
            num_new = q1 - q0
            context_len = md.seq_lens[b] - num_new
            keys = flat_k.index_select(0, md.kv_slot_ids[b]).to(query.dtype)  # [L, Hkv, D], position order
            values = flat_v.index_select(0, md.kv_slot_ids[b]).to(query.dtype)
            tree = md.tree_masks[b] if md.tree_masks is not None else None
            if tree is not None:
                block_start = md.seq_lens[b] - tree.shape[1]   # the context before the draft block
                context = torch.arange(block_start)
            for i in range(num_new):
                if tree is None:
                    n = context_len + i + 1
                    k_row, v_row = keys[:n], values[:n]  # prefix view: same strides for every L
                else:
                    idx = torch.cat([context, block_start + tree[i].nonzero().flatten()])
                    k_row, v_row = keys.index_select(0, idx), values.index_select(0, idx)
                q_row = query[q0 + i].unsqueeze(1).unsqueeze(0)  # [1, H, 1, D]
                o = F.scaled_dot_product_attention(
                    q_row, k_row.permute(1, 0, 2).unsqueeze(0), v_row.permute(1, 0, 2).unsqueeze(0),
                    scale=self.scale, enable_gqa=gqa)  # [1, H, 1, D]
                out[q0 + i] = o[0, :, 0]
        return out
