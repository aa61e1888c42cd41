"""Run by torchrun in test_tensor_parallel: every rank builds the same LLM; rank 0 writes the output."""
import json
import sys

from specserve import LLM, SamplingParams

if __name__ == "__main__":
    model_dir, out_path = sys.argv[1], sys.argv[2]
    llm = LLM(model_dir, tensor_parallel_size=2)       # ranks other than 0 serve rank 0 from in here, then exit
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 41]}],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    llm.shutdown()
