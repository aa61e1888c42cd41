"""Incremental detokenization equals decoding the whole output; stop strings are found in the new text."""
from __future__ import annotations

import random

import pytest

from specserve import LLM, SamplingParams
from specserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from specserve.worker.step import StepResult
from tests.conftest import requires_smollm2

TEXTS = ["def f(x):\n    return x * 2  # doubled\n", "naïve café — 東京 🎉🎉 ok", "a\u200bb\tc  \n\n  end",
         "print('€ ¥ £')", "🇫🇷 flag, 👩‍💻 coder"]


def check_incremental(tok, ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    pieces = [detok.add(t) for t in ids]
    want = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.final_text() == want
    assert "".join(pieces) == detok.text and want.startswith(detok.text)
    # the text so far is always a prefix of the whole decode, with no partial character in it
    detok = IncrementalDetokenizer(tok, skip_special_tokens)
    for i, t in enumerate(ids):
        detok.add(t)
        assert "\ufffd" not in detok.text or "\ufffd" in want
        assert tok.decode(ids[:i + 1], skip_special_tokens=skip_special_tokens).startswith(detok.text)


def test_tiny_tokenizer_random_ids_and_texts(tiny_qwen2_dir):
    tok = LLM(tiny_qwen2_dir).get_tokenizer()
    rng = random.Random(0)
    for _ in range(20):   # random ids split multi-byte characters anywhere
        check_incremental(tok, [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))])
    for text in TEXTS:
        ids = tok.encode(text)
        check_incremental(tok, ids)
        check_incremental(tok, ids + [2, 1] + ids, skip_special_tokens=False)   # </s>, <s> kept as text


@requires_smollm2
def test_real_tokenizer_texts():
    from specserve.models.loader import load_tokenizer

    tok = load_tokenizer("smollm2-135m-instruct")
    for text in TEXTS:
        ids = tok.encode(text)
        check_incremental(tok, ids)
        check_incremental(tok, ids + [tok.eos_token_id] + ids, skip_special_tokens=False)
        check_incremental(tok, ids + [tok.eos_token_id] + ids, skip_special_tokens=True)


def test_fallback_for_tokenizers_that_clean_up_spaces(tiny_qwen2_dir):
    tok = LLM(tiny_qwen2_dir).get_tokenizer()
    tok.clean_up_tokenization_spaces = True   # a whole-text rule: decoding pieces would not match
    try:
        detok = IncrementalDetokenizer(tok)
        assert detok.backend is None
        ids = tok.encode("a , b . c ' d")
        for t in ids:
            detok.add(t)
        assert detok.final_text() == tok.decode(ids, skip_special_tokens=True)
    finally:
        tok.clean_up_tokenization_spaces = False


def test_generation_never_redecodes_the_output(tiny_qwen2_dir, monkeypatch):
    """The engine's text is grown per token: the tokenizer's whole-sequence decode is not called
    while generating 64 tokens (it was, once per token, before)."""
    llm = LLM(tiny_qwen2_dir)
    tok = llm.get_tokenizer()
    calls = []
    real = type(tok).decode
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, **kw: calls.append(len(ids)) or real(self, ids, **kw))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=64,
                                                                         ignore_eos=True))[0].outputs[0]
    monkeypatch.undo()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert sum(calls) <= 4, calls   # at most the few ids of a trailing partial character


def test_find_stop_string_hand_cases():
    assert find_stop_string("hello world", ["wor"], 8) == (6, "wor")     # ends in the new text
    assert find_stop_string("hello world", ["hel"], 8) is None           # checked before
    assert find_stop_string("abcXYdef", ["XY", "cX"], 3) == (2, "cX")    # the earliest wins
    assert find_stop_string("abcXYdef", ["XY", "cX"], 4) == (3, "XY")    # "cX" ended in checked text
    assert find_stop_string("abc", [], 0) is None
    assert find_stop_string("aaa", ["aa"], 2) == (1, "aa")     # the one at 0 ended in checked text


@pytest.mark.parametrize("stop", ["wor", "o w", "d"])
def test_stop_string_across_token_boundaries(tiny_qwen2_dir, stop):
    """A stop string completed by any token cuts the text right before it, whatever the split."""
    llm = LLM(tiny_qwen2_dir)
    tok = llm.get_tokenizer()
    ids = tok.encode("hello world and more")
    engine = llm.llm_engine
    engine.add_request("r", [3], SamplingParams(max_tokens=len(ids) + 1, stop=[stop], ignore_eos=True))
    req = engine.requests["r"][0]
    for t in ids:   # feed a fixed continuation through the scheduler and the output processor
        result = StepResult([[t]], [0])
        engine.scheduler.update_from_output([req], result)
        engine.output_processor.process([req], result)
        if req.is_finished:
            break
    assert req.text == "hello world and more".split(stop)[0]
    assert req.finish_reason == "stop" and req.stop_reason == stop
