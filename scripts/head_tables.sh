#!/usr/bin/env bash
# The draft-head tables of BENCHMARKS.md on one precomputed folder of the served int4 1.5B target:
# data scaling (eagle3, 3 unrolled steps, at 50k / 150k / 500k training tokens, 4 epochs each, so
# the same steps per token) and the seed's eagle / normed experiment at the largest size; each head's
# engine chain and tree acceptance (eval-head, held-out prompts) follows its training.
#
#   bash scripts/head_tables.sh            # rerun until it prints "all done": every piece resumes
#
# A training run resumes from its checkpoint.pt after an interruption and is skipped once its head
# is written; an evaluation is skipped once its JSON exists. Make the folder first (the command of
# "Piece 7" in docs/history/benchmarks-before-packing.md, itself resumable). Environment: DATA (the
# folder), RUNS (where the heads go), TOKENS_PER_STEP (the folder's mean tokens per step of 4 x
# 512-token segments, printed by train-head; 1,500 for answers + sources), EVAL_PROMPTS (HumanEval
# 0..n-1), EVAL_SPECBENCH, MIXED (the training's --mixed-precision; default bfloat16 where the CPU
# has it, else none), PIECES (default "scaling norm": the data-scaling rows, then the normed / eagle
# rows at 500k; name one of them to run only it, e.g. on a machine that has the folder but not the
# other piece's heads), VARIANTS (default "normed eagle": the norm / no-norm heads the "norm" piece
# trains, in that order).
# Run it alone: two torch processes on two cores slow each other far more than 2x.
#
# Every result is also copied into the checkout as soon as it exists (RESULTS, default
# docs/heads/tables: each head's train_summary.json, eval.json for the chain and eval-tree.json for
# EAGLE-2's dynamic tree), because the cache folder has not outlived a machine change while a
# checkout's uncommitted files have: commit them.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=qwen2.5-coder-1.5b-instruct
DATA=${DATA:-$HOME/.cache/specserve/head-data-int4/$TARGET}
RUNS=${RUNS:-$HOME/.cache/specserve/heads-runs}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-1500}
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
EVAL_SPECBENCH=${EVAL_SPECBENCH:-8}
RESULTS=${RESULTS:-docs/heads/tables}
# bfloat16 autocast only where the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): an AVX2
# CPU emulates it, slower than float32
if grep -q -E 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then MIXED=${MIXED:-bfloat16}; else MIXED=${MIXED:-none}; fi
PIECES=${PIECES:-scaling norm}
VARIANTS=${VARIANTS:-normed eagle}
EPOCHS=4
common=(--target "$TARGET" -q int4 --precompute skip --data-dir "$DATA" --intermediate-size 4480
        --draft-vocab-size 16384 --batch-size 4 --lr 1e-3 --warmup-steps 10 --mixed-precision "$MIXED"
        --eval-prompts 0)

train() {   # train OUT ARGS...: one head, resumed or skipped
  local out=$1; shift
  if [[ ! -f $out/model.safetensors ]]; then specserve train-head "${common[@]}" --out "$out" "$@"; fi
  echo "done: $out"
  mkdir -p "$RESULTS"
  cp "$out/train_summary.json" "$RESULTS/$(basename "$out")-train_summary.json"
}

evaluate() {   # evaluate HEAD NAME ARGS...: one engine evaluation, skipped once its JSON exists
  local h=$1 name=$2; shift 2
  if [[ ! -f $h/$name.json ]]; then
    specserve eval-head --target "$TARGET" -q int4 --head "$h" --num-prompts "$EVAL_PROMPTS" \
        --specbench-prompts "$EVAL_SPECBENCH" --max-tokens 64 --data-dir "$DATA" --json "$h/$name.json.tmp" "$@"
    mv "$h/$name.json.tmp" "$h/$name.json"
  fi
  echo "done: $h/$name.json"
  cp "$h/$name.json" "$RESULTS/$(basename "$h")-$name.json"
}

if ! python -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$DATA/manifest.json" 2>/dev/null; then
  echo "$DATA is not complete: rerun its precompute first (its prefixes are those of the whole folder)" >&2
  exit 1
fi
evaluate_both() {   # the chain k = 4, then the bench's tree (depth 4, top-k 4, 12 nodes)
  evaluate "$1" eval --num-speculative-tokens 4
  evaluate "$1" eval-tree --method eagle --num-speculative-tokens 4 --eagle-topk 4 --num-draft-tokens 12
}
# each head is evaluated as soon as it is trained, so that an interrupted run leaves whole rows
if [[ " $PIECES " == *" scaling "* ]]; then for n in 50000 150000 500000; do
  train "$RUNS/int4-eagle3-$n" --variant eagle3 --unroll-steps 3 --max-train-tokens $n \
      --num-steps $((n * EPOCHS / TOKENS_PER_STEP))
  evaluate_both "$RUNS/int4-eagle3-$n"
done; fi
if [[ " $PIECES " == *" norm "* ]]; then for v in $VARIANTS; do
  train "$RUNS/int4-$v-500000" --variant $v --max-train-tokens 500000 \
      --num-steps $((500000 * EPOCHS / TOKENS_PER_STEP))
  evaluate_both "$RUNS/int4-$v-500000"
done; fi
echo "all done: commit $RESULTS"
