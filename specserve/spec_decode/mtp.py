"""MTP / EAGLE chain speculation: a one-layer head drafts from the target's hidden states.

The head's entry at position p reads the pair (hidden state at p, token at p+1) and predicts the
hidden state at p+1, which the target's shared lm_head turns into the next draft token
(:mod:`specserve.models.draft_head`). Per sequence the proposer keeps the head's paged KV (one
layer, the target's block tables) and the target's hidden states it has not consumed yet, which
the worker hands over after every target forward (prefill chunks, plain decode, verification).

* ``catch_up`` runs the head over every position whose target hidden state and next token are
  known: after verification, the accepted positions, **with the target's hidden states**: the
  head's KV entries are refilled from the target's features, not from its own drifting ones
  (EAGLE, Li et al. 2024, section 3: the draft reads the target's features wherever they exist).
  The last row gives the logits of the first draft token.
* ``propose`` drafts a chain: draft j+1 comes from the head fed its own predicted hidden state and
  draft j. Those KV entries are overwritten by the next catch-up.

Only the head's single layer and the lm_head rows of the draft vocabulary run per draft token, so
catching up over a whole prompt is cheap and the head always follows the target.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.kv_cache.kv_cache import KVCache
from specserve.models.draft_head import DraftHead, PagedKV
from specserve.sample.sampler import SamplingMetadata, compute_probs, draw
from specserve.spec_decode.draft_vocab import to_target_logits
from specserve.spec_decode.proposer import ChainProposer, DraftProposal
from specserve.worker.step import StepBatch


@dataclass
class _HeadState:
    num_computed: int = 0                     # positions p whose pair (h_p, x_{p+1}) the head has KV for
    hidden: list[torch.Tensor] = field(default_factory=list)   # target hidden states from position `first`
    first: int = 0                            # position of hidden[0] row 0
    logits: torch.Tensor | None = None        # [V] target-vocab logits of the next first draft token
    last_hidden: torch.Tensor | None = None   # [H] the head's prediction behind `logits`
    chain_hidden: torch.Tensor | None = None  # [H] the head's latest prediction while drafting

    @property
    def known(self) -> int:
        """Positions below this have target hidden states (consumed or buffered)."""
        return self.first + sum(h.shape[0] for h in self.hidden)


class MTPProposer(ChainProposer):
    """Args:
        head: a draft head with the target's embedding and lm_head attached.
        num_blocks, block_size: the target's page pool (the head's one-layer KV uses the same pages).
        target_vocab_size: drafts are distributions over the target's vocabulary.
        device: where the head runs.
    """

    uses_target_hidden_states = True
    cheap_catch_up = True
    kv_lookahead = 1   # the entry at p embeds token p+1

    def __init__(self, head: DraftHead, num_blocks: int, block_size: int, target_vocab_size: int,
                 device: torch.device | str = "cpu"):
        self.head = head.eval()
        self.aux_hidden_state_layers = head.config.aux_hidden_state_layers
        self.block_size = block_size
        self.vocab_size = target_vocab_size
        cfg = head.config
        dtype = head.dtype
        self.kv = KVCache(1, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.device = device
        self.max_position = cfg.max_position_embeddings
        self.states: dict[int, _HeadState] = {}

    def steady_catch_up(self, k: int) -> int:
        return k + 1   # the refill covers the newest token and every accepted draft

    def _state(self, seq_id: int) -> _HeadState:
        return self.states.setdefault(seq_id, _HeadState())

    # ------------------------------------------------------------------ target features
    def observe_target_hidden_states(self, seq_id: int, first_position: int, hidden: torch.Tensor) -> None:
        """The target computed positions ``first_position ...`` of the sequence: ``hidden [n, H]``."""
        st = self._state(seq_id)
        if first_position != st.known:   # a gap or overlap (recompute after preemption): start over here
            st.hidden, st.first = [], first_position
        st.hidden.append(hidden.detach())

    def _take_hidden(self, st: _HeadState, start: int, end: int) -> torch.Tensor:
        """Target hidden states of positions [start, end), dropping those before ``start``."""
        allh = torch.cat(st.hidden) if len(st.hidden) > 1 else st.hidden[0]
        out = allh[start - st.first:end - st.first]
        st.hidden, st.first = [allh[start - st.first:]], start
        return out

    # ------------------------------------------------------------------ Proposer
    def num_computed_tokens(self, seq_id: int) -> int:
        # the head has covered position p once it has seen token p+1
        st = self.states.get(seq_id)
        return st.num_computed + 1 if st is not None else 0

    def num_valid_kv_tokens(self, seq_id: int) -> int:
        # entries below num_computed come from the target's features and are never rewritten
        st = self.states.get(seq_id)
        return st.num_computed if st is not None else 0

    def adopt_cached_prefix(self, seq_id: int, num_tokens: int) -> None:
        # the target computes from num_tokens on, and its hidden states start there
        self.states[seq_id] = _HeadState(num_computed=num_tokens, first=num_tokens)

    def max_num_draft_tokens(self, batch: StepBatch, b: int) -> int:
        st = self.states.get(batch.seq_ids[b])
        if st is None or st.logits is None:
            return 0
        return max(0, self.max_position - batch.num_tokens(b))

    def _run(self, hidden: torch.Tensor, token_ids: list[int] | torch.Tensor, block_tables: list[list[int]],
             starts: list[int], lens: list[int], positions: list[int] | None = None,
             tree_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One head forward over ``lens[b]`` rows of each sequence (pages ``block_tables[b]``)
        written from slot index ``starts[b]``, at positions ``starts[b] ...`` (or ``positions``,
        flat), causal (or under ``tree_masks``, see :class:`AttentionMetadata`); returns predicted
        hidden states ``[sum(lens), H]``."""
        md = AttentionMetadata.build(block_tables, starts, lens, self.block_size, tree_masks, device=self.device)
        ids = (token_ids.to(self.device) if isinstance(token_ids, torch.Tensor)
               else torch.tensor(token_ids, dtype=torch.int64, device=self.device))
        if positions is None:
            positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            return self.head(hidden.to(self.device, self.head.dtype), ids, pos,
                             PagedKV(self.kv.key_cache[0], self.kv.value_cache[0], md))

    def _target_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[n, V_target]`` float32; tokens outside the draft vocabulary at -inf."""
        with torch.inference_mode():
            logits = self.head.compute_logits(head_hidden)
        if logits.shape[-1] == self.vocab_size and self.head.config.draft_vocab_size is None:
            return logits
        return to_target_logits(logits, self.head.draft_to_target, self.vocab_size)

    def catch_up(self, batch: StepBatch) -> int:
        rows_h, tokens, starts, todo, lens, tables = [], [], [], [], [], []
        for b, seq_id in enumerate(batch.seq_ids):
            st = self._state(seq_id)
            num_tokens = batch.num_tokens(b)
            end = min(st.known, num_tokens - 1)   # pairs need the next token too
            if end <= st.num_computed or end > self.max_position:
                continue
            rows_h.append(self._take_hidden(st, st.num_computed, end))
            tokens.extend(batch.token_ids[b][st.num_computed + 1:end + 1])
            starts.append(st.num_computed)
            lens.append(end - st.num_computed)
            tables.append(batch.block_tables[b])
            todo.append((num_tokens, st, end))
        if not todo:
            return 0
        out = self._run(torch.cat(rows_h), tokens, tables, starts, lens)
        last = [end - 1 for end in itertools.accumulate(lens)]
        logits = self._target_logits(out[last])
        for i, (num_tokens, st, end) in enumerate(todo):
            st.num_computed = end
            decoding = end == num_tokens - 1
            st.logits = logits[i] if decoding else None
            st.last_hidden = out[last[i]] if decoding else None
        return max(lens)

    def _start_chain(self, batch: StepBatch) -> None:
        for seq_id in batch.seq_ids:
            st = self._state(seq_id)
            st.chain_hidden = st.last_hidden

    def _carried_logits(self, seq_id: int) -> torch.Tensor:
        return self._state(seq_id).logits

    def _next_logits(self, batch: StepBatch, active: list[int], histories: list[list[int]], j: int) -> torch.Tensor:
        # the head on its own previous prediction and draft j-1, at draft j-1's position - 1
        states = [self._state(batch.seq_ids[i]) for i in active]
        out = self._run(torch.stack([st.chain_hidden for st in states]), [histories[i][-1] for i in active],
                        [batch.block_tables[i] for i in active], [batch.num_tokens(i) - 2 + j for i in active],
                        [1] * len(active))
        for n, st in enumerate(states):
            st.chain_hidden = out[n]
        return self._target_logits(out)

    # ------------------------------------------------------------------ the sync-free step
    def propose_on_device(self, batch: StepBatch, num_draft_tokens: list[int],
                          md: SamplingMetadata) -> DraftProposal | None:
        """``max(num_draft_tokens)`` drafts for every sequence, kept on the device (one batched head
        forward per draft after the first; nothing is read back to the host). None unless every
        sequence's first draft can come from logits the head left behind."""
        states = [self.states.get(seq_id) for seq_id in batch.seq_ids]
        if any(st is None or st.logits is None for st in states):
            return None
        k = max(num_draft_tokens)
        logits = torch.stack([st.logits for st in states])
        hidden = torch.stack([st.last_hidden for st in states])
        ids, probs = [], []
        for j in range(k):
            if j > 0:   # the head on its own prediction and draft j-1, at draft j-1's position - 1
                hidden = self._run(hidden, ids[-1], batch.block_tables,
                                   [batch.num_tokens(b) - 2 + j for b in range(len(batch))], [1] * len(batch))
                logits = self._target_logits(hidden)
            q = compute_probs(logits, md)
            ids.append(draw(q, md.is_greedy, md.generators))
            probs.append(q)
        return DraftProposal(torch.stack(ids, dim=1), torch.stack(probs, dim=1), list(num_draft_tokens))

    def refill(self, batch: StepBatch, target_hidden: torch.Tensor, next_token_ids: torch.Tensor,
               query_lens: list[int], num_accepted: torch.Tensor) -> None:
        """The head re-runs over every verified row with the target's hidden states and the tokens
        that follow them, rewriting its KV from the target's features (a little work wasted on
        rejected rows, and no host read). The row of each sequence's last accepted position, chosen
        with ``num_accepted`` on the device, gives the next step's first-draft logits."""
        out = self._run(target_hidden, next_token_ids, batch.block_tables, list(batch.context_lens), query_lens)
        offsets = torch.tensor(list(itertools.accumulate(query_lens[:-1], initial=0)), dtype=torch.int64)
        last = out.index_select(0, offsets.to(out.device) + num_accepted.to(out.device))
        logits = self._target_logits(last)
        for i, seq_id in enumerate(batch.seq_ids):
            st = self._state(seq_id)
            st.logits, st.last_hidden = logits[i], last[i]

    def on_verified(self, seq_id: int, first_position: int, num_accepted: int, refilled: bool = False) -> None:
        st = self._state(seq_id)
        if refilled:   # the head covers the positions up to the last accepted one
            st.num_computed = first_position + num_accepted + 1
            st.hidden, st.first = [], st.num_computed
        else:          # the next catch-up refills from the target's hidden states
            st.logits = st.last_hidden = None

    def reset(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
