"""``specserve`` command line: ``generate``, ``serve``, ``bench``, ``bench-serve``, ``train-head``, ``eval-head``."""
from __future__ import annotations

import argparse
import sys
import time

from specserve.engine.engine import DEFAULT_MODEL
from specserve.models.quantization import QUANTIZATIONS

DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"  # drafts for DEFAULT_MODEL (same tokenizer)
DEFAULT_NUM_SPECULATIVE_TOKENS = 2  # best k measured by `specserve bench` (BENCHMARKS.md)
DEFAULT_QUANTIZATION = "int4"  # the fastest mode whose quality holds (BENCHMARKS.md, "Quantized target")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="built-in name, Hugging Face folder, .gguf file or hub id (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", "-q", default=DEFAULT_QUANTIZATION, choices=list(QUANTIZATIONS),
                   help="the target's linears: int4 / int8 (batch-invariant integer kernels: GGUF Q4_K / Q6_K "
                        "blocks used as they are, other weights quantized on load) or none (float32); "
                        "default: %(default)s")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--speculative-model", default=None,
                   help=f"draft model (default: {DEFAULT_DRAFT} when --model is the default target)")
    p.add_argument("--speculative-method", choices=["draft_model", "mtp", "eagle", "ngram"], default=None,
                   help="draft_model (a small LLM), mtp (a trained EAGLE / MTP head drafting a chain), eagle "
                        "(the head drafting a tree) or ngram (prompt lookup, no model); default: mtp when "
                        "--speculative-model is a head folder or a shipped head's name, else draft_model")
    p.add_argument("--speculative-token-tree", default=None,
                   help="eagle: a static tree, 'eagle1' (EAGLE-1's 25-node default) or paths of child ranks "
                        "like '[(0,), (1,), (0, 0)]'; default: a dynamic (EAGLE-2) tree")
    p.add_argument("--eagle-topk", type=int, default=4,
                   help="eagle dynamic trees: children per expanded node (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=int, default=12,
                   help="eagle dynamic trees: nodes verified per step (default: %(default)s)")
    p.add_argument("--prompt-lookup-max", type=int, default=4,
                   help="ngram: longest n-gram matched (default: %(default)s)")
    p.add_argument("--prompt-lookup-min", type=int, default=1,
                   help="ngram: shortest n-gram matched (default: %(default)s)")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help="draft tokens per step, k (default: %(default)s)")
    p.add_argument("--draft-quantization", "--speculative-quantization", choices=list(QUANTIZATIONS), default=None,
                   help="the draft model's linears (default: the same as --quantization); the output stays "
                        "exact whatever the draft's numerics, since the target verifies every token")
    p.add_argument("--no-speculation", action="store_true", help="decode without a draft")
    p.add_argument("--no-adaptive-speculation", action="store_true",
                   help="always draft k tokens; by default k is chosen per step (0 = off) from measured "
                        "acceptance and step cost")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per batch (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per step, prefill chunks included (default: %(default)s)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0,
                   help="memory for the paged KV cache (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV cache pages (overrides --kv-cache-memory-gb)")


def is_head(name: str) -> bool:
    """Whether ``name`` is a draft head (a shipped head, or a folder whose config.json is one)."""
    import json
    from pathlib import Path

    from specserve.models.registry import builtin_heads

    if name in builtin_heads():
        return True
    cfg = Path(name).expanduser() / "config.json"
    if not cfg.is_file():
        return False
    try:
        d = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return "specserve_head" in d or any(str(a).endswith(("Eagle", "MTP")) for a in d.get("architectures", []))


