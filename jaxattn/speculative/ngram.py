"""Prompt lookup: drafts copied from earlier in the row's own tokens (vLLM's NgramProposer, transformers'
`prompt_lookup_num_tokens`).

A row's history is its prompt followed by what it has generated so far. Its last n tokens are looked
up in the history before them, for n from `n_max` down to `n_min`; at the first n with a match, the
most recent earlier occurrence wins and the (up to) k tokens that followed it are the draft. No match:
no draft (the step is then a plain decoding step). Answers that repeat their input (summaries, code
edits, answers quoting a retrieved text) match often; free text seldom.

Host-side numpy: the history is on the host anyway (the stop token and the output are read there),
and a lookup over a few thousand tokens costs microseconds against a forward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from jaxattn._validate import is_int
from jaxattn.speculative.proposal import Proposal


@dataclasses.dataclass(frozen=True)
class NgramSettings:
    """Prompt lookup's settings.

    Attributes:
      n_min: the shortest suffix looked up (>= 1).
      n_max: the longest suffix looked up (>= n_min); longer suffixes are tried first.
      k: the most tokens drafted per step (>= 1).
    """

    n_min: int = 1
    n_max: int = 3
    k: int = 4

    def __post_init__(self):
        for name in ("n_min", "n_max", "k"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"NgramSettings.{name} must be a positive int, got {value!r}")
        if self.n_max < self.n_min:
            raise ValueError(f"NgramSettings.n_max must be >= n_min={self.n_min}, got {self.n_max}")


def _windows(history: np.ndarray, n: int) -> np.ndarray:
    """`[L - n + 1, n]` every n-token window of `history`."""
    return np.lib.stride_tricks.sliding_window_view(history, n)


def ngram_lookup(history, *, k: int, n_min: int = 1, n_max: int = 3) -> np.ndarray:
    """The draft for one row: `[<= k]` int32 ids that followed the latest earlier occurrence of the
    history's longest matching suffix (n_max down to n_min tokens); empty without a match.

    history: `[L]` int ids, the prompt followed by the generated tokens.
    """
    history = np.asarray(history)
    L = history.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = history[L - n:]
        # Windows starting at 0 .. L-n-1: every occurrence that ends before the suffix itself and has
        # at least one token after it.
        windows = _windows(history[:L - 1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if hits.size:
            return _continuation(history, hits[-1] + n, k)
    return np.zeros((0,), np.int32)


def _continuation(history: np.ndarray, start: int, k: int) -> np.ndarray:
    """k tokens copied from `history[start:]`, the copy running on into the tokens it has copied (as LZ77's
    overlapping copies): a match close to the end, in a repeating stretch, still drafts k tokens of the repeat."""
    # Draft i is token start + i; past the history's end that is draft i - (L - start): a cyclic copy.
    return np.resize(history[start:], k).astype(np.int32)


class NgramProposer:
    """Prompt lookup behind the `jaxattn.speculative.proposal.Proposer` interface (no model, no state)."""

    def __init__(self, settings: NgramSettings = NgramSettings()):
        if not isinstance(settings, NgramSettings):
            raise TypeError(f"settings must be an NgramSettings, got {type(settings).__name__}")
        self.settings = settings

    @property
    def k(self) -> int:
        return self.settings.k

    def begin(self, batch_size: int, capacity: int) -> None:
        """Nothing to prepare: the lookup reads only the history."""

    def propose(self, histories: Sequence[np.ndarray], k: int) -> Proposal:
        """Each row's lookup, at most `k` tokens (`k <= self.k`)."""
        s = self.settings
        drafts = [ngram_lookup(h, k=k, n_min=s.n_min, n_max=s.n_max) if k > 0 else np.zeros((0,), np.int32)
                  for h in histories]
        return Proposal.from_rows(drafts, k)
