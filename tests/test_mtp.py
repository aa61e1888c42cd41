"""MTP chain speculation in the engine: greedy exactness with any head, the head's KV refilled from
the target's hidden states, and a trained head accepted more often than an untrained one."""
from __future__ import annotations

import pytest
import torch

from specserve.entrypoints.llm import LLM
from specserve.attention.metadata import AttentionMetadata
from specserve.models.draft_head import DraftHead, PagedKV
from specserve.models.draft_head_config import DraftHeadConfig
from specserve.models.loader import load_model
from specserve.sampling_params import SamplingParams
from specserve.training.evaluate import (acceptance_length_stderr, chain_accuracy, conditional_acceptance,
                                         evaluate_head_in_engine)

PROMPTS = [list(range(3, 3 + n)) for n in (1, 5, 17, 40, 90, 7, 33, 64)]


def save_random_head(target_dir, folder, variant="normed", draft_vocab=None, seed=0, own_lm_head=False):
    cfg = load_model(str(target_dir)).config
    torch.manual_seed(seed)
    head = DraftHead(DraftHeadConfig.for_target(cfg, variant, intermediate_size=32, draft_vocab_size=draft_vocab,
                                                own_lm_head=own_lm_head))
    if draft_vocab is not None:
        head.set_draft_vocab(torch.arange(0, 2 * draft_vocab, 2))
    head.save(folder, dtype=torch.float32)
    return folder


@pytest.mark.parametrize("variant,draft_vocab,adaptive", [("normed", None, False), ("eagle", 40, False),
                                                          ("normed", None, True), ("eagle3", 40, False)])
def test_mtp_greedy_equals_no_speculation(tiny_qwen2_dir, tmp_path, variant, draft_vocab, adaptive):
    head = save_random_head(tiny_qwen2_dir, tmp_path / "head", variant, draft_vocab, own_lm_head=variant == "eagle3")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = LLM(tiny_qwen2_dir).generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    spec = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head), "num_speculative_tokens": 3,
                                                   "adaptive": adaptive})
    for batch in ([PROMPTS[4]], PROMPTS):   # batch 1, then 8 prompts of mixed lengths
        out = spec.generate([{"prompt_token_ids": p} for p in batch], params)
        want = [ref[PROMPTS.index(p)].outputs[0].token_ids for p in batch]
        assert [o.outputs[0].token_ids for o in out] == want
    eng = spec.llm_engine
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    if not adaptive:
        assert eng.spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("path,variant", [("sync_free", "normed"), ("general", "normed"), ("sync_free", "eagle3"),
                                          ("general", "eagle3")])
