"""``specserve train-head`` and ``specserve eval-head``.

train-head: build the corpus (standard library sources and/or self-distilled answers), precompute
the target's hidden states through the engine (resumable: rerun the same command after an
interruption), train the head, write it as an EAGLE-layout checkpoint, then evaluate it through
the engine's speculative path on held-out HumanEval prompts.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from specserve.config import DEFAULT_MODEL, DTYPES
from specserve.entrypoints.args import engine_args
from specserve.models.draft_head import target_layer_tensors
from specserve.models.draft_head_config import HEAD_VARIANTS
from specserve.models.quantization import QUANTIZATIONS
from specserve.results import write_json
from specserve.training.corpus import CORPORA, HUMANEVAL_EVAL_PROMPTS
from specserve.training.evaluate import HEAD_METHODS
from specserve.training.trainer import TrainConfig


# TrainConfig fields exposed as flags: (name, type, help)
TRAIN_FLAGS = [
    ("num_steps", int, "optimizer steps"), ("batch_size", int, "segments per step (per process)"),
    ("lr", float, "peak learning rate"), ("warmup_steps", int, "linear warmup steps"),
    ("weight_decay", float, "AdamW weight decay"), ("max_grad_norm", float, "gradient clipping norm"),
    ("hidden_loss_weight", float, "weight of the smooth-L1 hidden-state loss (default: 1.0; 0.0 for eagle3)"),
    ("ce_weight", float, "weight of the cross-entropy to the target's distribution (default: 0.1; 1.0 for eagle3)"),
    ("max_train_tokens", int, "train on the first N tokens of the training split (data-scaling runs)"),
    ("unroll_steps", int, "train on the head's own outputs for this many steps"),
    ("feature_noise", float, "EAGLE's training noise on the target's features: U(-a, a) times each "
                             "feature vector's RMS (default 0: none)"),
    ("intermediate_size", int, "the head's MLP width (default: the target's)"),
    ("draft_vocab_size", int, "score only the N most frequent tokens (default: all)"),
    ("val_fraction", float, "share of documents held out"), ("eval_every", int, "steps between evaluations"),
    ("seed", int, "random seed"), ("save_dtype", str, "float16 | bfloat16 | float32"),
    ("mixed_precision", str, "none | bfloat16: the training matmuls in bfloat16 under autocast"),
    ("length_multiple", int, "pad each batch's length to a multiple of this (few distinct shapes keep "
                             "oneDNN's primitive cache, and so memory, from growing)"),
    ("checkpoint_every", int, "steps between resumable checkpoints (out/checkpoint.pt; a rerun of the same "
                              "command goes on from the last one); 0: none")]


def add_train_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_MODEL, help="the target model (default: %(default)s)")
    p.add_argument("--variant", choices=list(HEAD_VARIANTS), default="normed",
                   help="eagle3: fuses three target layers, own lm_head (EAGLE-3); eagle: EAGLE-1's head; "
                        "normed: DeepSeek-V3's MTP module (default: %(default)s)")
    p.add_argument("--aux-layers", default="auto",
                   help="target layers whose input residual stream is precomputed too (comma-separated), "
                        "'auto' (EAGLE-3's (2, L/2, L-3) for --variant eagle3, none otherwise) or 'none'")
    p.add_argument("--precompute", choices=["auto", "only", "skip"], default="auto",
                   help="auto: precompute what the data folder lacks, then train; only: stop after "
                        "precomputing (a resumable piece of a long run); skip: train on the folder as it is")
    p.add_argument("--own-lm-head", action="store_true",
                   help="eagle3: train the head's own lm_head over the draft vocabulary (EAGLE-3's checkpoints "
                        "have one) instead of scoring with the target's frozen rows")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the head's decoder layer from the target's last layer (attention, MLP, norms) "
                        "instead of at random")
    p.add_argument("--corpus", default="stdlib",
                   help=f"comma-separated corpora from {', '.join(CORPORA)} (default: %(default)s)")
    p.add_argument("--max-corpus-tokens", type=int, default=200_000,
                   help="tokens of each source-code corpus (stdlib, packages) at most (default: %(default)s)")
    p.add_argument("--self-distill-docs", type=int, default=None,
                   help="prompts to self-distill per specbench/humaneval corpus (default: all)")
    p.add_argument("--self-distill-tokens", type=int, default=256, help="tokens per self-distilled answer")
    p.add_argument("--self-distill-answers", default=None, metavar="DIR",
                   help="a folder of answers made before (selfdistill_<corpus>_<tokens>tok.jsonl[.gz], e.g. "
                        "specserve/data/self_distill/<target>): those prompts are prefilled, not generated again")
    p.add_argument("--self-distill-batch", type=int, default=32,
                   help="prompts the target answers together (one batch, and what an interruption loses at most)")
    p.add_argument("--data-dir", default=None,
                   help="precomputed hidden states (default: <cache>/head-data/<target>, beside the converted "
                        "weights in $SPECSERVE_CACHE or ~/.cache/specserve, so that a fresh checkout resumes "
                        "them; reused and resumed)")
    p.add_argument("--out", default=None, help="the head's folder (default: heads/<target>-<variant>)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per precomputed segment")
    p.add_argument("--top-k", type=int, default=20, help="next-token probabilities stored per position")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the target's dtype for precomputation")
    p.add_argument("--device", default="cpu",
                   help="where the target precomputes and the head trains: cpu, cuda (under torchrun each "
                        "process takes cuda:LOCAL_RANK) (default: %(default)s)")
    p.add_argument("--quantization", "-q", default="none", choices=list(QUANTIZATIONS),
                   help="the target's linears while precomputing hidden states: train on the target as it "
                        "is served (default: %(default)s)")
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}   # before per-variant defaults
    for name, typ, help_ in TRAIN_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=typ, default=defaults[name],
                       help=help_ if "(default" in help_ else f"{help_} (default: %(default)s)")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="stop after this many training steps with a checkpoint and no head written (a piece "
                        "of a long run: rerun without it to finish)")
    p.add_argument("--eval-prompts", type=int, default=10,
                   help=f"held-out HumanEval prompts (of the first {HUMANEVAL_EVAL_PROMPTS}) for the engine "
                        "evaluation after training; 0 skips it (default: %(default)s)")
    p.add_argument("--eval-max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k for the engine evaluation")


def _slug(name: str) -> str:
    return Path(name).name.replace("/", "-")


def collect_documents(llm, corpora: list[str], max_corpus_tokens: int, self_distill_docs: int | None,
                      self_distill_tokens: int, cache_dir: Path | None = None,
                      capture=None, self_distill_batch: int = 32,
                      answers_dir: str | Path | None = None) -> list[tuple[str, list[int]]]:
    """Every document of the chosen corpora, tokenized, interleaved in a stable order (any prefix
    mixes the corpora). ``max_corpus_tokens`` bounds each source-code corpus. Self-distilled
    documents (the slow part: the target generates them) are appended to a file in ``cache_dir``
    as they are made and reused by a rerun with the same settings; with ``capture`` (``(folder,
    PrecomputeSettings)``) their hidden states are kept while they are generated. ``answers_dir``
    holds answers made before (``selfdistill_<corpus>_<tokens>tok.jsonl`` or ``.jsonl.gz``), reused
    for the prompts they cover.

    Raises:
        FileNotFoundError: ``answers_dir`` is not a folder."""
    from specserve.training.corpus import SOURCE_CORPORA, interleave, self_distill_documents, source_documents

    if answers_dir is not None and not Path(answers_dir).is_dir():
        raise FileNotFoundError(f"--self-distill-answers: no folder {str(answers_dir)!r}")
    docs = []
    for c in corpora:
        if c in SOURCE_CORPORA:
            docs += list(source_documents(llm.get_tokenizer(), c, max_tokens=max_corpus_tokens))
            continue
        name = f"selfdistill_{c}_{self_distill_tokens}tok.jsonl"   # the cache's and the shipped files' name
        cache = Path(cache_dir) / name if cache_dir is not None else None
        answers = None
        if answers_dir is not None:
            found = [f for f in (Path(answers_dir) / (name + ".gz"), Path(answers_dir) / name) if f.is_file()]
            answers = found[0] if found else None
            print(f"self-distillation ({c}): " + (f"reusing the answers in {answers}" if answers else
                                                  f"no {name}[.gz] in {answers_dir}: generating"), flush=True)
        docs += self_distill_documents(llm, c, self_distill_tokens, self_distill_docs, cache=cache, capture=capture,
                                       chunk=self_distill_batch, answers=answers)
    return interleave(docs)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The :class:`TrainConfig` the flags of :func:`add_train_head_args` describe."""
    return TrainConfig(variant=args.variant, own_lm_head=args.own_lm_head, init_from_target=args.init_from_target,
                       **{name: getattr(args, name) for name, _, _ in TRAIN_FLAGS})


