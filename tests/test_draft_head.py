"""Draft heads: the math against oracles, the two attention paths, the training-time test against
drafting, checkpoints in EAGLE-3, EAGLE and DeepSeek-MTP layouts."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specserve.attention.metadata import AttentionMetadata
from specserve.config import ModelConfig
from specserve.models.draft_head import DraftHead, PagedKV
from specserve.models.draft_head_checkpoint import load_draft_head, map_checkpoint_names
from specserve.models.draft_head_config import DraftHeadConfig

TARGET = ModelConfig(architecture="qwen2", vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                     rope_theta=10000.0, max_position_embeddings=128, attention_bias=True)


VARIANTS = ["eagle3", "eagle", "normed"]


def make_head(variant: str, draft_vocab: int | None = None, seed: int = 0, own_lm_head: bool = False) -> DraftHead:
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.for_target(TARGET, variant, intermediate_size=40, draft_vocab_size=draft_vocab,
                                                own_lm_head=own_lm_head))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(mean=1.0 if p.ndim == 1 and p.shape[0] == TARGET.hidden_size else 0.0, std=0.2)
    if draft_vocab is not None:
        head.set_draft_vocab(torch.randperm(TARGET.vocab_size)[:draft_vocab].sort().values)
    g = torch.Generator().manual_seed(seed + 1)
    head.attach_target(torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g),
                       torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g))
    return head


def feature_width(head: DraftHead) -> int:
    """Width of the target features the head reads (eagle3: the fused layers)."""
    return head.config.hidden_size * (head.config.num_aux_layers if head.variant == "eagle3" else 1)


def reference_forward(head: DraftHead, hidden: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor):
    """The head's math written out in float64 for one sequence ``[T, H]`` (causal attention)."""
    cfg = head.config
    sd = {k: v.double() for k, v in head.state_dict().items() if v.is_floating_point()}

    def norm(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w

    def lin(x, name, bias=False):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if bias else y

    e, h = head.embed_weight.double()[ids], hidden.double()
    if cfg.variant == "eagle3":   # fused layers -> fc; attention reads [norm(embed), norm(h)], residual h
        x = lin(h, "fc") if h.shape[-1] != cfg.hidden_size else h
        a = torch.cat([norm(e, sd["input_layernorm.weight"]), norm(x, sd["hidden_norm.weight"])], -1)
    else:
        if cfg.variant == "normed":
            e, h = norm(e, sd["enorm.weight"]), norm(h, sd["hnorm.weight"])
        x = lin(torch.cat([e, h], -1), "eh_proj", bias=cfg.variant == "eagle")
        a = norm(x, sd["input_layernorm.weight"]) if cfg.variant == "normed" else x
    T, nh, nkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = lin(a, "self_attn.q_proj", cfg.attention_bias).view(T, nh, d)
    k = lin(a, "self_attn.k_proj", cfg.attention_bias).view(T, nkv, d)
    v = lin(a, "self_attn.v_proj", cfg.attention_bias).view(T, nkv, d)
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rope(z):
        z1, z2 = z[..., :d // 2], z[..., d // 2:]
        return z * cos + torch.cat([-z2, z1], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / d ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(T, nh * d)
    x = x + lin(attn, "self_attn.o_proj")
    m = norm(x, sd["post_attention_layernorm.weight"])
    x = x + lin(F.silu(lin(m, "mlp.gate_proj")) * lin(m, "mlp.up_proj"), "mlp.down_proj")
    return norm(x, sd["shared_head.norm.weight"]) if cfg.variant == "normed" else x


@pytest.mark.parametrize("variant", VARIANTS)
def test_head_matches_float64_reference(variant):
    head = make_head(variant)
    torch.manual_seed(3)
    hidden = torch.randn(2, 9, feature_width(head))
    ids = torch.randint(0, TARGET.vocab_size, (2, 9))
    pos = torch.arange(1, 10).expand(2, 9)
    out = head(hidden, ids, pos)
    for b in range(2):
        ref = reference_forward(head, hidden[b], ids[b], pos[b])
        torch.testing.assert_close(out[b].double(), ref, rtol=1e-4, atol=1e-4)


def test_normed_head_equals_hf_decoder_layer():
    """The normed variant's layer is a standard pre-norm decoder layer: HF's Qwen2 model with one
    layer, fed eh_proj's output as inputs_embeds, must give the same hidden states."""
    from transformers import Qwen2Config, Qwen2Model

    head = make_head("normed")
    cfg = head.config
    hf = Qwen2Model(Qwen2Config(vocab_size=TARGET.vocab_size, hidden_size=cfg.hidden_size,
                                intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                                num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                                rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                                max_position_embeddings=cfg.max_position_embeddings)).eval()
    sd = head.state_dict()
    hf_sd = {"norm.weight": sd["shared_head.norm.weight"], "embed_tokens.weight": hf.embed_tokens.weight}
    for name, t in sd.items():
        if name.startswith(("self_attn.", "mlp.", "input_layernorm", "post_attention_layernorm")):
            hf_sd["layers.0." + name] = t
    hf.load_state_dict(hf_sd, strict=True)
    torch.manual_seed(4)
    hidden = torch.randn(1, 7, cfg.hidden_size)
    ids = torch.randint(0, TARGET.vocab_size, (1, 7))
    pos = torch.arange(5, 12).unsqueeze(0)
    with torch.no_grad():
        x = head.eh_proj(torch.cat([head.enorm(head.embed(ids)), head.hnorm(hidden)], -1))
        want = hf(inputs_embeds=x, position_ids=pos).last_hidden_state
        got = head(hidden, ids, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_paged_inference_path_equals_training_path(variant):
    """Two sequences through the paged KV cache (a prefill chunk, then token by token) give the
    training forward's hidden states."""
    head = make_head(variant)
    cfg = head.config
    torch.manual_seed(5)
    lens = [11, 6]
    hidden = [torch.randn(n, feature_width(head)) for n in lens]
    ids = [torch.randint(0, TARGET.vocab_size, (n,)) for n in lens]
    want = [head(h.unsqueeze(0), i.unsqueeze(0), torch.arange(n).unsqueeze(0))[0] for h, i, n in zip(hidden, ids, lens)]
    block_size, tables = 4, [[0, 1, 2], [3, 4]]
    kc = torch.zeros(6, block_size, cfg.num_key_value_heads, cfg.head_dim)
    vc = torch.zeros_like(kc)
    got = [[], []]
    steps = [(0, 5), (5, 1), (6, 1), (7, 4)]     # chunk boundaries of sequence 0; sequence 1 ends earlier
    for start, n in steps:
        rows = [(b, start, min(n, lens[b] - start)) for b in range(2) if start < lens[b]]
        md = AttentionMetadata.build([tables[b] for b, _, _ in rows], [s for _, s, _ in rows], [q for _, _, q in rows],
                                     block_size)
        h = torch.cat([hidden[b][s:s + q] for b, s, q in rows])
        i = torch.cat([ids[b][s:s + q] for b, s, q in rows])
        p = torch.cat([torch.arange(s, s + q) for _, s, q in rows])
        out = head(h, i, p, PagedKV(kc, vc, md))
        o = 0
        for b, s, q in rows:
            got[b].append(out[o:o + q])
            o += q
    for b in range(2):
        torch.testing.assert_close(torch.cat(got[b]), want[b], rtol=1e-5, atol=1e-5)


def test_reduced_vocabulary_scores_the_mapped_rows():
    full, reduced = make_head("normed"), make_head("normed", draft_vocab=12)
    reduced.load_state_dict({k: v for k, v in full.state_dict().items() if k != "draft_to_target"}, strict=False)
    h = torch.randn(3, TARGET.hidden_size)
    torch.testing.assert_close(reduced.compute_logits(h), full.compute_logits(h)[:, reduced.draft_to_target])
    with pytest.raises(ValueError, match="distinct"):
        reduced.set_draft_vocab(torch.zeros(12, dtype=torch.int64))


@pytest.mark.parametrize("variant,draft_vocab", [("eagle", None), ("normed", None), ("normed", 12)])
def test_save_and_reload_gives_identical_logits(tmp_path, variant, draft_vocab):
    head = make_head(variant, draft_vocab)
    head.save(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"][0].endswith("ForCausalLMEagle")
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)   # the target's: never saved
    assert ("d2t" in names) == (draft_vocab is not None)
    loaded, report = load_draft_head(tmp_path)
    assert report.missing == [] and report.unmapped == []
    loaded.attach_target(head.embed_weight, head._full_lm_head)
    hidden, ids = torch.randn(1, 8, TARGET.hidden_size), torch.randint(0, TARGET.vocab_size, (1, 8))
    pos = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded.compute_logits(loaded(hidden, ids, pos)), head.compute_logits(head(hidden, ids, pos)))
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)


def test_saved_head_is_readable_by_others(tmp_path):
    """safetensors writes mode 0600; a shipped or shared head must get the umask's mode (0644)."""
    import os
    old = os.umask(0o022)
    try:
        make_head("normed").save(tmp_path, dtype=torch.float32)
    finally:
        os.umask(old)
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name


def _layer_tensors(head: DraftHead, prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + n: t.clone() for n, t in head.state_dict().items()
            if n.startswith(("self_attn.", "mlp.", "input_layernorm", "post_attention_layernorm"))}


def test_load_eagle_layout_checkpoint(tmp_path):
    """A published-style EAGLE-1 checkpoint: fc with bias, layers.0.* without input_layernorm,
    plus the target's embedding (skipped) and a stray tensor (reported)."""
    from safetensors.torch import save_file

    src = make_head("eagle", seed=7)
    tensors = {"fc.weight": src.eh_proj.weight.detach().clone(), "fc.bias": src.eh_proj.bias.detach().clone(),
               "embed_tokens.weight": torch.zeros(TARGET.vocab_size, TARGET.hidden_size),
               "rotary_emb.inv_freq": torch.zeros(4)}
    tensors.update(_layer_tensors(src, "layers.0."))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle"], "model_type": "qwen2", "hidden_size": 32, "intermediate_size": 40,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="rotary_emb.inv_freq"):
        load_draft_head(tmp_path)
    head, report = load_draft_head(tmp_path, strict=False)
    assert head.config.variant == "eagle" and head.config.attention_bias
    assert report.unmapped == ["rotary_emb.inv_freq"] and report.target_owned == ["embed_tokens.weight"]
    assert report.missing == []
    for name, t in src.state_dict().items():
        if name != "draft_to_target":
            assert torch.equal(head.state_dict()[name], t), name


def test_load_deepseek_mtp_layout_maps_every_weight_and_reports_the_rest(tmp_path):
    from safetensors.torch import save_file

    src = make_head("normed", seed=8)
    p = "model.layers.2."
    tensors = {p + "enorm.weight": src.enorm.weight.detach().clone(), p + "hnorm.weight": src.hnorm.weight.detach().clone(),
               p + "eh_proj.weight": src.eh_proj.weight.detach().clone(),
               p + "shared_head.norm.weight": src.shared_head.norm.weight.detach().clone(),
               p + "shared_head.head.weight": torch.zeros(TARGET.vocab_size, TARGET.hidden_size),
               p + "embed_tokens.weight": torch.zeros(TARGET.vocab_size, TARGET.hidden_size),
               p + "self_attn.kv_a_proj_with_mqa.weight": torch.zeros(3, 3),
               p + "mlp.experts.0.gate_proj.weight": torch.zeros(3, 3)}
    tensors.update(_layer_tensors(src, p))
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    mapping, owned, unmapped = map_checkpoint_names(list(tensors))
    assert sorted(owned) == [p + "embed_tokens.weight", p + "shared_head.head.weight"]
    assert sorted(unmapped) == [p + "mlp.experts.0.gate_proj.weight", p + "self_attn.kv_a_proj_with_mqa.weight"]
    head, report = load_draft_head(tmp_path, config=src.config, strict=False)
    assert report.missing == [] and sorted(report.unmapped) == sorted(unmapped)
    for name, t in src.state_dict().items():
        if name != "draft_to_target":
            assert torch.equal(head.state_dict()[name], t), name
    assert len(report.loaded) == len([n for n in src.state_dict() if n != "draft_to_target"])


def test_bad_configs_name_the_value():
    with pytest.raises(ValueError, match="variant"):
        DraftHeadConfig.for_target(TARGET, "medusa")
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftHeadConfig.for_target(TARGET, "eagle", draft_vocab_size=51)
    head = make_head("eagle")
    with pytest.raises(ValueError, match="lm_head"):
        head.attach_target(torch.zeros(50, 32), torch.zeros(49, 32))


def _target_layer(seed: int = 7) -> dict[str, torch.Tensor]:
    """Random tensors of one TARGET decoder layer, by Hugging Face name without the layer prefix."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, i = TARGET.hidden_size, TARGET.num_attention_heads * TARGET.head_dim, \
        TARGET.num_key_value_heads * TARGET.head_dim, TARGET.intermediate_size
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.weight": (kv, h),
              "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
              "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
              "mlp.down_proj.weight": (h, i)}
    layer = {name: torch.randn(*shape, generator=g) * 0.3 for name, shape in shapes.items()}
    layer["input_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    layer["post_attention_layernorm.weight"] = 1 + 0.2 * torch.randn(h, generator=g)
    return layer


@pytest.mark.parametrize("variant", ["eagle3", "normed"])
@pytest.mark.parametrize("width", [48, 40])
def test_init_from_target_layer_computes_that_layer(variant, width):
    """Started from a target layer, the head applies that layer to the features it reads (eagle3:
    the highest fused layer; normed: the normalized hidden state), whatever the token: HF's Qwen2
    decoder layer with the same tensors is the oracle. A narrower MLP keeps the target's channels of
    largest |up row| x |down column|: the oracle's other down_proj columns are zeroed."""
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(TARGET, variant, intermediate_size=width))
    g = torch.Generator().manual_seed(1)
    head.attach_target(torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g),
                       torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=g))
    layer = _target_layer()
    head.init_from_target_layer(layer)
    hf = Qwen2Model(Qwen2Config(vocab_size=TARGET.vocab_size, hidden_size=TARGET.hidden_size,
                                intermediate_size=TARGET.intermediate_size, num_hidden_layers=1,
                                num_attention_heads=TARGET.num_attention_heads,
                                num_key_value_heads=TARGET.num_key_value_heads, rms_norm_eps=TARGET.rms_norm_eps,
                                rope_theta=TARGET.rope_theta,
                                max_position_embeddings=TARGET.max_position_embeddings)).eval()
    dropped = (layer["mlp.up_proj.weight"].norm(dim=1) * layer["mlp.down_proj.weight"].norm(dim=0)).argsort()[:48 - width]
    hf_sd = {"layers.0." + k: v.clone() for k, v in layer.items()}
    hf_sd["layers.0.mlp.down_proj.weight"][:, dropped] = 0
    hf_sd["norm.weight"] = torch.ones(TARGET.hidden_size)
    hf_sd["embed_tokens.weight"] = hf.embed_tokens.weight
    hf.load_state_dict(hf_sd, strict=True)
    torch.manual_seed(2)
    features = torch.randn(1, 7, feature_width(head))
    pos = torch.arange(3, 10).unsqueeze(0)
    with torch.no_grad():
        x = features[..., -TARGET.hidden_size:]
        if variant == "normed":   # hnorm (weight ones) before the layer
            x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + TARGET.rms_norm_eps)
        want = hf(inputs_embeds=x, position_ids=pos).last_hidden_state   # ends with a norm of weight ones
        for seed in (3, 4):   # the token's embedding does not enter yet
            ids = torch.randint(0, TARGET.vocab_size, (1, 7), generator=torch.Generator().manual_seed(seed))
            out = head(features, ids, pos)
            got = head.norm(out) if variant == "eagle3" else out
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_init_from_target_layer_names_what_does_not_fit():
    head = DraftHead(DraftHeadConfig.for_target(TARGET, "eagle3", intermediate_size=40))
    layer = _target_layer()
    with pytest.raises(ValueError, match="self_attn.o_proj.weight"):
        head.init_from_target_layer({k: v for k, v in layer.items() if k != "self_attn.o_proj.weight"})
    with pytest.raises(ValueError, match="self_attn.k_proj.weight.*needs"):
        head.init_from_target_layer({**layer, "self_attn.k_proj.weight": torch.zeros(16, 31)})
    wide = DraftHead(DraftHeadConfig.for_target(TARGET, "normed", intermediate_size=64))
    with pytest.raises(ValueError, match="64 channels"):
        wide.init_from_target_layer(layer)


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_eagle3_logits_and_wide_target_output(own_lm_head):
    """eagle3 scores ``norm(output)`` with its own lm_head (or the target's draft-vocabulary rows),
    and reads the target model's wide output (final hidden state first, then the fused layers)
    as the fused layers alone."""
    head = make_head("eagle3", draft_vocab=12, own_lm_head=own_lm_head)
    torch.manual_seed(6)
    fused = torch.randn(1, 7, feature_width(head))
    ids, pos = torch.randint(0, TARGET.vocab_size, (1, 7)), torch.arange(7).unsqueeze(0)
    with torch.no_grad():
        out = head(fused, ids, pos)
        wide = head(torch.cat([torch.randn(1, 7, TARGET.hidden_size), fused], -1), ids, pos)
        logits = head.compute_logits(out)
    assert torch.equal(wide, out)
    w = head.lm_head.weight if own_lm_head else head.lm_head_weight
    x = out.double()
    want = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + TARGET.rms_norm_eps) * head.norm.weight.double()) @ w.double().T
    torch.testing.assert_close(logits.double(), want, rtol=1e-4, atol=1e-4)
    assert logits.shape == (1, 7, 12)


