"""The target worker: the target model, its KV cache and the sampler, run over a StepBatch.

One forward over every new token of the batch (prefill chunks and decode tokens alike), then one
sampled token for each sequence the step brings to its last token. The speculative worker
(:mod:`specserve.spec_decode.worker`) wraps it and uses its pieces for verification.
"""
from __future__ import annotations

import torch

from specserve.sample.sampler import Sampler, SamplerOutput
from specserve.worker.model_runner import ModelRunner
from specserve.worker.step import LogprobEntry, StepBatch, StepResult


def logprob_entries(out: SamplerOutput, rows: list[list[int]], params: list) -> list[list[LogprobEntry] | None] | None:
    """Per sequence b, the logprob entries of its emitted tokens, which were chosen at rows
    ``rows[b]`` of ``out`` (a :class:`SamplerOutput`); None for a sequence that asked for none
    (``params[b].logprobs is None``) and for the whole batch when no logprobs were computed."""
    if out.logprobs is None:
        return None
    lps = out.logprobs.tolist()
    top = (out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist()) if out.top_logprobs is not None else None
    entries: list[list[LogprobEntry] | None] = []
    for r, p in zip(rows, params):
        k = p.logprobs
        if k is None:
            entries.append(None)
            continue
        entries.append([(lps[row], dict(zip(top[0][row][:k], top[1][row][:k])) if top is not None and k > 0 else {})
                        for row in r])
    return entries


class TargetWorker:
    """Args:
        runner: the target's :class:`ModelRunner` (its model and paged KV tensors; under tensor
            parallelism the leader's :class:`~specserve.distributed.runner.TensorParallelRunner`).
    """

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.sampler = Sampler()

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def num_lookahead_tokens(self) -> int:
        """Cache slots past the newest token a step may write (none: no drafts)."""
        return 0

    def execute(self, batch: StepBatch) -> StepResult:
        """One forward over the batch's new tokens; one token sampled per sequence that reaches its
        end. (Freed and cached sequences need nothing: the target keeps no state beyond pages.)"""
        cu = batch.cu_query_lens
        hidden_rows = [range(cu[b], cu[b + 1]) for b in range(len(batch))]
        sampling = [b for b in range(len(batch)) if batch.samples(b)]
        scored = [(b, batch.prompt_logprob_rows(b)) for b in range(len(batch))]
        scored = [(b, r) for b, r in scored if len(r)]
        rows = [cu[b + 1] - 1 for b in sampling] + [cu[b] + p - batch.context_lens[b] for b, r in scored for p in r]
        hidden, logits = self.runner.forward_with_logits(batch.input_ids, batch.positions, batch.block_tables,
                                                         batch.context_lens, batch.query_lens, rows)   # [T, H], [R, V]
        step_logits, logit_rows = logits, rows   # kept for observers (`rows` is reused below)
        prompt_logprobs = None
        if scored:
            prompt_logprobs = self._prompt_logprobs(batch, logits[len(sampling):], scored)
            logits = logits[:len(sampling)]
        new_tokens: list[list[int]] = [[] for _ in range(len(batch))]
        logprobs = None
        if sampling:
            out = self.sampler(logits, batch.sampling_metadata(sampling, device=self.device))
            for b, t in zip(sampling, out.sampled_token_ids.tolist()):
                new_tokens[b] = [t]
            if out.logprobs is not None:   # sequence b's token is row i of the sampled rows
                rows: list[list[int]] = [[] for _ in range(len(batch))]
                for i, b in enumerate(sampling):
                    rows[b] = [i]
                logprobs = logprob_entries(out, rows, batch.params)
        return StepResult(new_tokens, list(batch.query_lens), logprobs, hidden_states=hidden,
                          hidden_rows=hidden_rows, prompt_logprobs=prompt_logprobs, logits=step_logits,
                          logit_rows=logit_rows)

    @staticmethod
    def _prompt_logprobs(batch: StepBatch, logits: torch.Tensor,
                         scored: list[tuple[int, range]]) -> list[tuple[int, list[LogprobEntry]] | None]:
        """Per sequence, the entries of the prompt tokens that follow positions ``scored``'s rows
        (``logits [R, V]``, one row per scored position, in order): log_softmax of the raw logits."""
        out: list[tuple[int, list[LogprobEntry]] | None] = [None] * len(batch)
        start = 0
        for b, positions in scored:
            n = len(positions)
            nxt = torch.tensor(batch.prompt_token_ids[b][positions.start + 1:positions.stop + 1], dtype=torch.int64)
            lp = torch.log_softmax(logits[start:start + n].to(torch.float32), dim=-1)
            chosen = lp.gather(1, nxt.to(lp.device).unsqueeze(1)).squeeze(1).tolist()
            k = min(batch.params[b].prompt_logprobs, lp.shape[-1])
            if k > 0:
                vals, ids = lp.topk(k, dim=-1)
                tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [{} for _ in range(n)]
            out[b] = (positions.start + 1, list(zip(chosen, tops)))
            start += n
        return out

    # prefix caching (specserve.kv_cache.block_manager): the target's entry at position p depends
    # on tokens 0..p only, and a prefix the target has computed is all there is to its state
    proposer = None
    controller = None
    num_speculative_tokens = 0
    kv_lookahead = 0
    prefix_needs_draft = False   # no proposer: a cached page is valid for every model there is

    def num_valid_draft_tokens(self, seq_id: int, num_computed_tokens: int) -> int:
        """Leading positions whose draft / head entries are final too (no proposer: all computed)."""
        return num_computed_tokens

    def set_num_speculative_tokens(self, k: int) -> None:
        raise ValueError(f"num_speculative_tokens {k!r}: this engine runs without speculation")
