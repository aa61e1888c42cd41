"""Our decoder against Hugging Face transformers on the same weights (the oracle), and the
batch-invariance properties exact speculative decoding relies on."""
from __future__ import annotations

import pytest
import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.kv_cache.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import load_model, load_tokenizer
from tests.conftest import requires_smollm2

PROMPT_LENS = [1, 5, 23, 64]


def build(path: str) -> LlamaForCausalLM:
    loaded = load_model(path)
    return LlamaForCausalLM(loaded.config, loaded.weights).eval()


def new_cache(model: LlamaForCausalLM, block_size: int, num_tokens: int) -> KVCache:
    cfg = model.config
    num_blocks = -(-num_tokens // block_size) + 2
    return KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)


def forward(model, cache: KVCache, seqs: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
    """Run one flattened batch; ``seqs`` holds (new token ids, context length, block table) per
    sequence. Returns each sequence's logits ``[num_new, vocab]``."""
    md = AttentionMetadata.build([s[2] for s in seqs], [s[1] for s in seqs], [len(s[0]) for s in seqs],
                                 cache.block_size)
    ids = torch.tensor([t for s in seqs for t in s[0]])
    pos = torch.tensor([p for s in seqs for p in range(s[1], s[1] + len(s[0]))])
    logits = model.compute_logits(model(ids, pos, md, (cache.key_cache, cache.value_cache)))
    return list(logits.split([len(s[0]) for s in seqs]))


def prompts(vocab: int, lens=PROMPT_LENS, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def check_against_hf(ours: LlamaForCausalLM, hf, token_lists):
    """All prompts in ONE ragged batch on our side, one by one on the oracle's."""
    block_size = 16
    cache = new_cache(ours, block_size, sum(len(t) for t in token_lists) + block_size * len(token_lists))
    seqs, next_page = [], 0
    for toks in token_lists:
        n_pages = -(-len(toks) // block_size)
        seqs.append((toks, 0, list(range(next_page, next_page + n_pages))))
        next_page += n_pages
    got = forward(ours, cache, seqs)
    for toks, logits in zip(token_lists, got):
        with torch.no_grad():
            ref = hf(torch.tensor([toks])).logits[0].float()
        assert (logits - ref).abs().max().item() < 1e-3


def test_tiny_logits_match_transformers(tiny_dir):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    ours = build(tiny_dir)
    check_against_hf(ours, hf, prompts(ours.config.vocab_size))


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_hf):
    return build("smollm2-135m-instruct"), smollm2_hf


@requires_smollm2
def test_smollm2_gguf_logits_match_transformers(smollm2_pair):
    ours, hf = smollm2_pair
    tok = load_tokenizer("smollm2-135m-instruct")
    texts = ["def quicksort(arr):", "The capital of France is", "x"]
    token_lists = [tok.encode(t) for t in texts] + prompts(ours.config.vocab_size, [40])
    check_against_hf(ours, hf, token_lists)


def greedy_hf(hf, toks: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([toks]), attention_mask=torch.ones(1, len(toks), dtype=torch.long),
                      do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                      pad_token_id=0)
    return out[0, len(toks):].tolist()


def test_tiny_greedy_matches_transformers_generate(tiny_dir):
    from transformers import AutoModelForCausalLM
    from specserve import LLM, SamplingParams
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(tiny_dir)
    toks = prompts(llm.llm_engine.model_config.vocab_size, [3, 17, 40], seed=1)
    outs = llm.generate([{"prompt_token_ids": t} for t in toks],
                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for t, o in zip(toks, outs):
        assert o.outputs[0].token_ids == greedy_hf(hf, t, 32)


@requires_smollm2
def test_smollm2_greedy_matches_transformers_generate(smollm2_pair):
    from specserve import LLM, SamplingParams
    _, hf = smollm2_pair
    llm = LLM("smollm2-135m-instruct")
    tok = llm.get_tokenizer()
    texts = ["def quicksort(arr):", "The capital of France is", "Once upon a time"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for text, o in zip(texts, outs):
        assert o.outputs[0].token_ids == greedy_hf(hf, tok.encode(text), 32)


@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_paged_decode_equals_full_forward(tiny_qwen2_dir, block_size):
    """Prefill 20 tokens then decode 12 one at a time: every logit row equals the full forward's."""
    model = build(tiny_qwen2_dir)
    toks = prompts(model.config.vocab_size, [32], seed=2)[0]
    cache = new_cache(model, block_size, 32)
    # pages deliberately out of order, so a page-table mix-up cannot pass
    table = list(reversed(range(cache.num_blocks)))[: -(-32 // block_size)]
    full = forward(model, new_cache(model, block_size, 32), [(toks, 0, table)])[0]
    rows = [forward(model, cache, [(toks[:20], 0, table)])[0]]
    for p in range(20, 32):
        rows.append(forward(model, cache, [(toks[p:p + 1], p, table)])[0])
    assert torch.equal(torch.cat(rows), full)


def test_one_token_alone_equals_within_five(tiny_llama_dir):
    """Decode of one token vs the same token inside a 5-token forward (a k=4 verify): bitwise."""
    model = build(tiny_llama_dir)
    toks = prompts(model.config.vocab_size, [45], seed=3)[0]
    table = list(range(3))
    c1, c5 = new_cache(model, 16, 45), new_cache(model, 16, 45)
    forward(model, c1, [(toks[:40], 0, table)])
    forward(model, c5, [(toks[:40], 0, table)])
    five = forward(model, c5, [(toks[40:45], 40, table)])[0]
    for i in range(5):
        one = forward(model, c1, [(toks[40 + i:41 + i], 40 + i, table)])[0]
        assert torch.equal(one[0], five[i])


def test_batch_of_8_matches_each_alone(tiny_qwen2_dir):
    from specserve import LLM, SamplingParams
    llm = LLM(tiny_qwen2_dir, max_num_seqs=8)
    toks = prompts(llm.llm_engine.model_config.vocab_size, [1, 3, 17, 45, 100, 160, 231, 300], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": t} for t in toks], params)
    for t, out in zip(toks, batched):
        alone = llm.generate([{"prompt_token_ids": t}], params)[0]
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids


def test_auxiliary_layer_features_match_transformers_hidden_states(tiny_qwen2_dir):
    """With auxiliary layers (EAGLE-3's fused features), the model returns its final hidden states
    and then the residual stream entering each layer: HF's ``hidden_states[l]`` (the input of
    layer l); the logits are unchanged."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    ours = build(tiny_qwen2_dir)
    toks = prompts(ours.config.vocab_size, [19])[0]
    h = ours.config.hidden_size
    cache = new_cache(ours, 16, len(toks))
    md = AttentionMetadata.build([[0, 1]], [0], [len(toks)], 16)
    ids, pos = torch.tensor(toks), torch.arange(len(toks))
    plain = ours(ids, pos, md, (cache.key_cache, cache.value_cache))
    ours.aux_hidden_state_layers = (0, 2)
    wide = ours(ids, pos, md, (cache.key_cache, cache.value_cache))
    assert wide.shape == (len(toks), 3 * h)
    assert torch.equal(wide[:, :h], plain)
    assert torch.equal(ours.compute_logits(wide), ours.compute_logits(plain))
    with torch.no_grad():
        ref = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states
    for i, layer in enumerate((0, 2)):
        torch.testing.assert_close(wide[:, h * (1 + i):h * (2 + i)], ref[layer][0], rtol=1e-4, atol=1e-4)