def _draft_by_paged_cache(head: DraftHead, features: torch.Tensor, ids: torch.Tensor, anchor: int,
                          depth: int) -> list[torch.Tensor]:
    """What drafting computes (the paged inference path): the head's entries for positions
    0 .. anchor from the target's features, then ``depth`` chain steps, each on the head's own
    previous output and the next token, at the next position. Returns the chain's outputs."""
    cfg, bs = head.config, 4
    kc = torch.zeros(8, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=features.dtype)
    vc = torch.zeros_like(kc)
    table = list(range(8))
    md = AttentionMetadata.build([table], [0], [anchor + 1], bs)
    out = head(features[:anchor + 1], ids[1:anchor + 2], torch.arange(anchor + 1), PagedKV(kc, vc, md))
    chain, h = [], out[-1:]
    for i in range(1, depth + 1):
        md = AttentionMetadata.build([table], [anchor + i], [1], bs)
        h = head(h, ids[anchor + 1 + i:anchor + 2 + i], torch.tensor([anchor + i]), PagedKV(kc, vc, md))
        chain.append(h[0])
    return chain


@pytest.mark.parametrize("variant", VARIANTS)
def test_training_time_test_sees_what_drafting_sees(variant):
    """EAGLE-3's training-time test: unrolled step j of the training forward (its attention over
    step 0's keys up to the row and the same row's keys of steps 1 .. j) gives, at every row, the
    very hidden state the paged cache gives when drafting j tokens after that position (float64:
    the two paths agree to rounding)."""
    head = make_head(variant, seed=2).double()
    torch.manual_seed(9)
    t, depth = 12, 3
    features = torch.randn(t, feature_width(head), dtype=torch.float64)
    ids = torch.randint(0, TARGET.vocab_size, (t + depth + 1,))
    ttt, prev, steps = [], features.unsqueeze(0), []
    with torch.no_grad():
        for j in range(depth + 1):
            n = t - j
            prev = head(prev[:, :n], ids[1 + j:1 + j + n].unsqueeze(0), torch.arange(j, j + n).unsqueeze(0), ttt=ttt)
            steps.append(prev[0])
        for anchor in (0, 4, t - 1 - depth):
            chain = _draft_by_paged_cache(head, features, ids, anchor, depth)
            for j in range(1, depth + 1):
                torch.testing.assert_close(steps[j][anchor], chain[j - 1], rtol=1e-10, atol=1e-10)
    # plain causal attention within a step (the approximation this replaces) differs
    with torch.no_grad():
        naive = head(steps[0][:t - 1].unsqueeze(0), ids[2:t + 1].unsqueeze(0), torch.arange(1, t).unsqueeze(0))[0]
    assert not torch.allclose(naive[4], steps[1][4], atol=1e-3)