def test_head_kv_is_refilled_from_target_hidden_states(tiny_qwen2_dir, tmp_path, path, variant):
    """After generation steps, the head's KV at every position the head covers equals a fresh head
    forward over the target's own hidden states, even though drafting ran the head on its own
    (here deliberately corrupted) features at those positions first. Both paths that run: the
    sync-free step (the head refilled inside the step) and the general one (asking for logprobs
    keeps the drafts on the host; the head is refilled by the next catch-up). An EAGLE-3 head reads
    the target's fused layers: HF's hidden states entering those layers."""
    from specserve.engine.scheduler import ScheduledRequest, SchedulerOutput

    head_dir = save_random_head(tiny_qwen2_dir, tmp_path / "head", variant)
    llm = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head_dir),
                                                  "num_speculative_tokens": 3, "adaptive": False})
    eng = llm.llm_engine
    prop = eng.proposer
    real_run, drafting, corrupted = prop._run, [False], [0]

    def while_drafting(fn):
        def wrapper(*a, **kw):
            drafting[0] = True
            try:
                return fn(*a, **kw)
            finally:
                drafting[0] = False
        return wrapper

    def corrupting_run(hidden, *a, **kw):   # the head's own features, while drafting, are garbage
        if drafting[0]:
            corrupted[0] += 1
            hidden = hidden + 100.0
        return real_run(hidden, *a, **kw)

    prop._run = corrupting_run
    prop.propose = while_drafting(prop.propose)
    prop.propose_on_device = while_drafting(prop.propose_on_device)
    prompt = PROMPTS[3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                            logprobs=0 if path == "general" else None)
    eng.add_request("r", prompt, params)
    for _ in range(4):
        eng.step()
    assert corrupted[0] > 0, "the corruption never fired: drafting took another path"
    assert (eng.spec_stats.num_sync_free_steps > 0) == (path == "sync_free")
    req = eng.requests["r"][0]
    prop.catch_up(eng.scheduler.step_batch(SchedulerOutput([ScheduledRequest(req, 1)])))
    st = prop.states[req.seq_id]
    n = st.num_computed
    # the oracle: the target's hidden states over the whole sequence, then the head over them
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    ids = torch.tensor(req.all_token_ids)
    with torch.no_grad():
        states = hf(ids.unsqueeze(0), output_hidden_states=True).hidden_states
        layers = prop.head.config.aux_hidden_state_layers
        h = torch.cat([states[i][0] for i in layers], -1) if layers else states[-1][0]
        want = prop.head(h[:n].unsqueeze(0), ids[1:n + 1].unsqueeze(0), torch.arange(n).unsqueeze(0))[0]
    # read the head's KV back by recomputing the last position from the cache: its output must match
    table = eng.block_manager.block_table(req.seq_id)
    md = AttentionMetadata.build([table], [n - 1], [1], eng.block_manager.block_size)
    with torch.inference_mode():
        got = prop.head(h[n - 1:n], ids[n:n + 1], torch.tensor([n - 1]),
                        PagedKV(prop.kv.key_cache[0], prop.kv.value_cache[0], md))
    torch.testing.assert_close(got[0], want[n - 1], rtol=1e-4, atol=1e-4)
    assert n >= len(prompt) + 3


@pytest.mark.parametrize("variant", ["normed", "eagle3"])
def test_trained_head_is_accepted_more_often_than_an_untrained_one(tiny_qwen2_dir, tmp_path, variant, request):
    """The head trained on the target's own continuations drafts tokens the target accepts far more
    often than a random head of the same shape, on prompts it never saw."""
    trained = request.getfixturevalue("trained_tiny_head" if variant == "normed" else "trained_tiny_eagle3_head")
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    rates = {}
    untrained = save_random_head(tiny_qwen2_dir, tmp_path / "r", variant, own_lm_head=variant == "eagle3")
    for name, head in (("trained", trained), ("untrained", untrained)):
        llm = LLM(tiny_qwen2_dir, speculative_config={"method": "mtp", "model": str(head),
                                                      "num_speculative_tokens": 3, "adaptive": False})
        llm.generate(prompts, params)
        rates[name] = llm.llm_engine.spec_stats.acceptance_rate
    # an EAGLE-3 head reads only layers before the last one of this 3-layer target, not its final
    # hidden state: measured 0.09 (normed 0.25), against 0.004 untrained
    floor = 0.1 if variant == "normed" else 0.05
    assert rates["trained"] > floor and rates["trained"] > 3 * rates["untrained"], rates


def test_acceptance_length_stderr_equals_the_spread_of_enumerated_steps():
    """Ten steps accepting 0,0,0,0,1,1,2,2,2,3 drafts (k = 3): the chain accuracies they give and the
    standard error of their mean computed directly from the list."""
    import statistics

    accepted = [0, 0, 0, 0, 1, 1, 2, 2, 2, 3]
    chain = chain_accuracy([sum(m >= j for m in accepted) for j in (1, 2, 3)], [10, 10, 10])
    assert chain == pytest.approx([0.6, 0.4, 0.1])
    expected = (statistics.pvariance(accepted) / len(accepted)) ** 0.5   # 0.3302
    assert acceptance_length_stderr(chain, 10) == pytest.approx(expected)
    assert acceptance_length_stderr([1.0, 1.0, 1.0], 50) == 0.0   # every step accepts all: no spread
    assert acceptance_length_stderr(chain, 0) is None


