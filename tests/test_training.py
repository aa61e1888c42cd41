"""Head training: hidden-state precomputation against HF transformers, resumption, the split,
the schedule, and a real (tiny) training run that must beat a unigram baseline."""
from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import pytest
import torch

from specserve.entrypoints.llm import LLM
from specserve.models.draft_head import target_layer_tensors
from specserve.models.loader import load_model
from specserve.training.corpus import is_validation, stdlib_documents
from specserve.spec_decode.draft_vocab import frequent_token_vocab
from specserve.training.dataset import HiddenStateDataset
from specserve.training.hidden_states import PrecomputeSettings, bytes_per_token, precompute_hidden_states
from specserve.training.trainer import TrainConfig, lr_at, train_head


def _settings(llm, **kw):
    cfg = llm.llm_engine.model_config
    return PrecomputeSettings(target="tiny", hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, **kw)


@pytest.fixture(scope="module")
def tiny_data(tiny_qwen2_dir, tmp_path_factory):
    """Hidden states of the tiny Qwen2 target over ~12k tokens of standard-library source."""
    llm = LLM(tiny_qwen2_dir, kv_cache_dtype="float32")   # float32 entries: checked against float32 transformers
    docs = list(stdlib_documents(llm.get_tokenizer(), max_tokens=12000))
    out = tmp_path_factory.mktemp("hidden")
    precompute_hidden_states(llm.llm_engine, docs, out, _settings(llm, seq_len=128, top_k=8, shard_tokens=3000,
                                                                  aux_layers=(0, 2)),
                             progress=False)
    return out, docs


def test_precomputed_hidden_states_equal_hf_forward(tiny_qwen2_dir, tiny_data):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, docs = tiny_data
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["documents"] == [d for d, _ in docs]
    assert len(manifest["shards"]) > 1
    shard_path = out / manifest["shards"][0]["file"]
    umask = os.umask(0)
    os.umask(umask)
    assert shard_path.stat().st_mode & 0o777 == 0o666 & ~umask   # not safetensors' private 0600
    shard = load_file(str(shard_path))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    start = 0
    for n in shard["seq_lens"].tolist()[:3]:
        ids = shard["input_ids"][start:start + n].long()
        with torch.no_grad():
            o = hf(ids.unsqueeze(0), output_hidden_states=True)
        want_h = o.hidden_states[-1][0]                    # after the final norm: what feeds lm_head
        torch.testing.assert_close(shard["hidden_states"][start:start + n].float(), want_h, rtol=2e-3, atol=2e-3)
        want_aux = torch.cat([o.hidden_states[0][0], o.hidden_states[2][0]], -1)   # entering layers 0 and 2
        torch.testing.assert_close(shard["aux_hidden_states"][start:start + n].float(), want_aux, rtol=2e-3, atol=2e-3)
        p, i = torch.softmax(o.logits[0], -1).topk(8, -1)
        assert (shard["topk_ids"][start:start + n].long() == i).float().mean() > 0.99   # ties aside
        torch.testing.assert_close(shard["topk_probs"][start:start + n].float(), p, rtol=2e-3, atol=2e-3)
        start += n
    first = docs[0][1]
    assert shard["input_ids"][:len(first[:128])].tolist() == first[:128]


def test_precompute_resumes_after_interruption(tiny_qwen2_dir, tmp_path):
    llm = LLM(tiny_qwen2_dir)
    docs = [(f"{d}#{i}", ids[i:i + 300]) for d, ids in stdlib_documents(llm.get_tokenizer(), max_tokens=3000)
            for i in range(0, len(ids), 300)][:10]   # ten documents of 300 tokens
    settings = _settings(llm, seq_len=64, top_k=4, shard_tokens=500)

    def interrupted():
        for i, d in enumerate(docs):
            if i == len(docs) // 2:
                raise KeyboardInterrupt
            yield d

    with pytest.raises(KeyboardInterrupt):
        precompute_hidden_states(llm.llm_engine, interrupted(), tmp_path / "a", settings, progress=False)
    partial = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert not partial["complete"] and 0 < len(partial["documents"]) < len(docs)
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks
    precompute_hidden_states(llm.llm_engine, docs, tmp_path / "a", settings, progress=False)
    precompute_hidden_states(llm.llm_engine, docs, tmp_path / "b", settings, progress=False)
    a = HiddenStateDataset(tmp_path / "a", "train", 0.3)
    b = HiddenStateDataset(tmp_path / "b", "train", 0.3)
    assert a.doc_ids == b.doc_ids and a.num_tokens == b.num_tokens
    for x, y in zip(a.segments, b.segments):
        assert all(torch.equal(x[k], y[k]) for k in x)
    with pytest.raises(ValueError, match="made with"):
        precompute_hidden_states(llm.llm_engine, docs, tmp_path / "a", _settings(llm, seq_len=32, top_k=4),
                                 progress=False)


