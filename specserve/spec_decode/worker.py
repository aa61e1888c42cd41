"""The speculative worker: the one place that knows catch-up -> propose -> verify -> accept.

It wraps the :class:`~specserve.worker.target_worker.TargetWorker` and one
:class:`~specserve.spec_decode.proposer.Proposer` and executes a
:class:`~specserve.worker.step.StepBatch` like the target worker does, returning one
:class:`~specserve.worker.step.StepResult`; the engine commits it without knowing the method.

* Decode-only batches speculate with the k the adaptive controller chooses for the batch size
  (:mod:`specserve.spec_decode.adaptive`; 0 = a plain decode step, the proposer does no work):
  the proposer catches up, drafts chains (``DraftProposal``) or trees (``TreeProposal``), the
  target verifies every draft in one forward, and rejection sampling keeps a prefix
  (Leviathan et al. 2023, section 2.3; trees: SpecInfer, Miao et al. 2024, and EAGLE-2, Li et al. 2024).
* The sync-free chain step: when the proposer can draft on the device (an MTP head with carried
  logits) and no sequence needs its drafts on the host (logprobs, penalties), drafts, the
  verification, the acceptance and the head's refill stay on the device; the host reads one tensor,
  the accepted lengths and tokens (docs/architecture.md, "The sync-free MTP step").
* Batches with a prefill run the target alone. Whether the proposer follows a prompt (prefills
  along, so it can speculate on the sequence later) is decided per sequence: always for a proposer
  whose catch-up is cheap, otherwise when the controller expects speculation to repay the draft's
  prefill, and for a prompt the draft has not started, at the first decode step (so the draft
  never delays the first token). A followed sequence's draft prefill runs at the start of the
  next step, over every token the target has computed.
"""
from __future__ import annotations

import contextlib
import time

import torch

from specserve.config import SpeculativeConfig
from specserve.sample.rejection import rejection_sample_tensors
from specserve.sample.sampler import compute_probs, gather_logprobs
from specserve.spec_decode.adaptive import AdaptiveSpeculation
from specserve.spec_decode.proposer import DraftProposal, Proposer, TreeProposal
from specserve.spec_decode.tree import DraftTree, accept_tree, accepted_kv_moves, grammar_subtree
from specserve.worker.step import StepBatch, StepResult
from specserve.worker.target_worker import TargetWorker, logprob_entries


