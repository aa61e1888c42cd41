"""Running the engine's models outside any request: teacher-forced scoring and measurements.

Head training, ``bench --quality`` and the step benchmarks need the target's hidden states and
logits of given token segments, or a decode step at a chosen context, without a request's
sampling, stop rules and outputs. A :class:`ScratchSequence` holds pages of the engine's own pool
under a sequence id of the engine's (never a request's), runs the target's (or the draft model's)
runner over them, and gives the pages back when its ``with`` block ends.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from specserve.worker.model_runner import ModelInput


@dataclass
class Scores:
    """What :meth:`~specserve.engine.engine.LLMEngine.score` computed.

    Attributes:
        hidden_states: ``[sum L, H]`` final hidden states of the segments' tokens, segment after
            segment (``[sum L, (1 + n) H]`` with n auxiliary layers, see
            :meth:`~specserve.models.llama.LlamaForCausalLM.forward`).
    """

    hidden_states: torch.Tensor
    _compute_logits: Callable[[torch.Tensor, list[int]], torch.Tensor]

    def logits(self, rows: list[int]) -> torch.Tensor:
        """``[len(rows), V]`` float32 logits of rows of :attr:`hidden_states` (ask in chunks: V is large)."""
        return self._compute_logits(self.hidden_states, rows)


class ScratchSequence:
    """Pages for ``num_tokens`` tokens outside any request, and a runner to fill and read them.

    Attributes:
        block_table: its page ids.
        model: the model the runner runs (its linears and weights, for byte counts and timers).
        kv_cache: that model's paged KV tensors.
    """

    def __init__(self, runner, block_table: list[int], num_tokens: int):
        self.runner, self.block_table, self.num_tokens = runner, block_table, num_tokens
        self.model, self.kv_cache = runner.model, runner.kv_cache

    def forward(self, token_ids: list[int], start: int) -> torch.Tensor:
        """Write the entries of ``token_ids`` at positions ``start ..`` (those before are the
        context) and return their final hidden states ``[len(token_ids), H]``.

        Raises:
            ValueError: the tokens run past the pages held.
        """
        if start + len(token_ids) > self.num_tokens:
            raise ValueError(f"positions {start}..{start + len(token_ids) - 1} run past the {self.num_tokens} "
                             f"tokens this scratch sequence holds")
        return self.runner.forward([ModelInput(list(token_ids), start, self.block_table)]).hidden_states

    def logits(self, hidden_states: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``[len(rows), V]`` float32 logits of rows of the last forward's hidden states."""
        return self.runner.compute_logits(hidden_states, rows)


def _runner(engine, model: str):
    if model == "target":
        return engine.target.runner
    if model == "draft":
        runner = getattr(engine.proposer, "runner", None)
        if runner is None:
            raise ValueError("model='draft' needs an engine whose speculation method runs a draft model")
        return runner
    raise ValueError(f"model must be 'target' or 'draft', got {model!r}")


@contextmanager
def scratch_sequences(engine, lengths: list[int], model: str = "target") -> Iterator[list[ScratchSequence]]:
    """Hold pages for sequences of ``lengths`` tokens in ``engine``'s pool while the block runs.

    Raises:
        ValueError: ``model`` is not ``"target"`` or ``"draft"``, or ``"draft"`` without a draft model.
        NoFreeBlocksError: the pages are not free.
    """
    runner, bm = _runner(engine, model), engine.block_manager
    seq_ids = []
    try:
        for n in lengths:
            seq_ids.append(engine.new_seq_id())
            bm.allocate(seq_ids[-1], n)
        yield [ScratchSequence(runner, bm.block_table(s), n) for s, n in zip(seq_ids, lengths)]
    finally:
        for s in seq_ids:
            if bm.has_seq(s):
                bm.free(s)


@torch.inference_mode()
def score_segments(engine, segments: list[list[int]]) -> Scores:
    """:meth:`~specserve.engine.engine.LLMEngine.score`: one target forward over every segment,
    each from position 0 in pages of its own, freed before this returns."""
    with scratch_sequences(engine, [len(s) for s in segments]) as seqs:
        runner = seqs[0].runner
        hidden = runner.forward([ModelInput(list(seg), 0, q.block_table) for seg, q in zip(segments, seqs)])
        return Scores(hidden.hidden_states, engine.compute_logits)
