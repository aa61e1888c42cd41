"""Paged KV cache: page bookkeeping (:class:`BlockManager`) and tensors (:class:`KVCache`)."""

from specserve.kv_cache.block_manager import BlockManager, NoFreeBlocksError
from specserve.kv_cache.kv_cache import KVCache

__all__ = ["BlockManager", "KVCache", "NoFreeBlocksError"]
