"""Which part of the target each tensor-parallel rank holds (Megatron-LM's split).

Shoeybi et al. 2019, "Megatron-LM", section 3: in each block the first linear of a pair is split by
output columns (fused q/k/v by attention heads, fused gate/up by the intermediate dimension) and the
second by input rows (o_proj, down_proj), so a block needs one all-reduce after attention and one
after the MLP; the embedding and the lm_head are split by vocabulary rows.

Attention heads are split by KV group: a rank holds whole KV heads and the query heads that read
them; when there are fewer KV heads than ranks each KV head is replicated over ``tp / num_kv_heads``
ranks, which share its query heads (as vLLM does). Shares may be uneven (SmolLM2's 3 KV heads over 2
ranks: 2 and 1). Under int8 / int4 every row-parallel cut falls on a 256-value superblock boundary
(the MLP is then split by superblocks, o_proj must happen to align: Qwen2.5-1.5B at 2 ranks does),
so each rank's quantized blocks and its activations' per-superblock scales are exactly those of the
unsharded layer (:meth:`~specserve.models.quantization.QuantizedTensor.select_columns`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.config import ModelConfig
from specserve.models.quantization import SUPERBLOCK, QuantizedTensor


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank ``rank``'s share of the target, as ``[start, end)`` index ranges.

    Attributes:
        q_heads / kv_heads: attention heads (global indices).
        intermediate: MLP columns of gate/up, rows of down_proj's input.
        vocab: embedding and lm_head rows; every rank's logits are padded to ``vocab_shard_size``
            columns before they are gathered.
    """

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_shard_size: int

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _balanced(n: int, parts: int, rank: int) -> tuple[int, int]:
    return rank * n // parts, (rank + 1) * n // parts


def plan_shard(config: ModelConfig, rank: int, world_size: int, quantized: bool = False) -> TensorParallelShard:
    """Rank ``rank``'s share of a ``config``-shaped target over ``world_size`` ranks.

    Args:
        quantized: the linears run in int8 / int4, so row-parallel cuts must fall on superblocks.
    Raises:
        ValueError: a split this model cannot take, naming the counts (more ranks than query
            heads, KV heads that neither divide nor are divided by the ranks, an o_proj or down_proj
            cut inside a superblock under quantization).
    """
    tp, h, kv, d = world_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of size {tp}")
    group = h // kv
    if kv >= tp:
        kv_heads = _balanced(kv, tp, rank)
        q_heads = (kv_heads[0] * group, kv_heads[1] * group)
    elif tp % kv == 0 and group % (tp // kv) == 0:
        replicas = tp // kv
        head, part = divmod(rank, replicas)
        per = group // replicas
        kv_heads = (head, head + 1)
        q_heads = (head * group + part * per, head * group + (part + 1) * per)
    else:
        raise ValueError(f"tensor_parallel_size {tp} cannot split {h} attention heads with {kv} KV heads: "
                         f"the KV heads must divide among the ranks or the ranks among them, "
                         f"with each rank keeping whole query heads")
    inter = config.intermediate_size
    if quantized:        # down_proj's input rows are cut on superblocks
        units = -(-inter // SUPERBLOCK)
        if units < tp:
            raise ValueError(f"tensor_parallel_size {tp} cannot split the MLP's {inter} columns ({units} "
                             f"superblocks of {SUPERBLOCK}) for quantized weights; use quantization 'none' "
                             f"or at most {units} ranks")
        intermediate = tuple(min(inter, u * SUPERBLOCK) for u in _balanced(units, tp, rank))
    else:
        intermediate = _balanced(inter, tp, rank)
    if quantized:
        k0, k1 = q_heads[0] * d, q_heads[1] * d
        if k0 % SUPERBLOCK or (k1 % SUPERBLOCK and k1 != h * d):
            raise ValueError(f"tensor_parallel_size {tp} puts o_proj's input columns {k0}:{k1} of rank {rank} "
                             f"across {SUPERBLOCK}-value superblocks, which quantized weights cannot split; "
                             f"use quantization 'none' or another tensor_parallel_size")
    shard_rows = -(-config.vocab_size // tp)
    if (tp - 1) * shard_rows >= config.vocab_size:
        raise ValueError(f"tensor_parallel_size {tp} leaves a rank without vocabulary rows "
                         f"(vocab_size {config.vocab_size})")
    vocab = (min(config.vocab_size, rank * shard_rows), min(config.vocab_size, (rank + 1) * shard_rows))
    return TensorParallelShard(rank, tp, q_heads, kv_heads, intermediate, vocab, shard_rows)


def _rows(t, start: int, end: int):
    """Output rows ``start:end`` of a float or quantized ``[N, K]`` weight (or of a bias ``[N]``)."""
    if isinstance(t, QuantizedTensor):
        return t.select_rows(torch.arange(start, end))
    return t[start:end].clone()


def _columns(t, start: int, end: int):
    if isinstance(t, QuantizedTensor):
        return t.select_columns(start, end)
    return t[:, start:end].clone()


def shard_weights(config: ModelConfig, weights: dict, shard: TensorParallelShard) -> dict:
    """The Hugging Face-named weights of ``shard``'s rank, cut from the full ``weights``.

    Norms stay whole (every rank holds the full residual stream); ``lm_head.weight`` is always
    present in the result (a tied model's comes from the embedding rows).
    """
    d = config.head_dim
    (q0, q1), (k0, k1), (i0, i1), (v0, v1) = shard.q_heads, shard.kv_heads, shard.intermediate, shard.vocab
    out = {"model.embed_tokens.weight": _rows(weights["model.embed_tokens.weight"], v0, v1),
           "model.norm.weight": weights["model.norm.weight"]}
    out["lm_head.weight"] = _rows(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]), v0, v1)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        for name, (r0, r1) in (("q_proj", (q0 * d, q1 * d)), ("k_proj", (k0 * d, k1 * d)), ("v_proj", (k0 * d, k1 * d))):
            out[a + name + ".weight"] = _rows(weights[a + name + ".weight"], r0, r1)
            if a + name + ".bias" in weights:
                out[a + name + ".bias"] = _rows(weights[a + name + ".bias"], r0, r1)
        out[a + "o_proj.weight"] = _columns(weights[a + "o_proj.weight"], q0 * d, q1 * d)
        out[m + "gate_proj.weight"] = _rows(weights[m + "gate_proj.weight"], i0, i1)
        out[m + "up_proj.weight"] = _rows(weights[m + "up_proj.weight"], i0, i1)
        out[m + "down_proj.weight"] = _columns(weights[m + "down_proj.weight"], i0, i1)
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = weights[p + norm]
    return out
