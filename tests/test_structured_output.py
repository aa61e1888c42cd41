"""Structured output with and without speculation.

Oracles: the grammar's masks against a brute-force enumeration of the language over the tokenizer's
vocabulary; greedy output with speculation equals greedy output without it for every method; the
sampled output's distribution against the exact masked target distribution, enumerated with HF
transformers in float64; JSON outputs validated with ``jsonschema``.
"""
from __future__ import annotations

import json
from collections import Counter

import jsonschema
import pytest
import torch

from specserve import LLM, SamplingParams, StructuredOutputsParams
from tests.test_tree import chi_square_pvalue
from tests.tiny_models import make_layer_skip_draft

LETTERS = set("the")
REGEX = "[the]{1,3}"   # every string of 1 to 3 letters from {t, h, e}
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["fox", "dog"]}, "maxItems": 2},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}   # random weights would print whitespace for long
CHOICES = ["the quick", "lazy dog", "fox"]
LARK = 'start: "def " NAME "(" ")"\nNAME: /[a-z]{1,5}/'
PROMPTS = [[17, 92, 5, 230, 41, 8], [3, 44, 101, 7], [250, 12, 12, 9, 60], [88, 1, 140]]


def constraints():
    return [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
            StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=LARK),
            StructuredOutputsParams(json_object=True), None]


def token_texts(tok, vocab_size: int) -> list[str | None]:
    """Each id's own text (None for special tokens and ids past the tokenizer)."""
    special = set(tok.all_special_ids)
    return [None if i in special or i >= len(tok) else tok.decode([i]) for i in range(vocab_size)]


def regex_allowed(texts: list[str | None], done: str, eos: int) -> set[int]:
    """Brute force: ids whose text keeps ``done`` a prefix of a string of REGEX's language, and EOS
    where ``done`` is in it."""
    out = {i for i, t in enumerate(texts)
           if t and set(done + t) <= LETTERS and len(done + t) <= 3}
    if 1 <= len(done) <= 3:
        out.add(eos)
    return out


# ---------------------------------------------------------------------------------------- params
@pytest.mark.parametrize("kw, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"json": 3}, "json must be"),
    ({"regex": ""}, "regex must be"),
    ({"choice": []}, "choice must be"),
    ({"choice": ["a", 1]}, "choice must be.*entry 1 is 1$"),
    ({"choice": [f"c{i}" for i in range(50000)] + [""]}, "choice must be.*entry 50000 is ''$"),   # not the whole list
    ({"choice": "abc"}, "choice must be.*got str"),
])
def test_params_name_the_bad_field(kw, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_dir):
    return LLM(tiny_qwen2_dir)


@pytest.mark.parametrize("so, message", [
    (StructuredOutputsParams(regex="(ab"), "invalid regex.*unclosed group"),
    (StructuredOutputsParams(json={"type": "foo"}), "invalid json"),
    (StructuredOutputsParams(json="{not json"), "invalid json"),
    (StructuredOutputsParams(json="[1, 2]"), "must be an object"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "invalid grammar"),
    (StructuredOutputsParams(json={"$ref": "#"}), "allows no output"),          # an empty language
    (StructuredOutputsParams(regex="[^\\s\\S]"), "allows no output"),
    (StructuredOutputsParams(grammar='start: a\na: a "x"'), "allows no output"),
    (StructuredOutputsParams(json='{"a":' * 5000 + "1" + "}" * 5000), "invalid json.*recursion"),
    (StructuredOutputsParams(choice=[f"c{i}" for i in range(70000)]), "invalid choice"),   # past a size limit
])
def test_bad_grammars_are_refused_and_the_engine_goes_on(llm, so, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4, structured_outputs=so))
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.llm_engine.block_manager.num_free_blocks == llm.llm_engine.block_manager.num_blocks


def test_a_limit_hit_while_generating_ends_the_request_with_the_reason(llm):
    """llguidance checks some limits only while consuming (a repeat too large to expand): that
    request ends ("abort", the reason as stop_reason; the server answers 400) and the rest go on."""
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a{1000000}")),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex=REGEX))])
    assert out[0].outputs[0].finish_reason == "abort"
    assert "too many expressions" in out[0].outputs[0].stop_reason
    assert out[1].outputs[0].finish_reason == "stop" and len(out[1].outputs[0].text) <= 3


def test_ignore_eos_after_the_grammar_completes(llm):
    """With ignore_eos a completed grammar allows only EOS, which is emitted until max_tokens; the
    text is a word of the language."""
    so = StructuredOutputsParams(choice=CHOICES)
    c = llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                     SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, structured_outputs=so))[0].outputs[0]
    assert c.finish_reason == "length" and c.text in CHOICES


