"""The sync-free MTP step: one host read per step, counted; output still exact."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

from specserve.entrypoints.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.test_mtp import PROMPTS
from tests.test_spec_distribution import homogeneity_pvalue

# every way a tensor's value reaches Python (on a GPU each is a device-to-host synchronization)
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@contextlib.contextmanager
def count_host_reads():
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            counts[name] += 1
            return fn(self, *a, **kw)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@pytest.fixture(scope="module")
def head(trained_tiny_head):
    return trained_tiny_head


def test_one_host_read_per_step(tiny_qwen2_dir, head):
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head),
                                                  "num_speculative_tokens": 3, "adaptive": False})
    eng = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, min_p=0.05, max_tokens=40, ignore_eos=True)]
    for i, (p, ids) in enumerate(zip(params, PROMPTS[:4])):
        eng.add_request(f"r{i}", ids, p)
    while eng.spec_stats.num_sync_free_steps < 2:      # prefills, then speculative steps
        eng.step()
    measured = 0
    while eng.has_unfinished_requests():
        before = eng.spec_stats.num_sync_free_steps
        with count_host_reads() as reads:
            eng.step()
        if eng.spec_stats.num_sync_free_steps == before + 1:
            assert sum(reads.values()) == 1 and reads["tolist"] == 1, dict(reads)
            measured += 1
    assert measured >= 3
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_the_generic_step_reads_more(tiny_qwen2_dir, head):
    """The counter sees reads: the general speculative path (penalties need the drafts on the
    host) reads many times per step."""
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head),
                                                  "num_speculative_tokens": 3, "adaptive": False})
    eng = llm.llm_engine
    eng.add_request("r", PROMPTS[2], SamplingParams(temperature=0, frequency_penalty=0.5, max_tokens=20,
                                                    ignore_eos=True))
    for _ in range(3):
        eng.step()
    with count_host_reads() as reads:
        eng.step()
    assert eng.spec_stats.num_sync_free_steps == 0 and sum(reads.values()) > 3


@pytest.mark.parametrize("penalty", [0.0, 0.4])
def test_greedy_exact_on_both_paths(tiny_qwen2_dir, head, penalty):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, frequency_penalty=penalty)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = LLM(tiny_qwen2_dir).generate(prompts, params)
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head),
                                                   "num_speculative_tokens": 3, "adaptive": False})
    out = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    stats = spec.llm_engine.spec_stats
    assert (stats.num_sync_free_steps > 0) == (penalty == 0.0)
    assert stats.num_accepted_tokens > 0


def test_sync_free_sampling_matches_no_speculation(tiny_qwen2_dir, head):
    n, batch = 4000, 250
    prompt = {"prompt_token_ids": [17, 92, 5, 230, 41, 8]}
    base = LLM(tiny_qwen2_dir, max_num_seqs=256)
    spec = LLM(tiny_qwen2_dir, max_num_seqs=256, speculative_config={
        "method": "mtp", "model": str(head), "num_speculative_tokens": 2, "adaptive": False})
    counts = []
    for llm, seed0 in ((base, 0), (spec, 10 ** 6)):
        outs = []
        for start in range(0, n, batch):
            params = [SamplingParams(seed=seed0 + i, max_tokens=4, ignore_eos=True, temperature=1.0)
                      for i in range(start, start + batch)]
            outs += llm.generate([prompt] * batch, params)
        counts.append(Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs))
    assert spec.llm_engine.spec_stats.num_sync_free_steps > 0
    assert homogeneity_pvalue(*counts) > 1e-3
