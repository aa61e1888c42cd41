"""MTP / EAGLE chain speculation: a one-layer head drafts from the target's hidden states.

The head's entry at position p reads the pair (hidden state at p, token at p+1) and predicts the
hidden state at p+1, which the target's shared lm_head turns into the next draft token
(:mod:`specserve.models.draft_head`). Per sequence the proposer keeps the head's paged KV (one
layer, the target's block tables) and the target's hidden states it has not consumed yet, which
the engine hands over after every target forward (prefill chunks, plain decode, verification).

* ``catch_up`` runs the head over every position whose target hidden state and next token are
  known: after verification, the accepted positions, **with the target's hidden states** (SEED
  section 5: the head's KV entries are refilled from the target's features, not from its own
  drifting ones). The last row gives the logits of the first draft token.
* ``propose`` drafts a chain: draft j+1 comes from the head fed its own predicted hidden state and
  draft j. Those KV entries are overwritten by the next catch-up.

Only the head's single layer and the lm_head rows of the draft vocabulary run per draft token, so
catching up over a whole prompt is cheap and the head always follows the target.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.attention.metadata import AttentionMetadata
from specserve.engine.request import Request
from specserve.kv_cache.block_manager import BlockManager
from specserve.kv_cache.kv_cache import KVCache
from specserve.models.draft_head import DraftHead, PagedKV
from specserve.sample.sampler import compute_probs, draw
from specserve.spec_decode.proposer import ChainProposer


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
        block_manager: the page pool shared with the target.
        target_vocab_size: drafts are distributions over the target's vocabulary.
        device: where the head runs.
    """

    uses_target_hidden_states = True
    cheap_catch_up = True

    def __init__(self, head: DraftHead, block_manager: BlockManager, target_vocab_size: int,
                 device: torch.device | str = "cpu"):
        self.head = head.eval()
        self.block_manager = block_manager
        self.vocab_size = target_vocab_size
        cfg = head.config
        dtype = next(head.parameters()).dtype
        self.kv = KVCache(1, block_manager.num_blocks, block_manager.block_size, cfg.num_key_value_heads,
                          cfg.head_dim, dtype, device)
        self.device = device
        self.max_position = cfg.max_position_embeddings
        self.states: dict[int, _HeadState] = {}

    def steady_catch_up(self, k: int) -> int:
        return k + 1   # the refill covers the newest token and every accepted draft

    def _state(self, req: Request) -> _HeadState:
        return self.states.setdefault(req.seq_id, _HeadState())

    # ------------------------------------------------------------------ target features
    def observe_target_hidden_states(self, req: Request, first_position: int, hidden: torch.Tensor) -> None:
        """The target computed positions ``first_position ...`` of ``req``: ``hidden [n, H]``."""
        st = self._state(req)
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
    def num_computed_tokens(self, req: Request) -> int:
        # the head has covered position p once it has seen token p+1
        return self._state(req).num_computed + 1 if req.seq_id in self.states else 0

    def max_num_draft_tokens(self, req: Request) -> int:
        st = self.states.get(req.seq_id)
        if st is None or st.logits is None:
            return 0
        return max(0, self.max_position - req.num_tokens)

    def _run(self, hidden: torch.Tensor, token_ids: list[int] | torch.Tensor, reqs: list[Request], starts: list[int],
             lens: list[int], positions: list[int] | None = None,
             tree_masks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One head forward over ``lens[b]`` rows of each sequence written from slot index
        ``starts[b]``, at positions ``starts[b] ...`` (or ``positions``, flat), causal (or under
        ``tree_masks``, see :class:`AttentionMetadata`); returns predicted hidden states
        ``[sum(lens), H]``."""
        md = AttentionMetadata.build([self.block_manager.block_table(r.seq_id) for r in reqs], starts, lens,
                                     self.block_manager.block_size, tree_masks, device=self.device)
        ids = (token_ids.to(self.device) if isinstance(token_ids, torch.Tensor)
               else torch.tensor(token_ids, dtype=torch.int64, device=self.device))
        if positions is None:
            positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            return self.head(hidden.to(self.device, next(self.head.parameters()).dtype), ids, pos,
                             PagedKV(self.kv.key_cache[0], self.kv.value_cache[0], md))

    def _target_logits(self, head_hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> ``[n, V_target]`` float32; tokens outside the draft vocabulary at -inf."""
        with torch.inference_mode():
            logits = self.head.compute_logits(head_hidden)
        if logits.shape[-1] == self.vocab_size and self.head.config.draft_vocab_size is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.head.draft_to_target] = logits
        return full

    def catch_up(self, reqs: list[Request]) -> int:
        rows_h, tokens, starts, todo, lens = [], [], [], [], []
        for req in reqs:
            st = self._state(req)
            end = min(st.known, req.num_tokens - 1)   # pairs need the next token too
            if end <= st.num_computed or end > self.max_position:
                continue
            rows_h.append(self._take_hidden(st, st.num_computed, end))
            tokens.extend(req.all_token_ids[st.num_computed + 1:end + 1])
            starts.append(st.num_computed)
            lens.append(end - st.num_computed)
            todo.append((req, st, end))
        if not todo:
            return 0
        out = self._run(torch.cat(rows_h), tokens, [r for r, _, _ in todo], starts, lens)
        last = [sum(lens[:i + 1]) - 1 for i in range(len(lens))]
        logits = self._target_logits(out[last])
        for i, (req, st, end) in enumerate(todo):
            st.num_computed = end
            decoding = end == req.num_tokens - 1
            st.logits = logits[i] if decoding else None
            st.last_hidden = out[last[i]] if decoding else None
        return max(lens)

    def _start_chain(self, reqs: list[Request]) -> None:
        for r in reqs:
            st = self._state(r)
            st.chain_hidden = st.last_hidden

    def _carried_logits(self, req: Request) -> torch.Tensor:
        return self._state(req).logits

    def _next_logits(self, reqs: list[Request], active: list[int], histories: list[list[int]], j: int) -> torch.Tensor:
        # the head on its own previous prediction and draft j-1, at draft j-1's position - 1
        states = [self._state(reqs[i]) for i in active]
        out = self._run(torch.stack([st.chain_hidden for st in states]), [histories[i][-1] for i in active],
                        [reqs[i] for i in active], [reqs[i].num_tokens - 2 + j for i in active], [1] * len(active))
        for n, st in enumerate(states):
            st.chain_hidden = out[n]
        return self._target_logits(out)

    # ------------------------------------------------------------------ the sync-free step
    supports_sync_free = True

    def has_carried_logits(self, reqs: list[Request]) -> bool:
        """Every request's first draft can come from logits the head left behind."""
        return all(self._state(r).logits is not None for r in reqs)

    def draft_chain_tensors(self, reqs: list[Request], k: int, md) -> tuple[torch.Tensor, torch.Tensor]:
        """k draft tokens for every request, kept on the device: ``draft_token_ids [B, k]`` int64
        and ``draft_probs [B, k, V]`` float32 (the distributions drawn from, after each request's
        sampling parameters ``md``; penalties are not supported here). One batched head forward
        per draft after the first; nothing is read back to the host."""
        states = [self._state(r) for r in reqs]
        logits = torch.stack([st.logits for st in states])
        hidden = torch.stack([st.last_hidden for st in states])
        ids, probs = [], []
        for j in range(k):
            if j > 0:   # the head on its own prediction and draft j-1, at draft j-1's position - 1
                hidden = self._run(hidden, ids[-1], reqs, [r.num_tokens - 2 + j for r in reqs], [1] * len(reqs))
                logits = self._target_logits(hidden)
            q = compute_probs(logits, md)
            ids.append(draw(q, md.is_greedy, md.generators))
            probs.append(q)
        return torch.stack(ids, dim=1), torch.stack(probs, dim=1)

    def refill_in_step(self, reqs: list[Request], target_hidden: torch.Tensor, next_token_ids: torch.Tensor,
                       query_lens: list[int], num_accepted: torch.Tensor) -> None:
        """Right after verification, before the host knows what was accepted: the head re-runs
        over every verified row (the newest token and all drafts) with the target's hidden states
        ``target_hidden [T, H]`` and the tokens that follow them, ``next_token_ids [T]`` (accepted
        drafts, then the recovered or bonus token, then padding), rewriting its KV from the
        target's features (SEED section 9: a little work wasted on rejected rows, no sync). The
        row of each sequence's last accepted position, chosen with ``num_accepted [B]`` on the
        device, gives the next step's first-draft logits."""
        starts = [r.num_computed_tokens for r in reqs]
        out = self._run(target_hidden, next_token_ids, reqs, starts, query_lens)
        offsets = torch.tensor([sum(query_lens[:i]) for i in range(len(reqs))], dtype=torch.int64)
        rows = offsets.to(out.device) + num_accepted.to(out.device)
        last = out.index_select(0, rows)
        logits = self._target_logits(last)
        for i, r in enumerate(reqs):
            st = self._state(r)
            st.logits, st.last_hidden = logits[i], last[i]

    def commit_sync_free(self, req: Request, first_position: int, num_accepted: int) -> None:
        """The host learned ``num_accepted`` for ``req``, verified from ``first_position``: the head
        now covers the positions up to the last accepted one."""
        st = self._state(req)
        st.num_computed = first_position + num_accepted + 1
        st.hidden, st.first = [], st.num_computed

    def on_verified(self, req: Request, num_accepted: int) -> None:
        st = self._state(req)
        st.logits = st.last_hidden = None   # the next catch-up refills from the target's hidden states

    def reset(self, req: Request) -> None:
        self.states.pop(req.seq_id, None)

