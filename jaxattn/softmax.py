"""The one masked softmax and the one attention dropout of the library (docs/theory.md §3, §12, §17, §18).

Every attention (scaled dot-product, cached, latent and additive) turns its
logits into weights with `masked_softmax` and drops weights with
`dropout_weights`, so the conventions hold everywhere:

* softmax runs in float32 (float64 stays float64), whatever the logits' dtype;
* a key with mask False gets weight exactly 0;
* a query row with no key to attend to gets all-zero weights, never NaN, and
  finite gradients;
* sinks (one learned logit per query head, GPT-OSS; docs/theory.md §18) join
  every row's denominator without a value, so a row's weights sum to less than 1;
* a soft cap `c * tanh(s / c)` bounds logits to (-c, c) (Gemma 2; §17).

Masks and sinks of lower rank than the logits are given leading axes
explicitly, so nothing here relies on implicit rank promotion (it all runs
under `jax.numpy_rank_promotion("raise")`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The logit of a masked key. Finite rather than -inf: a row with every key masked
# becomes uniform (then zeroed) instead of 0/0, and its gradients stay finite.
MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


def softmax_dtype(dtype) -> jnp.dtype:
    """float32 for bfloat16/float16/float32 inputs; float64 inputs keep float64 (never downcast)."""
    return jnp.promote_types(dtype, jnp.float32)


def soft_cap(logits: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(logits / cap)`: logits squashed into (-cap, cap) (docs/theory.md §17); identity for None.

    Applied to attention logits after the scale and before any bias or mask
    (Gemma 2, splash's `attn_logits_soft_cap`, FlashAttention's `softcap`), and
    to a model's final logits. Its derivative is `1 - tanh(logits / cap)**2`.
    """
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def _expand_to(x: jax.Array, ndim: int) -> jax.Array:
    """`x` with leading axes of size 1 up to rank `ndim` (explicit, instead of rank promotion)."""
    return x.reshape((1,) * (ndim - x.ndim) + x.shape)


def _sink_logits(sinks, logits: jax.Array, axis: int) -> jax.Array:
    """Sinks broadcastable to `logits` without its key `axis` -> the rank of `logits`, key axis of size 1."""
    sinks = _expand_to(jnp.asarray(sinks).astype(logits.dtype), logits.ndim - 1)
    return jnp.expand_dims(sinks, axis % logits.ndim)


def masked_softmax(logits: jax.Array, mask: jax.Array | None = None, *, axis: int = -1,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Softmax over `axis` of the keys the boolean `mask` allows (True = attend), with optional sinks.

    Args:
      logits: scores, any float dtype, e.g. `[B, K, G, T, S]`.
      mask: boolean, broadcastable to `logits`, or None (every key allowed).
      axis: the key axis.
      sinks: None, or one logit per row broadcastable to `logits` with the key axis
        removed (e.g. `[1, K, G, 1]` for `[B, K, G, T, S]`, see `grouped_sinks`):
        `weights_j = exp(s_j) / (exp(sink) + sum_k exp(s_k))` (docs/theory.md §18).

    Returns:
      weights of the logits' shape in `softmax_dtype(logits.dtype)`: masked keys
      are exactly 0 and a row with no allowed key is all zeros; each other row sums
      to 1 over its allowed keys, or to `1 - exp(sink - logsumexp)` with sinks.
    """
    logits = logits.astype(softmax_dtype(logits.dtype))
    mask = None if mask is None else _expand_to(jnp.asarray(mask), logits.ndim)
    if sinks is None:
        if mask is None:
            return jax.nn.softmax(logits, axis=axis)
        weights = jax.nn.softmax(jnp.where(mask, logits, MASKED_LOGIT), axis=axis)
        # A fully masked row softmaxes to uniform over MASKED_LOGIT; zero it (elsewhere a no-op:
        # exp(MASKED_LOGIT - max) is already exactly 0 next to any real logit).
        return jnp.where(mask, weights, 0.0)
    sink = _sink_logits(sinks, logits, axis)
    masked = logits if mask is None else jnp.where(mask, logits, -jnp.inf)
    # The sink is finite, so the shift is finite even for a row with no allowed key (which
    # then has e = 0 everywhere: zeros). Softmax is shift-invariant: no gradient through it.
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(masked, axis=axis, keepdims=True), sink))
    e = jnp.exp(masked - top)
    return e / (jnp.sum(e, axis=axis, keepdims=True) + jnp.exp(sink - top))


def logsumexp(logits: jax.Array, mask: jax.Array | None = None, *, axis: int = -1,
              sinks: jax.Array | None = None) -> jax.Array:
    """`log(sum_allowed exp(logits) + exp(sink))` over `axis` (removed), in the softmax dtype.

    The log of `masked_softmax`'s denominator (FlashAttention's softmax statistic, jax.nn's
    `return_residual`): `weights = exp(logits - logsumexp)`. A row with no allowed key and
    no sink gives -inf. Same arguments as `masked_softmax`.
    """
    logits = logits.astype(softmax_dtype(logits.dtype))
    if mask is not None:
        logits = jnp.where(_expand_to(jnp.asarray(mask), logits.ndim), logits, -jnp.inf)
    if sinks is not None:
        logits = jnp.concatenate([logits, jnp.broadcast_to(
            _sink_logits(sinks, logits, axis), logits.shape[:axis % logits.ndim] + (1,)
            + logits.shape[axis % logits.ndim + 1:])], axis=axis)
    top = jnp.max(logits, axis=axis, keepdims=True)
    top = jax.lax.stop_gradient(jnp.where(top == -jnp.inf, 0.0, top))
    total = jnp.sum(jnp.exp(logits - top), axis=axis, keepdims=True)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + top, -jnp.inf)
    return jnp.squeeze(lse, axis)


def grouped_sinks(sinks: jax.Array, num_kv_heads: int) -> jax.Array:
    """`[N]` sinks -> `[1, K, G, 1]`, broadcastable to grouped logits `[B, K, G, T, S]` without S.

    Query head n = k * G + g belongs to key/value head k (as `jaxattn.kernels._grouping.group_heads`).
    """
    sinks = jnp.asarray(sinks)
    return sinks.reshape(1, num_kv_heads, sinks.shape[0] // num_kv_heads, 1)


def dropout_weights(weights: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout on attention weights: each kept with probability `1 - rate`, scaled by `1 / (1 - rate)`.

    The identity when `rate == 0` or `rng` is None (evaluation). The expectation
    of every weight is unchanged; the returned weights are those that multiply V.
    """
    if rate == 0.0 or rng is None:
        return weights
    keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), 0.0)