# ---------------------------------------------------------------------------------------- masks
def test_masks_equal_brute_force_enumeration(llm):
    """The mask after every prefix of the language equals the enumeration's, EOS included, and
    reading masks after uncommitted drafts leaves the committed state unchanged."""
    engine = llm.llm_engine
    vocab, eos = engine.model_config.vocab_size, engine.model_config.eos_token_ids[0]
    texts = token_texts(engine.tokenizer, vocab)
    state = engine.grammar_compiler.new_state(StructuredOutputsParams(regex=REGEX))
    checked = 0

    def walk(tokens: list[int], done: str) -> None:
        nonlocal checked
        mask = state.allowed_token_mask(tokens)
        assert set(mask.nonzero().flatten().tolist()) == regex_allowed(texts, done, eos), (tokens, done)
        checked += 1
        for t in sorted(regex_allowed(texts, done, eos) - {eos}):
            walk(tokens + [t], done + texts[t])

    walk([], "")
    assert checked > 30
    refused = next(i for i, t in enumerate(texts) if t == "q")
    assert not state.allowed_token_mask([refused]).any()          # a refused prefix allows nothing
    assert state.num_valid([texts.index("t"), texts.index("he"), refused]) == 2
    # committing moves the state; the masks are those after the committed text
    assert state.accept(texts.index("he"))
    assert set(state.allowed_token_mask().nonzero().flatten().tolist()) == regex_allowed(texts, "he", eos)
    assert not state.accept(refused)                               # refused: state unchanged
    assert state.accept(texts.index("e")) and state.is_terminated
    assert state.allowed_token_mask().nonzero().flatten().tolist() == [eos]
    # a drafted EOS there counts as valid, and nothing but EOS follows it
    assert state.num_valid([eos, texts.index("t")]) == 1
    assert state.allowed_token_mask([eos, texts.index("t")]).nonzero().flatten().tolist() == [eos]


# ---------------------------------------------------------------------------------------- greedy
@pytest.fixture(scope="module")
def self_draft(tiny_qwen2_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("so_draft") / "draft"
    make_layer_skip_draft(tiny_qwen2_dir, folder, keep_layers=3, noise=0.07)
    return str(folder)


METHODS = {
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    "eagle_dynamic": {"method": "eagle", "num_speculative_tokens": 4},
    "eagle_static": {"method": "eagle", "speculative_token_tree": "eagle1"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
}


def spec_config(name, self_draft, head):
    cfg = {**METHODS[name], "adaptive": False}
    if name == "draft_model":
        cfg["model"] = self_draft
    elif name != "ngram":
        cfg["model"] = head
    return cfg


def check_valid(so: StructuredOutputsParams | None, text: str) -> None:
    """The output is in the grammar's language (the constraint's own definition as oracle)."""
    import re

    if so is None:
        return
    if so.kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif so.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif so.kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"def [a-z]{1,5}\(\)", text), text


@pytest.fixture(scope="module")
def greedy_reference(llm):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in constraints()]
    params = [SamplingParams(temperature=0, max_tokens=120, structured_outputs=so)
              for _ in PROMPTS for so in constraints()]
    return prompts, params, llm.generate(prompts, params)


