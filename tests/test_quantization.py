"""Quantized (int8 / int4) batch-invariant linears: the kernels against a float64 oracle, bitwise
row independence at every row count, exact GGUF block mapping, and exact speculation on top."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.kernels import build_quant_ops, cpu_has_vnni, cpu_supports_quantized
from specserve.models.linear import QuantizedLinear, make_linear
from specserve.models.weight_packing import PackedWeight
from specserve.models.quantization import (QuantizedTensor, from_gguf, kernel_order, layout_for, natural_order,
                                          pack_int4, quantize, quantize_rows_reference, reference_matmul, unpack_int4)

pytestmark = pytest.mark.skipif(not cpu_supports_quantized(), reason="the int8 / int4 kernels need AVX2")

LAYOUTS = ["int8", "int4"]
# (out_features, in_features): whole superblocks, a short last superblock (896 = 3.5 x 256), tiny
SHAPES = [(48, 1536), (40, 896), (33, 64), (24, 320)]


def _weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, 5] *= 20  # an outlier column, as real projections have
    return w


def _inputs(m, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 40  # an outlier channel (massive activations)
    return x


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_float64_reference(layout, shape):
    n, k = shape
    if layout == "int4" and k % 64:
        pytest.skip("int4 packs 64 values per 32 bytes")
    bias = torch.randn(n)
    lin = make_linear([_weight(n, k)], bias, layout)
    x = _inputs(9, k)
    ref = reference_matmul(x, lin.parts[0], bias)
    got = lin(x).double()
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_activation_quantization_matches_reference():
    from specserve.kernels import quant_ops

    x = torch.cat([_inputs(5, 896), torch.zeros(1, 896), _inputs(3, 896) * torch.tensor([[1e-30], [1e30], [-7.0]])])
    x[8, 100] = -0.0
    xq, dx, bsum = quant_ops().quantize_rows(x)
    ref_q, ref_d = quantize_rows_reference(x)
    assert torch.equal(xq[:, natural_order(896)], ref_q) and torch.equal(dx, ref_d)   # stored in kernel order
    assert torch.equal(bsum, ref_q.view(9, -1, 32).sum(-1, dtype=torch.int32))


def test_activation_quantization_of_non_finite_and_subnormal_rows():
    """Hand-derived values where the float reference cannot speak: a NaN is left out of the
    maximum and quantizes to -127 (the clamp's order); an infinity makes the scale infinite and
    1 / scale zero, so finite values give 0 and the infinity (inf * 0 = NaN) -127; a subnormal
    superblock overflows 127 / amax to infinity, so every value goes to +-127."""
    from specserve.kernels import quant_ops

    k = 256
    x = _inputs(3, k)
    x[0, 17] = float("nan")
    x[1, 40] = float("inf")
    x[2] = (1 + torch.rand(k)) * 1e-42 * torch.where(torch.rand(k) < 0.5, -1.0, 1.0)
    assert x[2].abs().min() > 0 and x[2].abs().max() < torch.finfo(torch.float32).tiny
    xq, dx, _ = quant_ops().quantize_rows(x)
    xq = xq[:, natural_order(k)]
    finite = x[0].clone()
    finite[17] = 0.0
    ref_q, ref_d = quantize_rows_reference(finite[None])
    assert xq[0, 17] == -127 and torch.equal(xq[0, :17], ref_q[0, :17]) and torch.equal(xq[0, 18:], ref_q[0, 18:])
    assert torch.equal(dx[0], ref_d[0])
    assert dx[1, 0] == float("inf") and xq[1, 40] == -127
    assert torch.count_nonzero(xq[1]) == 1
    assert torch.equal(xq[2], torch.where(x[2] > 0, 127, -127).to(torch.int8))
    assert dx[2, 0] == x[2].abs().max() / 127


@pytest.mark.parametrize("k", [1536, 896, 64, 320])
def test_kernel_order_transposes_groups_of_four(k):
    """Hand-checked map: position t*4B + 4b + i holds column 32b + 4t + i in each superblock, and
    the int4 packing keeps every value (all of it lossless)."""
    order = kernel_order(k)
    assert sorted(order.tolist()) == list(range(k)) and torch.equal(order[natural_order(k)], torch.arange(k))
    if k == 1536:   # whole superblocks: vectors of 32 bytes, byte group b from block b
        assert order[:12].tolist() == [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67]
        assert order[32:36].tolist() == [4, 5, 6, 7] and order[256:260].tolist() == [256, 257, 258, 259]
    if k == 896:    # the short last superblock (4 blocks of 32): vectors of 16 bytes
        assert order[768:776].tolist() == [768, 769, 770, 771, 800, 801, 802, 803]
        assert order[768 + 16:768 + 20].tolist() == [772, 773, 774, 775]
    if k == 64:     # 2 blocks: vectors of 8 bytes
        assert order[:16].tolist() == [0, 1, 2, 3, 32, 33, 34, 35, 4, 5, 6, 7, 36, 37, 38, 39]
    if k % 64 == 0:
        q = torch.randint(0, 16, (3, k), dtype=torch.uint8)
        packed = pack_int4(q)
        assert torch.equal(unpack_int4(packed), q)
        width = 4 * (min(256, k) // 32)   # byte 0: low nibble = vector 0's first value, high = vector 1's
        assert torch.equal(packed[:, 0] & 0x0F, q[:, 0]) and torch.equal(packed[:, 0] >> 4, q[:, order[width]])


@pytest.mark.parametrize("layout", LAYOUTS + ["mixed"])
def test_rows_bitwise_independent_of_row_count(layout):
    """Row i of an M-row call equals row i alone and the same row in any other M, M = 1..17, 23..26,
    31..34, 127..130 and 255..258 (the kernels switch from one-vector tiles of up to 12 rows to
    two-vector tiles of up to 6 above 24 rows, and take the rows in passes of 256 at this
    in_features: the bits stay the same)."""
    k = 1536
    if layout == "mixed":  # a fused q/k/v: q, k int4 (Q4_K) and v int8 (Q6_K)
        lin = make_linear([quantize(_weight(64, k, 1), "int4"), quantize(_weight(32, k, 2), "int4"),
                           quantize(_weight(32, k, 3), "int8")], torch.randn(128), "int4")
        assert [p.layout for p in lin.parts] == ["int4", "int8"]
    else:
        lin = make_linear([_weight(72, k)], torch.randn(72), layout)
    x = _inputs(258, k)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(258)])
    for m in list(range(1, 18)) + [23, 24, 25, 26, 31, 32, 33, 34, 127, 128, 129, 130, 255, 256, 257, 258]:
        assert torch.equal(lin(x[:m]), alone[:m]), m
        assert torch.equal(lin(x[258 - m:]), alone[258 - m:]), m  # rows at other places in the batch


@pytest.mark.parametrize("layout", LAYOUTS)
def test_result_independent_of_thread_count(layout):
    """75 weight rows (five groups of 16, the last one short): threads split the groups, and
    two-vector tiles leave a different lone vector for each thread count; the bits stay the same."""
    lin = make_linear([_weight(75, 1536)], None, layout)
    x = _inputs(130, 1536)   # enough rows for the two-vector tiles
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lin(x)
        torch.set_num_threads(3)
        three = lin(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, lin(x)) and torch.equal(three, one)


def _builds():
    """Every build this CPU runs: AVX2, and with VNNI 256- and 512-bit vectors."""
    vnni = [build_quant_ops(vnni=True, zmm=z) for z in (True, False)] if cpu_has_vnni() else []
    return [build_quant_ops(vnni=False)] + vnni


def _call(ops, x, packed: PackedWeight, out):
    xq, dx, bsum = ops.quantize_rows(x)
    p = packed
    if p.layout == "int4":
        ops.q4_matmul(xq, dx, bsum, p.wq, p.sc, p.mn, p.d, p.dmin, p.n, None, out, 0)
    elif p.layout == "int6":
        ops.q6_matmul(xq, dx, p.wq, p.sc, p.sc2, p.d, p.n, None, out, 0)
    else:
        ops.q8_matmul(xq, dx, p.wq, p.sc, p.corr, p.d, p.n, None, out, 0)
    return xq


@pytest.mark.skipif(not cpu_has_vnni(), reason="this CPU has no AVX-512 VNNI: only the AVX2 kernels exist here")
@pytest.mark.parametrize("k", [1536, 896, 2304, 2176])
@pytest.mark.parametrize("m", [1, 7, 21, 37, 134])
def test_vnni_and_avx2_kernels_give_the_same_bits(k, m):
    """The VNNI dot products (vpdpbusd, scales multiplied per sub-block; 512-bit vectors of 16
    weight rows or 256-bit ones of 8) and the AVX2 ones (vpmaddubsw / vpmaddwd, int4's pair sums
    added as int16) sum the same integers: equal outputs, bit for bit, in whole and short
    superblocks, for both layouts, with one-vector tiles (1, 7, 21 rows) and two-vector ones (37,
    134), 41 weight rows (a short last group)."""
    x = _inputs(m, k)
    w4, w8 = PackedWeight.pack(quantize(_weight(41, k), "int4")), PackedWeight.pack(quantize(_weight(41, k, 2), "int8"))
    outs = []
    for ops in _builds():
        o4, o8 = torch.empty(m, 41), torch.empty(m, 41)
        outs.append((_call(ops, x, w4, o4), o4, o8))
        _call(ops, x, w8, o8)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)
    assert outs[0][1].abs().max() > 0 and outs[0][2].abs().max() > 0


@pytest.mark.parametrize("k", [1536, 896])
def test_int4_integer_sums_at_their_extremes(k):
    """Every weight at 15 (the top nibble), every sub-block scale and min at 255 and activations at
    +-127 after quantization: the largest integer sums the int4 kernels form (the AVX2 build adds a
    sub-block's pair products as int16, 8 x 3,810 per lane; a superblock's scaled sum reaches 8 x
    255 x 60,960, near 2^27) still match the float64 oracle, in whole and short superblocks, for
    both signs, in every build this CPU runs."""
    n, s = 38, (k + 255) // 256
    w = QuantizedTensor("int4", torch.full((n, k // 2), 0xFF, dtype=torch.uint8),
                        torch.full((n, k // 32), 255, dtype=torch.uint8), torch.full((n, k // 32), 255, dtype=torch.uint8),
                        torch.ones(n, s), torch.ones(n, s) * torch.arange(n).view(n, 1) / 5)
    x = torch.stack([torch.full((k,), 127.0), torch.full((k,), -127.0)] * 17)
    ref = reference_matmul(x, w)
    assert ref[0, 0] == 127 * 15 * 255 * k   # every dot product at its largest: the oracle is exact here
    for ops in _builds():
        got = torch.empty(34, n)
        _call(ops, x, PackedWeight.pack(w), got)
        assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("k", [1536, 896])
def test_int8_integer_sums_at_their_extremes(k):
    """int8 weights at +-127 with scales at +-127 against activations at +-127: the VNNI path's
    offset activations (x + 128 up to 255) and its correction term, and the AVX2 path's pair sums
    (2 x 127 x 127 < 2^15), at their largest, match the float64 oracle in every build."""
    n, s = 40, (k + 255) // 256
    sign = torch.where(torch.arange(k) % 3 == 0, -1, 1)
    q = (127 * sign).to(torch.int8).expand(n, k)
    sc = torch.full((n, k // 16), 127, dtype=torch.int8)
    sc[1::2] = -127   # odd weight rows: negative sub-block scales (Q6_K's are signed)
    from specserve.models.quantization import kernel_order
    w = QuantizedTensor("int8", q[:, kernel_order(k)].contiguous(), sc, None, torch.ones(n, s) / 7, None)
    x = torch.stack([127.0 * sign, -127.0 * sign, torch.full((k,), 127.0)] * 6).float()
    ref = reference_matmul(x, w)
    assert abs(ref[0, 0] / (127 ** 3 * k * w.d[0, 0].item()) - 1) < 1e-12   # every product at its largest
    for ops in _builds():
        got = torch.empty(18, n)
        _call(ops, x, PackedWeight.pack(w), got)
        assert (got.double() - ref).abs().max() <= 1e-6 * ref.abs().max()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES + [(17, 512)])
def test_packed_layout_round_trips(layout, shape):
    """Packing is a reordering: unpacking gives the same integers and scales back, bit for bit, and
    the packed bytes hold the documented positions (hand-checked: row 16g + w's values at byte 4w)."""
    n, k = shape
    if layout == "int4" and k % 64:
        pytest.skip("int4 packs 64 values per 32 bytes")
    qt = quantize(_weight(n, k), layout)
    packed = PackedWeight.pack(qt)
    back = packed.unpack()
    for f in ("qs", "sc", "mn", "d", "dmin"):
        a, b = getattr(qt, f), getattr(back, f)
        assert (a is None and b is None) or torch.equal(a, b), f
    natural = qt.dequantize()
    if layout == "int4":   # value 32j + 8c + i of row w: low nibble of byte 4w + i in block (j, c)
        q = unpack_int4(qt.qs)
        assert packed.wq[0, 1, 2, 3, 1] & 0x0F == q[3, 32 + 16 + 1] and packed.wq[0, 1, 2, 3, 1] >> 4 == q[3, 32 + 16 + 4 + 1]
    else:                  # value 16j + 4t + i of row w at [g, j, t, w, i]
        q = qt.qs[:, natural_order(k)]
        assert packed.wq[0, 2, 1, 5, 3] == q[5, 32 + 4 + 3]
    assert torch.equal(back.dequantize(), natural)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantize_error_bounded(layout):
    """Each weight lies within half a quantization step (plus the sub-scale's rounding)."""
    w = _weight(16, 512)
    qt = quantize(w, layout)
    err = (qt.dequantize() - w).abs()
    sup = qt.d.repeat_interleave(256, 1)[:, :512]
    if layout == "int8":
        step = sup * qt.sc.float().repeat_interleave(16, 1)
        assert (err <= step / 2 * (1 + 1e-5)).all()  # nothing clipped
        amax = w.view(16, -1, 16).abs().amax(-1).repeat_interleave(16, 1)
        assert (step <= (amax / 127 + sup) * (1 + 1e-5)).all()  # scales rounded up by < one d
    else:
        step = sup * qt.sc.float().repeat_interleave(32, 1)
        offset = qt.dmin.repeat_interleave(256, 1)[:, :512] * qt.mn.float().repeat_interleave(32, 1)
        assert ((w + offset) / step >= -1e-5).all() and ((w + offset) / step <= 15 + 1e-4).all()
        assert (err <= step / 2 * (1 + 1e-5) + 1e-7).all()  # nothing clipped
        blocks = w.view(16, -1, 32)
        span = (blocks.amax(-1).clamp(min=0) - blocks.amin(-1).clamp(max=0)).repeat_interleave(32, 1)
        dmin = qt.dmin.repeat_interleave(256, 1)[:, :512]
        assert (step <= ((span + dmin) / 15 + sup) * (1 + 1e-5)).all()
    assert torch.equal(unpack_int4(pack_int4(torch.arange(64 * 3).remainder(16).view(3, 64))),
                       torch.arange(64 * 3).remainder(16).view(3, 64).to(torch.uint8))


def test_unpackable_shape_names_the_tensor():
    with pytest.raises(ValueError, match=r"cannot pack tensor 'model.layers.0.mlp.down_proj.weight'.*96"):
        make_linear([torch.randn(8, 96)], None, "int4", "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        LLM("unused-model-name", quantization="int3")


def _random_kquant_blocks(kind: str, n: int, k: int, seed=0) -> np.ndarray:
    """Valid GGUF Q4_K / Q6_K rows of random content: ``[n, bytes per row]`` uint8."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    d = (rng.random(len(blocks)) * 0.01 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q4_K":
        blocks[:, 0:2] = d
        blocks[:, 2:4] = (rng.random(len(blocks)) * 0.01).astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        blocks[:, 208:210] = d
    return blocks.reshape(n, -1)


@pytest.mark.parametrize("kind, layout", [("Q4_K", "int4"), ("Q6_K", "int8"), ("Q6_K", "int6")])
def test_gguf_kquant_blocks_map_exactly(kind, layout):
    """Q4_K -> int4 and Q6_K -> int8 or int6 keep the file's values bit for bit (gguf's dequantizer is the oracle)."""
    import gguf

    from specserve.models.gguf_loader import dequantize

    n, k = 20, 768
    raw = _random_kquant_blocks(kind, n, k)
    expected = dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(n, k)
    qt = from_gguf("w", raw, kind, (n, k), layout, dequantize)
    assert qt.layout == layout and qt.source == kind
    assert np.array_equal(qt.dequantize().numpy(), expected)
    assert layout_for("int8", "Q4_K") == "int8"


def test_gguf_rows_chunked_like_whole():
    """A long tensor converted in row chunks equals the same rows converted at once."""
    from specserve.models import quantization
    from specserve.models.gguf_loader import dequantize

    raw = _random_kquant_blocks("Q6_K", 40, 512, seed=3)
    whole = from_gguf("w", raw, "Q6_K", (40, 512), "int8", dequantize)
    old = quantization._ROWS_PER_CHUNK
    quantization._ROWS_PER_CHUNK = 16
    try:
        chunked = from_gguf("w", raw, "Q6_K", (40, 512), "int8", dequantize)
    finally:
        quantization._ROWS_PER_CHUNK = old
    assert all(torch.equal(a, b) for a, b in zip((whole.qs, whole.sc, whole.d), (chunked.qs, chunked.sc, chunked.d)))


def _q6k(n: int, k: int, seed: int = 0) -> QuantizedTensor:
    """A GGUF Q6_K tensor of random blocks in the int6 layout (the file's integers, exact)."""
    from specserve.models.gguf_loader import dequantize

    return from_gguf("w", _random_kquant_blocks("Q6_K", n, k, seed), "Q6_K", (n, k), "int6", dequantize)


@pytest.mark.parametrize("shape", [(40, 768), (17, 256), (75, 2304)])
def test_int6_is_the_int8_layout_in_fewer_bytes(shape):
    """A Q6_K tensor packed to 6 bits gives, bit for bit, what the same integers give in the int8
    layout, in every build and at 1, 5 and 37 rows (both tile shapes), reads 0.75 bytes a weight
    (plus scales), unpacks exactly, and matches the float64 oracle."""
    n, k = shape
    q6 = _q6k(n, k)
    assert q6.layout == "int6" and q6.qs.min() >= -32 and q6.qs.max() <= 31
    q8 = QuantizedTensor("int8", q6.qs, q6.sc, None, q6.d, None, "Q6_K")
    p6, p8 = PackedWeight.pack(q6), PackedWeight.pack(q8)
    assert p6.wq.numel() == -(-n // 16) * 16 * k * 3 // 4
    back = p6.unpack()
    assert back.layout == "int6" and torch.equal(back.qs, q6.qs) and torch.equal(back.sc, q6.sc)
    for m in (1, 5, 37):
        x = _inputs(m, k)
        ref = reference_matmul(x, q6)
        for ops in _builds():
            o6, o8 = torch.empty(m, n), torch.empty(m, n)
            _call(ops, x, p6, o6)
            _call(ops, x, p8, o8)
            assert torch.equal(o6, o8), m
            assert (o6.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_int6_rows_bitwise_independent_and_in_fused_linears():
    """int6 rows alone equal the same rows in any call (one- and two-vector tiles), also as the
    v block of a fused q/k/v beside int4 blocks (as Q4_K_M files store them)."""
    k = 512
    lin = make_linear([quantize(_weight(32, k, 1), "int4"), _q6k(40, k, 2)], torch.randn(72), "int4")
    assert [p.layout for p in lin.parts] == ["int4", "int6"]
    x = _inputs(40, k)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    for m in (1, 2, 5, 12, 13, 24, 25, 40):
        assert torch.equal(lin(x[:m]), alone[:m]) and torch.equal(lin(x[40 - m:]), alone[40 - m:]), m


def test_q6k_goes_to_int6_under_int4():
    assert layout_for("int4", "Q6_K") == "int6" and layout_for("int8", "Q6_K") == "int8"
    assert layout_for("int4", "Q8_0") == "int8" and layout_for("int4", "Q4_K") == "int4"


# ------------------------------------------------------------------------------ engine level

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 3, 17, 45, 100, 160, 231, 300]


def _prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in lengths]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=LAYOUTS)
def quantized_reference(request, tiny_qwen2_dir):
    base = LLM(tiny_qwen2_dir, quantization=request.param)
    assert isinstance(base.llm_engine.target.model.layers[0].gate_up_proj, QuantizedLinear)
    batch = _ids(base.generate(_prompts(), GREEDY))
    alone = [_ids(base.generate([p], GREEDY))[0] for p in _prompts()]
    assert batch == alone  # a batch of 8 == each alone
    return request.param, batch


@pytest.mark.parametrize("method", ["draft_model", "ngram", "mtp", "eagle"])
def test_quantized_target_greedy_speculation_exact(quantized_reference, tiny_qwen2_dir, trained_tiny_head,
                                                   tmp_path_factory, method):
    """Greedy with speculation == greedy without, on the same quantized target, for every method."""
    from tests.tiny_models import make_layer_skip_draft

    layout, reference = quantized_reference
    cfg = {"method": method, "adaptive": False, "num_speculative_tokens": 3}
    if method == "draft_model":
        draft = tmp_path_factory.mktemp("qdraft")
        make_layer_skip_draft(tiny_qwen2_dir, draft, keep_layers=3, noise=0.07)
        cfg.update(model=str(draft), draft_quantization="int4")
    elif method in ("mtp", "eagle"):
        cfg["model"] = trained_tiny_head
    llm = LLM(tiny_qwen2_dir, quantization=layout, speculative_config=cfg)
    if method in ("mtp", "eagle"):   # the head drafts on the target's integer kernels too
        head = llm.llm_engine.proposer.head
        assert head.quantization == layout and isinstance(head.self_attn.q_proj, QuantizedLinear)
    assert _ids(llm.generate(_prompts(), GREEDY)) == reference
    st = llm.llm_engine.spec_stats
    assert st.num_verify_steps > 0
    if method != "ngram":
        assert st.num_accepted_tokens > 0


def test_quantized_smollm2_gguf_speculation_exact(smollm2_gguf):
    """The real SmolLM2 GGUF (Q4_1 layers, tied Q8_0 embedding) read straight from its blocks as int4,
    drafting for itself in int8: greedy with speculation == without, a batch == each alone."""
    from specserve.models.loader import load_model

    loaded = load_model(smollm2_gguf, quantization="int4")
    head = loaded.weights["lm_head.weight"]
    assert isinstance(head, QuantizedTensor) and head.layout == "int8" and head.source == "Q8_0"
    assert loaded.weights["model.layers.0.mlp.down_proj.weight"].source == "Q4_1"
    texts = ["def fibonacci(n):", "The capital of France is", "import numpy as np\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = LLM(smollm2_gguf, loaded=loaded, quantization="int4")
    reference = _ids(base.generate(texts, params))
    assert reference == [_ids(base.generate([t], params))[0] for t in texts]
    spec = LLM(smollm2_gguf, quantization="int4", loaded=loaded,
               speculative_config={"method": "draft_model", "model": smollm2_gguf, "num_speculative_tokens": 3,
                                   "adaptive": False, "draft_quantization": "int8"})
    assert _ids(spec.generate(texts, params)) == reference
    assert spec.llm_engine.spec_stats.num_accepted_tokens > 0


def test_kernels_find_their_cache_without_importing_the_models():
    """specserve.kernels sits below specserve.models: finding the build cache must not import the
    loader (an import circle models -> attention -> kernels -> models before)."""
    import subprocess
    import sys

    code = ("import sys, pathlib, specserve.kernels as k; "
            "k.build_directory(pathlib.Path(k.__file__).with_name('paged_attention.cpp'), [], 'x'); "
            "print(sorted(m for m in sys.modules if m.startswith('specserve.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
