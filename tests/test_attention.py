"""Paged attention backends (the per-row PyTorch reference and our CPU kernel) against a float64
reference, tree masks against per-path runs, the kernel's batch invariance."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from specserve.attention import cpu_backend
from specserve.attention.cpu_backend import CpuAttentionBackend
from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.kernels import cpu_supports_quantized

H, HKV, D = 4, 2, 16

needs_kernel = pytest.mark.skipif(not cpu_supports_quantized(), reason="the CPU attention kernel needs AVX2")
BACKENDS = [pytest.param(TorchAttentionBackend, id="torch"), pytest.param(CpuAttentionBackend, id="kernel", marks=needs_kernel)]


def reference(q, k, v, visible):
    """float64 attention of one query row over keys ``k [L, Hkv, D]`` where ``visible [L]`` is True."""
    group = H // HKV
    kk = k[visible].double().repeat_interleave(group, dim=1)  # [n, H, D]
    vv = v[visible].double().repeat_interleave(group, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), kk) / math.sqrt(D)
    return torch.einsum("hn,nhd->hd", s.softmax(-1), vv)


def make_cache(num_blocks, block_size):
    return torch.zeros(num_blocks, block_size, HKV, D), torch.zeros(num_blocks, block_size, HKV, D)


@pytest.mark.parametrize("backend_cls", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_ragged_batch_matches_reference(block_size, backend_cls):
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
    out = backend_cls(H, HKV, D).forward(q, k, v, kc, vc, md)
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


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_tree_equals_each_path_alone(backend_cls):
    """Tree root -> {a -> c, b}: every node's output equals running its root-to-node path as a chain."""
    torch.manual_seed(1)
    block_size, ctx = 4, 7
    parents = [-1, 0, 0, 1]  # root, a, b, c
    n = len(parents)
    ctx_k, ctx_v = torch.randn(ctx, HKV, D), torch.randn(ctx, HKV, D)
    q, k, v = torch.randn(n, H, D), torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    backend = backend_cls(H, HKV, D)

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


@pytest.mark.parametrize("backend_cls", BACKENDS)
def test_tree_grown_level_by_level_equals_one_shot(backend_cls):
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
    backend = backend_cls(H, HKV, D)
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


