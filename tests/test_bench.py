"""Quick end-to-end runs of ``specserve bench`` on a tiny random model (figures, not speed)."""
from __future__ import annotations

import json

import pytest
from pathlib import Path

from specserve.entrypoints.cli import main
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_tiny_llama")
    make_tiny_model("llama", folder)
    return str(folder)


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def test_bench_json_has_positive_figures(tiny_bench_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", tiny_bench_model, "--num-prompts", "2", "--max-tokens", "4", "--skip-hf",
               "--max-k", "2", "--repeats", "2", "--context-len", "20", "--prefill-len", "40", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    s = res["specserve"]["summary"]
    for key in ("ttft_median_s", "decode_tok_s_median", "decode_tok_s_aggregate", "e2e_tok_s_median",
                "e2e_tok_s_aggregate"):
        assert _positive(s[key]), key
    assert s["total_tokens"] == 2 * 4
    assert [len(r["token_ids"]) for r in res["specserve"]["per_prompt"]] == [4, 4]
    assert [e["k"] for e in res["vk"]["vk"]] == [1, 2]
    assert all(_positive(e["v"]) and _positive(e["t_ms_median"]) for e in res["vk"]["vk"])
    assert res["vk"]["context_len"] == 20
    assert res["hf"] is None
    assert res["config"]["num_prompts"] == 2 and res["machine"]["torch_threads"] >= 1
    pre = res["prefill"]["specserve"]
    assert pre["tokens"] == 40 and len(pre["tok_s"]) == 3 and all(_positive(r) for r in pre["tok_s"])
    (bd,) = res["decode_breakdown"]
    cfg = json.loads((Path(tiny_bench_model) / "config.json").read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    # float16 entries (the default) of keys and values, every layer, the context and the new token
    kv_bytes = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * (20 + 1)
    assert bd["role"] == "target" and bd["context_len"] == 20 and bd["kv_mb"] * 1e6 == pytest.approx(kv_bytes)
    assert 0 < bd["linear_ms"] < bd["step_ms"] and bd["outside_ms"] == pytest.approx(bd["step_ms"] - bd["linear_ms"])
    assert bd["weight_mb"] > 0 and bd["floor_ms"] == pytest.approx(
        (bd["weight_mb"] + bd["kv_mb"]) * 1e6 / (bd["bandwidth_gbs"] * 1e9) * 1e3)
    printed = capsys.readouterr().out
    assert "| specserve |" in printed and "V(k)" in printed and "prefill of 40-token prompts" in printed
    assert "| target | 20 |" in printed


def test_prefill_prompts_share_no_first_block():
    """Distinct openings (no prefix-cache hit between them), each exactly the asked length, from a
    pool shorter than one prompt."""
    from specserve.benchmarks.engine_runs import prefill_prompts

    prompts = prefill_prompts(list(range(50)), 120)
    assert [len(p) for p in prompts] == [120, 120, 120]
    assert len({tuple(p[:16]) for p in prompts}) == 3
    assert prompts[1][:3] == [37, 38, 39] and prompts[0][50:53] == [0, 1, 2]


def test_bench_with_hf_peer_and_batching(tiny_bench_model, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", tiny_bench_model, "--num-prompts", "2", "--max-tokens", "3",
               "--batch-size", "2", "--max-k", "1", "--repeats", "1", "--context-len", "10",
               "--quantization", "none",  # transformers runs the float weights
               "--json", str(out), "--plot", str(tmp_path / "vk.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert _positive(res["hf"]["summary"]["decode_tok_s_median"])
    assert _positive(res["decode_ratio_specserve_over_hf"])
    assert [len(r["token_ids"]) for r in res["hf"]["per_prompt"]] == [3, 3]
    assert len(res["vk"]["vk"]) == 1
    # same weights, same prompt ids, greedy: the tiny model's tokens agree with transformers'
    assert res["agreement"]["identical_prompts"] == 2
    assert "| transformers |" in capsys.readouterr().out


def test_bench_rejects_bad_flag(tiny_bench_model):
    assert main(["bench", "--model", tiny_bench_model, "--num-prompts", "0", "--skip-hf"]) == 2
    assert main(["bench", "--model", tiny_bench_model, "--prefill-len", "-1", "--skip-hf"]) == 2


def test_bench_measures_speculation_in_the_same_run(tiny_bench_model, tmp_path, capsys):
    """The model drafting for itself: every draft accepted, outputs identical to no speculation."""
    out = tmp_path / "bench.json"
    rc = main(["bench", "--model", tiny_bench_model, "--speculative-model", tiny_bench_model, "--spec-ks", "2,3",
               "--num-prompts", "2", "--max-tokens", "6", "--skip-hf", "--max-k", "1", "--repeats", "1",
               "--context-len", "10", "--json", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["speculative"]
    assert [r["k"] for r in runs] == [2, 3]
    for r in runs:
        assert r["agreement_with_no_speculation"]["identical_prompts"] == 2
        assert r["spec_decode"]["acceptance_rate"] == 1.0 and r["spec_decode"]["mean_acceptance_length"] > 2
        assert _positive(r["speedup_decode_median"])
    draft = runs[0]["draft_breakdown"]   # the draft model's own decode step
    assert draft["role"] == "draft" and draft["context_len"] == 10 and 0 < draft["linear_ms"] < draft["step_ms"]
    printed = capsys.readouterr().out
    assert "identical to no speculation" in printed and "| draft | 10 |" in printed


def test_bench_methods_side_by_side(tiny_qwen2_dir, trained_tiny_head, tmp_path, capsys):
    """Every method on one target in one run: greedy outputs equal none's, figures positive; the
    model drafting for itself accepts everything."""
    out = tmp_path / "methods.json"
    methods = ["none", "ngram", "draft_model", "mtp", "eagle-static", "eagle-dynamic"]
    rc = main(["bench", "--model", tiny_qwen2_dir, "--methods", ",".join(methods),
               "--speculative-model", tiny_qwen2_dir, "--head", trained_tiny_head,
               "--speculative-token-tree", "[[0], [1], [0, 0]]", "--num-speculative-tokens", "3",
               "--num-prompts", "2", "--max-tokens", "8", "--skip-hf", "--json", str(out),
               "--plot", str(tmp_path / "methods.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["method"] for r in res["methods"]] == methods
    for r in res["methods"]:
        assert r["agreement_with_none"]["identical_prompts"] == 2, r["method"]
        assert _positive(r["speedup_decode_median"]) and _positive(r["summary"]["e2e_tok_s_aggregate"])
    by = {r["method"]: r for r in res["methods"]}
    assert by["draft_model"]["spec_decode"]["acceptance_rate"] == 1.0
    assert by["eagle-static"]["speculative_config"]["speculative_token_tree"] == "[[0], [1], [0, 0]]"
    assert all(r["adaptive_steps_per_k"] is None for r in res["methods"])   # k fixed by default: no controller
    assert (tmp_path / "methods.png").stat().st_size > 0
    assert "| eagle-dynamic |" in capsys.readouterr().out


def test_bench_methods_adaptive(tiny_qwen2_dir, tmp_path, capsys):
    """--adaptive runs each method as generate does (the controller picks k per step): greedy
    outputs still equal none's, and the config and table say so."""
    out = tmp_path / "methods.json"
    rc = main(["bench", "--model", tiny_qwen2_dir, "--methods", "none,ngram,draft_model", "--adaptive",
               "--speculative-model", tiny_qwen2_dir, "--num-speculative-tokens", "3",
               "--num-prompts", "2", "--max-tokens", "8", "--skip-hf", "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    for r in res["methods"][1:]:
        assert r["speculative_config"]["adaptive"] is True and r["speculative_config"]["num_speculative_tokens"] == 3
        assert r["agreement_with_none"]["identical_prompts"] == 2, r["method"]
        steps = r["adaptive_steps_per_k"]   # the engine's controller chose every decode step's k
        assert steps is not None and len(steps) == 4 and sum(steps) > 0, (r["method"], steps)
    assert res["methods"][0]["adaptive_steps_per_k"] is None
    assert "| draft_model | k = 3, adaptive (at most) |" in capsys.readouterr().out


def test_bench_methods_bad_input(tiny_qwen2_dir, capsys):
    assert main(["bench", "--model", tiny_qwen2_dir, "--methods", "none,medusa", "--skip-hf"]) == 2
    assert "medusa" in capsys.readouterr().err
    assert main(["bench", "--model", tiny_qwen2_dir, "--methods", "none,mtp", "--skip-hf"]) == 2   # no head
    assert "--head" in capsys.readouterr().err
    assert main(["bench", "--model", tiny_qwen2_dir, "--adaptive", "--skip-hf"]) == 2   # no --methods
    assert "--adaptive applies to --methods only" in capsys.readouterr().err


@pytest.mark.parametrize("kv_cache_dtype,rel_tol,min_agreement",
                         [("float32", 1e-4, 1.0), ("float16", 1e-3, 1.0), ("bfloat16", 1e-2, 0.95)])
def test_quality_teacher_forcing_matches_transformers(tiny_bench_model, kv_cache_dtype, rel_tol, min_agreement):
    """`bench --quality`'s argmax and perplexity equal transformers' on the same float weights (a
    16-bit KV cache rounds keys and values to 11 (float16) or 8 (bfloat16) significant bits: looser
    bounds, and bfloat16 may flip a near tie of this random model's logits)."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    from specserve.benchmarks.quality import agreement_rate, teacher_forced
    from specserve.engine.engine import EngineArgs, LLMEngine

    g = torch.Generator().manual_seed(0)
    segments = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (40, 17, 2)]
    out = teacher_forced(LLMEngine(EngineArgs(model=tiny_bench_model, kv_cache_dtype=kv_cache_dtype)), segments,
                         logits_chunk=7)
    hf = AutoModelForCausalLM.from_pretrained(tiny_bench_model).eval()
    argmax, nll, n = [], 0.0, 0
    with torch.no_grad():
        for seg in segments:
            logp = torch.log_softmax(hf(torch.tensor([seg])).logits[0, :-1].double(), dim=-1)
            argmax += logp.argmax(-1).tolist()
            nll -= float(logp.gather(1, torch.tensor(seg[1:])[:, None]).sum())
            n += len(seg) - 1
    assert out["num_tokens"] == n == 56
    assert agreement_rate(out["argmax"], argmax) >= min_agreement
    assert math.isclose(out["perplexity"], math.exp(nll / n), rel_tol=rel_tol)
