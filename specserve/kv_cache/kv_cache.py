"""Paged KV tensors for one model (target or draft).

Page ids and slot ids come from :class:`specserve.kv_cache.BlockManager`;
slot id ``s`` is page ``s // block_size`` at offset ``s % block_size``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KVCache", "move_kv_slots"]


def move_kv_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy K/V entries from slots ``src [N]`` to ``dst [N]`` (int64) in every layer of caches
    ``[num_layers, num_blocks, block_size, Hkv, D]`` (contiguous); a source may also be a target."""
    for cache in (key_cache, value_cache):
        flat = cache.view(cache.shape[0], -1, *cache.shape[3:])    # [L, num_slots, Hkv, D]
        moved = flat.index_select(1, src.to(cache.device))          # gather first: a source may be a target
        flat.index_copy_(1, dst.to(cache.device), moved)


class KVCache:
    """Per-model paged KV tensors.

    ``key_cache`` / ``value_cache``: ``[num_layers, num_blocks, block_size,
    num_kv_heads, head_dim]`` of ``dtype`` on ``device``, zero-initialised.

    Raises:
        ValueError: any dimension < 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        dims = dict(
            num_layers=num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for name, v in dims.items():
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.value_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @property
    def num_slots(self) -> int:
        """``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    def _flat(self, cache: Tensor, layer: int) -> Tensor:
        # contiguous, so view shares storage: [num_slots, Hkv, D]
        return cache[layer].view(self.num_slots, self.num_kv_heads, self.head_dim)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    def _check_slots(self, slots: Tensor, name: str) -> None:
        if slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError(
                f"{name} must be 1-D int64, got shape {tuple(slots.shape)} {slots.dtype}"
            )

    def write(self, layer: int, slot_mapping: Tensor, key: Tensor, value: Tensor) -> None:
        """Store ``key[i]`` / ``value[i]`` at slot ``slot_mapping[i]`` of ``layer``.

        Args:
            layer: layer index in ``[0, num_layers)``.
            slot_mapping: ``[T]`` int64 flat slot ids (distinct), each in
                ``[0, num_blocks * block_size)``.
            key, value: ``[T, num_kv_heads, head_dim]``; cast to the cache dtype.

        Raises:
            IndexError: bad ``layer`` (out-of-range slots raise from torch).
            ValueError: wrong shapes or ``slot_mapping`` dtype.
        """
        self._check_layer(layer)
        self._check_slots(slot_mapping, "slot_mapping")
        t = slot_mapping.shape[0]
        want = (t, self.num_kv_heads, self.head_dim)
        if tuple(key.shape) != want or tuple(value.shape) != want:
            raise ValueError(
                f"key/value must be {want}, got {tuple(key.shape)} / {tuple(value.shape)}"
            )
        idx = slot_mapping.to(self.device)
        self._flat(self.key_cache, layer).index_copy_(0, idx, key.to(self.device, self.dtype))
        self._flat(self.value_cache, layer).index_copy_(
            0, idx, value.to(self.device, self.dtype)
        )

    def gather(self, layer: int, slot_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values stored at ``slot_ids`` of ``layer``, in order.

        Args:
            layer: layer index in ``[0, num_layers)``.
            slot_ids: ``[L]`` int64 flat slot ids.

        Returns:
            ``(keys, values)``, each a new ``[L, num_kv_heads, head_dim]``
            tensor of the cache dtype.

        Raises:
            IndexError: bad ``layer`` (out-of-range slots raise from torch).
            ValueError: ``slot_ids`` not 1-D int64.
        """
        self._check_layer(layer)
        self._check_slots(slot_ids, "slot_ids")
        idx = slot_ids.to(self.device)
        return (
            self._flat(self.key_cache, layer).index_select(0, idx),
            self._flat(self.value_cache, layer).index_select(0, idx),
        )

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one page costs across all layers, keys plus values."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @staticmethod
    def num_blocks_for_memory(
        bytes_budget: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> int:
        """How many pages fit in ``bytes_budget`` (floor; 0 if none fit).

        One page costs ``2 * num_layers * block_size * num_kv_heads *
        head_dim * element_size(dtype)`` bytes (keys and values).
        """
        per = KVCache.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, int(bytes_budget) // per)
