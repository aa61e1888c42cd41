"""Draft-target speculative decoding: greedy exactness, distribution, finishing rules, pages."""
from __future__ import annotations

import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import load_model
from tests.tiny_models import make_layer_skip_draft, make_tiny_model

LENGTHS = [1, 3, 17, 45, 100, 160, 231, 300]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def drafts(tiny_qwen2_dir, tmp_path_factory):
    """Drafts for the tiny Qwen2 target: an independently initialized smaller model (rejects almost
    everything), a perturbed copy (accepts some), and a copy with 64 padded vocabulary rows."""
    root = tmp_path_factory.mktemp("drafts")
    make_tiny_model("qwen2", root / "independent", seed=1, num_layers=1, hidden_size=32, num_heads=2,
                    num_kv_heads=1)
    make_layer_skip_draft(tiny_qwen2_dir, root / "perturbed", keep_layers=3, noise=0.07)
    make_layer_skip_draft(tiny_qwen2_dir, root / "padded", keep_layers=3, noise=0.07, pad_vocab=64)
    return {name: str(root / name) for name in ("independent", "perturbed", "padded")}


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in lengths]


def spec_llm(target, draft, k, **kw):
    return LLM(target, speculative_config={"method": "draft_model", "adaptive": False, "model": draft, "num_speculative_tokens": k},
               **kw)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def all_pages_free(llm):
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    return bm.num_free_blocks == bm.num_blocks and not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def reference(tiny_qwen2_dir):
    base = LLM(tiny_qwen2_dir)
    return {"batch": token_ids(base.generate(prompts(), GREEDY)), "base": base}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["independent", "perturbed"])
def test_greedy_equals_no_speculation(tiny_qwen2_dir, drafts, reference, draft, k, block_size):
    llm = spec_llm(tiny_qwen2_dir, drafts[draft], k, block_size=block_size)
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference["batch"]
    # batch size 1: a prompt of length 1 and a longer one, each alone
    for i in (0, 3):
        assert token_ids(llm.generate([prompts()[i]], GREEDY)) == [reference["batch"][i]]
    stats = llm.llm_engine.spec_stats
    assert stats.num_verify_steps > 0 and all_pages_free(llm)
    if draft == "perturbed":  # both outcomes really happen
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_padded_vocab_draft(tiny_qwen2_dir, drafts, reference):
    llm = spec_llm(tiny_qwen2_dir, drafts["padded"], 4)
    assert llm.llm_engine.proposer.runner.model.config.vocab_size == llm.llm_engine.model_config.vocab_size + 64
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference["batch"]
    sampled = llm.generate(prompts(), SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True))
    vocab = llm.llm_engine.model_config.vocab_size
    assert all(t < vocab for ids in token_ids(sampled) for t in ids)


def test_different_tokenizer_is_rejected(tiny_qwen2_dir, tmp_path):
    from tests.tiny_models import save_tiny_tokenizer
    make_tiny_model("qwen2", tmp_path, seed=2, num_layers=1)
    save_tiny_tokenizer(tmp_path, vocab_size=280)  # another vocabulary
    with pytest.raises(ValueError, match="tokenizer"):
        spec_llm(tiny_qwen2_dir, str(tmp_path), 2)


def test_short_draft_context_stops_speculating(tiny_qwen2_dir):
    target = load_model(tiny_qwen2_dir)
    draft = load_model(tiny_qwen2_dir)
    draft.config.max_position_embeddings = 40
    llm = LLM(tiny_qwen2_dir, loaded=target, loaded_draft=draft,
              speculative_config={"method": "draft_model", "adaptive": False, "model": tiny_qwen2_dir, "num_speculative_tokens": 4})
    ps = prompts([5, 30, 60])
    assert token_ids(llm.generate(ps, GREEDY)) == token_ids(LLM(tiny_qwen2_dir, loaded=target).generate(ps, GREEDY))
    assert all_pages_free(llm)


# ---------------------------------------------------------------- finishing inside accepted runs
@pytest.fixture(scope="module")
def self_draft(tiny_qwen2_dir):
    """The target drafting for itself: every draft is accepted, so stops land mid-run."""
    return spec_llm(tiny_qwen2_dir, tiny_qwen2_dir, 8)


SEEDED = dict(temperature=1.0, seed=5, ignore_eos=True)