@pytest.mark.parametrize("own_lm_head,draft_vocab", [(False, None), (True, 12)])
def test_eagle3_checkpoint_layout_round_trip(tmp_path, own_lm_head, draft_vocab):
    head = make_head("eagle3", draft_vocab, own_lm_head=own_lm_head)
    head.save(tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(head.config.aux_hidden_state_layers)
    from safetensors.torch import load_file
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert ("lm_head.weight" in names) == own_lm_head and ("d2t" in names) == (draft_vocab is not None)
    assert not any(n.startswith(("layers.", "eh_proj")) or "embed" in n for n in names)
    loaded, report = load_draft_head(tmp_path)
    assert report.missing == [] and report.unmapped == []
    loaded.attach_target(head.embed_weight, head._full_lm_head)
    fused, ids = torch.randn(1, 8, feature_width(head)), torch.randint(0, TARGET.vocab_size, (1, 8))
    pos = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded.compute_logits(loaded(fused, ids, pos)), head.compute_logits(head(fused, ids, pos)))


def test_load_foreign_eagle3_checkpoint(tmp_path):
    """Tensors synthesized in the EAGLE-3 layout vLLM and SGLang load (fc [H, 3H], midlayer.* with
    2H-wide q/k/v, norm, lm_head over the draft vocabulary, d2t offsets, t2d mask), a config that
    does not name the fused layers, the target's embedding and a stray tensor."""
    from safetensors.torch import save_file

    h, n, layers = TARGET.hidden_size, 12, 30   # a 30-layer target: EAGLE-3 fuses layers 2, 15, 27
    g = torch.Generator().manual_seed(11)
    q, kv = TARGET.num_attention_heads * TARGET.head_dim, TARGET.num_key_value_heads * TARGET.head_dim
    shapes = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (n, h),
              "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,),
              "midlayer.self_attn.q_proj.weight": (q, 2 * h), "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv, 2 * h), "midlayer.self_attn.o_proj.weight": (h, q),
              "midlayer.mlp.gate_proj.weight": (40, h), "midlayer.mlp.up_proj.weight": (40, h),
              "midlayer.mlp.down_proj.weight": (h, 40)}
    tensors = {k: torch.randn(*s, generator=g) for k, s in shapes.items()}
    draft_ids = torch.randperm(TARGET.vocab_size, generator=g)[:n].sort().values
    tensors["d2t"] = draft_ids - torch.arange(n)
    t2d = torch.zeros(TARGET.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    tensors.update({"t2d": t2d, "embed_tokens.weight": torch.zeros(TARGET.vocab_size, h),
                    "midlayer.rotary_emb.inv_freq": torch.zeros(4)})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h, "intermediate_size": 40,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "draft_vocab_size": n,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="target_num_layers"):
        load_draft_head(tmp_path, strict=False)
    with pytest.raises(ValueError, match="rotary_emb.inv_freq"):
        load_draft_head(tmp_path, target_num_layers=layers)
    head, report = load_draft_head(tmp_path, strict=False, target_num_layers=layers)
    c = head.config
    assert (c.variant, c.own_lm_head, c.aux_hidden_state_layers, c.attention_bias) == ("eagle3", True, (2, 15, 27), False)
    assert report.unmapped == ["midlayer.rotary_emb.inv_freq"] and report.target_owned == ["embed_tokens.weight"]
    assert report.missing == []
    assert torch.equal(head.draft_to_target, draft_ids)
    sd = head.state_dict()
    for name in shapes:
        assert torch.equal(sd[name.removeprefix("midlayer.")], tensors[name]), name


