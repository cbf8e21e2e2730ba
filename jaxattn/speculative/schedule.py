"""How many tokens to draft next step: the count that is expected to give the most tokens per unit of time.

A verification step of d drafts (a forward of d + 1 tokens) costs more than a plain step, and pays back
only in the drafts kept. With a per-token acceptance rate a (each draft kept with probability a, given the
ones before it were: Leviathan et al. 2023, §3.3), a step of d drafts emits in expectation

    E(d) = 1 + a + a^2 + ... + a^d = (1 - a^(d + 1)) / (1 - a)

tokens, at a cost c(d) in plain steps (c(0) = 1). `AdaptiveK` picks the d that maximises E(d) / c(d):

* a is each request's own (`AdaptiveK.acceptance`): a decayed count of drafts kept over drafts tried (a
  draft after a rejected one is not tried), from a prior of 1/2, so it follows the text as it changes;
* c(d) is the machine's (`DraftCosts`): the measured seconds of verification steps of that width over
  those of plain steps at the same number of rows (medians of the last few), until measured a guess (each
  draft a tenth of a step).
  A verification that costs little (a float32 step, memory-bound) makes long drafts pay at a modest
  acceptance; a costly one (a quantized step, whose products grow with the rows) needs a high one.

Where no d > 0 is expected to pay, k is 0 (plain steps) and, after `probe_after` plain steps, 1 again for
one step, to notice a stretch of text that starts to repeat its input (or that a draft model starts to
predict). A probe whose draft is rejected doubles the plain steps before the next (up to `MAX_PROBE_GAP`
times `probe_after`): free text, where drafts seldom pay, is seldom probed. A step without drafts (no n-gram
match) leaves k as it is. `adaptive=False` keeps k at its most.
"""

from __future__ import annotations

import collections
import dataclasses

from jaxattn._validate import is_int

