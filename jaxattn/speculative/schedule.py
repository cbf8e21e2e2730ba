"""How many tokens to draft next step: k backs off where drafts are rejected and grows back where they are not.

A verification step of k + 1 tokens costs more than a plain step of one (more so with larger k), and
pays back only in accepted drafts. `AdaptiveK` follows the acceptance of the last step:

* a step that proposed and kept nothing halves k (down to 0: plain decoding steps, no drafts);
* a step that kept every draft doubles k (from 0 to 1), up to the proposer's k;
* a step that kept some drafts keeps k;
* after `probe_after` plain steps at k = 0, k goes to 1 to look again, so a stretch of text that
  starts to repeat its input (or that a draft model starts to predict) is noticed.

So free text, whose drafts are mostly rejected, runs mostly plain steps, and a summary, whose drafts
are mostly kept, runs at the full k. A step without drafts (no n-gram match) leaves k as it is.
"""

from __future__ import annotations

import dataclasses

from jaxattn._validate import is_int


@dataclasses.dataclass
class AdaptiveK:
    """The k of the next step (see the module docstring).

    Attributes:
      k_max: the most drafts per step (the proposer's k).
      probe_after: plain steps at k = 0 before drafting one token again.
      adaptive: False keeps k at `k_max` throughout.
      k: the current k.
    """

    k_max: int
    probe_after: int = 16
    adaptive: bool = True
    k: int = -1
    _plain_steps: int = 0

    def __post_init__(self):
        for name in ("k_max", "probe_after"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if self.k < 0:
            self.k = self.k_max

    @property
    def plain_run(self) -> int:
        """At k = 0, the plain steps left before the next probe (a caller may run them in one program); else 0."""
        return self.probe_after - self._plain_steps if self.adaptive and self.k == 0 else 0

    def update(self, proposed: int, accepted: int, steps: int = 1) -> int:
        """After a step that proposed `proposed` drafts (the most of any row) and kept `accepted` (the most
        of any row), or after `steps` plain steps at k = 0: the next step's k."""
        if not self.adaptive:
            return self.k
        if self.k == 0:
            self._plain_steps += steps
            if self._plain_steps >= self.probe_after:
                self.k, self._plain_steps = min(1, self.k_max), 0
        elif proposed > 0 and accepted == 0:
            self.k //= 2
        elif proposed > 0 and accepted >= proposed:
            self.k = min(2 * self.k, self.k_max)
        return self.k
