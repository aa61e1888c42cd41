"""Speculative-decoding statistics, per request and for the engine.

Terms: a *verify step* is one target forward over a sequence's newest token plus its draft tokens.
*Acceptance rate* = accepted draft tokens / proposed draft tokens. *Acceptance length* = tokens
produced per verify step, bonus or recovered token included (so it is at least 1 and at most k+1).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Counters (tokens) and timings (seconds) of speculative steps."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts accepted at position j
    drafted_per_position: list[int] = field(default_factory=list)   # [k]: drafts proposed at position j
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    num_sync_free_steps: int = 0   # engine steps run by the sync-free MTP path

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Record one verify step of one sequence."""
        self.num_verify_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        grow = num_draft - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for j in range(num_draft):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += int(j < num_accepted)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens produced per verify step, bonus included."""
        if not self.num_verify_steps:
            return None
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of drafts accepted at each draft position (position 0 = first draft token)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def as_dict(self) -> dict:
        return {"num_verify_steps": self.num_verify_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length,
                "acceptance_by_position": self.acceptance_by_position,
                "draft_time_s": self.draft_time_s, "verify_time_s": self.verify_time_s,
                "num_sync_free_steps": self.num_sync_free_steps}


@dataclass
class StepStats:
    """What one engine step did (read by the server's Prometheus metrics after every step).

    ``num_speculative_tokens`` is the k chosen for a decode-only step when speculation is
    configured (0 = speculation off for this step), None for other steps. ``acceptance`` holds
    ``(num_draft_tokens, num_accepted)`` per sequence of a speculative step.
    """

    num_scheduled: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_cache_usage: float
    num_speculative_tokens: int | None
    acceptance: list[tuple[int, int]]
    step_time_s: float
