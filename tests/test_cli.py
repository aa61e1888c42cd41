"""`specserve generate` end to end on a tiny model folder, and its handling of bad input."""
from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main


def test_generate_streams_the_greedy_completion(tiny_qwen2_dir, capsys):
    assert main(["generate", "--model", tiny_qwen2_dir, "--max-tokens", "12", "the quick brown"]) == 0
    printed = capsys.readouterr().out
    # the CLI's default target is int4 (our batch-invariant integer kernels)
    expected = LLM(tiny_qwen2_dir, quantization="int4").generate(["the quick brown"],
                                                                 SamplingParams(temperature=0, max_tokens=12))
    assert printed == expected[0].outputs[0].text + "\n"


def test_generate_bad_input_is_one_clear_line(tiny_qwen2_dir, capsys):
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "Traceback" not in err
    assert main(["generate", "--model", tiny_qwen2_dir, "--temperature", "-1", "hi"]) == 2
    assert "-1" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_qwen2_dir, ""]) == 2
    assert "empty" in capsys.readouterr().err


def test_quantization_bad_input_is_one_clear_line(tiny_qwen2_dir, tmp_path, capsys):
    from tests.tiny_models import make_tiny_model

    with pytest.raises(SystemExit) as e:  # argparse: exit 2, naming the value and the choices
        main(["generate", "--model", tiny_qwen2_dir, "--quantization", "int3", "hi"])
    assert e.value.code == 2 and "int3" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_qwen2_dir, "--dtype", "bfloat16", "hi"]) == 2
    assert "quantization 'int4'" in capsys.readouterr().err
    odd = tmp_path / "odd"
    make_tiny_model("llama", odd, hidden_size=48, num_heads=4, num_kv_heads=2)
    capsys.readouterr()  # (saving the model printed progress)
    assert main(["generate", "--model", str(odd), "--quantization", "int8", "hi"]) == 2
    err = capsys.readouterr().err
    assert "q_proj.weight" in err and "(48, 48)" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_speculative_config_json_flag(tiny_qwen2_dir, capsys):
    """vLLM's ``--speculative-config '{...}'`` sets the whole config; bad JSON or keys are one clear line."""
    from specserve.entrypoints.args import engine_args
    from specserve.entrypoints.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", tiny_qwen2_dir, "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 3}', "hi"])
    spec = engine_args(args).speculative_config
    assert spec.method == "ngram" and spec.num_speculative_tokens == 3
    assert main(["generate", "--model", tiny_qwen2_dir, "--speculative-config", '{"method": "ngram", "k": 3}',
                 "hi"]) == 2
    assert "unknown speculative_config key(s) ['k']" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_qwen2_dir, "--speculative-config", "{bad", "hi"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_qwen2_dir, "--max-tokens", "8", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 2}', "the quick brown"]) == 0
    printed = capsys.readouterr().out
    want = LLM(tiny_qwen2_dir, quantization="int4").generate(["the quick brown"],
                                                             SamplingParams(temperature=0, max_tokens=8))
    assert printed == want[0].outputs[0].text + "\n"
