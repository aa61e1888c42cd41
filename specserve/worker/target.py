"""The target as the engine holds it: model, paged KV cache, runner, and its life (health, shutdown).

:meth:`Target.build` builds it in this process. Under tensor parallelism
:class:`~specserve.distributed.target.TensorParallelTarget` builds the same handle around the
leader's shard and the worker ranks; :func:`~specserve.distributed.target.build_target` picks
one, so the engine never asks which it has.
"""
from __future__ import annotations

import contextlib

import torch

from specserve.config import EngineArgs, ModelConfig
from specserve.kv_cache.kv_cache import KVCache
from specserve.models.llama import LlamaForCausalLM
from specserve.models.loader import LoadedModel
from specserve.models.quantization import to_device
from specserve.worker.model_runner import ModelRunner

# what a draft head shares with its target (the head's builder dequantizes a quantized lm_head)
SHARED_WEIGHTS = ("model.embed_tokens.weight", "lm_head.weight")


def kv_pool_size(args: EngineArgs, cfg: ModelConfig, num_kv_heads: int, kv_dtype: torch.dtype) -> tuple[int, int]:
    """``(num_blocks, max_model_len)`` of the paged KV pool: ``args.num_blocks``, or the memory
    budget ``kv_cache_memory_gb`` but never more pages than ``max_num_seqs`` full-length sequences
    use; ``max_model_len`` is cut to what the pool holds (a lone request must always fit, or
    preemption could never make room for it)."""
    max_len = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    if args.num_blocks is None:
        by_memory = KVCache.num_blocks_for_memory(int(args.kv_cache_memory_gb * 2**30), cfg.num_hidden_layers,
                                                  args.block_size, num_kv_heads, cfg.head_dim, kv_dtype)
        by_use = args.max_num_seqs * -(-max_len // args.block_size)
        num_blocks = max(1, min(by_memory, by_use))
    else:
        num_blocks = args.num_blocks
    return num_blocks, min(max_len, num_blocks * args.block_size)


class Target:
    """The built target.

    Attributes:
        model: this process's :class:`LlamaForCausalLM` (under tensor parallelism: rank 0's shard).
        kv_cache: its paged KV tensors.
        runner: the :class:`ModelRunner` the target worker runs it through.
        num_blocks, max_model_len: the KV pool's size and the longest sequence it serves.
        shared_weights: the ``[V, H]`` embedding (and lm_head, when not tied) on the engine's
            device, for a draft head that shares them; dropped once the proposer is built.
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, runner: ModelRunner, num_blocks: int,
                 max_model_len: int, shared_weights: dict):
        self.model, self.kv_cache, self.runner = model, kv_cache, runner
        self.num_blocks, self.max_model_len = num_blocks, max_model_len
        self.shared_weights = shared_weights

    @classmethod
    def build(cls, args: EngineArgs, loaded: LoadedModel, dtype: torch.dtype, kv_dtype: torch.dtype) -> Target:
        """The target in this process, on ``args.device``."""
        cfg = loaded.config
        weights = to_device(loaded.weights, args.device, dtype)
        num_blocks, max_model_len = kv_pool_size(args, cfg, cfg.num_key_value_heads, kv_dtype)
        model = LlamaForCausalLM(cfg, weights, args.quantization).eval()
        kv_cache = KVCache(cfg.num_hidden_layers, num_blocks, args.block_size, cfg.num_key_value_heads,
                           cfg.head_dim, kv_dtype, args.device)
        shared = {k: weights[k] for k in SHARED_WEIGHTS if k in weights}
        return cls(model, kv_cache, ModelRunner(model, kv_cache), num_blocks, max_model_len, shared)

    def draft_context(self):
        """The context a draft's own compute runs in (more cores under tensor parallelism)."""
        return contextlib.nullcontext()

    def check(self) -> None:
        """Raise what stops the target from serving a step (a lost tensor-parallel rank)."""

    def health(self) -> str | None:
        """What stops the target from serving, or None. Any thread."""
        return None

    def keepalive(self, idle_s: float = 600.0) -> None:
        """Called while the engine is idle (tensor parallelism: keeps the workers' wait alive)."""

    def shutdown(self, polite: bool = True) -> None:
        """Release what the target holds beyond this process's memory (worker ranks). Idempotent."""

    def communication_stats(self) -> dict | None:
        """Counters of the ranks' communication so far (None: one rank, none): ``collectives``
        ``{op: [calls, bytes, seconds]}``, ``bytes_sent`` / ``bytes_used`` of the step messages."""
        return None
