"""The reference formulations ("xla"): the maths as einsums, differentiated by JAX.

Every other implementation in `jaxattn.kernels` is tested equal to these. They
keep the library's layout (`[B, T, N, H]`, caches `[B, K, L, H]`), group query
heads as `[B, T, K, G, H]` instead of repeating keys and values, and leave every
layout decision to XLA. Any order of differentiation, forward or reverse mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels._grouping import allowed_keys, group_heads, merge_heads
from jaxattn.masks import visible_cache_slots
from jaxattn.softmax import dropout_weights, grouped_sinks, logsumexp, masked_softmax, soft_cap, softmax_dtype


def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None, return_residual=False, segment_ids=None):
    """Scaled dot-product attention (contract: `jaxattn.scaled_dot_product_attention`, `_call`'s docstring).

    Logits: `soft_cap(scale * q.k, logits_soft_cap) + bias` (docs/theory.md §17), masked, then the
    softmax with `sinks` in its denominator (§18); `segment_ids` `[B, T]` join the mask
    (`jaxattn.masks.segment_mask`, §27). Returns `(out [B, T, N, Hv], weights [B, N, T, S]
    float32 or None, residual [B, T, N] float32 or None)`; the residual is the logsumexp of the
    masked logits and the sink (-inf for a row that sees nothing), under `stop_gradient`.
    """
    B, T, N, H = query.shape
    S, K = key.shape[1:3]
    q = query.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]: G query heads per kv head
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, key,
                        preferred_element_type=softmax_dtype(query.dtype)) * scale
    logits = soft_cap(logits, logits_soft_cap)
    bias = None if bias is None else group_heads(bias, K)
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    allowed = allowed_keys(mask, is_causal, T, S, K, bias, local_window_size, key_value_seq_lengths,
                           segment_ids)
    sinks = None if sinks is None else grouped_sinks(sinks, K)  # [1, K, G, 1]
    weights = masked_softmax(logits, allowed, sinks=sinks)  # [B, K, G, T, S]
    residual = None
    if return_residual:  # [B, K, G, T] -> [B, T, N]
        lse = jax.lax.stop_gradient(logsumexp(logits, allowed, sinks=sinks))
        residual = lse.transpose(0, 3, 1, 2).reshape(B, T, N)
    weights = dropout_weights(weights, dropout_rate, dropout_rng)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights.astype(value.dtype), value)
    return merge_heads(out, query.dtype), (weights.reshape(B, N, T, S) if return_weights else None), residual


def cached_attention(query, key_cache, value_cache, query_positions, *, scale, window=None,
                     logits_soft_cap=None, sinks=None):
    """Attention of new queries against a heads-major cache (contract: `jaxattn.attention.cached_attention`)."""
    B, T, N, H = query.shape
    K, L = key_cache.shape[1:3]
    q = query.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    logits = jnp.einsum("BTKGH,BKSH->BKGTS", q, key_cache,
                        preferred_element_type=softmax_dtype(query.dtype)) * scale
    logits = soft_cap(logits, logits_soft_cap)
    visible = visible_cache_slots(query_positions, L, window)[:, :, None]  # [B, 1, 1, T, L]
    sinks = None if sinks is None else grouped_sinks(sinks, K)
    weights = masked_softmax(logits, visible, sinks=sinks)  # [B, K, G, T, L]
    out = jnp.einsum("BKGTS,BKSH->BTKGH", weights.astype(value_cache.dtype), value_cache)
    return merge_heads(out, query.dtype)


def write_rows(buffer, update, starts, *, axis):
    """Row b of `update` written into row b of `buffer` at slots `starts[b] + arange(T)` along `axis`."""
    def one_row(row, new, start):  # the batch axis is gone: the slot axis is axis - 1
        return jax.lax.dynamic_update_slice_in_dim(row, new, start, axis - 1)
    return jax.vmap(one_row)(buffer, update.astype(buffer.dtype), starts)


def matmul(x, w):
    """`x [M, K] @ w [K, N]` in the operands' dtype, summed and returned in float32."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
