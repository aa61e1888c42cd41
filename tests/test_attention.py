"""Paged attention backend against a float64 reference, tree masks against per-path runs."""
from __future__ import annotations

import math

import pytest
import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend

H, HKV, D = 4, 2, 16


def reference(q, k, v, visible):
    """float64 attention of one query row over keys ``k [L, Hkv, D]`` where ``visible [L]`` is True."""
    group = H // HKV
    kk = k[visible].double().repeat_interleave(group, dim=1)  # [n, H, D]
    vv = v[visible].double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), kk) / math.sqrt(D)
    return torch.einsum("hn,nhd->hd", s.softmax(-1), vv)


def make_cache(num_blocks, block_size):
    return torch.zeros(num_blocks, block_size, HKV, D), torch.zeros(num_blocks, block_size, HKV, D)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_ragged_batch_matches_reference(block_size):
    """A prefill, a decode and a 5-token verify in one batch, on shuffled pages."""
    torch.manual_seed(0)
    context_lens, query_lens = [0, 9, 30], [13, 1, 5]
    totals = [c + q for c, q in zip(context_lens, query_lens)]
    pages = torch.randperm(sum(-(-t // block_size) for t in totals)).tolist()
    tables, at = [], 0
    for t in totals:
        n = -(-t // block_size)
        tables.append(pages[at:at + n])
        at += n
    kc, vc = make_cache(len(pages), block_size)
    full_k = [torch.randn(t, HKV, D) for t in totals]
    full_v = [torch.randn(t, HKV, D) for t in totals]
    # the context is already in the cache
    for b, c in enumerate(context_lens):
        md_ctx = AttentionMetadata.build([tables[b]], [0], [c], block_size) if c else None
        if md_ctx is not None:
            kc.view(-1, HKV, D)[md_ctx.slot_mapping] = full_k[b][:c]
            vc.view(-1, HKV, D)[md_ctx.slot_mapping] = full_v[b][:c]
    md = AttentionMetadata.build(tables, context_lens, query_lens, block_size)
    q = torch.randn(sum(query_lens), H, D)
    k = torch.cat([full_k[b][c:] for b, c in enumerate(context_lens)])
    v = torch.cat([full_v[b][c:] for b, c in enumerate(context_lens)])
    out = TorchAttentionBackend(H, HKV, D).forward(q, k, v, kc, vc, md)
    row = 0
    for b, (c, n) in enumerate(zip(context_lens, query_lens)):
        for i in range(n):
            visible = torch.arange(totals[b]) <= c + i
            ref = reference(q[row], full_k[b], full_v[b], visible)
            assert torch.allclose(out[row].double(), ref, atol=1e-5)
            row += 1


def tree_mask(parents: list[int]) -> torch.Tensor:
    """``[n, n]`` mask of a tree given each node's parent index (-1 = root): a node sees its ancestors."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            m[i, j] = True
            j = parents[j]
    return m


def test_tree_mask_hand_built():
    assert tree_mask([-1, 0, 0, 1]).int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]


def test_tree_equals_each_path_alone():
    """Tree root -> {a -> c, b}: every node's output equals running its root-to-node path as a chain."""
    torch.manual_seed(1)
    block_size, ctx = 4, 7
    parents = [-1, 0, 0, 1]  # root, a, b, c
    n = len(parents)
    ctx_k, ctx_v = torch.randn(ctx, HKV, D), torch.randn(ctx, HKV, D)
    q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    backend = TorchAttentionBackend(H, HKV, D)

    def run(idx: list[int], mask):
        kc, vc = make_cache(8, block_size)
        table = [5, 2, 7, 0]
        pre = AttentionMetadata.build([table], [0], [ctx], block_size)
        kc.view(-1, HKV, D)[pre.slot_mapping] = ctx_k
        vc.view(-1, HKV, D)[pre.slot_mapping] = ctx_v
        md = AttentionMetadata.build([table], [ctx], [len(idx)], block_size,
                                     tree_masks=None if mask is None else [mask])
        return backend.forward(q[idx], k[idx], v[idx], kc, vc, md)

    tree = run(list(range(n)), tree_mask(parents))
    for node in range(n):
        path, j = [], node
        while j != -1:
            path.insert(0, j)
            j = parents[j]
        chain = run(path, None)
        assert torch.equal(tree[node], chain[-1])
    # a causal mask given explicitly is the plain chain
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(run(list(range(n)), causal), run(list(range(n)), None))


def test_tree_grown_level_by_level_equals_one_shot():
    """A draft head writes a tree one level per forward: the new level's rows see the context plus
    their ancestors among the rows written before (a [new, block] mask). Outputs equal the tree
    verified in one forward."""
    torch.manual_seed(2)
    block_size, ctx = 4, 6
    parents = [-1, 0, 0, 1, 2, 3]        # root; a, b; c (of a), d (of b); e (of c)
    levels = [[0], [1, 2], [3, 4], [5]]
    n = len(parents)
    ctx_k, ctx_v = torch.randn(ctx, HKV, D), torch.randn(ctx, HKV, D)
    q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    backend = TorchAttentionBackend(H, HKV, D)
    table = [3, 1, 6, 2]
    full = tree_mask(parents)

    def fresh():
        kc, vc = make_cache(8, block_size)
        pre = AttentionMetadata.build([table], [0], [ctx], block_size)
        kc.view(-1, HKV, D)[pre.slot_mapping] = ctx_k
        vc.view(-1, HKV, D)[pre.slot_mapping] = ctx_v
        return kc, vc

    kc, vc = fresh()
    one_shot = backend.forward(q, k, v, kc, vc,
                               AttentionMetadata.build([table], [ctx], [n], block_size, tree_masks=[full]))
    kc, vc = fresh()
    written = 0
    for level in levels:
        idx = torch.tensor(level)
        mask = full[idx][:, :written + len(level)]     # [new, block so far]
        md = AttentionMetadata.build([table], [ctx + written], [len(level)], block_size, tree_masks=[mask])
        out = backend.forward(q[idx], k[idx], v[idx], kc, vc, md)
        assert torch.equal(out, one_shot[idx])
        written += len(level)