def speculative_config(args: argparse.Namespace) -> dict | None:
    """The draft-model config the flags ask for, or None without speculation."""
    if args.no_speculation:
        return None
    common = {"num_speculative_tokens": args.num_speculative_tokens, "adaptive": not args.no_adaptive_speculation}
    if args.speculative_method == "ngram":
        return {"method": "ngram", "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min, **common}
    draft = args.speculative_model
    if draft is None and args.model == DEFAULT_MODEL:
        draft = DEFAULT_DRAFT
    if draft is None:
        return None
    method = args.speculative_method or ("mtp" if is_head(draft) else "draft_model")
    if method == "eagle":
        common.update(speculative_token_tree=args.speculative_token_tree, eagle_topk=args.eagle_topk,
                      num_draft_tokens=args.num_draft_tokens)
    return {"method": method, "model": draft, "draft_quantization": args.draft_quantization, **common}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
                block_size=args.block_size, speculative_config=speculative_config(args),
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                kv_cache_memory_gb=args.kv_cache_memory_gb, num_blocks=args.num_blocks)


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine.engine import EngineArgs, LLMEngine
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    engine = LLMEngine(EngineArgs(**engine_kwargs(args)))
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      tokenize=False, add_generation_prompt=True)
    engine.add_request("cli", prompt, params)
    printed, num_tokens = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if not out.finished:  # hold back a partial UTF-8 character
                text = text.rstrip("\ufffd")
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = max(printed, len(text))
            num_tokens = len(out.outputs[0].token_ids)
    sys.stdout.write("\n")
    seconds = time.perf_counter() - t0
    summary = f"{num_tokens} tokens in {seconds:.1f} s ({num_tokens / seconds:.2f} tokens/s, prefill included)"
    st = engine.spec_stats
    if engine.proposer is not None:
        method = getattr(engine.spec_config.method, "value", engine.spec_config.method)
        if st.num_verify_steps:
            # decode steps after the first token: verify steps emit accepted + 1 tokens, plain steps 1
            plain = max(0, num_tokens - 1 - st.num_accepted_tokens - st.num_verify_steps)
            summary += (f"; {method} speculation in {st.num_verify_steps} of {st.num_verify_steps + plain} decode steps"
                        f"{' (adaptive: off where it did not pay)' if engine.spec_controller else ''}: "
                        f"{st.num_accepted_tokens}/{st.num_draft_tokens} drafts accepted, "
                        f"mean acceptance length {st.mean_acceptance_length:.2f}")
        else:
            summary += f"; {method} speculation: no speculative step ran"
    print(summary, file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specserve.benchmarks.bench import run_bench
    return run_bench(args)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from specserve.benchmarks.serve_bench import run_serve_bench
    return run_serve_bench(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from specserve.entrypoints.openai.api_server import run_server
    return run_server(args)


def cmd_train_head(args: argparse.Namespace) -> int:
    from specserve.training.commands import run_train_head
    return run_train_head(args)


def cmd_eval_head(args: argparse.Namespace) -> int:
    from specserve.training.commands import run_eval_head
    return run_eval_head(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion and stream it to stdout")
    add_engine_args(g)
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--max-queue-len", type=int, default=256,
                   help="waiting requests beyond which new ones get 503 (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="measure decode tokens/s, TTFT and verify cost V(k)")
    add_engine_args(b)
    from specserve.benchmarks.bench import add_bench_args
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    bs = sub.add_parser("bench-serve", help="load the OpenAI server at several concurrencies, with and "
                                            "without speculation: tokens/s, TTFT, TPOT, acceptance")
    add_engine_args(bs)
    from specserve.benchmarks.serve_bench import add_serve_bench_args
    add_serve_bench_args(bs)
    bs.set_defaults(func=cmd_bench_serve)

    from specserve.training.commands import add_eval_head_args, add_train_head_args
    th = sub.add_parser("train-head", help="train an EAGLE / MTP draft head on the target's precomputed hidden "
                                           "states (torchrun for several processes)")
    add_train_head_args(th)
    th.set_defaults(func=cmd_train_head)
    eh = sub.add_parser("eval-head", help="a head's acceptance through the engine's speculative path, and its "
                                          "validation loss")
    add_eval_head_args(eh)
    eh.set_defaults(func=cmd_eval_head)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input: one clear line, not a traceback
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