class SpeculativeWorker:
    """Args:
        target: the target worker (its model, KV cache and sampler verify the drafts).
        proposer: the method's proposer.
        config: ``num_speculative_tokens`` (k, or the largest k when ``adaptive``) and ``adaptive``.
        draft_context: a callable returning the context the draft's own compute runs in
            (:meth:`~specserve.worker.target.Target.draft_context`).
    """

    def __init__(self, target: TargetWorker, proposer: Proposer, config: SpeculativeConfig,
                 draft_context=contextlib.nullcontext):
        self.target = target
        self.proposer = proposer
        self.config = config
        self._k = config.num_speculative_tokens
        self.controller = AdaptiveSpeculation(self._k) if config.adaptive else None
        self._follow: set[int] = set()     # seq ids whose draft prefill runs at the start of the next step
        self._deferred: set[int] = set()   # seq ids whose draft prefill waits for a decode step's estimate
        self._cold: set[int] = set()       # seq ids on a cached prefix the draft has not caught up over
        # the context the draft's own compute runs in (the tensor-parallel leader gives it every
        # core: TensorParallelTarget.draft_context)
        self.draft_context = draft_context

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def num_speculative_tokens(self) -> int:
        """k (the largest k when adaptive)."""
        return self._k

    def set_num_speculative_tokens(self, k: int) -> None:
        """Draft ``k`` tokens a step from now on (adaptive: k becomes the largest, and the
        controller starts its measurements anew). The config keeps the value it was built with.

        Raises:
            ValueError: ``k`` is not a positive int.
        """
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be a positive int, got {k!r}")
        self._k = k
        if self.controller is not None:
            self.controller = AdaptiveSpeculation(k)

    def num_lookahead_tokens(self) -> int:
        """Cache slots past the newest token a speculative step may write: k drafts and the bonus
        token (a tree: its largest tree)."""
        return self.proposer.num_lookahead_tokens(self.num_speculative_tokens)

    @property
    def kv_lookahead(self) -> int:
        """Tokens past its page that a page's entries depend on (1 for a head; prefix caching)."""
        return self.proposer.kv_lookahead

    @property
    def prefix_needs_draft(self) -> bool:
        """A head needs its own entries wherever the target skips (it reads the target's hidden
        states, which a cached prefix does not recompute): its hits end where its entries do."""
        return self.proposer.uses_target_hidden_states

    def num_valid_draft_tokens(self, seq_id: int, num_computed_tokens: int) -> int:
        """Leading positions whose proposer entries are final (a page is reused by the proposer
        only where they are)."""
        valid = self.proposer.num_valid_kv_tokens(seq_id)
        return num_computed_tokens if valid is None else min(valid, num_computed_tokens)

    def _adopt_cached_prefix(self, seq_id: int, num_tokens: int, num_draft_tokens: int) -> None:
        """A new sequence starts on cached pages holding the target's entries of its first
        ``num_tokens`` positions and the proposer's of the first ``num_draft_tokens``: the proposer
        starts there. A draft behind the target then catches up as over a prompt it has not
        started (its follow decision is the same), not as a sequence it fell behind."""
        self.proposer.adopt_cached_prefix(seq_id, num_draft_tokens)
        if num_draft_tokens < num_tokens:
            self._cold.add(seq_id)

    def _free(self, seq_ids: list[int]) -> None:
        """Sequences that finished, were aborted or preempted: the proposer forgets them."""
        for seq_id in seq_ids:
            self.proposer.reset(seq_id)
            self._follow.discard(seq_id)
            self._deferred.discard(seq_id)
            self._cold.discard(seq_id)

    # ------------------------------------------------------------------ one step
    def execute(self, batch: StepBatch) -> StepResult:
        """One step: the draft prefills the sequences it follows, then a decode-only batch
        speculates with the controller's k (0: a plain step) and any other batch runs the target
        alone, deciding which prompts the proposer follows. Returns the step's result; the
        proposer's state already reflects what the target accepted."""
        self._free(batch.freed_seq_ids)
        for seq_id, num_tokens, num_draft_tokens in batch.cached_prefixes:
            self._adopt_cached_prefix(seq_id, num_tokens, num_draft_tokens)
        self._prefill_followed(batch)
        t0 = time.perf_counter()   # the draft's late prefill is its own cost, not the step's
        ctrl = self.controller
        if batch.is_decode_only:
            eligible = [self._keeps_up(batch, b) for b in range(len(batch))]
            if not any(eligible):   # nothing can draft: a plain step, counted and timed as one
                k = 0
            elif ctrl is not None:
                k = ctrl.choose(len(batch), all(eligible))
            else:
                k = self.num_speculative_tokens
            if k > 0:
                result, steady = self._speculative_step(batch, eligible, k)
            else:
                result, steady = self._plain_step(batch), True
            result.num_speculative_tokens = k
            if ctrl is not None:
                ctrl.observe_step(len(batch), k, time.perf_counter() - t0, steady)
            return result
        for b, seq_id in enumerate(batch.seq_ids):
            decision = self._should_follow(batch, b)
            if decision:
                self._follow.add(seq_id)
            elif decision is None:
                self._deferred.add(seq_id)
        result = self._plain_step(batch)
        if ctrl is not None:
            ctrl.observe_target_prefill(sum(batch.query_lens), time.perf_counter() - t0)
        return result

    def _plain_step(self, batch: StepBatch) -> StepResult:
        result = self.target.execute(batch)
        self._observe_hidden(batch, result)
        return result

    def _observe_hidden(self, batch: StepBatch, result: StepResult) -> None:
        """Hand a head the target's hidden states of every position the step made valid."""
        if not self.proposer.uses_target_hidden_states:
            return
        for b, rows in enumerate(result.hidden_rows):
            if isinstance(rows, range):
                hidden = result.hidden_states[rows.start:rows.stop]
            else:
                hidden = result.hidden_states[torch.tensor(rows, dtype=torch.int64)]
            if len(hidden):
                self.proposer.observe_target_hidden_states(batch.seq_ids[b], batch.context_lens[b], hidden)

    # ------------------------------------------------------------------ following prompts
    def _prefill_followed(self, batch: StepBatch) -> None:
        """The draft catches up over the sequences it follows (marked by the last step), and, in
        a decode-only batch, over those whose deferred decision the controller now makes."""
        rows = [b for b, s in enumerate(batch.seq_ids) if s in self._follow]
        if self._deferred and batch.is_decode_only:
            for b, seq_id in enumerate(batch.seq_ids):
                if seq_id not in self._deferred:
                    continue
                decision = self._follow_decision(batch, b, len(batch))
                if decision is not None:
                    self._deferred.discard(seq_id)
                    if decision:
                        rows.append(b)
        if not rows:
            return
        for b in rows:
            self._follow.discard(batch.seq_ids[b])
        sub = batch.select(sorted(rows))
        t0 = time.perf_counter()
        before = sum(self.proposer.num_computed_tokens(s) for s in sub.seq_ids)
        with self.draft_context():
            self.proposer.catch_up(sub)
        self._cold.difference_update(sub.seq_ids)
        if self.controller is not None:
            done = sum(self.proposer.num_computed_tokens(s) for s in sub.seq_ids) - before
            self.controller.observe_draft_prefill(done, time.perf_counter() - t0)

    def _should_follow(self, batch: StepBatch, b: int) -> bool | None:
        """Whether the draft follows sequence b through this prefill/mixed step: it must not have
        fallen behind, and the controller must expect speculation to repay the prefill (always,
        for a cheap catch-up: a one-layer head). None: decide in the first decode-only step,
        always for a prompt the draft has not started (the draft's prefill never delays the first
        token and is weighed at the batch size the sequence really decodes in: requests of one
        wave arrive a step apart), and whenever the controller cannot tell yet."""
        seq_id = batch.seq_ids[b]
        if seq_id in self._deferred:
            return None
        cold = seq_id in self._cold   # like a prompt the draft has not started
        if not cold and not self._keeps_up(batch, b):
            return False
        if self.controller is None or self.proposer.cheap_catch_up:
            return True
        if cold or self.proposer.num_computed_tokens(seq_id) == 0:
            return None
        return self._follow_decision(batch, b, batch.expected_batch_size)

    def _follow_decision(self, batch: StepBatch, b: int, batch_size: int) -> bool | None:
        """The controller's :meth:`~AdaptiveSpeculation.worth_following` for sequence b."""
        todo = batch.num_tokens(b) - self.proposer.num_computed_tokens(batch.seq_ids[b])
        return self.controller.worth_following(batch_size, batch.max_new_tokens[b], todo)

    def _keeps_up(self, batch: StepBatch, b: int) -> bool:
        """Whether the proposer is close enough behind sequence b's computed tokens to catch up in
        a step. A sequence it fell far behind (speculation was off for it a while) decodes without
        speculation: catching up would cost a draft prefill."""
        if self.proposer.cheap_catch_up:
            return True
        lag = batch.context_lens[b] - self.proposer.num_computed_tokens(batch.seq_ids[b])
        return lag <= 4 * (self.num_speculative_tokens + 1)

    def _num_draft_tokens(self, batch: StepBatch, b: int, k: int) -> int:
        """At most k drafts for sequence b now: never past max_tokens, max_model_len, the
        proposer's reach or the pages the scheduler reserved."""
        k = min(k, self.proposer.max_num_draft_tokens(batch, b), batch.max_draft_tokens[b])
        capacity = len(batch.block_tables[b]) * batch.block_size
        if k > 0 and batch.num_tokens(b) - 1 + self.proposer.num_lookahead_tokens(k) > capacity:
            return 0
        return max(0, k)

    # ------------------------------------------------------------------ speculation
    def _speculative_step(self, batch: StepBatch, eligible: list[bool], k: int) -> tuple[StepResult, bool]:
        """catch up -> propose -> verify (one target forward over each sequence's drafts) ->
        accept. Returns the result and whether the step was steady: the proposer caught up over
        no more than what the last speculative step left, every sequence could draft and some
        did (a step where only some draft would look cheaper than k costs)."""
        t0 = time.perf_counter()
        prop = self.proposer
        with self.draft_context():
            caught_up = prop.catch_up(batch if all(eligible) else batch.select([b for b, e in enumerate(eligible) if e]))
            ks = [self._num_draft_tokens(batch, b, k) if e else 0 for b, e in enumerate(eligible)]
            steady = caught_up <= prop.steady_catch_up(k) and all(eligible) and any(ks)
            proposal = None
            if all(eligible) and any(ks) and not (batch.any_logprobs or batch.any_penalties or batch.any_grammar):
                proposal = prop.propose_on_device(batch, ks, batch.sampling_metadata(device=self.device))
            sync_free = proposal is not None
            if proposal is None:
                proposal = prop.propose(batch, ks)
        draft_end = time.perf_counter()
        if isinstance(proposal, TreeProposal):
            result = self._verify_trees(batch, proposal.trees)
        else:
            result = self._verify_chains(batch, proposal, sync_free)
        result.draft_time_s, result.verify_time_s = draft_end - t0, time.perf_counter() - draft_end
        result.sync_free = sync_free
        if not sync_free:   # the newest token's and the accepted drafts' hidden states
            self._observe_hidden(batch, result)
        for b, seq_id in enumerate(batch.seq_ids):
            prop.on_verified(seq_id, batch.context_lens[b], result.num_accepted_tokens[b], refilled=sync_free)
        if self.controller is not None:
            # drafts asked for but not found count as rejected: the controller weighs what k yields
            self.controller.observe_acceptance(list(zip(ks, result.num_accepted_tokens)))
        return result, steady

    def _verify(self, batch: StepBatch, input_ids: torch.Tensor, query_lens: list[int], positions: list[int],
                histories: list[list[int]] | None, tree_masks: list[torch.Tensor] | None = None,
                drafts: list[list[int]] | None = None):
        """One target forward over every verified row (``query_lens[b]`` rows of sequence b, from
        its newest token's slot); returns hidden states ``[T, H]``, logits ``[T, V]``, the rows'
        sampling metadata and the target's distributions ``[T, V]`` (penalties see ``histories``;
        a grammar masks row r with its state after ``drafts[r]``, the drafts before it)."""
        runner = self.target.runner
        hidden, logits = runner.forward_with_logits(input_ids, positions, batch.block_tables, batch.context_lens,
                                                    query_lens, list(range(len(positions))), tree_masks)
        row_seq = [b for b, q in enumerate(query_lens) for _ in range(q)]
        md = batch.sampling_metadata(row_seq, histories, self.device, drafts)
        return hidden, logits, md, compute_probs(logits, md)

    def _logprobs(self, batch: StepBatch, logits: torch.Tensor, md, rows: list[list[int]],
                  emitted: list[list[int]]):
        """Logprob entries of the emitted tokens (sequence b's j-th drawn at logits row ``rows[b][j]``)."""
        if not batch.any_logprobs:
            return None
        chosen = torch.zeros(logits.shape[0], dtype=torch.int64)
        for r, toks in zip(rows, emitted):
            chosen[torch.tensor(r, dtype=torch.int64)] = torch.tensor(toks, dtype=torch.int64)
        return logprob_entries(gather_logprobs(logits, chosen, md), rows, batch.params)

    def _verify_chains(self, batch: StepBatch, proposal: DraftProposal, sync_free: bool) -> StepResult:
        """Verify chains of ``proposal.num_draft_tokens[b]`` drafts and accept by rejection sampling
        (:func:`~specserve.sample.rejection.rejection_sample_tensors`). Sync-free: the proposer
        refills from the verified rows before the step's one host read."""
        drafts, ks = proposal.draft_token_ids, list(proposal.num_draft_tokens)     # [B, K]
        num_seqs, kmax = drafts.shape
        host = drafts.tolist() if batch.any_penalties or batch.any_grammar else None
        if batch.any_grammar:   # drafts the grammar refuses are cut (deterministic ones: n-gram)
            for b in range(num_seqs):
                g = batch.grammar(b)
                if g is not None and ks[b]:
                    ks[b] = g.num_valid(host[b][:ks[b]])
        device = self.device
        query_lens = [k + 1 for k in ks]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        # sequence b's verified rows are entries [b, 0 .. ks[b]] of a [B, K + 1] block (newest token,
        # then drafts): one gather picks them all, for the inputs and for the tokens that follow
        flat = torch.tensor([b * (kmax + 1) + j for b, q in enumerate(query_lens) for j in range(q)]).to(device)
        newest = torch.tensor([toks[-1] for toks in batch.token_ids], dtype=torch.int64).to(device)
        input_ids = torch.cat([newest.unsqueeze(1), drafts.to(device)], dim=1).view(-1)[flat]
        positions = [p for c, q in zip(batch.context_lens, query_lens) for p in range(c, c + q)]
        histories = None   # only penalties read them: row j sees the drafts before it as output
        if batch.any_penalties:
            histories = [batch.output_token_ids[b] + host[b][:j] for b, q in enumerate(query_lens) for j in range(q)]
        before = [host[b][:j] for b, q in enumerate(query_lens) for j in range(q)] if batch.any_grammar else None
        hidden, logits, md, probs = self._verify(batch, input_ids, query_lens, positions, histories, drafts=before)
        gather = torch.tensor([[s + min(j, n) for j in range(kmax + 1)] for s, n in zip(starts, ks)])
        target_probs = probs[gather.to(device)]                                 # [B, K + 1, V]
        num_acc, out = rejection_sample_tensors(drafts.to(device), ks, proposal.draft_probs, target_probs,
                                                [p.greedy for p in batch.params], batch.generators)
        if sync_free:
            next_ids = out.reshape(-1)[flat].clamp(min=0)                         # -1 pads rejected rows
            self.proposer.refill(batch, hidden, next_ids, query_lens, num_acc)
        verified = torch.cat([num_acc.unsqueeze(1), out], dim=1).tolist()       # the step's one host read
        accepted = [v[0] for v in verified]
        emitted = [v[1:m + 2] for v, m in zip(verified, accepted)]
        rows = [range(s, s + m + 1) for s, m in zip(starts, accepted)]   # contiguous: sliced, not indexed
        return StepResult(emitted, [m + 1 for m in accepted], self._logprobs(batch, logits, md, rows, emitted),
                          list(ks), accepted, hidden_states=hidden, hidden_rows=rows)

    def _verify_trees(self, batch: StepBatch, trees: list[DraftTree]) -> StepResult:
        """Verify every node in one target forward (tree attention over the draft block, positions
        root + depth), accept the longest path the target agrees with
        (:func:`~specserve.spec_decode.tree.accept_tree`) and move its KV entries to the
        sequence's next slots, so the cache reads as if the path had been verified as a chain."""
        if batch.any_grammar:   # nodes the grammar refuses (and their subtrees) are cut
            trees = [tree if batch.grammar(b) is None else grammar_subtree(tree, batch.grammar(b))
                     for b, tree in enumerate(trees)]
        input_ids = torch.tensor([t for tree in trees for t in tree.token_ids], dtype=torch.int64)
        positions = [p for tree, c in zip(trees, batch.context_lens) for p in tree.positions(c)]
        query_lens = [tree.num_nodes for tree in trees]
        histories = None   # penalties see the path's drafts as output
        if batch.any_penalties:
            histories = [batch.output_token_ids[b] + [tree.token_ids[n] for n in tree.path(node)]
                         for b, tree in enumerate(trees) for node in range(tree.num_nodes)]
        before = None   # a node's row is masked by the grammar's state after its path
        if batch.any_grammar:
            before = [[tree.token_ids[n] for n in tree.path(node)] for tree in trees for node in range(tree.num_nodes)]
        hidden, logits, md, probs = self._verify(batch, input_ids, query_lens, positions, histories,
                                                 [tree.attention_mask() for tree in trees], before)
        runner = self.target.runner
        emitted, accepted, drafted, rows = [], [], [], []
        start = 0
        for b, tree in enumerate(trees):
            acc = accept_tree(tree, probs[start:start + tree.num_nodes], batch.params[b].greedy, batch.generators[b])
            ctx = batch.context_lens[b]
            moves = accepted_kv_moves(batch.slot_mapping(b, ctx, ctx + tree.num_nodes), acc.accepted_nodes)
            if moves is not None:
                runner.move_kv(*moves)
            emitted.append(acc.output_token_ids)
            accepted.append(len(acc.accepted_nodes))
            drafted.append(max(tree.depths))
            rows.append([start] + [start + n for n in acc.accepted_nodes])
            start += tree.num_nodes
        return StepResult(emitted, [m + 1 for m in accepted], self._logprobs(batch, logits, md, rows, emitted),
                          drafted, accepted, hidden_states=hidden, hidden_rows=rows)