def _aux_layers(value: str, variant: str, num_layers: int) -> tuple[int, ...]:
    """``--aux-layers``: "auto", "none" or comma-separated layer indices, checked against the target."""
    from specserve.models.draft_head_config import default_aux_layers

    if value == "auto":
        return default_aux_layers(num_layers) if variant == "eagle3" else ()
    if value == "none":
        return ()
    try:
        layers = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers must be 'auto', 'none' or comma-separated integers, got {value!r}") from None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--aux-layers {bad} out of range: the target has {num_layers} layers")
    return layers


def hidden_states_dir(data_dir: str | None, target: str) -> Path:
    """The folder of a target's precomputed hidden states: ``data_dir`` if given, else
    ``<cache>/head-data/<target>`` (``$SPECSERVE_CACHE`` or ``~/.cache/specserve``), which outlives a
    checkout as the converted weights do. A folder at the old default, ``./head-data/<target>``, is
    used while the cache has none (hours of precomputation are not started over)."""
    from specserve.cache_dir import default_cache_dir
    from specserve.training.hidden_states import MANIFEST

    if data_dir is not None:
        return Path(data_dir)
    cached = Path(default_cache_dir()) / "head-data" / _slug(target)
    legacy = Path("head-data") / _slug(target)
    if (legacy / MANIFEST).exists() and not (cached / MANIFEST).exists():
        print(f"hidden states: using {legacy}, the old default folder (move it to {cached})", flush=True)
        return legacy
    return cached


