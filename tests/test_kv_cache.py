"""Tests for specserve.kv_cache.kv_cache.KVCache."""

from __future__ import annotations

import pytest
import torch

from specserve.kv_cache import BlockManager, KVCache, NoFreeBlocksError


def _rand(t, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, h, d, generator=g)


def test_shapes_and_dtype():
    kv = KVCache(num_layers=3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8,
                 dtype=torch.float16)
    assert kv.key_cache.shape == (3, 5, 4, 2, 8)
    assert kv.value_cache.shape == (3, 5, 4, 2, 8)
    assert kv.key_cache.dtype == torch.float16
    assert kv.num_slots == 20
    with pytest.raises(ValueError):
        KVCache(1, 0, 4, 2, 8)


def test_write_gather_round_trip_exact():
    kv = KVCache(num_layers=2, num_blocks=4, block_size=3, num_kv_heads=2, head_dim=5)
    slots = torch.tensor([7, 0, 11, 3], dtype=torch.int64)
    k, v = _rand(4, 2, 5, 0), _rand(4, 2, 5, 1)
    kv.write(1, slots, k, v)
    gk, gv = kv.gather(1, slots)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    # order follows the requested slots
    gk2, _ = kv.gather(1, torch.tensor([11, 7], dtype=torch.int64))
    assert torch.equal(gk2, k[[2, 0]])
    # slot 7 = page 2 offset 1, in the 5-D layout
    assert torch.equal(kv.key_cache[1, 2, 1], k[0])
    # other layer untouched
    assert torch.count_nonzero(kv.key_cache[0]) == 0
    # gather returns copies
    gk[:] = 0
    assert torch.equal(kv.gather(1, slots)[0], k)


def test_write_casts_to_cache_dtype():
    kv = KVCache(1, 2, 2, 1, 4, dtype=torch.bfloat16)
    k = _rand(2, 1, 4, 3)
    kv.write(0, torch.tensor([1, 2]), k, k)
    gk, _ = kv.gather(0, torch.tensor([1, 2]))
    assert gk.dtype == torch.bfloat16
    assert torch.equal(gk, k.to(torch.bfloat16))


def test_write_validation():
    kv = KVCache(2, 2, 2, 1, 4)
    k = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError):
        kv.write(0, torch.tensor([0, 1], dtype=torch.int32), k, k)
    with pytest.raises(ValueError):
        kv.write(0, torch.tensor([0, 1, 2]), k, k)
    with pytest.raises(IndexError):
        kv.write(2, torch.tensor([0, 1]), k, k)
    with pytest.raises(ValueError):
        kv.gather(0, torch.tensor([[0]]))


def test_two_interleaved_sequences_stay_separate():
    bs, h, d, layers = 4, 2, 3, 2
    bm = BlockManager(num_blocks=8, block_size=bs)
    kv = KVCache(layers, 8, bs, h, d)
    expected = {0: [], 1: []}  # per seq: list of [Hkv, D] key rows (layer 0)
    lengths = {0: 0, 1: 0}
    step = 0
    # interleave prefill/decode chunks so their pages alternate in the pool
    for sid, n in [(0, 3), (1, 5), (0, 2), (1, 1), (0, 4), (1, 3), (0, 1)]:
        start = lengths[sid]
        bm.allocate(sid, start + n)
        slots = torch.tensor(bm.slot_mapping(sid, start, start + n), dtype=torch.int64)
        k = torch.full((n, h, d), 0.0) + torch.arange(step, step + n).view(n, 1, 1).float()
        for layer in range(layers):
            kv.write(layer, slots, k + 1000 * layer, -(k + 1000 * layer))
        expected[sid].extend(k.unbind(0))
        lengths[sid] += n
        step += n
    assert set(bm.block_table(0)).isdisjoint(bm.block_table(1))
    for sid in (0, 1):
        slots = torch.tensor(bm.slot_mapping(sid, 0, lengths[sid]), dtype=torch.int64)
        want = torch.stack(expected[sid])
        for layer in range(layers):
            gk, gv = kv.gather(layer, slots)
            assert torch.equal(gk, want + 1000 * layer)
            assert torch.equal(gv, -(want + 1000 * layer))
    # speculative rollback of seq 0 then rewrite: seq 1 unaffected
    bm.truncate(0, lengths[0] - 3)
    bm.allocate(0, lengths[0])
    slots = torch.tensor(bm.slot_mapping(0, lengths[0] - 3, lengths[0]), dtype=torch.int64)
    kv.write(0, slots, torch.full((3, h, d), -7.0), torch.full((3, h, d), -7.0))
    s1 = torch.tensor(bm.slot_mapping(1, 0, lengths[1]), dtype=torch.int64)
    assert torch.equal(kv.gather(0, s1)[0], torch.stack(expected[1]))


def test_num_blocks_for_memory_hand_computed():
    # per block: 2 (k,v) * 2 layers * 16 slots * 4 heads * 8 dim * 2 bytes = 4096
    assert KVCache.num_blocks_for_memory(1 << 20, 2, 16, 4, 8, torch.float16) == 256
    assert KVCache.num_blocks_for_memory(4096 * 3 + 4095, 2, 16, 4, 8, torch.bfloat16) == 3
    # float32: 8192 bytes per block
    assert KVCache.num_blocks_for_memory(8192 * 10, 2, 16, 4, 8, torch.float32) == 10
    assert KVCache.num_blocks_for_memory(8191, 2, 16, 4, 8, torch.float32) == 0
    assert KVCache.bytes_per_block(2, 16, 4, 8, torch.float32) == 8192
    # matches the real tensor footprint
    kv = KVCache(2, 10, 16, 4, 8)
    used = (kv.key_cache.numel() + kv.value_cache.numel()) * kv.key_cache.element_size()
    assert used == 8192 * 10


def test_package_exports():
    import specserve.kv_cache as pkg

    assert {"BlockManager", "KVCache", "NoFreeBlocksError"} <= set(pkg.__all__)
    assert issubclass(NoFreeBlocksError, RuntimeError)
