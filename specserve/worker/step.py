"""The two records a step's data flows through, one way: the engine hands a worker a
:class:`StepBatch` and commits the :class:`StepResult` it gets back.

A worker never sees a ``Request`` and never changes the engine's state; the engine never looks
inside a worker. Row ``b`` of every per-sequence list is the same sequence, in the scheduler's order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from specserve.attention.metadata import slot_ids
from specserve.sample.sampler import SamplingMetadata
from specserve.sampling_params import SamplingParams
from specserve.structured_output import GrammarState

# (logprob of the emitted token, {token id: logprob} of the top ones), per emitted token
LogprobEntry = tuple[float, dict[int, float]]


@dataclass(eq=False)
class StepBatch:
    """One step's work for B sequences, built once on the host by the scheduler.

    Per sequence b:
        seq_ids[b]: the key of its pages (and of every proposer's state for it).
        prompt_token_ids[b], output_token_ids[b], token_ids[b]: its tokens so far (prompt, output,
            both): the engine's own lists, held, not copied; read only.
        context_lens[b]: tokens already in the KV cache. query_lens[b]: tokens this step computes
            from there: a prompt chunk, a recompute after preemption, or 1 (the newest token).
        block_tables[b]: its page ids (the scheduler allocated them for this step, lookahead included).
        params[b], generators[b]: its sampling parameters and its own generator (None: shared RNG).
        max_new_tokens[b]: tokens it may still emit (``max_tokens`` and ``max_model_len``).
        max_draft_tokens[b]: drafts a verification may add after its newest token without
            passing ``max_tokens`` or writing past ``max_model_len`` (a speculative step drafts
            at most this many; 0 when none fit).
    Step-wide:
        block_size: tokens per page.
        expected_batch_size: sequences expected to decode together (running + waiting, at most
            ``max_num_seqs``): the batch size a new prompt will decode in.
        grammars: per sequence its :class:`~specserve.structured_output.GrammarState` at the
            committed output (structured output) or None; None for the whole batch when no
            sequence has one. A worker reads masks after uncommitted drafts and never commits.
        freed_seq_ids: sequences finished, aborted or preempted since the last batch: the worker
            forgets them before this step (their ids never come back).
        cached_prefixes: ``(seq_id, num_tokens, num_draft_tokens)`` of the sequences admitted
            this step on cached pages: the target's entries of their first ``num_tokens``
            positions and the proposer's of the first ``num_draft_tokens`` are already there.

    Derived (once, on first use): ``input_ids [T]`` and ``positions [T]`` int64 over the T =
    sum(query_lens) new tokens, ``cu_query_lens [B + 1]`` (row offsets, a host list).
    """

    seq_ids: list[int]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    token_ids: list[list[int]]
    context_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    max_new_tokens: list[int]
    max_draft_tokens: list[int]
    block_size: int
    expected_batch_size: int = 1
    grammars: list[GrammarState | None] | None = None
    freed_seq_ids: list[int] = field(default_factory=list)
    cached_prefixes: list[tuple[int, int, int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)

    def num_tokens(self, b: int) -> int:
        """Tokens of sequence b so far (prompt + output)."""
        return len(self.token_ids[b])

    def samples(self, b: int) -> bool:
        """This step reaches sequence b's last token: its logits give the next token."""
        return self.context_lens[b] + self.query_lens[b] == len(self.token_ids[b])

    @cached_property
    def is_decode_only(self) -> bool:
        """Every sequence adds exactly its newest token (the batches speculation runs on)."""
        return bool(self.seq_ids) and all(q == 1 and self.samples(b) for b, q in enumerate(self.query_lens))

    @cached_property
    def cu_query_lens(self) -> list[int]:
        cu = [0]
        for q in self.query_lens:
            cu.append(cu[-1] + q)
        return cu

    @cached_property
    def input_ids(self) -> torch.Tensor:
        ids = [t for toks, c, q in zip(self.token_ids, self.context_lens, self.query_lens) for t in toks[c:c + q]]
        return torch.tensor(ids, dtype=torch.int64)

    @cached_property
    def positions(self) -> torch.Tensor:
        return torch.tensor([p for c, q in zip(self.context_lens, self.query_lens) for p in range(c, c + q)],
                            dtype=torch.int64)

    @cached_property
    def any_logprobs(self) -> bool:
        return any(p.logprobs is not None for p in self.params)

    def prompt_logprob_rows(self, b: int) -> range:
        """Positions of this step's rows of sequence b whose next token is a prompt token (empty
        unless it asked for ``prompt_logprobs``)."""
        if self.params[b].prompt_logprobs is None:
            return range(0)
        c = self.context_lens[b]
        return range(c, min(c + self.query_lens[b], len(self.prompt_token_ids[b]) - 1))

    @cached_property
    def any_penalties(self) -> bool:
        return any(p.has_penalties for p in self.params)

    @cached_property
    def any_grammar(self) -> bool:
        """Some sequence's output is constrained by a grammar (structured output)."""
        return self.grammars is not None and any(g is not None for g in self.grammars)

    def grammar(self, b: int) -> GrammarState | None:
        return self.grammars[b] if self.grammars is not None else None

    def select(self, rows: list[int]) -> "StepBatch":
        """The sub-batch of sequences ``rows`` (same lists, same order)."""
        def pick(xs):
            return [xs[b] for b in rows]
        return StepBatch(pick(self.seq_ids), pick(self.prompt_token_ids), pick(self.output_token_ids),
                         pick(self.token_ids), pick(self.context_lens), pick(self.query_lens),
                         pick(self.block_tables), pick(self.params), pick(self.generators),
                         pick(self.max_new_tokens), pick(self.max_draft_tokens), self.block_size,
                         self.expected_batch_size, pick(self.grammars) if self.grammars is not None else None)

    def slot_mapping(self, b: int, start: int, end: int) -> torch.Tensor:
        """``[end - start]`` int64 cache slots of sequence b's indices ``start .. end - 1``."""
        return slot_ids(self.block_tables[b], start, end, self.block_size)

    def sampling_metadata(self, rows: list[int] | None = None, output_histories: list[list[int]] | None = None,
                          device: torch.device | str = "cpu",
                          drafts: list[list[int]] | None = None) -> SamplingMetadata:
        """:class:`SamplingMetadata` with one logits row per entry of ``rows`` (sequence indices; a
        sequence repeats once per verified position; default: every sequence once).
        ``output_histories`` replaces each row's output tokens (drafts count as output for penalties).
        ``drafts``: per row, the uncommitted tokens before it (default none): a grammar's mask for
        the row is its state after them."""
        rows = list(range(len(self))) if rows is None else rows
        histories = output_histories if output_histories is not None else [self.output_token_ids[b] for b in rows]
        masks = None
        if self.any_grammar:
            masks = [None if self.grammars[b] is None else
                     self.grammars[b].allowed_token_mask(drafts[r] if drafts is not None else ())
                     for r, b in enumerate(rows)]
        return SamplingMetadata.build([self.params[b] for b in rows], [self.prompt_token_ids[b] for b in rows],
                                      histories, [self.generators[b] for b in rows], device=device,
                                      allowed_token_masks=masks)


@dataclass(eq=False)
class StepResult:
    """What a worker computed for a :class:`StepBatch`, per sequence b:

        new_token_ids[b]: tokens to append, in order: none (a prompt chunk short of the prompt's
            end), one (a plain step), or the accepted drafts then the recovered or bonus token.
        num_computed_tokens[b]: tokens whose KV this step made valid (``query_lens[b]``; after a
            verification: the newest token and the accepted drafts).
        logprobs[b]: one :data:`LogprobEntry` per new token, or None when it asked for none.
        prompt_logprobs[b]: ``(i, entries)``: the :data:`LogprobEntry` of prompt tokens ``i, i+1,
            ...`` (each given the tokens before it) that this step's rows scored; None when it
            asked for none or scored no prompt token.
        num_draft_tokens[b] / num_accepted_tokens[b]: drafts verified (a tree: its depth) and
            accepted; None for the whole step when it verified nothing.
    Step-wide:
        num_speculative_tokens: the k the step drafted with (0: a plain decode step chosen by the
            adaptive controller; None: no speculation was considered).
        draft_time_s, verify_time_s: seconds drafting (catch-up included) and verifying.
        sync_free: the step ran the sync-free chain path (one host read).
        hidden_states ``[T, H]`` and hidden_rows[b]: the target's final hidden states and, per
            sequence, the rows of its computed positions ``context_lens[b] ...`` (heads read them).
        logits ``[R, V]`` float32 and logit_rows ``[R]``: the raw target logits the step computed
            (before any sampling processor) and the hidden-state rows they score (a plain step's
            sampled and prompt-logprob rows; None where not kept), so observers need not recompute them.
    """

    new_token_ids: list[list[int]]
    num_computed_tokens: list[int]
    logprobs: list[list[LogprobEntry] | None] | None = None
    num_draft_tokens: list[int] | None = None
    num_accepted_tokens: list[int] | None = None
    num_speculative_tokens: int | None = None
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    sync_free: bool = False
    hidden_states: torch.Tensor | None = field(default=None, repr=False)
    hidden_rows: list[list[int] | range] | None = None
    prompt_logprobs: list[tuple[int, list[LogprobEntry]] | None] | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)
    logit_rows: list[int] | None = None

    @property
    def verified(self) -> bool:
        return self.num_accepted_tokens is not None

    @property
    def acceptance(self) -> list[tuple[int, int]]:
        """(drafted, accepted) per sequence; empty when nothing was verified."""
        if not self.verified:
            return []
        return list(zip(self.num_draft_tokens, self.num_accepted_tokens))