def test_split_is_by_document_and_stable():
    ids = [f"doc{i}" for i in range(2000)]
    val = [d for d in ids if is_validation(d, 0.1)]
    assert 150 < len(val) < 250
    assert val == [d for d in reversed(ids) if is_validation(d, 0.1)][::-1]


def test_split_keeps_documents_whole(tiny_data):
    out, _ = tiny_data
    train, val = HiddenStateDataset(out, "train", 0.2), HiddenStateDataset(out, "validation", 0.2)
    assert set(train.doc_ids).isdisjoint(val.doc_ids)
    assert train.num_tokens + val.num_tokens == sum(s["num_tokens"] for s in train.manifest["shards"])


def test_frequent_token_vocab_hand_case():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    assert frequent_token_vocab(counts, 3).tolist() == [2, 3, 5]
    assert frequent_token_vocab(counts, 4).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="7"):
        frequent_token_vocab(counts, 7)


def test_lr_schedule_hand_computed():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, num_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))           # half way: cos = 0
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(35, cfg) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))))


def test_bytes_per_token():
    assert bytes_per_token(1536, 20) == 3072 + 4 + 120
    assert bytes_per_token(1536, 20, num_aux_layers=3) == 4 * 3072 + 4 + 120


def test_dataset_limits_and_auxiliary_features(tiny_data, tmp_path):
    out, _ = tiny_data
    full = HiddenStateDataset(out, "train", 0.2)
    part = HiddenStateDataset(out, "train", 0.2, max_tokens=2000, load_aux=True)
    assert 2000 <= part.num_tokens < 2000 + 128 and part.num_tokens < full.num_tokens
    b = part.batch([0, 1])
    assert b.aux_hidden_states.shape[:2] == b.hidden_states.shape[:2] and b.aux_hidden_states.shape[2] == 2 * 64
    assert full.batch([0]).aux_hidden_states is None
    plain = tmp_path / "plain"
    plain.mkdir()
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["settings"]["aux_layers"]
    (plain / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="without auxiliary layers"):
        HiddenStateDataset(plain, "train", 0.2, load_aux=True)


def test_token_limited_split_takes_documents_in_the_corpus_order(tiny_data):
    """A data-scaling prefix follows the stable corpus order (``order_key``), not the order the
    documents were written in; a smaller prefix is part of a larger one; rows are read intact."""
    from specserve.training.corpus import order_key

    out, _ = tiny_data
    full = HiddenStateDataset(out, "train", 0.2)
    order = sorted(dict.fromkeys(full.doc_ids), key=order_key)
    assert order != list(dict.fromkeys(full.doc_ids))   # the fixture was written in another order
    small = HiddenStateDataset(out, "train", 0.2, max_tokens=1500)
    large = HiddenStateDataset(out, "train", 0.2, max_tokens=4000)
    kept = list(dict.fromkeys(small.doc_ids))
    assert kept == order[:len(kept)]
    assert large.doc_ids[:len(small.doc_ids)] == small.doc_ids
    rows = {}
    for d, seg in zip(full.doc_ids, full.segments):
        rows.setdefault(d, []).append(seg)
    seen: dict[str, int] = {}
    for d, seg in zip(large.doc_ids, large.segments):   # each segment equals the whole-shard read's
        want = rows[d][seen.setdefault(d, 0)]
        seen[d] += 1
        assert all(torch.equal(seg[k], want[k]) for k in want)


