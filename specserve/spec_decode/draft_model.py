"""Draft-target speculation: a separate small LLM of the same tokenizer drafts for the target.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding") and Chen et al.
2023 ("Accelerating Large Language Model Decoding with Speculative Sampling"); the draft runs in the
same step loop as the target, over the same pages (docs/architecture.md, "A speculative step").
The draft shares the target's block tables (one page pool) and keeps its own KV tensors. At the
start of every speculative step it *catches up*: one batched forward over the tokens it has not
seen (the prompt, tokens decoded while speculation was off, or after verification the
recovered/bonus token and the last draft), keeping the logits of the newest token. Those logits
give the first draft token, so a step of k drafts costs k draft forwards in all. Rejected draft KV entries are
rolled back by length (``num_computed``), never copied.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.spec_decode.draft_vocab import to_target_logits
from specserve.spec_decode.proposer import ChainProposer
from specserve.worker.model_runner import ModelInput, ModelRunner
from specserve.worker.step import StepBatch


@dataclass
class _DraftState:
    num_computed: int = 0                 # tokens whose KV is in the draft cache
    logits: torch.Tensor | None = None    # [V_target] carried logits for the next first draft token
    proposed_from: int = 0                # num_computed when the last proposal started
    disabled: bool = False                # past the draft's maximum position


class DraftModelProposer(ChainProposer):
    """Args:
        runner: the draft model with its own KV tensors (the target's pages: the batch's block tables).
        target_vocab_size: the draft's logits are cut or padded to it (padding rows are never proposed).
    """

    def __init__(self, runner: ModelRunner, target_vocab_size: int):
        self.runner = runner
        self.vocab_size = target_vocab_size
        self.max_position = runner.model.config.max_position_embeddings
        self.states: dict[int, _DraftState] = {}

    def _state(self, seq_id: int) -> _DraftState:
        return self.states.setdefault(seq_id, _DraftState())

    def _align(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[N, V_draft]`` -> ``[N, V_target]``: extra rows cut, missing ids at -inf
        (a reduced vocabulary's logits scattered to their target ids, the rest at -inf)."""
        rows = self.runner.model.lm_head_rows
        if rows is not None:
            return to_target_logits(logits, rows, self.vocab_size)
        v = logits.shape[-1]
        if v >= self.vocab_size:
            return logits[:, :self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def num_computed_tokens(self, seq_id: int) -> int:
        st = self.states.get(seq_id)
        return st.num_computed if st is not None else 0

    def num_valid_kv_tokens(self, seq_id: int) -> int:
        # draft entries at or past num_computed are rewritten (drafts, rollback); below it never
        return self.num_computed_tokens(seq_id)

    def adopt_cached_prefix(self, seq_id: int, num_tokens: int) -> None:
        self.states[seq_id] = _DraftState(num_computed=num_tokens)

    def max_num_draft_tokens(self, batch: StepBatch, b: int) -> int:
        st = self.states.get(batch.seq_ids[b])
        if st is None or st.disabled or st.logits is None:
            return 0
        # the catch-up after verification writes up to position num_tokens + k
        return max(0, self.max_position - batch.num_tokens(b) - 1)

    def _start_chain(self, batch: StepBatch) -> None:
        for seq_id in batch.seq_ids:
            st = self._state(seq_id)
            st.proposed_from = st.num_computed

    def _carried_logits(self, seq_id: int) -> torch.Tensor:
        return self._state(seq_id).logits

    def _next_logits(self, batch: StepBatch, active: list[int], histories: list[list[int]], j: int) -> torch.Tensor:
        # feed the previous draft token of every still-active row, one batched forward
        states = [self._state(batch.seq_ids[i]) for i in active]
        inputs = [ModelInput([histories[i][-1]], st.num_computed, batch.block_tables[i])
                  for i, st in zip(active, states)]
        fwd = self.runner.forward(inputs)
        for st in states:
            st.num_computed += 1
        return self._align(self.runner.compute_logits(fwd.hidden_states, fwd.last_rows))

    def on_verified(self, seq_id: int, first_position: int, num_accepted: int, refilled: bool = False) -> None:
        st = self._state(seq_id)
        # KV of the accepted drafts stays; the draft never saw the last draft token
        st.num_computed = min(st.num_computed, st.proposed_from + num_accepted)
        st.logits = None

    def catch_up(self, batch: StepBatch) -> int:
        inputs, todo = [], []
        for b, seq_id in enumerate(batch.seq_ids):
            st = self._state(seq_id)
            num_tokens = batch.num_tokens(b)
            decoding = batch.context_lens[b] == num_tokens - 1
            end = num_tokens if decoding else batch.context_lens[b]
            if st.disabled or end <= st.num_computed:
                continue
            if end > self.max_position:  # the draft cannot go further: this sequence stops speculating
                st.disabled, st.logits = True, None
                continue
            tokens = batch.token_ids[b][st.num_computed:end]
            inputs.append(ModelInput(tokens, st.num_computed, batch.block_tables[b]))
            todo.append((st, end, decoding))
        if not inputs:
            return 0
        fwd = self.runner.forward(inputs)
        rows = [row for row, (_, _, decoding) in zip(fwd.last_rows, todo) if decoding]
        logits = self._align(self.runner.compute_logits(fwd.hidden_states, rows)) if rows else None
        it = iter(range(len(rows)))
        for st, end, decoding in todo:
            st.num_computed = end
            st.logits = logits[next(it)] if decoding else None
        return max(len(inp.token_ids) for inp in inputs)

    def reset(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