def test_eos_accepted_mid_draft(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir)
    base = LLM(tiny_qwen2_dir, loaded=loaded)
    p = prompts([9], seed=1)
    ref = token_ids(base.generate(p, GREEDY))[0]
    i = next(i for i in range(3, 20) if ref[i] not in ref[:i])
    loaded.config.eos_token_ids = [ref[i]]
    spec = LLM(tiny_qwen2_dir, loaded=loaded, loaded_draft=load_model(tiny_qwen2_dir),
               speculative_config={"method": "draft_model", "adaptive": False, "model": tiny_qwen2_dir, "num_speculative_tokens": 8})
    out = spec.generate(p, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    assert out.token_ids == ref[:i + 1] and out.finish_reason == "stop"
    assert spec.llm_engine.spec_stats.num_accepted_tokens > i // 2  # the EOS came inside accepted runs
    assert all_pages_free(spec)


def test_stop_string_mid_accepted_run(self_draft, reference):
    base = reference["base"]
    p = prompts([8], seed=3)
    ref = base.generate(p, SamplingParams(max_tokens=24, **SEEDED))[0].outputs[0]
    stop = ref.text[6:9]
    want = base.generate(p, SamplingParams(max_tokens=24, stop=[stop], **SEEDED))[0].outputs[0]
    got = self_draft.generate(p, SamplingParams(max_tokens=24, stop=[stop], **SEEDED))[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "stop")
    assert len(got.token_ids) < len(ref.token_ids)
    assert all_pages_free(self_draft)


def test_stop_and_max_tokens_in_one_run(self_draft, reference):
    p = prompts([7], seed=4)
    ref = token_ids(reference["base"].generate(p, GREEDY))[0]
    i = next(i for i in range(3, 20) if ref[i] not in ref[:i])
    out = self_draft.generate(p, SamplingParams(temperature=0, max_tokens=i + 2, stop_token_ids=[ref[i]],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:i + 1] and out.finish_reason == "stop"
    out = self_draft.generate(p, SamplingParams(temperature=0, max_tokens=i + 1, stop_token_ids=[ref[i]],
                                                ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:i + 1] and out.finish_reason == "stop"


def test_max_tokens_smaller_than_k(self_draft, reference):
    for n in (1, 2, 3):
        outs = self_draft.generate(prompts(), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert token_ids(outs) == [r[:n] for r in reference["batch"]]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_frequency_penalty_sign(tiny_qwen2_dir, drafts, reference):
    spec = spec_llm(tiny_qwen2_dir, drafts["perturbed"], 4)
    got = {}
    for fp in (-2.0, 2.0):
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=fp)
        got[fp] = token_ids(spec.generate(prompts()[:4], params))
        assert got[fp] == token_ids(reference["base"].generate(prompts()[:4], params))
    assert got[-2.0] != got[2.0]


def test_seed_alone_and_in_batch(tiny_qwen2_dir, drafts):
    spec = spec_llm(tiny_qwen2_dir, drafts["perturbed"], 4)
    p = prompts([11], seed=7)
    mine = SamplingParams(temperature=1.0, seed=2024, max_tokens=20, ignore_eos=True)
    alone = token_ids(spec.generate(p, mine))
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True) for s in range(7)]
    batch = token_ids(spec.generate(prompts(LENGTHS[:7], seed=8) + p, others + [mine]))
    assert batch[-1] == alone[0]
    assert token_ids(spec.generate(p, SamplingParams(temperature=1.0, seed=1, max_tokens=20))) != alone


def test_metrics(tiny_qwen2_dir, drafts):
    spec = spec_llm(tiny_qwen2_dir, drafts["perturbed"], 4)
    out = spec.generate(prompts()[:3], GREEDY)
    per_request = [o.metrics.spec_decode for o in out]
    engine = spec.llm_engine.spec_stats
    assert sum(s.num_draft_tokens for s in per_request) == engine.num_draft_tokens
    assert sum(s.num_accepted_tokens for s in per_request) == engine.num_accepted_tokens
    assert 1.0 <= engine.mean_acceptance_length <= 5.0
    assert len(engine.acceptance_by_position) == 4
    assert engine.draft_time_s > 0 and engine.verify_time_s > 0
    # tokens after prefill = accepted + one per verify step
    for o, s in zip(out, per_request):
        assert len(o.outputs[0].token_ids) == 1 + s.num_accepted_tokens + s.num_verify_steps


@pytest.mark.parametrize("block_size", [1, 16])
def test_pages_return_after_many_requests_and_aborts(tiny_qwen2_dir, drafts, block_size):
    spec = spec_llm(tiny_qwen2_dir, drafts["perturbed"], 3, block_size=block_size, max_num_seqs=32)
    engine = spec.llm_engine
    rng = random.Random(block_size)
    ids = []
    for i in range(200):
        n = rng.randint(1, 60)
        rid = engine.add_request(f"r{i}", [rng.randrange(3, 300) for _ in range(n)],
                                 SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 12)))
        ids.append(rid)
    to_abort = set(rng.sample(ids, 40))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps % 3 == 0 and to_abort:
            engine.abort_request(to_abort.pop())
        engine.block_manager.check_invariants()
    assert all_pages_free(spec)


def test_int8_draft_keeps_output_exact(tiny_qwen2_dir, drafts, reference):
    """A lossy int8 draft changes which tokens are proposed, never which are emitted."""
    from specserve.models.linear import QuantizedLinear
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "draft_model", "adaptive": False, "model": drafts["perturbed"],
                                                  "num_speculative_tokens": 4, "draft_quantization": "int8"})
    draft = llm.llm_engine.proposer.runner.model
    assert isinstance(draft.lm_head.linear, QuantizedLinear) and draft.lm_head.linear.parts[0].layout == "int8"
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference["batch"]
    assert llm.llm_engine.spec_stats.num_accepted_tokens > 0


def test_k_set_on_the_engine_takes_effect_at_the_next_step(tiny_qwen2_dir):
    """`specserve bench` runs one engine at several k through ``set_num_speculative_tokens``
    between runs: the next step drafts with the new k, and the config keeps its value."""
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "draft_model", "model": tiny_qwen2_dir,
                                                  "num_speculative_tokens": 2, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    eng = llm.llm_engine
    for k in (2, 4):
        eng.set_num_speculative_tokens(k)
        eng.reset_spec_stats()
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params)
        # the target drafting for itself accepts every draft: the longest chain is k
        assert len(eng.spec_stats.drafted_per_position) == k
        assert eng.num_speculative_tokens == k and eng.spec_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        eng.set_num_speculative_tokens(0)
    with pytest.raises(ValueError, match="without speculation"):
        LLM(tiny_qwen2_dir).llm_engine.set_num_speculative_tokens(2)