def test_bfloat16_mixed_precision_matches_float32_closely(tiny_qwen2_dir, tiny_data):
    """Under ``mixed_precision="bfloat16"`` the matmuls run in bfloat16 (the loss moves, so autocast
    is on) while the loss and its gradient stay within bfloat16's rounding of float32's."""
    from specserve.models.draft_head import DraftHead
    from specserve.models.draft_head_config import DraftHeadConfig
    from specserve.training.trainer import autocast, head_losses

    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    data = HiddenStateDataset(out, "train", 0.2, load_aux=True)
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(loaded.config, "eagle3", aux_hidden_state_layers=(0, 2)))
    head.attach_target(w["model.embed_tokens.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"]))
    batch = data.batch([0, 1, 2, 3])
    results = {}
    for mp in ("none", "bfloat16"):
        cfg = TrainConfig(variant="eagle3", unroll_steps=2, mixed_precision=mp)
        head.zero_grad()
        with autocast(cfg, "cpu"):
            loss, _ = head_losses(head, batch, cfg, head.target_to_draft())
        loss.backward()
        results[mp] = (loss.detach(), torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None]))
    (l32, g32), (l16, g16) = results["none"], results["bfloat16"]
    assert l16.dtype == torch.float32 and l16.item() != l32.item()
    assert abs(l16.item() - l32.item()) < 1e-2 * l32.item()
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99
    with pytest.raises(ValueError, match="mixed_precision"):
        TrainConfig(mixed_precision="float16")


_MALLOC_PROBE = """
import ctypes, ctypes.util
from specserve.training.trainer import return_freed_memory_to_the_os
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2
def mapped(n):   # glibc marks a chunk served by its own mapping with bit 2 of the size word before it
    p = libc.malloc(n); bit = ctypes.c_size_t.from_address(p - 8).value & 2; libc.free(p); return bool(bit)
libc.free(libc.malloc(30 << 20))   # freeing a mapped 30 MiB block raises the dynamic threshold to 30 MiB
before = mapped(8 << 20)
ok = return_freed_memory_to_the_os()
print(before, ok, mapped(libc.mallinfo2().fordblks + (1 << 20)))   # more than the heap holds free, < 30 MiB
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_the_trainer_serves_large_blocks_by_mappings_returned_when_freed():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "True"]


def test_padding_a_batch_to_a_length_multiple_leaves_the_loss_unchanged(tiny_qwen2_dir, tiny_data):
    """``length_multiple`` pads a batch past its longest segment with masked rows: the shape is a
    multiple, the padding is masked out, and the loss and gradient (float32, eager) equal the
    unpadded batch's to rounding."""
    from specserve.models.draft_head import DraftHead
    from specserve.models.draft_head_config import DraftHeadConfig
    from specserve.training.trainer import head_losses

    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    data = HiddenStateDataset(out, "train", 0.2, load_aux=True)
    idx = [0, 1, 2]
    plain, padded = data.batch(idx), data.batch(idx, 48)
    t = plain.input_ids.shape[1]
    assert padded.input_ids.shape[1] == -(-t // 48) * 48 > t
    assert padded.mask[:, t:].sum() == 0 and torch.equal(padded.mask[:, :t], plain.mask)
    assert torch.equal(padded.hidden_states[:, :t], plain.hidden_states)
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(loaded.config, "eagle3", aux_hidden_state_layers=(0, 2)))
    head.attach_target(w["model.embed_tokens.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"]))
    cfg = TrainConfig(variant="eagle3", unroll_steps=3)
    results = []
    for batch in (plain, padded):
        head.zero_grad()
        loss, _ = head_losses(head, batch, cfg, head.target_to_draft())
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None])))
    (l1, g1), (l2, g2) = results
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="length_multiple must be >= 1, got 0"):
        TrainConfig(length_multiple=0)


def test_feature_noise_is_uniform_and_scaled_by_each_vectors_rms():
    """EAGLE's feature noise, per fused layer: (noisy - clean) / rms lies in (-a, a) with the
    uniform distribution's mean 0 and variance a^2 / 3, whatever the layer's scale."""
    from specserve.training.trainer import add_feature_noise

    torch.manual_seed(0)
    width, a = 64, 0.2
    x = torch.randn(2000, 3, width) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)   # three scales
    noisy = add_feature_noise(x.flatten(-2), a, width).unflatten(-1, (3, width))
    z = (noisy - x) / x.pow(2).mean(-1, keepdim=True).sqrt()
    assert z.abs().max() <= a * (1 + 1e-5)
    for layer in range(3):
        zl = z[:, layer].double()
        assert abs(zl.mean().item()) < 0.002                               # s.e. 0.2 / sqrt(3 * 128000)
        assert abs(zl.var().item() / (a * a / 3) - 1) < 0.02               # s.e. of the ratio ~0.0035
    assert torch.equal(add_feature_noise(x.flatten(-2), 0.0, width), x.flatten(-2))
    with pytest.raises(ValueError, match="feature_noise must be in \\[0, 1\\), got 1.5"):
        TrainConfig(feature_noise=1.5)


