"""``specserve`` command line: ``generate``, ``serve``, ``bench``, ``bench-serve``, ``train-head``, ``eval-head``."""
from __future__ import annotations

import argparse
import sys
import time

from specserve.huge_pages import use_huge_pages

use_huge_pages()   # on purpose at import, before the import below brings in torch (it reads the variable once)

from specserve.entrypoints.args import add_engine_args, engine_args  # noqa: E402


def cmd_generate(args: argparse.Namespace) -> int:
    from specserve.engine.engine import LLMEngine
    from specserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    engine = LLMEngine(engine_args(args))
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
            summary += measured_gain(engine.spec_controller)
        else:
            summary += f"; {method} speculation: no speculative step ran"
    print(summary, file=sys.stderr)
    return 0


def measured_gain(controller) -> str:
    """``"; measured gain 1.42x plain decode steps (k = 3)"`` from the adaptive controller's timed
    steps at batch 1 (empty without a controller or before both were timed)."""
    gain = controller.measured_gain(1) if controller is not None else None
    return "" if gain is None else f"; measured gain {gain[0]:.2f}x plain decode steps (k = {gain[1]})"


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
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 opens the port to the network (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000,
                   help="port to listen on, bound before the model loads (default: %(default)s)")
    s.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (401 otherwise); default: $SPECSERVE_API_KEY, "
                        "else no key")
    s.add_argument("--metrics-need-api-key", action="store_true",
                   help="require the API key on /metrics too (default: /metrics and /health are open)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="CORS: comma-separated origins whose browser pages may call the API, '*' for any "
                        "(default: none, CORS closed)")
    s.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM); with --ssl-certfile serves https")
    s.add_argument("--ssl-certfile", default=None, help="TLS certificate chain (PEM)")
    s.add_argument("--max-queue-len", type=int, default=256,
                   help="waiting requests beyond which new ones get 503 (default: %(default)s)")
    s.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                   help="request bodies larger than this get 413 before they are parsed (default: %(default)s)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's line and headers (from connecting, or "
                        "from the last response); slower or silent clients are dropped (default: %(default)s)")
    s.add_argument("--request-timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive after its headers; then 408 "
                        "(default: %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT / SIGTERM: seconds requests in flight may take to finish before they are ended "
                        "(streams get a final error event); new requests are refused at once (default: %(default)s)")
    s.add_argument("--max-connections", type=int, default=1024,
                   help="concurrent connections and requests beyond which new ones get 503 (default: %(default)s)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="(default: %(default)s)")
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
