"""The fused decoder layer's native ops (RMSNorm with the residual add, SwiGLU's activation, rotary
embedding with the KV write, 16-bit KV caches) against the PyTorch reference layer, their row
independence, and the whole model on the fused path against the reference path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.attention.cpu_backend import AttentionPlan, CpuAttentionBackend
from specserve.attention.metadata import AttentionMetadata
from specserve.attention.torch_backend import TorchAttentionBackend
from specserve.kernels import cpu_supports_quantized

pytestmark = pytest.mark.skipif(not cpu_supports_quantized(), reason="the fused layer's kernels need AVX2")


@pytest.fixture(scope="module")
def ops():
    from specserve.kernels import quant_ops
    return quant_ops()


@pytest.fixture(scope="module")
def attn_ops():
    from specserve.kernels import attention_ops
    return attention_ops()


def rms_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double())


@pytest.mark.parametrize("k", [64, 576, 1536, 896 + 8])
def test_rms_norm_rows_match_float64_and_do_not_depend_on_the_batch(ops, k):
    g = torch.Generator().manual_seed(k)
    h, d = torch.randn(9, k, generator=g) * 3, torch.randn(9, k, generator=g)
    w = torch.randn(k, generator=g)
    summed, y = ops.rms_norm_rows(h, d, w, 1e-6, False)
    assert torch.equal(summed, h + d)                         # the residual add is one IEEE add
    ref = rms_reference(h + d, w, 1e-6)
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    same, y_alone = ops.rms_norm_rows(h, None, w, 1e-6, False)
    assert same.data_ptr() == h.data_ptr()                    # no delta: the stream itself
    ref_alone = rms_reference(h, w, 1e-6)
    assert (y_alone.double() - ref_alone).abs().max() <= 1e-5 * ref_alone.abs().max()
    for m in (0, 4, 8):                                       # each row alone: the same bits
        assert torch.equal(ops.rms_norm_rows(h[m:m + 1] + d[m:m + 1], None, w, 1e-6, False)[1], y[m:m + 1])
    if k % 32 == 0:   # the quantized form is quantize_rows of the float form, exactly
        q = ops.rms_norm_rows(h, d, w, 1e-6, True)[1:]
        assert all(torch.equal(a, b) for a, b in zip(q, ops.quantize_rows(y)))


@pytest.mark.parametrize("i", [64, 1536, 8960])
def test_silu_mul_rows_match_float64_and_do_not_depend_on_the_batch(ops, i):
    g = torch.Generator().manual_seed(i)
    gu = torch.randn(5, 2 * i, generator=g) * 6
    (y,) = ops.silu_mul_rows(gu, False)
    gate, up = gu.double().chunk(2, -1)
    ref = gate / (1 + torch.exp(-gate)) * up
    assert ((y.double() - ref).abs() <= 1e-6 * ref.abs() + 1e-30).all()   # a few float32 roundings
    assert torch.equal(ops.silu_mul_rows(gu[3:4].contiguous(), False)[0], y[3:4])
    q = ops.silu_mul_rows(gu, True)
    assert all(torch.equal(a, b) for a, b in zip(q, ops.quantize_rows(y)))


def test_silu_mul_rows_extremes(ops):
    """Saturation and special values as torch's silu: large |x|, infinities and NaN."""
    x = torch.tensor([[-1e30, -200.0, -88.5, -87.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 200.0, 1e30,
                       float("inf"), float("-inf"), float("nan"), 1.0, -1.0]])
    (y,) = ops.silu_mul_rows(torch.cat([x, torch.ones_like(x)], 1), False)
    ref = F.silu(x.double())
    finite = ref.isfinite()
    assert torch.allclose(y.double()[finite], ref[finite], rtol=1e-6, atol=1e-37)
    assert torch.equal(y[~finite].isnan(), ref[~finite].isnan()) and torch.equal(y[ref.isinf()], ref[ref.isinf()].float())


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_write_kv_equals_the_reference_rotary_and_write(attn_ops, cache_dtype):
    """Rotated queries bit for bit as the reference rotary; keys and values written rounded to the
    cache's type exactly as ``tensor.to(dtype)`` rounds."""
    from specserve.models.llama import RotaryEmbedding

    h, hkv, d, t = 4, 2, 32, 7
    rot = RotaryEmbedding(d, 10000.0, 64)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g) * 4
    positions = torch.tensor([0, 5, 6, 7, 31, 63, 2])
    slots = torch.tensor([3, 9, 10, 11, 0, 20, 5])
    kc = torch.zeros(24, hkv, d, dtype=cache_dtype)
    vc = torch.zeros(24, hkv, d, dtype=cache_dtype)
    q_out = attn_ops.rope_write_kv(qkv, rot.cos, rot.sin, positions, slots, kc, vc, h)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], -1)
    q_ref, k_ref = rot(positions, q.reshape(t, h, d), k.reshape(t, hkv, d))
    assert torch.equal(q_out, q_ref)
    assert torch.equal(kc[slots], k_ref.to(cache_dtype)) and torch.equal(vc[slots], v.reshape(t, hkv, d).to(cache_dtype))
    with pytest.raises(RuntimeError, match="past the rotary table"):
        attn_ops.rope_write_kv(qkv, rot.cos, rot.sin, positions + 64, slots, kc, vc, h)
    with pytest.raises(RuntimeError, match="out of range"):
        attn_ops.rope_write_kv(qkv, rot.cos, rot.sin, positions, slots + 100, kc, vc, h)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_attention_over_a_16_bit_cache_equals_the_reference_on_the_widened_entries(cache_dtype):
    """The kernel widens 16-bit entries exactly: its result over a float16 / bfloat16 cache is its
    result over the same entries stored as float32, bit for bit, and the reference backend's within
    float32 rounding; a decode row alone equals the same row inside a verify."""
    h, hkv, d, bs = 4, 2, 16, 4
    g = torch.Generator().manual_seed(2)
    table, ctx, n = [5, 2, 7, 0, 3], 11, 4
    kc = (torch.randn(8, bs, hkv, d, generator=g) * 2).to(cache_dtype)
    vc = torch.randn(8, bs, hkv, d, generator=g).to(cache_dtype)
    q = torch.randn(n, h, d, generator=g)
    k_new, v_new = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    md = AttentionMetadata.build([table], [ctx], [n], bs)
    backend = CpuAttentionBackend(h, hkv, d)
    k16, v16 = kc.clone(), vc.clone()
    out = backend.forward(q, k_new, v_new, k16, v16, AttentionPlan.build(md))
    k32, v32 = k16.float(), v16.float()     # the entries as written, widened
    assert torch.equal(backend.forward(q, k_new.to(cache_dtype).float(), v_new.to(cache_dtype).float(), k32.clone(),
                                       v32.clone(), md), out)
    ref = TorchAttentionBackend(h, hkv, d).forward(q, k_new, v_new, kc.clone(), vc.clone(), md)
    assert (out - ref).abs().max() < 1e-5
    last = AttentionMetadata.build([table], [ctx + n - 1], [1], bs)
    assert torch.equal(backend.forward(q[-1:], k_new[-1:], v_new[-1:], k16, v16, last), out[-1:])