def test_feature_noise_only_while_training(tiny_qwen2_dir, tiny_data):
    """The noise perturbs the training loss and leaves evaluation (``head.eval()``) exact."""
    from specserve.models.draft_head import DraftHead
    from specserve.models.draft_head_config import DraftHeadConfig
    from specserve.training.trainer import head_losses

    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    batch = HiddenStateDataset(out, "train", 0.2, load_aux=True).batch([0, 1])
    torch.manual_seed(0)
    head = DraftHead(DraftHeadConfig.for_target(loaded.config, "eagle3", aux_hidden_state_layers=(0, 2)))
    head.attach_target(w["model.embed_tokens.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"]))
    clean, noisy = TrainConfig(variant="eagle3", unroll_steps=2), TrainConfig(variant="eagle3", unroll_steps=2,
                                                                              feature_noise=0.3)
    with torch.no_grad():
        head.train()
        l_clean, _ = head_losses(head, batch, clean, head.target_to_draft())
        l_noisy, _ = head_losses(head, batch, noisy, head.target_to_draft())
        head.eval()
        l_eval, _ = head_losses(head, batch, noisy, head.target_to_draft())
    assert not torch.isclose(l_noisy, l_clean, rtol=1e-4)
    assert torch.equal(l_eval, l_clean)


def test_aux_layer_flag():
    from specserve.training.commands import _aux_layers

    assert _aux_layers("auto", "eagle3", 28) == (2, 14, 25)
    assert _aux_layers("auto", "normed", 28) == () and _aux_layers("none", "eagle3", 28) == ()
    assert _aux_layers("1,5", "eagle", 28) == (1, 5)
    with pytest.raises(ValueError, match="out of range"):
        _aux_layers("1,28", "eagle3", 28)
    with pytest.raises(ValueError, match="comma-separated"):
        _aux_layers("low", "eagle3", 28)


@pytest.mark.parametrize("variant,draft_vocab,unroll,mixed_precision",
                         [("normed", None, 1, "none"), ("eagle", 64, 2, "none"), ("eagle3", 64, 2, "none"),
                          ("eagle3", 64, 2, "bfloat16")])