PRIOR_DRAFT_COST = 0.1  # a drafted token's cost in plain steps, until a verification has been timed
DECAY = 0.9  # how much of the acceptance counts so far each verification keeps
COST_WINDOW = 9  # the timings of a step's shape its cost is the lower median of
MAX_PROBE_GAP = 8  # the most plain steps between probes, in units of probe_after
PLAIN_EVERY = 8  # until plain steps are timed at some rows, every this many steps there is one


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens a step of `drafts` drafts emits in expectation, each kept with probability `acceptance`."""
    return sum(acceptance ** i for i in range(drafts + 1))


def widths(k: int) -> tuple[int, ...]:
    """The verification widths (tokens a row) for drafts of up to `k` tokens: 1 + 1, 2, 4, ... and 1 + k
    (the engine compiles these; d drafts run in the narrowest that holds d + 1)."""
    counts, count = {k}, 1
    while count < k:
        counts.add(count)
        count *= 2
    return tuple(sorted(1 + c for c in counts))


@dataclasses.dataclass
class DraftCosts:
    """What a step of d drafts a row costs, in plain steps, as measured on this machine.

    `observe(rows, drafts, seconds)` takes each decode-only step's wall time (drafts 0: a plain step), the
    first of each shape left out (it may have compiled); `relative(rows, d)` is a step of d drafts' seconds
    over a plain step's at those rows, or `1 + PRIOR_DRAFT_COST * d` until both are measured. Each is the
    lower median of the shape's last `COST_WINDOW` timings: a step slowed by something else (a collection, a
    page fault, another process) must not make a width look dear for good, since a width that looks dear is
    not chosen, so not timed again. Steps of d drafts run in the narrowest of `widths` that holds d + 1
    tokens, so d counts are timed by that width.

    Attributes:
      widths: the verification widths (`widths(k)`).
      timings: `(rows, width) -> deque` of the last seconds a step (width 1: plain).
    """

    widths: tuple[int, ...]
    timings: dict = dataclasses.field(default_factory=dict)
    _seen: set = dataclasses.field(default_factory=set)
    _steps: dict = dataclasses.field(default_factory=dict)  # steps observed by rows

    def width(self, drafts: int) -> int:
        return 1 if drafts == 0 else min(w for w in self.widths if w > drafts)

    def candidates(self, most: int) -> tuple[int, ...]:
        """The draft counts worth weighing up to `most`: 0 and each width's fullest (d = w - 1)."""
        return (0, *(w - 1 for w in self.widths if w - 1 <= most))

    def observe(self, rows: int, drafts: int, seconds: float) -> None:
        self._steps[rows] = self._steps.get(rows, 0) + 1
        key = (rows, self.width(drafts))
        if key not in self._seen:  # a shape's first step may have compiled its program
            self._seen.add(key)
            return
        self.timings.setdefault(key, collections.deque(maxlen=COST_WINDOW)).append(seconds)

    def seconds(self, rows: int, width: int) -> float | None:
        """A step's seconds at `rows` rows of `width` tokens (the lower median of its last timings), or None."""
        timings = self.timings.get((rows, width))
        return sorted(timings)[(len(timings) - 1) // 2] if timings else None

    def knows_plain(self, rows: int) -> bool:
        """A plain step at `rows` rows has been timed: the unit a draft's cost is measured in."""
        return (rows, 1) in self.timings

    def wants_plain(self, rows: int) -> bool:
        """The next step at `rows` rows should be a plain one: plain steps are not yet timed there and this is
        every `PLAIN_EVERY`-th step. Else a row that always drafts (a code edit) would never learn what its
        drafts cost, and would keep drafting at the prior's price where they do not pay."""
        return not self.knows_plain(rows) and self._steps.get(rows, 0) % PLAIN_EVERY == PLAIN_EVERY - 1

    def relative(self, rows: int, drafts: int) -> float:
        if drafts == 0:
            return 1.0
        plain, verify = self.seconds(rows, 1), self.seconds(rows, self.width(drafts))
        if plain is None or verify is None:
            return 1.0 + PRIOR_DRAFT_COST * drafts
        return verify / plain


@dataclasses.dataclass
class AdaptiveK:
    """The k of the next step (see the module docstring).

    Attributes:
      k_max: the most drafts per step (the proposer's k).
      probe_after: plain steps at k = 0 before drafting one token again.
      adaptive: False keeps k at `k_max` throughout.
      costs: the machine's costs (shared by the requests of an engine); None: `DraftCosts(widths(k_max))`.
      rows: the rows of the steps this request's k is chosen for (the costs depend on them).
      k: the current k.
    """

    k_max: int
    probe_after: int = 16
    adaptive: bool = True
    costs: DraftCosts | None = None
    rows: int = 1
    k: int = -1
    kept: float = 0.0  # drafts kept, decayed
    tried: float = 0.0  # drafts tried (up to the first rejected one), decayed
    _plain_steps: int = 0
    _gap: int = 0  # plain steps before the next probe (0: probe_after)
    _probing: bool = False

    def __post_init__(self):
        for name in ("k_max", "probe_after"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.costs is None:
            self.costs = DraftCosts(widths(self.k_max))
        if self.k < 0:
            self.k = self.best() if self.adaptive else self.k_max

    @property
    def acceptance(self) -> float:
        """The chance that a draft is kept (its predecessors kept), from a prior of one kept in two tried."""
        return (self.kept + 1) / (self.tried + 2)

    def best(self) -> int:
        """The draft count with the most expected tokens per unit of cost (0: plain steps pay best)."""
        a = self.acceptance
        return max(self.costs.candidates(self.k_max),
                   key=lambda d: (expected_tokens(a, d) / self.costs.relative(self.rows, d), -d))

    def for_rows(self, rows: int) -> int:
        """The k for a step of `rows` decode rows (the costs depend on them); a k of 0 stays 0 until its probe."""
        if self.adaptive and self.k > 0 and rows != self.rows:
            self.rows = rows
            self.k = self.best()
        self.rows = rows
        return self.k

    @property
    def plain_run(self) -> int:
        """At k = 0, the plain steps left before the next probe (a caller may run them in one program); else 0."""
        return self.gap - self._plain_steps if self.adaptive and self.k == 0 else 0

    @property
    def gap(self) -> int:
        """Plain steps at k = 0 before the next probe."""
        return self._gap or self.probe_after

    def update(self, proposed: int, accepted: int, steps: int = 1) -> int:
        """After a step that proposed `proposed` drafts (the most of any row) and kept `accepted` (the most
        of any row), or after `steps` plain steps at k = 0: the next step's k."""
        if not self.adaptive:
            return self.k
        if proposed > 0:
            self.kept = DECAY * self.kept + accepted
            self.tried = DECAY * self.tried + min(accepted + 1, proposed)
            if self._probing:  # a rejected probe waits twice as long for the next
                self._gap = min(2 * self.gap, MAX_PROBE_GAP * self.probe_after) if accepted == 0 else 0
            self.k, self._plain_steps, self._probing = self.best(), 0, False
        elif self.k == 0:
            self._plain_steps += steps
            if self._plain_steps >= self.gap:
                self.k, self._plain_steps, self._probing = min(1, self.k_max), 0, True
        return self.k