def _random_paged(seq_lens, hkv, d, block_size=16, seed=0):
    """Caches holding ``seq_lens`` tokens of random K/V on shuffled pages; the block tables."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // block_size) for n in seq_lens]
    pages = torch.randperm(sum(npages) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in npages:
        tables.append(pages[at:at + n])
        at += n
    kc = torch.randn(len(pages), block_size, hkv, d, generator=g) * 2
    vc = torch.randn(len(pages), block_size, hkv, d, generator=g)
    return kc, vc, tables


@needs_kernel
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (12, 2, 40), (7, 1, 24)], ids=["smollm2", "g6-d40", "g7-d24"])
def test_kernel_rows_are_batch_invariant(h, hkv, d):
    """SmolLM2's heads (9 query, 3 kv, dim 64) and two shapes that leave every remainder of the
    kernel's blocks (an odd head of a kv group, lanes past the last block of 32): a row over 301
    keys gives the same bits decoded alone, as the last of a 4-row verify, inside a prefill, next to
    other sequences, on 1 or 2 threads; and matches float64 to 1e-5."""
    bs = 16
    lens = [301, 40, 77]
    kc, vc, tables = _random_paged(lens, hkv, d, bs)
    g = torch.Generator().manual_seed(5)
    qall = torch.randn(sum(lens), h, d, generator=g) * 3   # sharp softmaxes: scores span ~+-60
    backend = CpuAttentionBackend(h, hkv, d)

    def run(seqs):   # seqs: (seq, context_len, n): rows context_len .. context_len + n - 1
        md = AttentionMetadata.build([tables[b] for b, _, _ in seqs], [c for _, c, _ in seqs],
                                     [n for _, _, n in seqs], bs)
        q = torch.cat([qall[sum(lens[:b]) + c: sum(lens[:b]) + c + n] for b, c, n in seqs])
        flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)
        k, v = flat_k[md.slot_mapping].clone(), flat_v[md.slot_mapping].clone()   # rewrite the same K/V
        return backend.forward(q, k, v, kc, vc, md)

    alone = run([(0, 300, 1)])[0]
    assert torch.equal(run([(0, 297, 4)])[-1], alone)
    assert torch.equal(run([(0, 0, 301)])[-1], alone)
    assert torch.equal(run([(1, 10, 30), (0, 298, 3), (2, 76, 1)])[30 + 2], alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(run([(2, 0, 77), (0, 300, 1)])[-1], alone)
    finally:
        torch.set_num_threads(threads)
    keys = kc.view(-1, hkv, d)[AttentionMetadata.build([tables[0]], [0], [301], bs).slot_mapping]
    vals = vc.view(-1, hkv, d)[AttentionMetadata.build([tables[0]], [0], [301], bs).slot_mapping]
    kk, vv = keys.double().repeat_interleave(h // hkv, 1), vals.double().repeat_interleave(h // hkv, 1)
    s = torch.einsum("hd,nhd->hn", qall[300].double(), kk) / math.sqrt(d)
    assert s.max() - s.min() > 40
    ref = torch.einsum("hn,nhd->hd", s.softmax(-1), vv)
    assert torch.allclose(alone.double(), ref, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("h,hkv", [(6, 2), (2, 2)], ids=["group-of-3", "no-groups"])
def test_kernel_blocks_keep_each_rows_bits(h, hkv):
    """The kernel blocks 2 heads x 4 keys (scores) and 2 heads x 32 lanes (values) without reordering
    a row's operations: every row of a 23-token prefill (1..23 visible keys: every remainder of 4)
    gives the bits it gives decoded alone; rotating the query heads inside each kv group (a head
    moves between a 2-head block and the odd tail) rotates the outputs, bit for bit; and every row
    matches float64 to 1e-5."""
    d, bs, n = 40, 4, 23
    kc, vc, tables = _random_paged([n], hkv, d, bs, seed=7)
    q = torch.randn(n, h, d, generator=torch.Generator().manual_seed(8)) * 2
    backend = CpuAttentionBackend(h, hkv, d)
    flat_k, flat_v = kc.view(-1, hkv, d), vc.view(-1, hkv, d)

    def run(queries, context, rows):
        md = AttentionMetadata.build(tables, [context], [rows], bs)
        return backend.forward(queries, flat_k[md.slot_mapping].clone(), flat_v[md.slot_mapping].clone(), kc, vc, md)

    prefill = run(q, 0, n)
    for r in range(n):
        assert torch.equal(run(q[r:r + 1], r, 1)[0], prefill[r]), r
    group = h // hkv
    rotate = torch.tensor([g * group + (i + 1) % group for g in range(hkv) for i in range(group)])
    assert torch.equal(run(q[:, rotate], 0, n), prefill[:, rotate])
    keys = flat_k[AttentionMetadata.build(tables, [0], [n], bs).slot_mapping].double().repeat_interleave(group, 1)
    vals = flat_v[AttentionMetadata.build(tables, [0], [n], bs).slot_mapping].double().repeat_interleave(group, 1)
    for r in range(n):
        s_r = torch.einsum("hd,nhd->hn", q[r].double(), keys[:r + 1]) / math.sqrt(d)
        ref = torch.einsum("hn,nhd->hd", s_r.softmax(-1), vals[:r + 1])
        assert torch.allclose(prefill[r].double(), ref, atol=1e-5, rtol=0), r


@needs_kernel
def test_kernel_falls_back_where_it_does_not_serve(monkeypatch):
    """``SPECSERVE_ATTENTION=torch``, float64 caches and a head dim not a multiple of 8 run the
    reference backend (equal bits); the kernel itself differs from it only by rounding."""
    torch.manual_seed(3)
    kc, vc, tables = _random_paged([20], HKV, D, 4)
    md = AttentionMetadata.build(tables, [15], [5], 4)
    q, k, v = torch.randn(5, H, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    ref = TorchAttentionBackend(H, HKV, D).forward(q, k, v, kc.clone(), vc.clone(), md)
    kernel = CpuAttentionBackend(H, HKV, D).forward(q, k, v, kc.clone(), vc.clone(), md)
    assert torch.allclose(kernel, ref, atol=1e-5) and not torch.equal(kernel, ref)
    monkeypatch.setenv("SPECSERVE_ATTENTION", "torch")
    assert torch.equal(CpuAttentionBackend(H, HKV, D).forward(q, k, v, kc.clone(), vc.clone(), md), ref)
    monkeypatch.delenv("SPECSERVE_ATTENTION")
    ref64 = TorchAttentionBackend(H, HKV, D).forward(q.double(), k.double(), v.double(), kc.double(), vc.double(), md)
    assert torch.equal(CpuAttentionBackend(H, HKV, D).forward(
        q.double(), k.double(), v.double(), kc.double(), vc.double(), md), ref64)
    d12 = 12
    kc12, vc12, _ = _random_paged([20], HKV, d12, 4)
    q12, k12, v12 = torch.randn(5, H, d12), torch.randn(5, HKV, d12), torch.randn(5, HKV, d12)
    assert torch.equal(CpuAttentionBackend(H, HKV, d12).forward(q12, k12, v12, kc12.clone(), vc12.clone(), md),
                       TorchAttentionBackend(H, HKV, d12).forward(q12, k12, v12, kc12.clone(), vc12.clone(), md))


@needs_kernel
def test_kernel_refuses_inconsistent_indices():
    """Index tensors that would read past a sequence's slots are refused with the row named."""
    ops = cpu_backend._kernel()
    kc = torch.zeros(8, HKV, D)
    q = torch.zeros(1, H, D)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="row 0 reads past"):
        ops.paged_attention(q, kc, kc, torch.zeros(2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                            one * 3, one * 0, torch.zeros(1, 0, dtype=torch.uint8), 0.25)
    with pytest.raises(RuntimeError, match="slot 9 out of range"):
        ops.paged_attention(q, kc, kc, torch.tensor([9]), torch.zeros(1, dtype=torch.int64),
                            one, one * 0, torch.zeros(1, 0, dtype=torch.uint8), 0.25)


@needs_kernel
def test_kernel_mixed_tree_and_causal_batch_matches_reference():
    """One batch of a causal verify, a tree and a decode (the kernel's per-row indices for both
    kinds side by side) gives the reference backend's rows to float32 rounding."""
    torch.manual_seed(4)
    bs = 4
    kc, vc, tables = _random_paged([23, 15, 9], HKV, D, bs)
    tree = tree_mask([-1, 0, 0, 1, 2])
    md = AttentionMetadata.build(tables, [19, 10, 8], [4, 5, 1], bs, tree_masks=[None, tree, None])
    q, k, v = torch.randn(10, H, D), torch.randn(10, HKV, D), torch.randn(10, HKV, D)
    ref = TorchAttentionBackend(H, HKV, D).forward(q, k, v, kc.clone(), vc.clone(), md)
    out = CpuAttentionBackend(H, HKV, D).forward(q, k, v, kc.clone(), vc.clone(), md)
    assert torch.allclose(out, ref, atol=1e-5, rtol=0)


@needs_kernel
def test_a_build_killed_midway_does_not_hang_the_next():
    """torch's cpp_extension waits, without end, while a build's 'lock' file exists; a process
    killed mid-build leaves one behind. The next process removes it (it holds our flock, which no
    live builder then holds) and loads the kernel."""
    from specserve.kernels import _ATTENTION_SOURCE, _AVX2_FLAGS, attention_ops, build_directory

    attention_ops()   # built, or loaded from the cache
    stale = build_directory(_ATTENTION_SOURCE, list(_AVX2_FLAGS), "paged_attention") / "lock"
    stale.write_text("")
    try:
        code = "from specserve.kernels import attention_ops; attention_ops()"
        done = subprocess.run([sys.executable, "-c", code], timeout=180, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not stale.exists()
    finally:   # never leave it behind for the runs after a failure
        stale.unlink(missing_ok=True)