def test_training_lowers_val_loss_and_beats_unigram(tiny_qwen2_dir, tiny_data, tmp_path, variant, draft_vocab, unroll,
                                                    mixed_precision):
    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    cfg = TrainConfig(variant=variant, draft_vocab_size=draft_vocab, unroll_steps=unroll, num_steps=150, batch_size=8,
                      lr=2e-3, warmup_steps=10, eval_every=75, val_fraction=0.2, eval_chain=2,
                      mixed_precision=mixed_precision)
    summary, _ = train_head(out, tmp_path / "head", loaded.config, w["model.embed_tokens.weight"], lm_head, cfg,
                         progress=False)
    before, after = summary["val_before"], summary["val_after"]
    assert after["loss"] < 0.7 * before["loss"], (before, after)
    assert after["top1"] > summary["unigram_top1"] + 0.05, summary
    assert after["chain_top1"][1] > summary["unigram_top1"], summary     # two positions ahead, own features
    log = [json.loads(line) for line in (tmp_path / "head" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 150 and "val" in log[74] and log[-1]["tokens"] == summary["tokens_seen"]
    assert (tmp_path / "head" / "model.safetensors").is_file()


def test_interrupted_training_resumes_to_the_same_weights(tiny_qwen2_dir, tiny_data, tmp_path, monkeypatch):
    """A run stopped at a step, then killed between checkpoints, then rerun, ends with the weights,
    log and token count of a run never interrupted, bit for bit; a checkpoint of other settings is
    refused by name."""
    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    args = (loaded.config, w["model.embed_tokens.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"]))
    cfg = TrainConfig(variant="eagle3", draft_vocab_size=64, unroll_steps=2, num_steps=24, batch_size=4, lr=2e-3,
                      warmup_steps=4, eval_every=10 ** 6, val_fraction=0.2, eval_chain=2, checkpoint_every=8,
                      own_lm_head=True, feature_noise=0.1)   # the noise's draws resume too
    whole, head_a = train_head(out, tmp_path / "a", *args, cfg, progress=False)

    piece, _ = train_head(out, tmp_path / "b", *args, cfg, progress=False, stop_at_step=5)
    assert not piece["complete"] and (tmp_path / "b" / "checkpoint.pt").is_file()
    assert not (tmp_path / "b" / "model.safetensors").exists()
    calls = {"n": 0}
    real_batch = HiddenStateDataset.batch

    def dies_at_step_14(self, idx, *args):   # a kill: after the step-8 checkpoint, before the step-16 one
        calls["n"] += 1
        if calls["n"] == 14 - 5 + 1:
            raise KeyboardInterrupt
        return real_batch(self, idx, *args)

    monkeypatch.setattr(HiddenStateDataset, "batch", dies_at_step_14)
    with pytest.raises(KeyboardInterrupt):
        train_head(out, tmp_path / "b", *args, cfg, progress=False)
    monkeypatch.setattr(HiddenStateDataset, "batch", real_batch)
    with pytest.raises(ValueError, match="lr 0.002 there, 0.001 now"):
        train_head(out, tmp_path / "b", *args, TrainConfig(**{**cfg.__dict__, "lr": 1e-3}), progress=False)
    resumed, head_b = train_head(out, tmp_path / "b", *args, cfg, progress=False)

    assert resumed["complete"] and resumed["resumed_at"] == [5, 8]
    assert not (tmp_path / "b" / "checkpoint.pt").exists()
    sa, sb = head_a.state_dict(), head_b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert resumed["tokens_seen"] == whole["tokens_seen"] and resumed["val_after"] == whole["val_after"]
    logs = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
             for line in (tmp_path / d / "train_log.jsonl").read_text().splitlines()] for d in "ab"]
    assert logs[0] == logs[1] and [r["step"] for r in logs[1]] == list(range(1, 25))
    with pytest.raises(ValueError, match="stop_at_step"):
        train_head(out, tmp_path / "c", *args, cfg, progress=False, stop_at_step=0)


def test_train_head_starts_from_the_targets_last_layer(tiny_qwen2_dir, tiny_data, tmp_path):
    """init_from_target: the head's layer starts as the target's last one (what DraftHead.init_from_target_layer
    copies, checked against HF in test_draft_head), trains from there, and without the layer is refused."""
    out, _ = tiny_data
    loaded = load_model(str(tiny_qwen2_dir))
    w = loaded.weights
    args = (loaded.config, w["model.embed_tokens.weight"], w.get("lm_head.weight", w["model.embed_tokens.weight"]))
    cfg = TrainConfig(variant="normed", num_steps=4, batch_size=4, warmup_steps=1, eval_every=10 ** 6,
                      val_fraction=0.2, eval_chain=2, init_from_target=True)
    with pytest.raises(ValueError, match="target_layer"):
        train_head(out, tmp_path / "a", *args, cfg, progress=False)
    layer = target_layer_tensors(w, loaded.config.num_hidden_layers - 1)
    assert set(layer) >= {"self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"}
    summary, head = train_head(out, tmp_path / "b", *args, cfg, progress=False, stop_at_step=1, target_layer=layer)
    assert not summary["complete"]
    state = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["head"]
    # one small step away from the copy: still far closer to it than a random layer is
    start = layer["mlp.down_proj.weight"].float()
    assert (state["mlp.down_proj.weight"] - start).norm() < 0.1 * start.norm()


DDP_SCRIPT = """
import json, sys, torch
import torch.distributed as dist
from specserve.models.loader import load_model
from specserve.training.trainer import TrainConfig, train_head
data, target, out = sys.argv[1:4]
loaded = load_model(target)
w = loaded.weights
cfg = TrainConfig(num_steps=30, batch_size=2, lr=2e-3, warmup_steps=5, eval_every=30, val_fraction=0.2)
summary, head = train_head(data, out, loaded.config, w["model.embed_tokens.weight"],
                           w.get("lm_head.weight", w["model.embed_tokens.weight"]), cfg, progress=False)
flat = torch.cat([p.detach().flatten() for p in head.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
dist.all_gather(gathered, flat)
if dist.get_rank() == 0:
    json.dump({"world": summary["world_size"], "max_diff": max(float((g - flat).abs().max()) for g in gathered),
               "before": summary["val_before"]["loss"], "after": summary["val_after"]["loss"],
               "tokens_seen": summary["tokens_seen"]}, open(out + "/ddp.json", "w"))
dist.destroy_process_group()   # as train_head's docstring asks of its callers
"""


