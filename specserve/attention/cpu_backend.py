"""Paged attention on our CPU kernel: one call per layer instead of one per row.

The kernel (``specserve/kernels/paged_attention.cpp``) keeps the reference backend's contract, a
row's result depends on its own query and visible keys only, by computing every (row, kv head)
pair as one task with a fixed instruction sequence, so decode, verify, tree and prefill rows over
the same keys agree bit for bit. It serves float32 caches on the CPU; anything else (CUDA, other
dtypes, autograd, a CPU without AVX2 or a machine without a compiler) goes to
:class:`~specserve.attention.torch_backend.TorchAttentionBackend`. ``SPECSERVE_ATTENTION=torch``
forces the reference backend (A/B timing).
"""
from __future__ import annotations

import logging
import os

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend

logger = logging.getLogger(__name__)
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


def kernel_rows(md: AttentionMetadata) -> tuple[torch.Tensor, ...]:
    """The kernel's index tensors for ``md``, built once per step (cached in ``md.backend_cache``).

    Returns ``(seq_slots [sum seq_lens], row_slot_start [T], prefix [T], block_len [T], mask [T, W])``:
    row ``t`` sees the first ``prefix[t]`` slots of its sequence (from ``row_slot_start[t]`` in
    ``seq_slots``) and, of the ``block_len[t]`` after them, those where ``mask[t]`` is 1 (int64 but
    the uint8 mask; ``W`` is the widest draft block, 0 without trees).
    """
    cached = md.backend_cache.get("cpu_kernel_rows")
    if cached is not None:
        return cached
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
    rows = (torch.cat(md.kv_slot_ids).to("cpu", torch.int64), seq_start.repeat_interleave(qlens), prefix, block_len,
            mask)
    md.backend_cache["cpu_kernel_rows"] = rows
    return rows


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
                key_cache: torch.Tensor, value_cache: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        ops = _kernel() if self.allowed and self._serves(query, key_cache) else None
        if ops is None:
            return super().forward(query, key, value, key_cache, value_cache, md)
        flat_k, flat_v = self.write_kv(key, value, key_cache, value_cache, md)
        return ops.paged_attention(query.contiguous(), flat_k, flat_v, *kernel_rows(md), self.scale)

    @staticmethod
    def _serves(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
        return (query.shape[0] > 0 and query.device.type == "cpu" and key_cache.device.type == "cpu"
                and query.dtype == torch.float32 and key_cache.dtype == torch.float32 and key_cache.is_contiguous()
                and not (torch.is_grad_enabled() and query.requires_grad))
