"""A draft model: a small `DecoderLM` of the target's tokenizer drafting k tokens greedily, with its own cache.

Each `propose` is one jitted program: the tokens the draft has not yet seen are appended to its dense
cache in one `DecoderLM.extend` (padded to a bucket of widths, so the program compiles once per
(width, k)), then k - 1 one-token extends in a `jax.lax.scan`, each feeding the previous argmax. A longer
catch-up (a row that ran plain steps for a while, a new request's prompt) is first fed in pieces of
`CATCH_UP` tokens by one program of that width (`feed_tokens`): the widths, so the programs, stay a few
however long a row went without drafting.

The proposer keeps, per row, the ids its cache holds (`fed`). A call first finds the longest prefix
of the row's history that its cache still agrees with and rolls the cache back to it (the cache's
`lengths`: reads are masked by position, so slots past it are never seen and are overwritten next):
the drafts the target rejected fall away without the caller saying which they were.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn._validate import is_int
from jaxattn.cache.build import init_cache
from jaxattn.cache.containers import KV_CACHES
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, call_kernels
from jaxattn.model import DecoderLM
from jaxattn.speculative.proposal import Proposal


CATCH_UP = 32  # the widest catch-up drafted from; more tokens are fed first, this many a call


def catch_up_width(need: int) -> int:
    """The padded width of a catch-up extend of `need` tokens: 2 (a step's usual one or two), then powers of two."""
    width = 2
    while width < need:
        width *= 2
    return width


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


@functools.partial(jax.jit, static_argnames=("config", "kernels", "k"))
def draft_tokens(params, cache, catch_up, num_catch, *, config: ModelConfig, kernels: Kernels, k: int):
    """k greedy drafts per row after appending its unseen tokens.

    Args:
      params: the draft model's parameters.
      cache: its `DecodeCache`, `lengths` already rolled back to what each row's history agrees with.
      catch_up: `[B, W]` int the tokens to append, right-padded; `num_catch`: `[B]` int in `[1, W]` real ones.
      k: drafts per row (>= 1).

    Returns:
      `(drafts [B, k] int32, cache)`: the cache holds the catch-up and the first k - 1 drafts.
    """
    model = DecoderLM(config, kernels)
    logits, cache = model.apply({"params": params}, catch_up, cache, num_new=num_catch, method=DecoderLM.extend)
    first = jnp.argmax(logits[jnp.arange(catch_up.shape[0]), num_catch - 1], axis=-1).astype(jnp.int32)

    def step(carry, _):
        cache, token = carry
        logits, cache = model.apply({"params": params}, token[:, None], cache, method=DecoderLM.extend)
        token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return (cache, token), token

    (cache, _), rest = jax.lax.scan(step, (cache, first), None, length=k - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1), cache


@functools.partial(jax.jit, static_argnames=("config", "kernels"))
def feed_tokens(params, cache, tokens, num, *, config: ModelConfig, kernels: Kernels):
    """Appends `num [B]` (in `[0, W]`) of each row's `tokens [B, W]` to the draft's cache, drafting nothing."""
    _, cache = DecoderLM(config, kernels).apply({"params": params}, tokens, cache, num_new=num,
                                                method=DecoderLM.extend)
    return cache


class DraftProposer:
    """Greedy drafts from a small model (see the module docstring).

    Args:
      params, config: the draft `DecoderLM`; its vocabulary must be the target's (checked by the caller
        against the target's config).
      k: the most tokens drafted per step (>= 1).
      kernels: as `jaxattn.generate`'s (None: this machine's defaults, `jaxattn.kernels.call_kernels`).
      kv_cache: the draft cache's storage, "auto" or "int8".
    """

    def __init__(self, params, config: ModelConfig, *, k: int = 4, kernels: Kernels | None = None,
                 kv_cache: str = "auto"):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not is_int(k) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {kv_cache!r}")
        self.config, self.k, self.kv_cache = config, int(k), kv_cache
        self.kernels, self.params = call_kernels(params, kernels)
        self.cache, self.fed = None, []

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def begin(self, batch_size: int, capacity: int) -> None:
        """A cache for `batch_size` rows of `capacity` tokens plus room for a padded catch-up; kept (and its
        rows' prefixes reused) when the shape is unchanged."""
        if capacity > self.config.max_seq_len:
            raise ValueError(f"the draft model's context, max_seq_len={self.config.max_seq_len}, is shorter than "
                             f"the target's rows of {capacity} tokens")
        # Room past `capacity` for a catch-up padded to its bucket; positions stay inside the draft's context.
        slots = min(capacity + 2 * self.k + 2, self.config.max_seq_len)
        if self.cache is None or self.cache.lengths.shape[0] != batch_size or self.cache.num_slots != slots:
            self.cache = init_cache(self.config, batch_size, slots, dtype=self.kv_cache)
            self.fed = [np.zeros((0,), np.int32) for _ in range(batch_size)]

    def propose(self, histories: Sequence[np.ndarray], k: int) -> Proposal:
        """Per row, k greedy drafts after its history (none when `k == 0`)."""
        if self.cache is None or len(histories) != len(self.fed):
            raise ValueError(f"call begin(batch_size={len(histories)}, capacity) before propose")
        if k == 0:
            return Proposal.from_rows([np.zeros((0,), np.int32)] * len(histories), 0)
        histories = [np.asarray(h, np.int32) for h in histories]
        # The draft's logits after the last history token are needed, so at least that token is fed again.
        kept = np.array([min(common_prefix(f, h), len(h) - 1) for f, h in zip(self.fed, histories)], np.int32)
        cache, kept = self._feed(histories, self.cache.replace(lengths=jnp.asarray(kept)), kept)
        need = max(len(h) - n for h, n in zip(histories, kept))
        width = min(catch_up_width(need), self.cache.num_slots - int(kept.max()) - (k - 1))
        if width < need:
            raise ValueError(f"the draft cache ({self.cache.num_slots} slots) cannot take {need} more tokens and "
                             f"{k} drafts; call begin with a larger capacity")
        catch_up = np.zeros((len(histories), width), np.int32)
        for b, (h, n) in enumerate(zip(histories, kept)):
            catch_up[b, :len(h) - n] = h[n:]
        drafts, self.cache = draft_tokens(self.params, cache, jnp.asarray(catch_up),
                                          jnp.asarray([len(h) - n for h, n in zip(histories, kept)], jnp.int32),
                                          config=self.config, kernels=self.kernels, k=k)
        drafts = np.asarray(drafts)
        self.fed = [np.concatenate([h, d[:k - 1]]) for h, d in zip(histories, drafts)]
        return Proposal(tokens=drafts, num=np.full((len(histories),), k, np.int32))

    def _feed(self, histories: list[np.ndarray], cache, kept: np.ndarray):
        """Feeds each row's unseen tokens but its last `CATCH_UP` in pieces of `CATCH_UP` -> `(cache, kept)`.
        A piece is as wide as the fullest row's room allows (a wider write would be clamped onto its tokens)."""
        while True:
            width = min(CATCH_UP, self.cache.num_slots - int(kept.max()))
            num = np.array([min(width, max(0, len(h) - n - CATCH_UP)) for h, n in zip(histories, kept)], np.int32)
            if not num.any():
                return cache, kept
            pieces = np.zeros((len(histories), width), np.int32)
            for b, (h, n, m) in enumerate(zip(histories, kept, num)):
                pieces[b, :m] = h[n:n + m]
            cache = feed_tokens(self.params, cache, jnp.asarray(pieces), jnp.asarray(num), config=self.config,
                                kernels=self.kernels)
            kept = kept + num