def test_ddp_training_under_torchrun_keeps_ranks_in_sync(tiny_qwen2_dir, tiny_data, tmp_path):
    """Two CPU processes (gloo) under torchrun: gradients are averaged, so every rank ends with the
    same weights; rank 0 writes the head; validation loss falls."""
    import os
    import subprocess
    import sys

    out, _ = tiny_data
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(out), str(tiny_qwen2_dir), str(tmp_path / "head")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads((tmp_path / "head" / "ddp.json").read_text())
    assert r["world"] == 2 and r["max_diff"] == 0.0
    assert r["after"] < r["before"]
    assert (tmp_path / "head" / "model.safetensors").is_file()


def test_self_distilled_documents_are_cached_for_a_rerun(tmp_path):
    """The target's answers are the slow part of corpus building: a rerun with the same settings
    reads them back instead of generating again."""
    from types import SimpleNamespace

    from specserve.training.commands import collect_documents

    calls = []

    class StubLLM:
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(len(prompts))
            return [SimpleNamespace(prompt_token_ids=[i, i + 1], outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)])
                    for i in range(len(prompts))]

    first = collect_documents(StubLLM(), ["humaneval"], 0, 3, 5, cache_dir=tmp_path)
    again = collect_documents(StubLLM(), ["humaneval"], 0, 3, 5, cache_dir=tmp_path)
    assert calls == [3] and again == first
    docs = dict(first)
    assert sorted(docs) == ["humaneval/40", "humaneval/41", "humaneval/42"]   # the first 40 prompts are held out
    assert docs["humaneval/40"] == [0, 1, 7, 7, 7, 7, 7]
    collect_documents(StubLLM(), ["humaneval"], 0, 3, 6, cache_dir=tmp_path)   # other settings: generated
    assert calls == [3, 3]
    # an interrupted run: the answers written so far (and a cut last line) are kept, the rest made
    cache = tmp_path / "selfdistill_humaneval_5tok.jsonl"
    lines = cache.read_text().splitlines()
    cache.write_text(lines[0] + "\n" + lines[1][:10])
    more = collect_documents(StubLLM(), ["humaneval"], 0, 5, 5, cache_dir=tmp_path)
    assert calls == [3, 3, 4] and len(more) == 5 and dict(more)["humaneval/40"] == docs["humaneval/40"]
    # answers made elsewhere (a committed .jsonl.gz): only the prompts they miss are generated
    import gzip

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "selfdistill_humaneval_4tok.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps({"doc_id": f"humaneval/{40 + i}", "token_ids": [9, i]}) + "\n" for i in range(3)).encode()))
    fresh = tmp_path / "fresh"
    got = dict(collect_documents(StubLLM(), ["humaneval"], 0, 4, 4, cache_dir=fresh, answers_dir=shipped))
    assert calls == [3, 3, 4, 1]
    assert got["humaneval/42"] == [9, 2] and got["humaneval/43"] == [0, 1, 7, 7, 7, 7]
    with pytest.raises(FileNotFoundError, match="nowhere"):
        collect_documents(StubLLM(), ["humaneval"], 0, 4, 4, cache_dir=fresh, answers_dir=tmp_path / "nowhere")


