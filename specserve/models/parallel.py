"""Tensor-parallel layers: what each rank computes of a layer split over the ranks, and where the
group adds or gathers (Megatron-LM, Shoeybi et al. 2019, section 3).

``tp`` is a :class:`~specserve.distributed.group.TensorParallelGroup` (its ``shard`` a
:class:`~specserve.distributed.sharding.TensorParallelShard`), or None for one rank; with None
every layer here is exactly the plain one, with no extra call on the hot path.

* Column-parallel linears (q/k/v, gate/up) need no class: a rank's shard of the weights
  (:func:`~specserve.distributed.sharding.shard_weights`) is a plain linear over its own heads or
  MLP columns, and its output feeds only that rank's attention / SiLU-mul (:func:`local_heads`).
* Row-parallel linears (o_proj, down_proj): a rank holds the input columns matching its heads, so
  its output is a partial sum the group adds up (:func:`row_parallel`).
* The vocabulary: each rank holds a contiguous range of the embedding's and the lm_head's rows
  (:class:`VocabParallelEmbedding`, :class:`ParallelLMHead`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig


def local_heads(cfg: ModelConfig, tp=None) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)`` this rank's attention runs (all of them on one rank)."""
    if tp is None:
        return cfg.num_attention_heads, cfg.num_key_value_heads
    return tp.shard.num_heads, tp.shard.num_kv_heads


class RowParallelLinear(nn.Module):
    """A linear whose input features are split over the ranks: each rank's output ``[T, out]`` is
    a partial sum, and the group's all-reduce makes it the full output on every rank. Takes
    float rows (``forward``) and quantized ones (``forward_quantized``) as the linear does."""

    def __init__(self, linear: nn.Module, tp):
        super().__init__()
        self.linear, self.tp = linear, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))

    def forward_quantized(self, *rows: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear.forward_quantized(*rows))


def row_parallel(linear: nn.Module, tp=None) -> nn.Module:
    """``linear`` as a row-parallel layer (itself on one rank)."""
    return linear if tp is None else RowParallelLinear(linear, tp)


def unwrap(linear: nn.Module) -> nn.Module:
    """The local linear inside a parallel wrapper (the linear itself on one rank)."""
    return linear.linear if isinstance(linear, RowParallelLinear) else linear


class VocabParallelEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows ``[start, end)``: ids outside them look up
    exact zeros, and the group's all-reduce adds the one rank's row that holds each id.

    ``forward(input_ids [T] int64) -> [T, hidden_size]``.
    """

    def __init__(self, weight: torch.Tensor, tp=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(input_ids, self.weight)
        start, end = self.tp.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        local = F.embedding((input_ids - start).clamp(0, end - start - 1), self.weight)
        return self.tp.all_reduce(local * mine.unsqueeze(1).to(local.dtype))


class ParallelLMHead(nn.Module):
    """The lm_head over this rank's vocabulary rows; the logits of all ranks are gathered (equal
    widths, padding dropped) into ``[N, vocab_size]``.

    Args:
        linear: this rank's rows of the head (any linear of :mod:`specserve.models.linear`).
        vocab_size: the full vocabulary.
        tp: the group, or None.
    """

    def __init__(self, linear: nn.Module, vocab_size: int, tp=None):
        super().__init__()
        self.linear, self.vocab_size, self.tp = linear, vocab_size, tp

    @property
    def out_features(self) -> int:
        return self.linear.out_features

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
        logits = self.linear(hidden_states).float()
        if self.tp is None:
            return logits
        width = self.tp.shard.vocab_shard_size
        if logits.shape[1] < width:
            logits = F.pad(logits, (0, width - logits.shape[1]))
        return torch.cat(self.tp.all_gather(logits), dim=1)[:, :self.vocab_size]

    @staticmethod
    def check_rows(rows: torch.Tensor | None, tp=None) -> None:
        """A reduced head (a draft's vocabulary subset) runs on one rank only.

        Raises:
            ValueError: ``rows`` given with a tensor-parallel group.
        """
        if rows is not None and tp is not None:
            raise ValueError("a reduced lm_head (lm_head_rows) is not supported under tensor parallelism")
