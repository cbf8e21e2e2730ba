"""Additive (Bahdanau) attention (docs/theory.md §13).

Scores come from a one-hidden-layer network instead of a dot product:
`e_ij = w_score . tanh(q_i W_q + k_j W_k)`, so queries and keys may have
different sizes and no `1/sqrt(d)` scale is needed.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn._validate import require_bool, require_broadcastable, require_rank
from jaxattn.softmax import masked_softmax


def _validate(query, key, value, w_query, w_key, w_score, mask):
    require_rank("query", query, 3, "[B, T, Dq]")
    require_rank("key", key, 3, "[B, S, Dk]")
    require_rank("value", value, 3, "[B, S, Dv]")
    require_rank("w_query", w_query, 2, "[Dq, A]")
    require_rank("w_key", w_key, 2, "[Dk, A]")
    require_rank("w_score", w_score, 1, "[A]")
    (B, T, Dq), (_, S, Dk) = query.shape, key.shape
    if key.shape[0] != B or value.shape[:2] != (B, S):
        raise ValueError(
            f"query {query.shape}, key {key.shape} and value {value.shape} must share B, "
            "and key and value must share S"
        )
    A = w_score.shape[0]
    if w_query.shape != (Dq, A) or w_key.shape != (Dk, A):
        raise ValueError(
            f"w_query {w_query.shape} must be (Dq, A) = {(Dq, A)} and w_key {w_key.shape} "
            f"must be (Dk, A) = {(Dk, A)} (A from w_score {w_score.shape})"
        )
    if mask is not None:
        require_bool("mask", mask)
        require_broadcastable("mask", mask.shape, (B, T, S), "[B, T, S]")


def additive_attention(query, key, value, *, w_query, w_key, w_score, mask=None,
                       return_weights=False):
    """Bahdanau attention.

    Args:
      query: `[B, T, Dq]`; key: `[B, S, Dk]`; value: `[B, S, Dv]`.
      w_query: `[Dq, A]`; w_key: `[Dk, A]`; w_score: `[A]`.
      mask: boolean, True = attend, broadcastable to `[B, T, S]`.
      return_weights: also return the `[B, T, S]` float32 weights.

    Returns:
      `[B, T, Dv]`, or `(out, weights)`. Fully masked rows give zeros.
    """
    mask = None if mask is None else jnp.asarray(mask)
    _validate(query, key, value, w_query, w_key, w_score, mask)
    q = jnp.einsum("BTD,DA->BTA", query, w_query)
    k = jnp.einsum("BSD,DA->BSA", key, w_key)
    hidden = jnp.tanh(q[:, :, None, :] + k[:, None, :, :])  # [B, T, S, A]
    scores = jnp.einsum("BTSA,A->BTS", hidden, w_score)
    weights = masked_softmax(scores, mask)  # [B, T, S] float32
    out = jnp.einsum("BTS,BSD->BTD", weights.astype(value.dtype), value)
    return (out, weights) if return_weights else out