def run_train_head(args: argparse.Namespace) -> int:
    from specserve.entrypoints.llm import LLM
    from specserve.models.loader import load_model
    from specserve.training.hidden_states import PrecomputeSettings, precompute_hidden_states, read_manifest
    from specserve.training.plot import write_training_plot
    from specserve.training.trainer import train_head

    corpora = [c.strip() for c in args.corpus.split(",") if c.strip()]
    bad = [c for c in corpora if c not in CORPORA]
    if bad or not corpora:
        raise ValueError(f"--corpus must list some of {CORPORA}, got {args.corpus!r}")
    cfg = train_config(args)
    if not 0 <= args.eval_prompts <= HUMANEVAL_EVAL_PROMPTS:   # checked now, not after the training
        raise ValueError(f"--eval-prompts must be in [0, {HUMANEVAL_EVAL_PROMPTS}], got {args.eval_prompts}")
    data_dir = hidden_states_dir(args.data_dir, args.target)
    out = Path(args.out or Path("heads") / f"{_slug(args.target)}-{args.variant}")
    corpus_spec = {"corpora": corpora, "max_corpus_tokens": args.max_corpus_tokens,
                   "self_distill_docs": args.self_distill_docs, "self_distill_tokens": args.self_distill_tokens}
    try:
        manifest = read_manifest(data_dir)
    except FileNotFoundError:
        manifest = None
    # a folder is done for this command when complete for the same corpus (older folders: complete)
    done = manifest is not None and manifest.get("complete", False) and manifest.get("corpus", corpus_spec) == corpus_spec
    if args.precompute == "skip" or done:
        if manifest is None:
            raise ValueError(f"--precompute skip: no precomputed hidden states in {str(data_dir)!r}")
        print(f"hidden states: reusing {data_dir} ({sum(s['num_tokens'] for s in manifest['shards']):,} tokens)",
              flush=True)
    else:
        if args.self_distill_batch < 1:
            raise ValueError(f"--self-distill-batch must be >= 1, got {args.self_distill_batch}")
        batch = args.self_distill_batch   # the default 2 GB page pool per 32 answers, so a whole batch fits
        llm = LLM.from_engine_args(engine_args(args, model=args.target, speculative_config=None, device=args.device,
                                               max_num_seqs=max(64, batch), kv_cache_memory_gb=max(2.0, batch / 16)))
        mc = llm.llm_engine.model_config
        settings = PrecomputeSettings(args.target, mc.hidden_size, mc.vocab_size, args.seq_len, args.top_k,
                                     quantization=args.quantization,
                                     aux_layers=_aux_layers(args.aux_layers, args.variant, mc.num_hidden_layers))
        docs = collect_documents(llm, corpora, args.max_corpus_tokens, args.self_distill_docs, args.self_distill_tokens,
                                 cache_dir=data_dir, capture=(data_dir, settings), self_distill_batch=batch,
                                 answers_dir=args.self_distill_answers)
        precompute_hidden_states(llm.llm_engine, docs, data_dir, settings,
                                 total_tokens=sum(len(ids) for _, ids in docs), corpus=corpus_spec)
        del llm
        if args.precompute == "only":
            return 0
    loaded = load_model(args.target)
    w = loaded.weights
    embed = w["model.embed_tokens.weight"]
    device = args.device
    if device == "cuda" and "LOCAL_RANK" in os.environ:
        device = f"cuda:{os.environ['LOCAL_RANK']}"
    target_layer = (target_layer_tensors(w, loaded.config.num_hidden_layers - 1) if cfg.init_from_target else None)
    summary, head = train_head(data_dir, out, loaded.config, embed, w.get("lm_head.weight", embed), cfg, device=device,
                               stop_at_step=args.stop_at_step, target_layer=target_layer)
    del loaded, w, embed, head
    if _end_process_group() > 0:
        return 0   # rank 0 wrote the head; it alone plots and evaluates it
    if not summary["complete"]:
        print(f"stopped at step {args.stop_at_step} of {cfg.num_steps}: {out / 'checkpoint.pt'} holds the run; "
              f"rerun the command without --stop-at-step to finish it", flush=True)
        return 0
    note = write_training_plot({args.variant: out / "train_log.jsonl"}, out / "train_curves.png")
    if note:
        print(note, flush=True)
    after = summary["val_after"]
    print(f"head written to {out}: validation loss {summary['val_before']['loss']:.4f} -> {after['loss']:.4f}, "
          f"top-1 {after['top1']:.3f} (unigram baseline {summary['unigram_top1']:.3f}), "
          f"chain top-1 {[round(x, 3) for x in after['chain_top1']]}, {summary['seconds']:.0f} s", flush=True)
    if args.eval_prompts > 0:
        result = _eval(args.target, str(out), args.eval_prompts, args.num_speculative_tokens, args.eval_max_tokens,
                       args.dtype, args.quantization)
        summary["engine_eval"] = result
        write_json(out / "train_summary.json", summary)
    return 0


