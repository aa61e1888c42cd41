#!/usr/bin/env bash
# Tensor parallelism on CUDA (NCCL), the check this repo owes where no multi-GPU machine was lent.
# Needs >= 2 GPUs (NCCL cannot put two ranks on one device) and the model files (HF hub cache or
# the built-in names' sources). Usage, from the repository root:
#     bash scripts/tensor_parallel_gpu.sh [model] [tp]
# 1. installs the package into .venv-gpu (the CUDA torch wheel from PyPI);
# 2. checks TP = tp logits against TP = 1 and greedy with speculation against greedy without, at TP = tp;
# 3. times decode steps at TP = 1 and TP = tp (specserve.benchmarks.tensor_parallel) into docs/bench/.
set -euo pipefail
MODEL=${1:-qwen2.5-coder-1.5b-instruct}
TP=${2:-2}
python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
pip install -q torch==2.13.0 && pip install -q -e ".[test,models,bench]"
nvidia-smi --query-gpu=name,memory.total --format=csv
python - "$MODEL" "$TP" <<'PY'
import sys, torch
from specserve import LLM, SamplingParams
model, tp = sys.argv[1], int(sys.argv[2])
assert torch.cuda.device_count() >= tp, f"{torch.cuda.device_count()} GPUs for tensor_parallel_size {tp}"
kw = dict(device="cuda", dtype="bfloat16", max_model_len=2048)
prompts = ["def quicksort(xs):", "The three laws of thermodynamics are", "import numpy as np\n# mean of a list\n"]
def logits(llm):
    r, tok = llm.llm_engine.runner, llm.get_tokenizer()
    seqs = [tok.encode(p) for p in prompts]
    x = torch.tensor([t for s in seqs for t in s], device="cuda")
    pos = [p for s in seqs for p in range(len(s))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(seqs))]
    return r.forward_with_logits(x, pos, tables, [0] * len(seqs), [len(s) for s in seqs], list(range(len(x))))[1]
with LLM(model, **kw) as llm:
    ref = logits(llm)
with LLM(model, tensor_parallel_size=tp, **kw) as llm:
    got = logits(llm)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
err = (got.float() - ref.float()).abs().max().item()
print(f"max |logits TP={tp} - TP=1| = {err:.4g} (logits up to {ref.float().abs().max().item():.3g}); "
      f"top-1 agreement {(got.argmax(1) == ref.argmax(1)).float().mean().item():.4f}")
for spec in ({"method": "ngram"}, {"method": "mtp"}, {"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct"}):
    spec.update(num_speculative_tokens=3, adaptive=False)
    with LLM(model, tensor_parallel_size=tp, speculative_config=spec, **kw) as llm:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        print(spec["method"], "greedy equal to no speculation:", out == base,
              "acceptance length", round(llm.llm_engine.spec_stats.mean_acceptance_length, 2))
PY
python -m specserve.benchmarks.tensor_parallel --model "$MODEL" -q none --dtype bfloat16 --device cuda \
    --tp-sizes 1,"$TP" --batch-sizes 1,8,32 --max-tokens 64 --json docs/bench/tensor_parallel_gpu.json