def test_training_plot_from_logs(tmp_path):
    from specserve.training.plot import read_log, write_training_plot

    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "tokens": 1000 * s, "loss": 1.0,
                                       **({"val": {"loss": 2.0 / s, "top1": 0.1 * s, "chain_top1": [0.1 * s, 0.05 * s]}}
                                          if s % 2 == 0 else {})}) + "\n" for s in range(1, 7)))
    assert [r["step"] for r in read_log(log)] == [2, 4, 6]
    assert write_training_plot({"a": log, "b": log}, tmp_path / "p.png") is None
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_step_logits_reuse_the_rows_a_step_scored():
    """The capture takes the logits a step already computed and runs the lm_head only on the rest."""
    from types import SimpleNamespace

    from specserve.training.hidden_states import _step_logits

    g = torch.Generator().manual_seed(0)
    hidden, w = torch.randn(7, 5, generator=g), torch.randn(11, 5, generator=g)
    asked = []

    def compute_logits(h, rows):
        asked.append(list(rows))
        return h[torch.tensor(rows)] @ w.T

    runner = SimpleNamespace(compute_logits=compute_logits)
    scored = [6, 2]
    result = SimpleNamespace(hidden_states=hidden, logits=hidden[torch.tensor(scored)] @ w.T, logit_rows=scored)
    for rows, computes in (([2, 6], []), ([0, 1, 2], [0, 1]), ([3, 4], [3, 4]), ([6, 5, 2, 0], [5, 0])):
        asked.clear()
        got = _step_logits(runner, result, rows)
        torch.testing.assert_close(got, hidden[torch.tensor(rows)] @ w.T)
        assert asked == ([computes] if computes else [])
    none = SimpleNamespace(hidden_states=hidden, logits=None, logit_rows=None)
    torch.testing.assert_close(_step_logits(runner, none, [1, 3]), hidden[torch.tensor([1, 3])] @ w.T)


def test_plain_step_reports_the_logits_it_computed(tiny_qwen2_dir):
    """``StepResult.logits`` / ``logit_rows`` are the raw target logits of the rows the step scored,
    also when the step returns logprobs (which reuses the worker's row bookkeeping)."""
    from specserve.sampling_params import SamplingParams

    llm = LLM(tiny_qwen2_dir, max_num_batched_tokens=16)
    engine, seen = llm.llm_engine, []

    def observe(reqs, result):
        assert all(isinstance(r, int) for r in result.logit_rows)
        want = engine.target.runner.compute_logits(result.hidden_states, result.logit_rows)
        torch.testing.assert_close(result.logits, want, rtol=0, atol=0)
        seen.append(len(result.logit_rows))

    engine.step_observers.append(observe)
    llm.generate(["def add(a, b):", "import os\nimport sys\n\nclass Point:"],
                 [SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                  SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)], use_tqdm=False)
    assert seen and max(seen) >= 2


def test_hidden_states_captured_while_generating_equal_a_second_pass(tiny_qwen2_dir, tmp_path):
    """Self-distillation that keeps the target's hidden states as it generates (prefill chunks,
    then each decode step) stores what a separate pass over prompt + answer computes, and the
    later precompute skips those documents."""
    from safetensors.torch import load_file

    from specserve.sampling_params import SamplingParams
    from specserve.training.hidden_states import generate_with_hidden_states, read_manifest

    llm = LLM(tiny_qwen2_dir, max_num_batched_tokens=16)   # prompts prefill in several chunks
    settings = _settings(llm, seq_len=24, top_k=4, aux_layers=(1,))
    items = [("a", "def add(a, b):"), ("b", "import os\nimport sys\n\nclass Point:\n    x: int")]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    tokens = generate_with_hidden_states(llm, items, params, tmp_path / "cap", settings, progress=False)
    want = llm.generate([p for _, p in items], params, use_tqdm=False)
    assert [tokens[d] for d, _ in items] == [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in want]
    precompute_hidden_states(llm.llm_engine, [(d, tokens[d][:-1]) for d, _ in items], tmp_path / "two",
                             _settings(llm, seq_len=10**4, top_k=4, aux_layers=(1,)), progress=False)
    cap = load_file(str(tmp_path / "cap" / read_manifest(tmp_path / "cap")["shards"][0]["file"]))
    two = load_file(str(tmp_path / "two" / read_manifest(tmp_path / "two")["shards"][0]["file"]))
    assert cap["seq_lens"].sum() == two["seq_lens"].sum() == sum(len(tokens[d]) - 1 for d, _ in items)
    assert cap["seq_lens"].max() <= 24 < two["seq_lens"].max()
    assert torch.equal(cap["input_ids"], two["input_ids"])
    for key in ("hidden_states", "aux_hidden_states", "topk_probs"):
        torch.testing.assert_close(cap[key].float(), two[key].float(), rtol=2e-3, atol=2e-3)
    assert (cap["topk_ids"] == two["topk_ids"]).float().mean() > 0.99
    # the rest of a corpus: captured documents are not computed again
    manifest = precompute_hidden_states(llm.llm_engine, [(d, tokens[d]) for d, _ in items] + [("c", list(range(3, 40)))],
                                        tmp_path / "cap", settings, progress=False)
    assert manifest["complete"] and manifest["documents"] == ["a", "b", "c"] and len(manifest["shards"]) == 2


