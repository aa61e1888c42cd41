"""Model runner: turns a scheduled batch into model inputs, runs the model, returns logits.

The inputs of all scheduled requests are packed into flat host buffers (``input_ids [T]``,
``positions [T]``) plus one :class:`AttentionMetadata`, then moved to the model's device once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.kv_cache.kv_cache import KVCache, move_kv_slots
from specserve.models.llama import LlamaForCausalLM


@dataclass
class ModelInput:
    """One sequence's slice of a batch: ``token_ids`` written to the cache slots of sequence
    indices ``context_len ...``, at positions ``context_len ...`` unless ``positions`` says
    otherwise (tree verification: a node's position is the root's plus its depth)."""

    token_ids: list[int]
    context_len: int
    block_table: list[int]
    positions: list[int] | None = None


@dataclass
class ForwardOutput:
    hidden_states: torch.Tensor      # [T, hidden_size]
    last_rows: list[int]             # index in [T] of each sequence's last new token


class ModelRunner:
    """Runs one model (target or draft) over flattened batches against its own paged KV tensors.

    Args:
        model: the decoder.
        kv_cache: this model's KV tensors (pages addressed by the shared block tables).
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache):
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.embed_tokens.device

    def forward(self, inputs: list[ModelInput],
                tree_masks: list[torch.Tensor | None] | None = None) -> ForwardOutput:
        """Write the new tokens' KV and return final hidden states of every new token."""
        input_ids, positions, last_rows = [], [], []
        for x in inputs:
            input_ids.extend(x.token_ids)
            positions.extend(x.positions if x.positions is not None
                             else range(x.context_len, x.context_len + len(x.token_ids)))
            last_rows.append(len(input_ids) - 1)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        hidden = self.forward_tensors(ids, positions, [x.block_table for x in inputs],
                                      [x.context_len for x in inputs], [len(x.token_ids) for x in inputs], tree_masks)
        return ForwardOutput(hidden, last_rows)

    def forward_tensors(self, input_ids: torch.Tensor, positions: list[int] | torch.Tensor, block_tables: list[list[int]],
                        context_lens: list[int], query_lens: list[int],
                        tree_masks: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Like :meth:`forward` with the new tokens already a device tensor ``input_ids [T]``
        int64 (drafts that never went to the host); the host supplies what it knows without
        reading them: positions, block tables and lengths. Returns hidden states ``[T, H]``."""
        md = AttentionMetadata.build(block_tables, context_lens, query_lens, self.kv_cache.block_size,
                                     tree_masks, self.device)
        pos = torch.as_tensor(positions, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model(input_ids.to(self.device), pos, md, (self.kv_cache.key_cache, self.kv_cache.value_cache))

    def forward_with_logits(self, input_ids: torch.Tensor, positions, block_tables: list[list[int]],
                            context_lens: list[int], query_lens: list[int], logits_rows: list[int],
                            tree_masks: list[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_tensors`, then the logits ``[len(logits_rows), V]`` float32 of the given
        rows (None when there are none): hidden states and logits of one step (under tensor
        parallelism, one message)."""
        hidden = self.forward_tensors(input_ids, positions, block_tables, context_lens, query_lens, tree_masks)
        return hidden, self.compute_logits(hidden, logits_rows) if logits_rows else None

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V entries at cache slots ``src [N]`` int64 to slots ``dst [N]`` in every layer
        (tree verification's accepted path)."""
        move_kv_slots(self.kv_cache.key_cache, self.kv_cache.value_cache, src, dst)

    def compute_logits(self, hidden_states: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits ``[len(rows), vocab_size]`` float32 of the given rows only."""
        idx = torch.tensor(rows, dtype=torch.int64, device=hidden_states.device)
        return self.model.compute_logits(hidden_states.index_select(0, idx))
