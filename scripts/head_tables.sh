#!/usr/bin/env bash
# The draft-head tables of BENCHMARKS.md on one precomputed folder of the served int4 1.5B target:
# data scaling (eagle3, 3 unrolled steps, at 50k / 150k / 500k training tokens, 4 epochs each, so
# the same steps per token) and the seed's eagle / normed experiment at the largest size; then the
# engine's chain acceptance of every head (eval-head, held-out prompts).
#
#   bash scripts/head_tables.sh            # rerun until it prints "all done": every piece resumes
#
# A training run resumes from its checkpoint.pt after an interruption and is skipped once its head
# is written; an evaluation is skipped once its JSON exists. Make the folder first (the command of
# "Piece 7" in BENCHMARKS.md, itself resumable). Environment: DATA (the folder), RUNS (where the
# heads go), TOKENS_PER_STEP (the folder's mean tokens per step of 4 x 512-token segments, printed
# by train-head; 1,500 for answers + sources), EVAL_PROMPTS (HumanEval 0..n-1), EVAL_SPECBENCH.
# Run it alone: two torch processes on two cores slow each other far more than 2x.
set -euo pipefail
TARGET=qwen2.5-coder-1.5b-instruct
DATA=${DATA:-$HOME/.cache/specserve/head-data-int4/$TARGET}
RUNS=${RUNS:-$HOME/.cache/specserve/heads-runs}
TOKENS_PER_STEP=${TOKENS_PER_STEP:-1500}
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
EVAL_SPECBENCH=${EVAL_SPECBENCH:-8}
EPOCHS=4
common=(--target "$TARGET" -q int4 --precompute skip --data-dir "$DATA" --intermediate-size 4480
        --draft-vocab-size 16384 --batch-size 4 --lr 1e-3 --warmup-steps 10 --mixed-precision bfloat16
        --eval-prompts 0)

train() {   # train OUT ARGS...: one head, resumed or skipped
  local out=$1; shift
  if [[ -f $out/model.safetensors ]]; then echo "done: $out"; return; fi
  specserve train-head "${common[@]}" --out "$out" "$@"
}

if ! python -c "import json, sys; sys.exit(not json.load(open(sys.argv[1])).get('complete'))" "$DATA/manifest.json" 2>/dev/null; then
  echo "$DATA is not complete: rerun its precompute first (its prefixes are those of the whole folder)" >&2
  exit 1
fi
heads=()
for n in 50000 150000 500000; do
  heads+=("$RUNS/int4-eagle3-$n")
  train "$RUNS/int4-eagle3-$n" --variant eagle3 --unroll-steps 3 --max-train-tokens $n \
      --num-steps $((n * EPOCHS / TOKENS_PER_STEP))
done
for v in normed eagle; do
  heads+=("$RUNS/int4-$v-500000")
  train "$RUNS/int4-$v-500000" --variant $v --max-train-tokens 500000 \
      --num-steps $((500000 * EPOCHS / TOKENS_PER_STEP))
done
for h in "${heads[@]}"; do
  if [[ -f $h/eval.json ]]; then echo "done: $h/eval.json"; continue; fi
  specserve eval-head --target "$TARGET" -q int4 --head "$h" --num-prompts "$EVAL_PROMPTS" \
      --specbench-prompts "$EVAL_SPECBENCH" --max-tokens 64 --num-speculative-tokens 4 --data-dir "$DATA" \
      --json "$h/eval.json.tmp"
  mv "$h/eval.json.tmp" "$h/eval.json"
done
echo "all done"
