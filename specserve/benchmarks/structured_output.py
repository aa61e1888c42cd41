"""Structured output with speculation: speed, acceptance and validity under a JSON schema.

Chat requests (one at a time, greedy) ask the target to answer Spec-Bench questions as a JSON
object of a fixed schema; each runs without speculation and with it, constrained by the schema
and unconstrained (the reference: what the mask costs and what it changes). Reported per mode: decode tokens/s
(output tokens after the first / time after the first; the median over prompts and ``--repeats``
interleaved rounds), acceptance length (tokens per speculative step), the share of outputs
that parse and validate, whether greedy outputs with and without speculation are equal (they must
be), and the cost of one grammar mask over the vocabulary (ms, the median over the outputs'
prefixes). Run::

    python -m specserve.benchmarks.structured_output --json docs/bench/structured_output_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from tqdm.auto import tqdm

from specserve.benchmarks.machine import machine_info
from specserve.config import DEFAULT_DRAFT, DEFAULT_MODEL, DEFAULT_QUANTIZATION
from specserve.entrypoints.llm import LLM
from specserve.results import write_json
from specserve.sampling_params import SamplingParams, StructuredOutputsParams
from specserve.data.corpora import spec_bench_eval_questions

SCHEMA = {"type": "object",
          "properties": {"answer": {"type": "string", "maxLength": 300},
                         "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                         "keywords": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5}},
          "required": ["answer", "confidence", "keywords"], "additionalProperties": False}
INSTRUCTION = ("Answer the question as a JSON object with the keys answer (a short string), confidence "
               "(a number from 0 to 1) and keywords (a list of strings).\n\nQuestion: ")


def chat_prompts(tokenizer, num_requests: int) -> list[list[int]]:
    questions = [q for _, q in spec_bench_eval_questions()[:num_requests]]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION + q}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for q in questions]


def valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def mask_ms(llm: LLM, outputs: list[list[int]]) -> float:
    """Median ms to compute one mask from scratch, over every prefix of the outputs."""
    compiler = llm.llm_engine.grammar_compiler
    times = []
    for toks in outputs:
        state = compiler.new_state(StructuredOutputsParams(json=SCHEMA))
        for t in toks:
            t0 = time.perf_counter()
            state.allowed_token_mask()
            times.append(1e3 * (time.perf_counter() - t0))
            if not state.accept(t):
                break
    return statistics.median(times)


def timed(llm: LLM, ids: list[int], params: SamplingParams) -> dict:
    """One request alone; decode tok/s counts the tokens after the first over the time after it."""
    t0 = time.perf_counter()
    before = (llm.llm_engine.spec_stats.num_draft_tokens, llm.llm_engine.spec_stats.num_accepted_tokens,
              llm.llm_engine.spec_stats.num_verify_steps)
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    end = time.perf_counter()
    stats = llm.llm_engine.spec_stats
    c = out.outputs[0]
    decode_s = end - (out.metrics.first_token_time or t0)
    return {"prompt_tokens": len(ids), "output_tokens": len(c.token_ids), "token_ids": c.token_ids, "text": c.text,
            "finish_reason": c.finish_reason, "valid": valid(c.text),
            "decode_tok_s": (len(c.token_ids) - 1) / decode_s if decode_s > 0 else None,
            "draft_tokens": stats.num_draft_tokens - before[0], "accepted_tokens": stats.num_accepted_tokens - before[1],
            "verify_steps": stats.num_verify_steps - before[2]}


def summary(spec: bool, constrained: bool, rows: list[dict]) -> dict:
    steps = sum(r["verify_steps"] for r in rows)
    return {"speculation": spec, "structured": constrained, "requests": rows,
            "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rows if r["decode_tok_s"]),
            "valid_share": sum(r["valid"] for r in rows) / len(rows),
            "acceptance_length": 1 + sum(r["accepted_tokens"] for r in rows) / steps if steps else None,
            "speculative_steps": steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--quantization", "-q", default=DEFAULT_QUANTIZATION)
    # a fixed k: the adaptive controller may turn speculation off on a slow machine, and then
    # nothing about speculating under a grammar is measured
    p.add_argument("--speculative-config", default=json.dumps({"method": "draft_model", "model": DEFAULT_DRAFT,
                                                               "num_speculative_tokens": 3, "adaptive": False}),
                   help="JSON, as the engine's speculative_config (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--repeats", type=int, default=3, help="rounds over every prompt and mode (medians)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    modes = [(False, True), (True, True), (False, False), (True, False)]   # (speculation, schema)
    rows: dict[tuple[bool, bool], list[dict]] = {m: [] for m in modes}
    with LLM(args.model, quantization=args.quantization, max_model_len=2048) as plain, \
            LLM(args.model, quantization=args.quantization, max_model_len=2048,
                speculative_config=json.loads(args.speculative_config)) as spec_llm:
        prompts = chat_prompts(plain.llm_engine.tokenizer, args.num_requests)
        for llm in (plain, spec_llm):   # warm-up
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2))
        bar = tqdm(total=args.repeats * len(prompts) * len(modes), desc="structured output")
        for rep in range(args.repeats):   # interleaved, the order reversed every other round: drift hits all modes
            for ids in prompts:
                for spec, constrained in (modes if rep % 2 == 0 else modes[::-1]):
                    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
                    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
                    rows[(spec, constrained)].append(timed(spec_llm if spec else plain, ids, params))
                    bar.update(1)
        bar.close()
        results = [summary(spec, constrained, rows[(spec, constrained)]) for spec, constrained in modes]
        results[0]["mask_ms"] = mask_ms(plain, [r["token_ids"] for r in rows[modes[0]][:len(prompts)]])
    base, spec, free_base, free_spec = results
    report = {"command": "python -m specserve.benchmarks.structured_output "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "quantization": args.quantization, "speculative_config": args.speculative_config,
              "schema": SCHEMA, "max_tokens": args.max_tokens, "repeats": args.repeats, "batch_size": 1,
              "machine": machine_info(),
              "results": results, "speedup": spec["decode_tok_s"] / base["decode_tok_s"],
              "unconstrained_speedup": free_spec["decode_tok_s"] / free_base["decode_tok_s"],
              "constrained_over_free_tok_s": base["decode_tok_s"] / free_base["decode_tok_s"],   # texts differ
              "outputs_equal": all([r["token_ids"] for r in a["requests"]] == [r["token_ids"] for r in b["requests"]]
                                   for a, b in ((base, spec), (free_base, free_spec)))}
    for res in results:
        print(f"speculation {'on ' if res['speculation'] else 'off'} schema {'on ' if res['structured'] else 'off'}: "
              f"{res['decode_tok_s']:.2f} tok/s, valid {res['valid_share']:.0%}, "
              f"acceptance length {res['acceptance_length']}")
    print(f"mask {base['mask_ms']:.2f} ms; speculation's speedup {report['speedup']:.2f}x with the schema, "
          f"{report['unconstrained_speedup']:.2f}x without; outputs equal: {report['outputs_equal']}")
    if args.json:
        write_json(args.json, report)
    return 0 if report["outputs_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
