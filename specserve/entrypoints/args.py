"""The engine flags every command shares, and the one builder of :class:`EngineArgs` from them.

``generate``, ``serve``, ``bench``, ``bench-serve`` and ``train-head`` all build their engines
here, so a flag a command accepts always reaches its engine.
"""
from __future__ import annotations

import argparse
import dataclasses

from specserve.config import (DEFAULT_DRAFT, DEFAULT_MODEL, DEFAULT_NUM_SPECULATIVE_TOKENS, DEFAULT_QUANTIZATION,
                              DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineArgs)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="built-in name, Hugging Face folder, .gguf file or hub id (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights and activations (default: %(default)s)")
    p.add_argument("--quantization", "-q", default=DEFAULT_QUANTIZATION, choices=list(QUANTIZATIONS),
                   help="the target's linears: int4 / int8 (batch-invariant integer kernels: GGUF Q4_K / Q6_K "
                        "blocks used as they are, other weights quantized on load) or none (float32); "
                        "default: %(default)s")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's context, cut to what the KV "
                        "cache holds)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache page (default: %(default)s)")
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
                   help="the draft model's or head's linears (default: the same as --quantization); the output stays "
                        "exact whatever the draft's numerics, since the target verifies every token")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft_model: score only this many of a corpus's most frequent tokens (FR-Spec), so the "
                        "draft's lm_head reads that many rows; the output stays exact (default: the whole vocabulary)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's spelling: the whole speculative config as JSON, e.g. "
                        "'{\"method\": \"mtp\", \"num_speculative_tokens\": 3}' (keys of SpeculativeConfig); "
                        "replaces the --speculative-* / --num-speculative-tokens flags")
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
    p.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the paged KV cache's entries (target and draft model): auto is float16 for a float32 model "
                        "on the CPU (half the bytes a step reads), else the model's dtype (default: %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV pages of a prompt prefix seen before, the target's and the draft's "
                        "(default: on; --no-enable-prefix-caching turns it off)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the target over this many ranks (worker processes started by the engine, or "
                        "torchrun's ranks; gloo on CPU, NCCL on CUDA); the draft runs whole on rank 0 "
                        "(default: %(default)s)")
    p.add_argument("--distributed-timeout-s", type=float, default=60.0,
                   help="tensor parallelism: seconds a step waits for a rank before the engine fails "
                        "(default: %(default)s)")


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
    """The draft-model config the flags ask for, or None without speculation.

    Raises:
        ValueError: ``--speculative-config`` that is not a JSON object, or given with ``--no-speculation``.
    """
    if getattr(args, "speculative_config", None) is not None:
        import json

        if args.no_speculation:
            raise ValueError("--speculative-config and --no-speculation contradict each other")
        try:
            cfg = json.loads(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not valid JSON ({e}): {args.speculative_config!r}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {args.speculative_config!r}")
        return cfg
    if args.no_speculation:
        return None
    common = {"num_speculative_tokens": args.num_speculative_tokens, "adaptive": not args.no_adaptive_speculation}
    if args.speculative_method == "ngram":
        return {"method": "ngram", "prompt_lookup_max": args.prompt_lookup_max,
                "prompt_lookup_min": args.prompt_lookup_min, **common}
    draft = args.speculative_model
    heads = ("mtp", "eagle")
    if draft is None and args.model == DEFAULT_MODEL and args.speculative_method not in heads:
        draft = DEFAULT_DRAFT
    if draft is None and args.speculative_method not in heads:
        return None
    # a head method without a model takes the head shipped for the target (EngineArgs finds it)
    method = args.speculative_method or ("mtp" if is_head(draft) else "draft_model")
    if method == "eagle":
        common.update(speculative_token_tree=args.speculative_token_tree, eagle_topk=args.eagle_topk,
                      num_draft_tokens=args.num_draft_tokens)
    if method == "draft_model" and getattr(args, "draft_vocab_size", None) is not None:
        common["draft_vocab_size"] = args.draft_vocab_size
    return {"method": method, "model": draft, "draft_quantization": args.draft_quantization, **common}


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    """The :class:`EngineArgs` the flags of :func:`add_engine_args` describe; ``overrides`` replace
    fields (e.g. ``speculative_config``). A flag a command does not define keeps the field's default.

    Raises:
        ValueError: a bad value, named (see :class:`EngineArgs`).
    """
    k = getattr(args, "num_speculative_tokens", 1)
    if k < 1:   # even when no draft is configured: a flag that would be ignored is an error
        raise ValueError(f"--num-speculative-tokens must be >= 1, got {k}")
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"speculative_config", "seed", "device"}
    kwargs = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    if hasattr(args, "no_speculation"):
        kwargs["speculative_config"] = speculative_config(args)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)