def test_greedy_outputs_are_valid_without_speculation(greedy_reference):
    prompts, params, outs = greedy_reference
    for p, o in zip(params, outs):
        if p.structured_outputs is not None:
            if p.structured_outputs.kind == "json_object" and o.outputs[0].finish_reason == "length":
                continue   # an open-ended object may outlast max_tokens under random weights
            assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        check_valid(p.structured_outputs, o.outputs[0].text)


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_speculation_equals_without(tiny_qwen2_dir, self_draft, trained_tiny_eagle3_head,
                                                greedy_reference, method):
    """Every method, a batch mixing every kind of constraint and unconstrained requests: token
    for token the output without speculation, and drafts were accepted."""
    prompts, params, ref = greedy_reference
    spec = LLM(tiny_qwen2_dir, speculative_config=spec_config(method, self_draft, trained_tiny_eagle3_head))
    outs = spec.generate(prompts, params)
    for p, o, r in zip(params, outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, (method, p.structured_outputs)
    stats = spec.llm_engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert spec.llm_engine.block_manager.num_free_blocks == spec.llm_engine.block_manager.num_blocks


def test_greedy_under_preemption_equals_reference(tiny_qwen2_dir, self_draft, greedy_reference):
    """A pool too small for the batch: sequences are preempted and recomputed mid-grammar; their
    grammar state stays at their committed output and the outputs stay equal."""
    prompts, params, ref = greedy_reference
    spec = LLM(tiny_qwen2_dir, num_blocks=20, block_size=8,   # 160 tokens: one sequence fits
               speculative_config=spec_config("draft_model", self_draft, None))
    preempted = set()
    spec.llm_engine.step_observers.append(
        lambda reqs, result: preempted.update(r.seq_id for r in reqs if r.num_preemptions))
    outs = spec.generate(prompts, params)
    assert preempted
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids


@pytest.mark.parametrize("method", list(METHODS))
def test_sampled_json_is_always_valid(tiny_qwen2_dir, self_draft, trained_tiny_eagle3_head, method):
    """A batch of 24 sampled requests under the schema, every method: all parse and validate."""
    spec = LLM(tiny_qwen2_dir, speculative_config=spec_config(method, self_draft, trained_tiny_eagle3_head))
    so = StructuredOutputsParams(json=SCHEMA)
    outs = spec.generate([{"prompt_token_ids": PROMPTS[i % 4]} for i in range(24)],
                         [SamplingParams(temperature=1.0, seed=i, max_tokens=150, structured_outputs=so)
                          for i in range(24)])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


# ---------------------------------------------------------------------------------------- sampling
def exact_distribution(model_dir: str, prompt: list[int], vocab: int, eos: int, texts,
                       temperature: float) -> dict[tuple, float]:
    """P(output tokens) under the target masked by REGEX's language: exact enumeration of every
    token sequence, each step's distribution the softmax of HF's float64 logits / temperature over
    the allowed ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    out: dict[tuple, float] = {}

    def walk(tokens: tuple, done: str, prob: float) -> None:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(tokens)])).logits[0, -1, :vocab]
        allowed = sorted(regex_allowed(texts, done, eos))
        p = torch.softmax(logits[allowed] / temperature, dim=-1).tolist()
        for t, pt in zip(allowed, p):
            if t == eos:
                out[tokens] = out.get(tokens, 0.0) + prob * pt
            else:
                walk(tokens + (t,), done + texts[t], prob * pt)

    walk((), "", 1.0)
    return out


N_SAMPLES = 3000
TEMPERATURE = 4.0   # the random target is sharp: flattened, ~20 sequences are likely enough to test


@pytest.fixture(scope="module")
def far_draft(tiny_qwen2_dir, tmp_path_factory):
    """A draft far from the target (one layer, noisy): a distribution test fails on mistakes that a
    draft close to the target hides."""
    folder = tmp_path_factory.mktemp("so_far_draft") / "draft"
    make_layer_skip_draft(tiny_qwen2_dir, folder, keep_layers=1, noise=0.3)
    return str(folder)


@pytest.mark.parametrize("method", ["draft_model", "eagle_dynamic"])
def test_sampled_output_follows_the_masked_target_exactly(tiny_qwen2_dir, far_draft, trained_tiny_eagle3_head,
                                                          method):
    """3,000 seeded samples (temperature 4) of REGEX with speculation (chains: masked draft
    distributions and rejection sampling; trees: recursive rejection over masked nodes) against the
    exact distribution over every token sequence of the language."""
    spec = LLM(tiny_qwen2_dir, max_num_seqs=256,
               speculative_config=spec_config(method, far_draft, trained_tiny_eagle3_head))
    engine = spec.llm_engine
    vocab, eos = engine.model_config.vocab_size, engine.model_config.eos_token_ids[0]
    texts = token_texts(engine.tokenizer, vocab)
    prompt = PROMPTS[0]
    probs = exact_distribution(tiny_qwen2_dir, prompt, vocab, eos, texts, TEMPERATURE)
    assert abs(sum(probs.values()) - 1.0) < 1e-9 and len(probs) > 20
    so = StructuredOutputsParams(regex=REGEX)
    counts: Counter = Counter()
    for start in range(0, N_SAMPLES, 250):
        params = [SamplingParams(temperature=TEMPERATURE, seed=start + i, max_tokens=8, structured_outputs=so)
                  for i in range(250)]
        for o in spec.generate([{"prompt_token_ids": prompt}] * 250, params):
            toks = o.outputs[0].token_ids
            assert toks[-1] == eos, toks
            counts[tuple(toks[:-1])] += 1
    assert engine.spec_stats.num_accepted_tokens > 0
    assert chi_square_pvalue(counts, probs) > 1e-3