def test_chain_accuracy_hand_case():
    # 10 steps of 3 drafts: position 1 accepted 6 times, position 2 4 times, position 3 once
    chain = chain_accuracy([6, 4, 1], [10, 10, 10])
    assert chain == [0.6, 0.4, 0.1]
    assert conditional_acceptance(chain) == pytest.approx([0.6, 4 / 6, 0.25])


def test_evaluate_reports_engine_counters(tiny_qwen2_dir, tmp_path):
    head = save_random_head(tiny_qwen2_dir, tmp_path / "head")
    r = evaluate_head_in_engine(str(tiny_qwen2_dir), str(head), ["def f(x):", "import os\n"], 3, max_tokens=12)
    assert r["num_verify_steps"] > 0 and r["output_tokens"] == 24
    assert r["acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_verify_steps"])
    assert len(r["chain_accuracy"]) == 3 and r["top1"] == r["chain_accuracy"][0]
    assert r["draft_quantization"] == "none"   # the float target's head stays float


def test_evaluate_a_dynamic_tree_and_check_exactness(tiny_qwen2_dir, trained_tiny_head):
    """eval-head's tree mode drafts EAGLE-2's dynamic tree with the same head: the accepted drafts
    counted at depths 1..k are all of them (paths never go deeper than the tree), and the greedy
    outputs equal those without speculation, which it checks itself."""
    prompts = ["def f(x):", "import os\n", "class A:\n    def", "for i in range("]
    r = evaluate_head_in_engine(str(tiny_qwen2_dir), str(trained_tiny_head), prompts, 3, max_tokens=16,
                                method="eagle", eagle_topk=2, num_draft_tokens=6, check_exact=True)
    assert r["method"] == "eagle" and r["eagle_topk"] == 2 and r["num_draft_tokens_per_step"] == 6
    assert r["exact"] == len(prompts) and r["inexact_prompts"] == []
    assert len(r["chain_accuracy"]) == 3 and r["num_accepted_tokens"] > 0
    assert sum(r["accepted_per_position"]) == r["num_accepted_tokens"]
    # P(path >= j deep) over every step with a tree, shallow pruned trees included
    steps_with_tree = r["drafted_per_position"][0]
    assert r["chain_accuracy"] == [a / steps_with_tree for a in r["accepted_per_position"]]
    assert sum(r["chain_accuracy"]) * steps_with_tree == pytest.approx(r["num_accepted_tokens"])
    assert r["chain_accuracy"] == sorted(r["chain_accuracy"], reverse=True)
    assert r["num_draft_tokens"] <= 3 * r["num_verify_steps"]   # a tree step counts its depth, at most k
    with pytest.raises(ValueError, match="'medusa'"):
        evaluate_head_in_engine(str(tiny_qwen2_dir), str(trained_tiny_head), prompts, 3, method="medusa")


def test_head_methods_take_the_head_shipped_for_the_target():
    """``method="mtp"`` / ``"eagle"`` without a ``model`` use the head that ships with the target
    (as DeepSeek-V3's MTP layers ship with it), from the API and from the command line."""
    from specserve.config import EngineArgs
    from specserve.entrypoints.args import engine_args
    from specserve.entrypoints.cli import build_parser

    for method in ("mtp", "eagle"):
        ea = EngineArgs(model="qwen2.5-coder-0.5b-instruct", speculative_config={"method": method})
        assert ea.speculative_config.model == "qwen2.5-coder-0.5b-instruct-head"
    args = build_parser().parse_args(["generate", "--model", "qwen2.5-coder-0.5b-instruct",
                                      "--speculative-method", "mtp", "hi"])
    assert engine_args(args).speculative_config.model == "qwen2.5-coder-0.5b-instruct-head"
    with pytest.raises(ValueError, match="no head ships for target 'smollm2-135m-instruct'"):
        EngineArgs(model="smollm2-135m-instruct", speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="'draft_model' needs a draft 'model'"):
        EngineArgs(model="smollm2-135m-instruct", speculative_config={"method": "draft_model"})
