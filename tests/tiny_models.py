"""Tiny random Llama / Qwen2 models saved as Hugging Face folders: the oracle for our decoder."""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = ["def hello world return value", "the quick brown fox jumps over the lazy dog " * 20,
          "import numpy as np\nfor i in range(10):\n    print(i)\n"]


def save_tiny_tokenizer(folder: str | Path, vocab_size: int = 300):
    """Train a small byte-level BPE tokenizer (specials <unk>=0, <s>=1, </s>=2) and save it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    return fast


def make_tiny_model(arch: str, folder: str | Path, *, tie: bool = False, seed: int = 0, num_layers: int = 3,
                    hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                    max_position_embeddings: int = 1024, random_norms: bool = True, **save_kw):
    """Save a random ``arch`` ("llama" | "qwen2") model plus tokenizer to ``folder``; returns the HF model.

    Norm weights and biases are randomized too, so a mix-up of them cannot pass by accident.
    ``save_kw`` goes to ``save_pretrained`` (e.g. ``max_shard_size="100KB"`` to force shards).
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = save_tiny_tokenizer(folder)
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                  rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=500000.0, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(rope_theta=1000000.0, **common))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if random_norms and (name.endswith("bias") or "norm" in name):
                p.normal_(mean=1.0 if "norm" in name else 0.0, std=0.2)
            elif "embed" in name or "lm_head" in name:
                p.normal_(std=1.0)  # sharp logits: few near-ties in greedy comparisons
            else:
                p.normal_(std=0.15)  # layers strong enough that output is not just the last input
    model.save_pretrained(str(folder), **save_kw)
    return model.eval()


def make_layer_skip_draft(target_dir: str | Path, folder: str | Path, keep_layers: int = 1,
                          noise: float = 0.0, seed: int = 0, pad_vocab: int = 0):
    """A draft that keeps the first ``keep_layers`` layers of a saved target (plus optional weight
    noise): it agrees with the target often but not always, so drafts are partly accepted.
    ``pad_vocab`` appends random embedding/lm_head rows, as padded vocabularies do."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    model.model.layers = model.model.layers[:keep_layers]
    model.config.num_hidden_layers = keep_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:keep_layers]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        if noise:
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
        if pad_vocab:
            model.resize_token_embeddings(model.config.vocab_size + pad_vocab)
            rows = model.get_input_embeddings().weight[-pad_vocab:]
            rows.copy_(torch.randn(rows.shape, generator=g) * 3.0)
            head = model.get_output_embeddings().weight
            if head.data_ptr() != model.get_input_embeddings().weight.data_ptr():
                head[-pad_vocab:].copy_(torch.randn(head[-pad_vocab:].shape, generator=g) * 3.0)
    Path(folder).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(target_dir)).save_pretrained(str(folder))
    return model.eval()