def test_train_head_flags_take_each_variants_loss_defaults():
    from specserve.entrypoints.cli import build_parser
    from specserve.training.commands import train_config

    parse = lambda *a: train_config(build_parser().parse_args(["train-head", *a]))
    c = parse("--variant", "eagle3", "--own-lm-head", "--max-train-tokens", "5000")
    assert (c.hidden_loss_weight, c.ce_weight, c.own_lm_head, c.max_train_tokens) == (0.0, 1.0, True, 5000)
    assert not c.init_from_target and parse("--init-from-target").init_from_target
    c = parse("--variant", "normed")
    assert (c.hidden_loss_weight, c.ce_weight) == (1.0, 0.1)
    assert parse("--variant", "eagle", "--ce-weight", "0.5").ce_weight == 0.5
    with pytest.raises(ValueError, match="hidden_loss_weight must be 0"):
        parse("--variant", "eagle3", "--hidden-loss-weight", "1")


def test_hidden_states_live_in_the_cache_unless_an_old_folder_exists(tmp_path, monkeypatch):
    from specserve.training.commands import hidden_states_dir

    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert hidden_states_dir("elsewhere", "Org/Tgt") == Path("elsewhere")
    cached = hidden_states_dir(None, "qwen2.5-coder-1.5b-instruct")
    assert cached == tmp_path / "cache" / "head-data" / "qwen2.5-coder-1.5b-instruct"
    legacy = Path("head-data") / "qwen2.5-coder-1.5b-instruct"
    legacy.mkdir(parents=True)
    assert hidden_states_dir(None, "qwen2.5-coder-1.5b-instruct") == cached      # no manifest: not a folder of ours
    (legacy / "manifest.json").write_text("{}")
    assert hidden_states_dir(None, "qwen2.5-coder-1.5b-instruct") == legacy
    cached.mkdir(parents=True)
    (cached / "manifest.json").write_text("{}")
    assert hidden_states_dir(None, "qwen2.5-coder-1.5b-instruct") == cached


def test_engine_evaluation_checks_its_prompt_counts_first():
    from specserve.training.commands import _eval

    with pytest.raises(ValueError, match=r"--specbench-prompts must be in \[0, 48\]"):
        _eval("no-such-target", "no-such-head", 10, 4, 64, "float32", num_specbench=49)
    with pytest.raises(ValueError, match=r"must be in \[1, 40\]"):
        _eval("no-such-target", "no-such-head", 41, 4, 64, "float32")


def test_shipped_self_distilled_answers_are_training_prompts_only():
    """The committed answers of the 1.5B target cover its training prompts and none held out for
    evaluation (HumanEval 0-39, every 10th Spec-Bench question): a head trained on them is
    evaluated on text it never saw."""
    from pathlib import Path

    import specserve
    from specserve.training.corpus import HUMANEVAL_EVAL_PROMPTS, read_answers, spec_bench_eval_questions, \
        spec_bench_train_questions

    folder = Path(specserve.__file__).parent / "data" / "self_distill" / "qwen2.5-coder-1.5b-instruct"
    info = json.loads((folder / "generation.json").read_text())
    humaneval = read_answers(folder / "selfdistill_humaneval_256tok.jsonl.gz")
    specbench = read_answers(folder / "selfdistill_specbench_256tok.jsonl.gz")
    assert sorted(humaneval) == sorted(f"humaneval/{i}" for i in range(HUMANEVAL_EVAL_PROMPTS, 164))
    assert sorted(specbench) == sorted(f"specbench/{qid}" for qid, _ in spec_bench_train_questions())
    assert not set(specbench) & {f"specbench/{qid}" for qid, _ in spec_bench_eval_questions()}
    assert info["documents"] == {"humaneval": len(humaneval), "specbench": len(specbench)}
    assert info["tokens"] == {"humaneval": sum(map(len, humaneval.values())),
                              "specbench": sum(map(len, specbench.values()))}
    assert all(0 <= t < 151936 for ids in specbench.values() for t in ids)   # Qwen2.5's vocabulary