WIDE_TARGET = ModelConfig(architecture="qwen2", vocab_size=80, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128, attention_bias=True)


@pytest.mark.parametrize("layout,max_rel_err,min_top1", [("int8", 0.05, 0.9), ("int4", 0.3, 0.7)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantized_head_drafts_close_to_the_float_head(variant, layout, max_rel_err, min_top1):
    """``quantize_`` puts every linear on the integer kernels: the logits stay within the layout's
    rounding of the float head's and the top-1 draft mostly agrees; the target's own quantized
    lm_head rows are kept as stored."""
    from specserve.models.linear import QuantizedLinear
    from specserve.models.quantization import quantize

    torch.manual_seed(0)
    cfg = DraftHeadConfig.for_target(WIDE_TARGET, variant, intermediate_size=128, draft_vocab_size=48,
                                     aux_hidden_state_layers=(0, 2) if variant == "eagle3" else ())
    head = DraftHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(mean=1.0 if p.ndim == 1 and p.shape[0] == 64 else 0.0, std=0.15)
    head.set_draft_vocab(torch.randperm(80)[:48].sort().values)
    g = torch.Generator().manual_seed(1)
    embed, lm_head = torch.randn(80, 64, generator=g), torch.randn(80, 64, generator=g)
    target_lm_head = quantize(lm_head, layout, "lm_head.weight")
    head.attach_target(embed, target_lm_head.dequantize())
    width = 64 * (cfg.num_aux_layers if variant == "eagle3" else 1)
    hidden, ids = torch.randn(1, 96, width, generator=g), torch.randint(0, 80, (1, 96), generator=g)
    pos = torch.arange(96).unsqueeze(0)
    with torch.no_grad():
        want = head.compute_logits(head(hidden, ids, pos))
        head.quantize_(layout, target_lm_head=target_lm_head)
        got = head.compute_logits(head(hidden[0], ids[0], pos[0]))   # the inference shape [T, W]
    assert head.quantization == layout and head.lm_head_weight is None
    assert all(isinstance(head.get_submodule(n), QuantizedLinear) for n in ["self_attn.q_proj", "mlp.down_proj"])
    kept = head.quantized_lm_head.parts[0]
    assert torch.equal(kept.qs, target_lm_head.select_rows(head.draft_to_target).qs)
    assert got.dtype == torch.float32 and got.shape == want[0].shape
    assert (got - want[0]).norm() / want[0].norm() < max_rel_err
    assert (got.argmax(-1) == want[0].argmax(-1)).float().mean() >= min_top1


def test_quantizing_a_head_names_what_cannot_pack():
    head = make_head("eagle3")   # hidden size 32: int4 packs in_features in multiples of 64
    with pytest.raises(ValueError, match=r"o_proj.weight.*in_features 32"):
        head.quantize_("int4")
    with pytest.raises(ValueError, match="int3"):
        make_head("eagle").quantize_("int3")
    plain = make_head("normed")
    assert plain.quantize_("none") is plain and plain.quantization == "none"