def _end_process_group() -> int:
    """End torchrun's process group, if training made one, once every rank is done (a process that
    exits with it alive can abort in gloo's threads). Returns this process's rank (0 without one)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return 0
    rank = dist.get_rank()
    dist.barrier()
    dist.destroy_process_group()
    return rank


def _eval(target: str, head: str, num_prompts: int, k: int, max_tokens: int, dtype: str,
          quantization: str = "none", num_specbench: int = 0, draft_quantization: str | None = None,
          **tree_and_checks) -> dict:
    from specserve.data.corpora import humaneval_prompts, spec_bench_eval_questions
    from specserve.training.evaluate import evaluate_head_in_engine

    if not 1 <= num_prompts <= HUMANEVAL_EVAL_PROMPTS:
        raise ValueError(f"the number of evaluation prompts (--eval-prompts / --num-prompts) must be in "
                         f"[1, {HUMANEVAL_EVAL_PROMPTS}] (the held-out HumanEval prompts), got {num_prompts}")
    held_out = spec_bench_eval_questions()
    if not 0 <= num_specbench <= len(held_out):
        raise ValueError(f"--specbench-prompts must be in [0, {len(held_out)}] (the held-out questions), got {num_specbench}")
    prompts = humaneval_prompts(num_prompts)
    if num_specbench:
        from specserve.models.loader import load_tokenizer

        tok = load_tokenizer(target)
        step = len(held_out) // num_specbench
        prompts += [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
                    for _, q in held_out[::step][:num_specbench]]
    result = evaluate_head_in_engine(target, head, prompts, k, max_tokens, dtype, quantization=quantization,
                                     draft_quantization=draft_quantization, **tree_and_checks)
    result["num_specbench_prompts"] = num_specbench
    shape = (f"EAGLE-2 tree of depth {k}, top-k {result['eagle_topk']}, {result['num_draft_tokens_per_step']} nodes"
             if result["method"] == "eagle" else f"chain k={k}")
    exact = f", greedy = no speculation {result['exact']}/{len(prompts)}" if "exact" in result else ""
    print(f"engine evaluation ({num_prompts} held-out HumanEval prompts + {num_specbench} Spec-Bench, {shape}, greedy, "
          f"target {quantization}, head {result['draft_quantization']}): acceptance length "
          f"{result['acceptance_length']:.3f} +- {result['acceptance_length_stderr']:.3f} "
          f"({result['num_verify_steps']} steps), P(first j accepted) "
          f"{[round(x, 3) for x in result['chain_accuracy']]}{exact}", flush=True)
    return result


def add_eval_head_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_MODEL, help="the target model (default: %(default)s)")
    p.add_argument("--head", required=True, help="the head's folder or shipped name")
    p.add_argument("--num-prompts", type=int, default=10,
                   help=f"held-out HumanEval prompts (at most {HUMANEVAL_EVAL_PROMPTS}; default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="the chain's k, or the tree's depth")
    p.add_argument("--method", default="mtp", choices=list(HEAD_METHODS),
                   help="mtp: a chain of k drafts; eagle: EAGLE-2's dynamic tree (default: %(default)s)")
    p.add_argument("--eagle-topk", type=int, default=4, help="eagle: children per expanded node (default: %(default)s)")
    p.add_argument("--num-draft-tokens", type=int, default=12,
                   help="eagle: tree nodes verified per step (default: %(default)s)")
    p.add_argument("--check-exact", action="store_true",
                   help="also decode without speculation and count the outputs equal to it token for token")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--quantization", "-q", default="none", choices=list(QUANTIZATIONS),
                   help="the target's linears (evaluate a head on the target it was trained on; default: %(default)s)")
    p.add_argument("--draft-quantization", default=None, choices=list(QUANTIZATIONS),
                   help="the head's linears (default: the target's, as served)")
    p.add_argument("--specbench-prompts", type=int, default=0,
                   help="also this many held-out Spec-Bench questions, through the chat template (default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="precomputed hidden states: also report the validation loss")
    p.add_argument("--val-fraction", type=float, default=TrainConfig.val_fraction)
    p.add_argument("--json", default=None, help="write the results here")


def run_eval_head(args: argparse.Namespace) -> int:
    from specserve.models.draft_head_checkpoint import load_draft_head
    from specserve.models.loader import load_model
    from specserve.models.registry import resolve_head

    result = {"target": args.target, "head": args.head,
              "engine": _eval(args.target, args.head, args.num_prompts, args.num_speculative_tokens,
                              args.max_tokens, args.dtype, args.quantization, args.specbench_prompts,
                              args.draft_quantization, method=args.method, eagle_topk=args.eagle_topk,
                              num_draft_tokens=args.num_draft_tokens, check_exact=args.check_exact)}
    if args.data_dir:
        from specserve.training.dataset import HiddenStateDataset
        from specserve.training.trainer import evaluate

        loaded = load_model(args.target)
        head, _ = load_draft_head(resolve_head(args.head), target_num_layers=loaded.config.num_hidden_layers)
        head.float()
        w = loaded.weights
        head.attach_target(w["model.embed_tokens.weight"].float(),
                           w.get("lm_head.weight", w["model.embed_tokens.weight"]).float())
        cfg = TrainConfig(variant=head.config.variant, eval_chain=args.num_speculative_tokens)
        val = HiddenStateDataset(args.data_dir, "validation", args.val_fraction,
                                 load_aux=head.config.variant == "eagle3")
        result["validation"] = evaluate(head, val, cfg, head.target_to_draft())
        v = result["validation"]
        print(f"validation ({val.num_tokens} tokens): loss {v['loss']:.4f}, top-1 {v['top1']:.3f}, "
              f"chain top-1 {[round(x, 3) for x in v['chain_top1']]}", flush=True)
    if args.json:
        write_json(args.json, result)
    return 0
