"""Paged attention on our CPU kernel: one call per layer instead of one per row.

The kernel (``specserve/kernels/paged_attention.cpp``) keeps the reference backend's contract, a
row's result depends on its own query and visible keys only, by computing every (row, kv head)
pair as one task with a fixed instruction sequence, so decode, verify, tree and prefill rows over
the same keys agree bit for bit. It serves float32, float16 and bfloat16 caches on the CPU (16-bit
entries are widened exactly on load); anything else (CUDA, other dtypes, autograd, a CPU without AVX2 or a machine without a compiler) goes to
:class:`~specserve.attention.torch_backend.TorchAttentionBackend`. ``SPECSERVE_ATTENTION=torch``
forces the reference backend (A/B timing).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)
# the KV-cache dtypes the kernels read (``--kv-cache-dtype``)
KERNEL_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_unavailable: str | None = None   # why the kernel cannot run in this process, once known


def _kernel():
    """The compiled kernel module, or None (logged once) where it cannot run."""
    global _unavailable
    if _unavailable is not None:
        return None
    from specserve.kernels import KernelUnavailableError, attention_ops
    try:
        return attention_ops()
    except KernelUnavailableError as e:
        _unavailable = str(e)
        logger.warning("paged attention falls back to the per-row PyTorch backend: %s", e)
        return None


@dataclass
class AttentionPlan:
    """What every layer's attention needs of one batch, built once per forward (FlashInfer's
    plan / run split) from its :class:`AttentionMetadata` and taken by each layer's run.

    Attributes:
        md: the metadata planned (the reference backend reads it).
        seq_slots: ``[sum seq_lens]`` int64, every sequence's cache slots in position order.
        row_slot_start: ``[T]`` int64, where row ``t``'s sequence starts in ``seq_slots``.
        prefix: ``[T]`` int64, row ``t`` sees the first ``prefix[t]`` slots of its sequence ...
        block_len: ``[T]`` int64, ... and of the ``block_len[t]`` after them (a draft block) ...
        mask: ``[T, W]`` uint8, ... those where ``mask[t]`` is 1 (``W``: the widest draft block, 0
            without trees).
        slot_mapping: ``[T]`` int64, the cache slot each row's key and value are written to.
    """

    md: AttentionMetadata
    seq_slots: torch.Tensor
    row_slot_start: torch.Tensor
    prefix: torch.Tensor
    block_len: torch.Tensor
    mask: torch.Tensor
    slot_mapping: torch.Tensor

    @classmethod
    def build(cls, md: AttentionMetadata) -> "AttentionPlan":
        """The plan of ``md`` (host tensors; a few small ops, once per forward)."""
        qlens = torch.tensor(md.query_lens, dtype=torch.int64)
        seq_lens = torch.tensor(md.seq_lens, dtype=torch.int64)
        starts = torch.tensor(md.query_start_loc[:-1], dtype=torch.int64)
        seq_start = seq_lens.cumsum(0) - seq_lens
        # causal rows: the context and the new tokens up to the row itself
        row_in_seq = torch.arange(md.query_start_loc[-1], dtype=torch.int64) - starts.repeat_interleave(qlens)
        prefix = (seq_lens - qlens).repeat_interleave(qlens) + row_in_seq + 1
        trees = md.tree_masks or []
        width = max((m.shape[1] for m in trees if m is not None), default=0)
        block_len = torch.zeros_like(prefix)
        mask = torch.zeros(len(prefix), width, dtype=torch.uint8)
        for b, tree in enumerate(trees):   # tree rows: everything before the draft block, then the block's mask
            if tree is not None:
                q0, q1, w = md.query_start_loc[b], md.query_start_loc[b + 1], tree.shape[1]
                prefix[q0:q1] = md.seq_lens[b] - w
                block_len[q0:q1] = w
                mask[q0:q1, :w] = tree
        seq_slots = torch.cat(md.kv_slot_ids).to("cpu", torch.int64) if md.kv_slot_ids else torch.empty(0, dtype=torch.int64)
        return cls(md, seq_slots, seq_start.repeat_interleave(qlens), prefix, block_len, mask,
                   md.slot_mapping.to("cpu", torch.int64).contiguous())

    @property
    def kernel_rows(self) -> tuple[torch.Tensor, ...]:
        """The kernel's index arguments: ``(seq_slots, row_slot_start, prefix, block_len, mask)``."""
        return self.seq_slots, self.row_slot_start, self.prefix, self.block_len, self.mask


class CpuAttentionBackend(TorchAttentionBackend):
    """:class:`TorchAttentionBackend`'s interface and results (to float32 rounding: the kernel sums
    in its own fixed order) on one kernel call per layer where the kernel serves the tensors.

    On a machine without CUDA the kernel is built (or loaded from the cache) when the model is, so
    the one-time compile never lands inside a timed generation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.allowed = head_dim % 8 == 0 and os.environ.get("SPECSERVE_ATTENTION", "kernel") != "torch"
        if self.allowed and not torch.cuda.is_available():
            _kernel()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: "AttentionMetadata | AttentionPlan") -> torch.Tensor:
        """:meth:`TorchAttentionBackend.forward`, given the metadata or its plan (built here when
        not given: a caller running several layers builds it once, :meth:`AttentionPlan.build`)."""
        plan = md if isinstance(md, AttentionPlan) else None
        ops = _kernel() if self.allowed and self._serves(query, key_cache) else None
        if ops is None:
            return super().forward(query, key, value, key_cache, value_cache, plan.md if plan else md)
        plan = plan or AttentionPlan.build(md)
        flat_k, flat_v = self.write_kv(key, value, key_cache, value_cache, plan.md)
        return ops.paged_attention(query.contiguous(), flat_k, flat_v, *plan.kernel_rows, self.scale)

    def fused_available(self, key_cache: torch.Tensor) -> bool:
        """Whether :meth:`run_fused` serves this cache here (the kernel, a CPU cache, head_dim % 16 == 0)."""
        return (self.allowed and self.head_dim % 16 == 0 and key_cache.device.type == "cpu"
                and key_cache.dtype in KERNEL_CACHE_DTYPES and key_cache.is_contiguous() and _kernel() is not None)

    def run_fused(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
        """Rotary embedding, KV write and attention of one layer in two kernel calls.

        Args:
            qkv: ``[T, (H + 2 Hkv) D]`` float32, the fused q/k/v projection's output.
            positions: ``[T]`` int64.
            cos, sin: ``[max_position, D]`` float32 rotary tables (rotate-half layout).
            key_cache, value_cache: one layer's ``[num_blocks, block_size, Hkv, D]``, float32,
                float16 or bfloat16 (keys and values are rounded to it when written).
            plan: the batch's :class:`AttentionPlan`.
        Returns:
            ``[T, H, D]`` float32.
        Raises:
            RuntimeError: a position past the tables or a slot past the cache (from the kernel).
        """
        ops = _kernel()
        flat_k = key_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = value_cache.view(-1, self.num_kv_heads, self.head_dim)
        q = ops.rope_write_kv(qkv, cos, sin, positions, plan.slot_mapping, flat_k, flat_v, self.num_heads)
        return ops.paged_attention(q, flat_k, flat_v, *plan.kernel_rows, self.scale)

    @staticmethod
    def _serves(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (query.shape[0] > 0 and query.device.type == "cpu" and key_cache.device.type == "cpu"
                and query.dtype == torch.float32 and key_cache.dtype in KERNEL_CACHE_DTYPES and key_cache.is_contiguous()
                and not (torch.is_grad_enabled() and query.requires_grad))
