"""Prompt logprobs (``SamplingParams.prompt_logprobs``), checked against HF transformers' logits of
the same weights: whole and chunked prefill, speculation on, prefix caching on, preemption, and
``max_tokens=0`` (scoring a text without generating)."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

TOP = 3


def hf_prompt_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, V]`` float64 log_softmax of HF's logits: row i scores token i + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1)


def prompts(n_list=(1, 2, 9, 40, 77), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).tolist() for n in n_list]


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_dir):
    return {tuple(p): hf_prompt_logprobs(tiny_qwen2_dir, p) if len(p) > 1 else None for p in prompts()}


def check(out, ids, ref, tol: float = 1e-4, rel: float = 0.0):
    """Logprobs within ``tol + rel * |logprob|`` of the oracle's (a 16-bit KV cache rounds keys and
    values to 11 significant bits: wider bounds)."""
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry, want = plp[i], ref[i - 1]
        bound = lambda t: tol + rel * abs(want[t].item())   # noqa: E731
        assert abs(entry[ids[i]].logprob - want[ids[i]].item()) < bound(ids[i]), (i, entry[ids[i]], want[ids[i]])
        top_ids = want.topk(TOP).indices.tolist()
        ranked = sorted((t for t, lp in entry.items() if lp.rank is not None), key=lambda t: entry[t].rank)
        assert ranked == top_ids, (i, ranked, top_ids)
        for t in top_ids:
            assert abs(entry[t].logprob - want[t].item()) < bound(t)


@pytest.mark.parametrize("setting", ["whole", "chunked", "speculative", "cached_prefix", "preempted", "float16_kv"])
def test_prompt_logprobs_match_transformers(tiny_qwen2_dir, oracle, setting):
    # float32 KV entries against the float32 oracle; the default 16-bit cache in its own case
    kw = dict(kv_cache_dtype="float16" if setting == "float16_kv" else "float32")
    if setting == "chunked":
        kw.update(max_num_batched_tokens=8)
    elif setting == "speculative":
        kw.update(speculative_config={"method": "draft_model", "model": tiny_qwen2_dir, "num_speculative_tokens": 3,
                                      "adaptive": False}, max_num_batched_tokens=16)
    elif setting == "preempted":
        kw.update(num_blocks=24, block_size=4)
    llm = LLM(tiny_qwen2_dir, **kw)
    preempted = []
    sched = llm.llm_engine.scheduler
    real_preempt = sched._preempt
    sched._preempt = lambda req, out: (preempted.append(req.request_id), real_preempt(req, out))
    ps = prompts()
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=TOP, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    if setting == "cached_prefix":   # the prompts are in the cache: scoring must compute them anyway
        llm.generate([{"prompt_token_ids": p} for p in ps], plain)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params)
    ref_tokens = [o.outputs[0].token_ids for o in LLM(tiny_qwen2_dir).generate(
        [{"prompt_token_ids": p} for p in ps], plain)]
    for p, out, want in zip(ps, outs, ref_tokens):
        assert out.outputs[0].token_ids == want            # scoring the prompt changes nothing else
        if len(p) == 1:
            assert out.prompt_logprobs == [None]
        else:
            # float16 entries (2^-11 relative) move this random model's logprobs (up to 48 in size) by up to 1.1e-2
            check(out, p, oracle[tuple(p)], *((2e-2,) if setting == "float16_kv" else ()))
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert bool(preempted) == (setting == "preempted")


def test_max_tokens_zero_scores_the_prompt_only(tiny_qwen2_dir, oracle):
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              kv_cache_dtype="float32")
    ps = prompts()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], SamplingParams(max_tokens=0, prompt_logprobs=0))
    for p, out in zip(ps, outs):
        c = out.outputs[0]
        assert c.token_ids == [] and c.text == "" and c.finish_reason == "length" and out.finished
        if len(p) > 1:
            ref = oracle[tuple(p)]
            assert all(abs(out.prompt_logprobs[i][p[i]].logprob - ref[i - 1][p[i]].item()) < 1e-4
                       for i in range(1, len(p)))
            assert all(len(out.prompt_logprobs[i]) == 1 for i in range(1, len(p)))   # 0: the token's own only
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_too_many_prompt_logprobs_is_refused_and_nothing_is_harmed(tiny_qwen2_dir):
    llm = LLM(tiny_qwen2_dir)
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"prompt_logprobs must be <= the vocabulary size {vocab}"):
        llm.generate(["abc"], SamplingParams(max_tokens=2, prompt_logprobs=vocab + 1))
    out = llm.generate(["abc"], SamplingParams(max_tokens=2, prompt_logprobs=vocab))[0]
    assert all(len(e) == vocab for e in out.prompt_logprobs[1:])   # every token ranked
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.has_unfinished_requests()
