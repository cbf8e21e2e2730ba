"""Attention with a hand-written backward ("custom_vjp"), for training (docs/theory.md §15).

Contract: `jaxattn.scaled_dot_product_attention`'s, reverse mode only (`jax.jvp`
through it raises). Values equal the reference ("xla") exactly in the forward pass
and gradients to float32 summation order (tests/test_kernels.py).

The backward is FlashAttention's: with P the weights and O = P V,
dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O), which needs
only the output, not a second `[T, S]` product. Heads go in front
(`[B, K, G, T, H]`) so that every product is a matmul batched over (B, K), a
form XLA:CPU runs faster than contracting the grouped layout in place
(docs/performance.md). Dropout and `return_weights` use the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn.kernels._call import reference_unless, weights_or_dropout
from jaxattn.kernels._grouping import allowed_keys, group_heads, heads_major, heads_minor
from jaxattn.softmax import masked_softmax, softmax_dtype


@reference_unless(weights_or_dropout)
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`."""
    T = query.shape[1]
    S, K = key.shape[1:3]
    q, k, v = heads_major(query, key, value)  # [B,K,G,T,H], [B,K,S,H], [B,K,S,Hv]
    bias = None if bias is None else group_heads(bias, K)
    allowed = allowed_keys(mask, is_causal, T, S, K, bias, local_window_size, key_value_seq_lengths)
    out = _attention(q, k, v, bias, allowed, scale)  # [B,K,G,T,Hv]
    return heads_minor(out, query.dtype), None  # [B,T,N,Hv]


def _weights(q, k, bias, allowed, scale):
    """`[B,K,G,T,S]` weights in float32 (float64 for float64 inputs)."""
    logits = jnp.einsum("BKGTH,BKSH->BKGTS", q, k, preferred_element_type=softmax_dtype(q.dtype)) * scale
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    return masked_softmax(logits, allowed)


def _weighted_values(weights, v):
    return jnp.einsum("BKGTS,BKSH->BKGTH", weights.astype(v.dtype), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, bias, allowed, scale):
    return _forward(q, k, v, bias, allowed, scale)[0]


def _forward(q, k, v, bias, allowed, scale):
    weights = _weights(q, k, bias, allowed, scale)
    out = _weighted_values(weights, v)
    return out, (q, k, v, bias, allowed, weights, out)


def _backward(scale, residuals, d_out):
    q, k, v, bias, allowed, weights, out = residuals
    f32 = weights.dtype
    d_out = d_out.astype(f32)
    d_v = jnp.einsum("BKGTS,BKGTH->BKSH", weights, d_out)
    d_weights = jnp.einsum("BKGTH,BKSH->BKGTS", d_out, v, preferred_element_type=f32)
    # rowsum(dO * O) as a batched dot: as a multiply and a sum, XLA:CPU fused it into the
    # dO V^T library call and the step ran slower (docs/performance.md).
    delta = jnp.einsum("BKGTH,BKGTH->BKGT", d_out, out.astype(f32))[..., None]  # [B,K,G,T,1]
    d_logits = weights * (d_weights - delta)  # masked keys and empty rows have weight 0: 0 here
    d_q = jnp.einsum("BKGTS,BKSH->BKGTH", d_logits, k, preferred_element_type=f32) * scale
    d_k = jnp.einsum("BKGTS,BKGTH->BKSH", d_logits, q, preferred_element_type=f32) * scale
    d_bias = None if bias is None else _sum_to_shape(d_logits, bias.shape).astype(bias.dtype)  # 0 where masked
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None


def _sum_to_shape(x, shape):
    """Sums a `[B,K,G,T,S]` cotangent down to the broadcast `shape` of a bias."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


_attention.defvjp(_forward, _backward)
