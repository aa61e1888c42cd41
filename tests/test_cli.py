"""`specserve generate` end to end on a tiny model folder, and its handling of bad input."""
from __future__ import annotations

from specserve import LLM, SamplingParams
from specserve.entrypoints.cli import main


def test_generate_streams_the_greedy_completion(tiny_qwen2_dir, capsys):
    assert main(["generate", "--model", tiny_qwen2_dir, "--max-tokens", "12", "the quick brown"]) == 0
    printed = capsys.readouterr().out
    expected = LLM(tiny_qwen2_dir).generate(["the quick brown"], SamplingParams(temperature=0, max_tokens=12))
    assert printed == expected[0].outputs[0].text + "\n"


def test_generate_bad_input_is_one_clear_line(tiny_qwen2_dir, capsys):
    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "Traceback" not in err
    assert main(["generate", "--model", tiny_qwen2_dir, "--temperature", "-1", "hi"]) == 2
    assert "-1" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_qwen2_dir, ""]) == 2
    assert "empty" in capsys.readouterr().err
