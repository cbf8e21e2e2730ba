"""Attention with a hand-written backward ("custom_vjp"), for training (docs/theory.md §15).

Contract: `jaxattn.scaled_dot_product_attention`'s, reverse mode only (`jax.jvp`
through it raises). Values equal the reference ("xla") exactly in the forward pass
and gradients to float32 summation order (tests/test_kernels.py).

The backward is FlashAttention's: with P the weights and O = P V,
dS = P * (dP - rowsum(dP * P)). The row sum is taken from the float32 P and dP, not as
rowsum(dO * O): with 16-bit inputs O is rounded to 16 bits, and dP minus the row sum cancels,
so a row sum from the rounded O left dS (and a bias's gradient) off by that rounding times the
row's size. Heads go in front (`[B, K, G, T, H]`) so that every product is a matmul batched
over (B, K), a form XLA:CPU runs faster than contracting the grouped layout in place
(docs/performance.md). Dropout, `return_weights` and a traced scale use the reference.

Every product takes its operands in the inputs' dtype and sums in float32 (the softmax's
dtype): for bfloat16 inputs the weights and dS are rounded to bfloat16 before their products, as
the reference rounds the weights before `P V` and as FlashAttention does, and XLA:CPU runs each as
its bfloat16 library dot instead of widening both operands to float32. The two products that sum
over the queries (dV = P^T dO, dK = dS^T Q) are computed transposed, from a copy of the small dO
or Q turned `[H, G*T]`: summing over a leading dim of both operands, XLA:CPU copied the whole
`[S, G*T]` weights transposed instead (docs/performance.md §17).

A soft cap `c * tanh(z / c)` of the scaled logits z (docs/theory.md §17) multiplies
dS by `1 - tanh^2` before the products with q and k (the bias, added after the cap,
gets dS itself); the tanh is kept from the forward. A sink (§18) is a logit with no
value: its dP is 0, so its gradient is `-sum over rows of p_sink * rowsum(dP * P)`, with
`p_sink = exp(sink - logsumexp)`. Without either the program is the plain one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxattn.kernels._call import reference_unless, weights_or_dropout
from jaxattn.kernels._grouping import allowed_keys, group_heads, heads_major, heads_minor
from jaxattn.softmax import grouped_sinks, logsumexp, masked_softmax, softmax_dtype


@reference_unless(weights_or_dropout)
def attention(query, key, value, *, mask, bias, is_causal, scale, dropout_rate, dropout_rng,
              return_weights, local_window_size=None, key_value_seq_lengths=None, logits_soft_cap=None,
              sinks=None, return_residual=False, segment_ids=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`."""
    B, T, N = query.shape[:3]
    S, K = key.shape[1:3]
    q, k, v = heads_major(query, key, value)  # [B,K,G,T,H], [B,K,S,H], [B,K,S,Hv]
    bias = None if bias is None else group_heads(bias, K)
    allowed = allowed_keys(mask, is_causal, T, S, K, bias, local_window_size, key_value_seq_lengths,
                           segment_ids)
    if sinks is not None:
        sinks = grouped_sinks(jnp.asarray(sinks), K).astype(softmax_dtype(query.dtype))  # [1,K,G,1]
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    out, lse = _attention(q, k, v, bias, allowed, sinks, scale, cap, return_residual)  # [B,K,G,T,Hv]
    residual = None
    if return_residual:  # [B,K,G,T] -> [B,T,N]
        residual = jax.lax.stop_gradient(lse).transpose(0, 3, 1, 2).reshape(B, T, N)
    return heads_minor(out, query.dtype), None, residual  # [B,T,N,Hv]


def _logits(q, k, bias, scale, cap):
    """`[B,K,G,T,S]` logits in float32 (float64 for float64 inputs), and the soft cap's tanh (or None)."""
    logits = jnp.einsum("BKGTH,BKSH->BKGTS", q, k, preferred_element_type=softmax_dtype(q.dtype)) * scale
    tanh = None
    if cap is not None:  # c * tanh(z / c), before the bias (§17)
        tanh = jnp.tanh(logits / cap)
        logits = cap * tanh
    if bias is not None:
        logits = logits + bias.astype(logits.dtype)
    return logits, tanh