def test_one_row_float_linear_equals_its_row_in_many():
    """oneDNN runs a single row with in_features >= 1536 on another kernel than several rows;
    BatchInvariantLinear must give a decode row the bits it gets inside a verify."""
    from specserve.models.linear import BatchInvariantLinear

    g = torch.Generator().manual_seed(3)
    for n, k in [(576, 1536), (1536, 8960), (256, 576)]:
        lin = BatchInvariantLinear(torch.randn(n, k, generator=g))
        x = torch.randn(70, k, generator=g)
        full = lin(x)
        for m in (1, 2, 5, 17, 70):
            assert torch.equal(lin(x[m - 1:m]), full[m - 1:m]) and torch.equal(lin(x[:m])[m - 1], full[m - 1])


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_fused_model_matches_the_reference_layer_and_keeps_rows_independent(tiny_qwen2_dir, quantization):
    """The whole decoder on the fused path: within float tolerance of the PyTorch reference layer
    (the same model with ``fused = False``), and a sequence's rows carry the same bits alone, in a
    batch, decoded one at a time or verified together."""
    from specserve import LLM
    from specserve.worker.model_runner import ModelInput

    llm = LLM(tiny_qwen2_dir, quantization=quantization)
    engine = llm.llm_engine
    runner, bm, model = engine.target.runner, engine.block_manager, engine.target.runner.model
    assert model.fused
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (9, 23, 4)]
    for i, s in enumerate(seqs):
        bm.allocate(-10 - i, len(s) + 8)
    tables = [bm.block_table(-10 - i) for i in range(len(seqs))]
    try:
        def run(fused: bool, inputs):
            model.fused = fused
            return runner.forward(inputs).hidden_states.clone()

        whole = [ModelInput(s, 0, t) for s, t in zip(seqs, tables)]
        fused, ref = run(True, whole), run(False, whole)
        tol = 1e-4 if quantization == "none" else 5e-2   # int4: a different rounding may move a quantized step
        assert (fused - ref).abs().max() <= tol * ref.abs().max()
        alone = run(True, [ModelInput(seqs[1], 0, tables[1])])
        assert torch.equal(alone, fused[9:32])
        # the last 3 tokens decoded one by one == verified together
        s, t = seqs[1], tables[1]
        run(True, [ModelInput(s[:-3], 0, t)])
        steps = torch.cat([run(True, [ModelInput([s[j]], j, t)]) for j in range(len(s) - 3, len(s))])
        verify = run(True, [ModelInput(s[-3:], len(s) - 3, t)])
        assert torch.equal(steps, verify) and torch.equal(verify, fused[29:32])
    finally:
        model.fused = True
        for i in range(len(seqs)):
            bm.free(-10 - i)


def test_kv_cache_dtype_is_checked_and_resolved(tiny_qwen2_dir):
    from specserve import LLM
    from specserve.config import EngineArgs

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .* got 'fp8'"):
        EngineArgs(model=tiny_qwen2_dir, kv_cache_dtype="fp8")
    assert LLM(tiny_qwen2_dir).llm_engine.target.kv_cache.key_cache.dtype == torch.float16          # auto on the CPU
    assert LLM(tiny_qwen2_dir, kv_cache_dtype="bfloat16").llm_engine.target.kv_cache.key_cache.dtype == torch.bfloat16
    spec = {"method": "draft_model", "model": tiny_qwen2_dir, "num_speculative_tokens": 2}
    draft_kv = LLM(tiny_qwen2_dir, kv_cache_dtype="float32", speculative_config=spec).llm_engine.worker.proposer.runner.kv_cache
    assert draft_kv.key_cache.dtype == torch.float32


def test_a_model_the_fused_ops_cannot_take_runs_the_reference_layer(tmp_path, caplog):
    """head_dim 12 (not a multiple of 16): the reference layer, named in a warning; HF's output."""
    from tests.tiny_models import make_tiny_model

    from specserve import LLM, SamplingParams

    hf = make_tiny_model("llama", tmp_path, hidden_size=48)        # 4 heads of 12
    with caplog.at_level("WARNING"):
        llm = LLM(str(tmp_path))
    assert not llm.llm_engine.target.runner.model.fused and "head_dim 12" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with torch.no_grad():
        want = hf.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out[0].outputs[0].token_ids == want[0, 3:].tolist()
