"""What one step computes, as the scheduler hands it to the model runner: plain data (`SchedulerOutput`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jaxattn.serving.requests import Request


class PromptChunk(NamedTuple):
    """A piece of a prompt in a step: `count` tokens of `request` from position `start`."""

    request: Request
    start: int
    count: int


@dataclasses.dataclass
class SchedulerOutput:
    """One step, as the model runner takes it.

    Attributes:
      decode: requests decoding one token each (their last), in row order.
      prefill: prompt chunks in row order (one request may have several, consecutive).
      ended: requests cancelled since the last step (nothing to compute; they ended here).
      turns: per decode row, the most tokens it draws in this call (several decode steps in one call);
        empty: one step.
      drafts: a verification step (speculative decoding): per decode row its drafted tokens (some empty);
        empty: no verification.
      fed_by: a step scheduled ahead (`Scheduler.schedule_ahead`): per decode request, its row in the step
        in flight, which it keeps, taking the token drawn there on the device; empty: the requests take
        rows 0, 1, ... and every token is the host's.
    """

    decode: list[Request]
    prefill: list[PromptChunk]
    ended: list[Request]
    turns: list[int] = dataclasses.field(default_factory=list)
    drafts: list = dataclasses.field(default_factory=list)
    fed_by: list[int] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> int:
        """The most decode steps the call runs (1: a plain step)."""
        return max(self.turns, default=1)

    @property
    def empty(self) -> bool:
        """Nothing to compute."""
        return not self.decode and not self.prefill
