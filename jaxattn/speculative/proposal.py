"""The proposers' one interface: a row's history in, up to k drafted tokens out.

Every proposer (`jaxattn.speculative.ngram.NgramProposer`, `jaxattn.speculative.draft.DraftProposer`)
has:

* `k`: the most tokens it drafts per step;
* `begin(batch_size, capacity)`: called before a generation whose rows hold at most `capacity`
  tokens (prompt, output and drafts), so a model proposer can size its cache;
* `propose(histories, k) -> Proposal`: per row, given the row's history (`[L_b]` ids, prompt then
  output so far), at most `k` drafted tokens. A row may draft fewer, or none. A proposer that keeps
  state (a draft model's cache) works out from the histories what changed since its last call, so
  the caller never tells it what the target accepted.

Drafts are deterministic here (a point mass), which rejection sampling accepts as any draft
distribution (`jaxattn.speculative.acceptance.point_mass`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import numpy as np


class Proposal(NamedTuple):
    """What a proposer drafted for B rows.

    Attributes:
      tokens: `[B, k]` int32 numpy drafted ids, row b's first `num[b]` real, the rest 0.
      num: `[B]` int32 numpy drafted tokens per row, in `[0, k]`.
    """

    tokens: np.ndarray
    num: np.ndarray

    @classmethod
    def from_rows(cls, drafts: Sequence[np.ndarray], k: int) -> "Proposal":
        """Rows of at most `k` ids each, right-padded with 0 into `[B, k]`."""
        tokens = np.zeros((len(drafts), k), np.int32)
        num = np.zeros((len(drafts),), np.int32)
        for b, draft in enumerate(drafts):
            num[b] = len(draft)
            tokens[b, :len(draft)] = draft
        return cls(tokens=tokens, num=num)


class Proposer(Protocol):
    """What `jaxattn.speculative.generate.speculative_generate` asks of a proposer (see the module docstring)."""

    @property
    def k(self) -> int: ...

    def begin(self, batch_size: int, capacity: int) -> None: ...

    def propose(self, histories: Sequence[np.ndarray], k: int) -> Proposal: ...