def _weighted_values(weights, v):
    """`P V` `[B,K,G,T,Hv]` in v's dtype: the weights rounded to it, the sums in the weights' dtype."""
    return jnp.einsum("BKGTS,BKSH->BKGTH", weights.astype(v.dtype), v,
                      preferred_element_type=weights.dtype).astype(v.dtype)


def _sum_over_queries(x, scores):
    """`sum_{g,t} scores[b,k,g,t,s] x[b,k,g,t,h]` `[B,K,S,H]` in float32 (dV = P^T dO, dK = dS^T Q) for x
    `[B,K,G,T,H]` and scores `[B,K,G,T,S]` of one dtype, as `(x^T scores)^T`: x (the small one) is copied
    `[B,K,H,G*T]` behind a barrier, so that XLA cannot fold the transpose back into the product."""
    B, K, G, T, H = x.shape
    x_t = jax.lax.optimization_barrier(x.reshape(B, K, G * T, H).transpose(0, 1, 3, 2))  # [B,K,H,G*T]
    product = jnp.einsum("BKHX,BKXS->BKHS", x_t, scores.reshape(B, K, G * T, scores.shape[-1]),
                         preferred_element_type=jnp.promote_types(x.dtype, jnp.float32))
    return product.transpose(0, 1, 3, 2)  # [B,K,S,H]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, bias, allowed, sinks, scale, cap, want_lse):
    """`(out [B,K,G,T,Hv], lse [B,K,G,T] or None)`; lse's cotangent is ignored (returned under stop_gradient)."""
    return _forward(q, k, v, bias, allowed, sinks, scale, cap, want_lse)[0]


def _forward(q, k, v, bias, allowed, sinks, scale, cap, want_lse):
    logits, tanh = _logits(q, k, bias, scale, cap)
    weights = masked_softmax(logits, allowed, sinks=sinks)
    # The sink's gradient needs its weight exp(sink - lse): finite, as the sink is.
    lse = logsumexp(logits, allowed, sinks=sinks) if want_lse or sinks is not None else None
    out = _weighted_values(weights, v)
    return (out, lse if want_lse else None), (q, k, v, bias, allowed, sinks, weights, tanh, lse)


def _backward(scale, cap, want_lse, residuals, cotangents):
    q, k, v, bias, allowed, sinks, weights, tanh, lse = residuals
    f32, dtype = weights.dtype, v.dtype  # sums in f32; the products' operands in the inputs' dtype
    d_out = cotangents[0].astype(dtype)  # the logsumexp's cotangent: it is returned under stop_gradient
    d_v = _sum_over_queries(d_out, weights.astype(dtype))
    d_weights = jnp.einsum("BKGTH,BKSH->BKGTS", d_out, v, preferred_element_type=f32)
    delta = jnp.sum(weights * d_weights, axis=-1, keepdims=True)  # [B,K,G,T,1]
    d_logits = weights * (d_weights - delta)  # masked keys and empty rows have weight 0: 0 here
    d_bias = None if bias is None else _sum_to_shape(d_logits, bias.shape).astype(bias.dtype)  # 0 where masked
    if tanh is not None:  # through c * tanh(z / c): times 1 - tanh^2
        d_logits = d_logits * (1.0 - tanh * tanh)
    d_scores = d_logits.astype(q.dtype)
    d_q = jnp.einsum("BKGTS,BKSH->BKGTH", d_scores, k, preferred_element_type=f32) * scale
    d_k = _sum_over_queries(q, d_scores) * scale
    d_sinks = None
    if sinks is not None:  # dP_sink = 0 (no value): d_sink = p_sink * (0 - delta), summed over B and T
        p_sink = jnp.exp(sinks.astype(f32) - lse)  # [B,K,G,T]
        d_sinks = _sum_to_shape(-(p_sink * delta[..., 0]), sinks.shape).astype(sinks.dtype)
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None, d_sinks


def _sum_to_shape(x, shape):
    """Sums a cotangent down to the broadcast `shape` of a bias (`[B,K,G,T,S]`) or of sinks (`[1,K,G,1]`)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


_attention.defvjp(_forward, _backward)
