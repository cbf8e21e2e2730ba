"""What a speculative generation did: steps, drafts proposed and accepted per position, time spent drafting.

The names follow vLLM's spec-decode metrics: the acceptance rate is accepted / proposed drafts; the
mean accepted per step counts the drafts a step kept (each step also emits one token of its own, so
a step emits `1 + mean_accepted` tokens on average); per position i, the share of the steps that
proposed an i-th draft in which it was kept.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class SpeculativeStats:
    """Counts over a generation's verification steps (all rows together).

    Attributes:
      steps: verification steps (each one forward pass of the target over k + 1 tokens per row).
      proposed_at: `[k_max]` int, rows that proposed a draft at position i (0-based), summed over steps.
      accepted_at: `[k_max]` int, of those, the drafts kept.
      draft_seconds: wall time in the proposer's `propose` (a draft model's forward passes, or the lookup).
      k_trace: the k each step asked the proposer for (the adaptive schedule, `jaxattn.speculative.schedule`).
    """

    steps: int = 0
    proposed_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int64))
    accepted_at: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.int64))
    draft_seconds: float = 0.0
    k_trace: list = dataclasses.field(default_factory=list)

    @classmethod
    def empty(cls, k_max: int) -> "SpeculativeStats":
        return cls(proposed_at=np.zeros((k_max,), np.int64), accepted_at=np.zeros((k_max,), np.int64))

    def record(self, k: int, num_proposed: np.ndarray, accepted: np.ndarray) -> None:
        """One step that asked for `k` drafts: per row, the drafts proposed `[B]` and kept `[B]`."""
        positions = np.arange(len(self.proposed_at))[None, :]
        self.proposed_at += np.sum(positions < np.asarray(num_proposed)[:, None], axis=0)
        self.accepted_at += np.sum(positions < np.asarray(accepted)[:, None], axis=0)
        self.steps += 1
        self.k_trace.append(int(k))

    @property
    def proposed(self) -> int:
        return int(self.proposed_at.sum())

    @property
    def accepted(self) -> int:
        return int(self.accepted_at.sum())

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (0 when none was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts kept per step (0 without steps)."""
        return self.accepted / self.steps if self.steps else 0.0

    def acceptance_by_position(self) -> list[float | None]:
        """Per draft position, the share kept of those proposed there (None where none was)."""
        return [float(a / p) if p else None for a, p in zip(self.accepted_at, self.proposed_at)]

    def as_dict(self) -> dict:
        """A JSON-able summary."""
        return {"steps": self.steps, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.acceptance_rate, "mean_accepted": self.mean_accepted,
                "acceptance_by_position": self.acceptance_by_position(), "draft_seconds": self.draft_seconds}
