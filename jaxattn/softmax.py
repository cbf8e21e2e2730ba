"""The one masked softmax and the one attention dropout of the library (docs/theory.md §3, §12).

Every attention (scaled dot-product, cached, latent and additive) turns its
logits into weights with `masked_softmax` and drops weights with
`dropout_weights`, so the conventions hold everywhere:

* softmax runs in float32 (float64 stays float64), whatever the logits' dtype;
* a key with mask False gets weight exactly 0;
* a query row with no key to attend to gets all-zero weights, never NaN, and
  finite gradients.
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


def masked_softmax(logits: jax.Array, mask: jax.Array | None = None, *, axis: int = -1) -> jax.Array:
    """Softmax over `axis` of the keys the boolean `mask` allows (True = attend).

    Args:
      logits: scores, any float dtype, e.g. `[B, K, G, T, S]`.
      mask: boolean, broadcastable to `logits`, or None (every key allowed).
      axis: the key axis.

    Returns:
      weights of the logits' shape in `softmax_dtype(logits.dtype)`: each row
      sums to 1 over its allowed keys, masked keys are exactly 0, and a row
      with no allowed key is all zeros.
    """
    logits = logits.astype(softmax_dtype(logits.dtype))
    if mask is None:
        return jax.nn.softmax(logits, axis=axis)
    weights = jax.nn.softmax(jnp.where(mask, logits, MASKED_LOGIT), axis=axis)
    # A fully masked row softmaxes to uniform over MASKED_LOGIT; zero it (elsewhere a no-op:
    # exp(MASKED_LOGIT - max) is already exactly 0 next to any real logit).
    return jnp.where(mask, weights, 0.0)


def dropout_weights(weights: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout on attention weights: each kept with probability `1 - rate`, scaled by `1 / (1 - rate)`.

    The identity when `rate == 0` or `rng` is None (evaluation). The expectation
    of every weight is unchanged; the returned weights are those that multiply V.
    """
    if rate == 0.0 or rng is None:
        return weights
    keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), 0.0)
