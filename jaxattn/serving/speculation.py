"""The engine's drafts: which decode rows draft how many tokens this step, and what the drafts did.

`Speculator` asks a proposer (`jaxattn.speculative.proposal.Proposer`: prompt lookup, `NgramProposer`, or a
draft model, `DraftProposer`) for each decode row's drafts, and gives every request its own k
(`jaxattn.speculative.schedule.AdaptiveK`): the count expected to give the most tokens per second, from the
request's acceptance so far and what steps of each width cost on this machine (`costs`, a
`jaxattn.speculative.schedule.DraftCosts` the engine times its decode-only steps into); at 0, after
`probe_after` plain steps one token again. The scheduler asks it for a step's drafts (`drafts`), within the token budget (a row
drafting d tokens costs d + 1) and the tokens each row may still draw; a step in which no row drafts is a
plain step (and may be overlapped or run several decode steps in one call).

Each running request holds one of the proposer's `rows` rows (`Request.draft_row`) while it drafts: a
draft model keeps a dense cache per row and works out from a row's history what it has not yet seen (a
new request's prompt on its first step, a row's kept drafts after). Every call passes all rows, a row
not in the step its last history again (a draft model then feeds one token). A draft model's programs
compile per width of that catch-up (`jaxattn.speculative.draft`); the first, a step's usual one, at
start-up (`warm_up`).

Its counters follow vLLM's spec-decode metrics: verification steps, drafts (rows that drafted), draft
tokens, accepted tokens, accepted tokens per position, and the host's time drafting.
"""

from __future__ import annotations

import time

import numpy as np

from jaxattn.serving.requests import Request, Status
from jaxattn.speculative.proposal import Proposer
from jaxattn.speculative.schedule import AdaptiveK, DraftCosts, widths


class Speculator:
    """A proposer's drafts for the engine's decode rows, each row's k adapting to its acceptance.

    Args:
      proposer: `NgramProposer` or `DraftProposer`; its `k` is the most drafts a row proposes per step (the
        verification's width is k + 1).
      rows: the rows the proposer holds (the engine's `max_seqs`).
      capacity: the most tokens of a row (the engine's `max_model_len`).
      probe_after: plain steps at k = 0 before a row drafts again.
      adaptive: each row's k follows its acceptance; False: always k.

    Attributes:
      costs: what a step of each width costs against a plain one (`observe` times the engine's steps).
      steps, drafts, draft_tokens, accepted_tokens: counts over the verification steps (vLLM's names).
      accepted_per_position: `[k]` int, drafts kept at position i.
      draft_seconds: host time spent looking up drafts.
    """

    def __init__(self, proposer: Proposer, *, rows: int, capacity: int, probe_after: int = 16,
                 adaptive: bool = True):
        self.proposer, self.k, self.probe_after, self.adaptive = proposer, proposer.k, probe_after, adaptive
        proposer.begin(rows, capacity)
        self.costs = DraftCosts(widths(self.k))
        self._histories = [np.zeros(1, np.int32) for _ in range(rows)]  # each row's last history
        self._holders: list[Request | None] = [None] * rows
        self.steps = self.drafts_made = self.draft_tokens = self.accepted_tokens = 0
        self.accepted_per_position = np.zeros(self.k, np.int64)
        self.draft_seconds = 0.0

    def warm_up(self) -> None:
        """One call of the proposer on every row's one-token history: a draft model's usual program compiles."""
        self.proposer.propose(self._histories, self.k)

    def _schedule(self, request: Request) -> AdaptiveK:
        if request.draft_schedule is None:
            request.draft_schedule = AdaptiveK(self.k, probe_after=self.probe_after, adaptive=self.adaptive,
                                               costs=self.costs)
        return request.draft_schedule

    def _row(self, request: Request) -> int:
        """The proposer's row the request holds (a free one taken: its holder no longer runs)."""
        row = request.draft_row
        if row is None or self._holders[row] is not request:
            row = next(i for i, holder in enumerate(self._holders)
                       if holder is None or holder.status is not Status.RUNNING or holder.draft_row != i)
            self._holders[row], request.draft_row = request, row
        return row

    def may_draft(self, requests: list[Request]) -> bool:
        """Some row would look for drafts at its next step (its k is above 0)."""
        return any(self._schedule(request).k > 0 for request in requests)

    def plain_step(self, requests: list[Request]) -> None:
        """A plain step ran for these rows: those backing off (k = 0) count it towards their next probe."""
        for request in requests:
            schedule = self._schedule(request)
            if schedule.k == 0:
                schedule.update(0, 0)

    def propose(self, requests: list[Request], left: list[int], budget: int, reserve) -> list[np.ndarray]:
        """Each row's drafts for this step (at most its k, `left[i] - 1`: the row emits drafts + 1 tokens at
        most, and `budget` tokens in all, the rows' last tokens counted), cut to the slots its pages hold
        (`reserve(request, count)`: `KVCacheManager.reserve`); empty where it drafts nothing. A row backing
        off (k = 0) counts a plain step."""
        started = time.perf_counter()
        if self.adaptive and self.costs.wants_plain(len(requests)):  # timing the unit of a draft's cost
            return [np.zeros(0, np.int32)] * len(requests)
        budget -= len(requests)
        ks = []
        for request, most in zip(requests, left):
            schedule = self._schedule(request)
            ks.append(min(schedule.for_rows(len(requests)), most - 1, max(budget, 0)))
            budget -= ks[-1]
            if schedule.k == 0:
                schedule.update(0, 0)
        drafts = [np.zeros(0, np.int32)] * len(requests)
        if max(ks) > 0:
            rows = [self._row(request) for request in requests]
            for request, row in zip(requests, rows):
                self._histories[row] = np.asarray(request.tokens, np.int32)
            proposal = self.proposer.propose(self._histories, max(ks))
            drafts = [proposal.tokens[row, :min(k, proposal.num[row])] for row, k in zip(rows, ks)]
            drafts = [draft[:reserve(request, len(draft) + 1) - 1] if len(draft) else draft
                      for request, draft in zip(requests, drafts)]
        self.draft_seconds += time.perf_counter() - started
        return drafts

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        """A decode-only step of `rows` rows and at most `drafts` drafts a row (0: plain) took `seconds`."""
        self.costs.observe(rows, drafts, seconds)

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """After a verification step: the row drafted `proposed` tokens and kept `accepted`; its k follows."""
        if proposed:
            self.drafts_made += 1
            self.draft_tokens += proposed
            self.accepted_tokens += accepted
            self.accepted_per_position[:accepted] += 1
            self._schedule(request).update(proposed, accepted)

    def metrics(self) -> dict:
        """The counters, and the acceptance rate (accepted / draft tokens) and mean tokens emitted per
        drafting row (1 + accepted / drafts)."""
        return {"steps": self.steps, "drafts": self.drafts_made, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens,
                "accepted_per_position": self.accepted_per_position.tolist(),
                "acceptance_rate": self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0,
                "mean_emitted": 1 + self.accepted_tokens / self.drafts_made if self.drafts_made else 1.0,
                "draft_seconds": self.draft_seconds}
