"""Choosing the next token from logits: greedy, temperature, top-k, top-p.

Every function is pure and takes float32 logits `[B, V]`. The sampling knobs
(`temperature`, `top_k`, `top_p`) may be Python numbers or traced scalars, so
one jit-compiled decoding loop serves every setting without recompiling:

* `temperature == 0` means greedy (argmax); otherwise logits are divided by it.
* `top_k <= 0` disables top-k; otherwise exactly `top_k` tokens survive
  (ties at the boundary are broken by the lower token id, so the support
  never grows past k).
* `top_p >= 1` disables top-p (nucleus); otherwise the smallest set of the
  most probable tokens whose probability sums to at least `top_p` survives
  (the single most probable token always survives).

The order is Hugging Face's and nanoGPT's: temperature, then top-k, then top-p
on the distribution renormalised over the top-k survivors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def greedy(logits: jnp.ndarray) -> jnp.ndarray:
    """`[B, V]` logits -> `[B]` int32 argmax (lowest id on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def apply_temperature(logits: jnp.ndarray, temperature) -> jnp.ndarray:
    """Divides `[B, V]` logits by `temperature`; a temperature of 0 leaves them as they are."""
    temperature = jnp.asarray(temperature, jnp.float32)
    return logits / jnp.where(temperature > 0, temperature, 1.0)


def _descending_order(logits: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """`(order, ranks)`, both `[B, V]` int32: `order[b, r]` is the id of rank r, `ranks[b, v]` the rank of id v."""
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1)
    return order, ranks


def _top_k_keep_sorted(vocab_size: int, top_k) -> jnp.ndarray:
    """`[V]` bool over ranks: True for the first `top_k` ranks (all when `top_k <= 0`)."""
    top_k = jnp.asarray(top_k, jnp.int32)
    rank = jnp.arange(vocab_size)
    return (rank < top_k) | (top_k <= 0)


def _top_p_keep_sorted(sorted_logits: jnp.ndarray, top_p) -> jnp.ndarray:
    """`[B, V]` bool over ranks: the nucleus of probability mass `top_p` of descending logits."""
    top_p = jnp.asarray(top_p, jnp.float32)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # [B, V] probability of the strictly better ranks
    is_best = (jnp.arange(sorted_logits.shape[-1]) == 0)[None, :]  # [1, V]
    return (mass_before < top_p) | is_best | (top_p >= 1.0)


def support_mask(logits: jnp.ndarray, *, top_k=0, top_p=1.0) -> jnp.ndarray:
    """`[B, V]` bool, True for the tokens that top-k then top-p leave eligible.

    Args:
      logits: `[B, V]` float logits (already divided by the temperature).
      top_k: keep the `top_k` highest logits; `<= 0` keeps all.
      top_p: then keep the smallest most-probable set with mass `>= top_p`,
        measured on the distribution renormalised over the top-k survivors;
        `>= 1` keeps all.
    """
    order, ranks = _descending_order(logits)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)  # [B, V] descending
    keep_k = _top_k_keep_sorted(logits.shape[-1], top_k)[None, :]  # [1, V]
    sorted_logits = jnp.where(keep_k, sorted_logits, _NEG_INF)
    keep_sorted = keep_k & _top_p_keep_sorted(sorted_logits, top_p)  # [B, V] by rank
    return jnp.take_along_axis(keep_sorted, ranks, axis=-1)  # [B, V] by token id


def filter_logits(logits: jnp.ndarray, *, top_k=0, top_p=1.0) -> jnp.ndarray:
    """`[B, V]` logits with every token outside `support_mask` set to -inf."""
    return jnp.where(support_mask(logits, top_k=top_k, top_p=top_p), logits, _NEG_INF)


def sample(logits: jnp.ndarray, rng: jax.Array, *, temperature=1.0, top_k=0, top_p=1.0) -> jnp.ndarray:
    """Draws one token per row.

    Args:
      logits: `[B, V]` float32 next-token logits.
      rng: a PRNG key; the same key and inputs give the same tokens.
      temperature: 0 = greedy; otherwise the softmax temperature.
      top_k: see `support_mask`.
      top_p: see `support_mask`.

    Returns:
      `[B]` int32 token ids.
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.asarray(temperature, jnp.float32)
    top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)

    # The knobs are traced, so branches are `lax.cond`s: greedy decoding and plain temperature
    # sampling skip the two argsorts of `support_mask` (a large share of a small model's decode
    # step, docs/performance.md). Every branch gives the same tokens as the full path.
    def draw(logits):
        scaled = apply_temperature(logits, temperature)
        filtered = jax.lax.cond((top_k > 0) | (top_p < 1.0),
                                lambda x: filter_logits(x, top_k=top_k, top_p=top_p), lambda x: x, scaled)
        return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)

    return jax.lax.cond(temperature > 0, draw, greedy, logits)
