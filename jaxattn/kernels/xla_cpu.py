"""Decoding formulations for XLA:CPU ("xla_cpu"): the reference maths in the operand orders it runs fastest.

Contracts: `jaxattn.attention.cached_attention` and `jaxattn.cache.containers.write_rows`;
equal to the reference ("xla") in tests/kernels/test_kernels.py. Why each order
(measured in docs/performance.md):

* the cache is the left operand of the logits' dot, contracted on its minor
  dim: a matrix-vector product that reads the cache in place (as the right
  operand XLA:CPU first transposed all of it, every step);
* with two real batch dims (B > 1, K > 1) and several query rows per head
  (G * T > 1: GQA decode, prefill), XLA:CPU hands the value product to its
  fast library only when the output is heads-major, so that order is used there;
* cache rows are written by one `dynamic_update_slice` per row (B is static):
  the vmapped form became a scatter that copied the whole buffer every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels._grouping import merge_heads
from jaxattn.masks import visible_cache_slots
from jaxattn.softmax import grouped_sinks, masked_softmax, soft_cap, softmax_dtype


def cached_attention(query, key_cache, value_cache, query_positions, *, scale, window=None,
                     logits_soft_cap=None, sinks=None):
    """Same arguments and result as `jaxattn.kernels.xla.cached_attention`."""
    B, T, N, H = query.shape
    K, L = key_cache.shape[1:3]
    q = query.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("BKSH,BTKGH->BKGTS", key_cache, q,
                        preferred_element_type=softmax_dtype(query.dtype)) * scale
    logits = soft_cap(logits, logits_soft_cap)
    sinks = None if sinks is None else grouped_sinks(sinks, K)  # [1, K, G, 1]
    weights = masked_softmax(logits, visible_cache_slots(query_positions, L, window)[:, :, None],
                             sinks=sinks)  # [B,K,G,T,L]
    return merge_heads(_weighted_values(weights.astype(value_cache.dtype), value_cache), query.dtype)


def _weighted_values(weights, value_cache):
    """`[B,K,G,T,L]` weights x `[B,K,L,Hv]` cache -> `[B,T,K,G,Hv]`."""
    B, K, G, T, L = weights.shape
    if B > 1 and K > 1 and G * T > 1:
        return jnp.einsum("BKGTS,BKSH->BKGTH", weights, value_cache).transpose(0, 3, 1, 2, 4)
    return jnp.einsum("BKGTS,BKSH->BTKGH", weights, value_cache)


def write_rows(buffer, update, starts, *, axis):
    """Same arguments and result as `jaxattn.kernels.xla.write_rows`."""
    update = update.astype(buffer.dtype)
    for b in range(buffer.shape[0]):
        index = tuple(starts[b] if d == axis else (b if d == 0 else 0) for d in range(buffer.ndim))
        buffer = jax.lax.dynamic_update_slice(buffer, update[b:b + 1], index)
    return buffer
