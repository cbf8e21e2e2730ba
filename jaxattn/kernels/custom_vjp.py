"""Attention with a hand-written backward ("custom_vjp"), for training (docs/theory.md §15).

Contract: `jaxattn.scaled_dot_product_attention`'s, reverse mode only (`jax.jvp`
through it raises). Values equal the reference ("xla") exactly in the forward pass
and gradients to float32 summation order (tests/kernels/test_kernels.py).

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

Causal self-attention (T == S) can run in blocks of query rows (`rows_per_block`; "causal_blocks" is
this kernel with `block_rows(T)` rows a block): rows [a, b) see keys [0, b) only, so each block's
logits are `[b - a, b]` and the keys every row of a block hides are never computed. With n blocks
that is (n + 1) / (2n) of the dense logits and products (9/16 with 8), and each block's working set
is a fraction of the whole. Each block is this kernel's forward and backward; dK, dV and a bias's or
the sinks' gradients are summed over the blocks in float32 and rounded once, so the blocks equal
the dense kernel in the forward pass and in gradients to float32 summation order.

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
              sinks=None, return_residual=False, segment_ids=None, rows_per_block=None):
    """Same arguments and results as `jaxattn.kernels.xla.attention`; with `rows_per_block`, a causal
    self-attention's query rows in blocks of that many (`causal_row_blocks`)."""
    B, T, N = query.shape[:3]
    S, K = key.shape[1:3]
    q, k, v = heads_major(query, key, value)  # [B,K,G,T,H], [B,K,S,H], [B,K,S,Hv]
    bias = None if bias is None else group_heads(bias, K)
    allowed = allowed_keys(mask, is_causal, T, S, K, bias, local_window_size, key_value_seq_lengths,
                           segment_ids)
    if sinks is not None:
        sinks = grouped_sinks(jnp.asarray(sinks), K).astype(softmax_dtype(query.dtype))  # [1,K,G,1]
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    blocks = causal_row_blocks(T, S, is_causal, rows_per_block)
    if len(blocks) > 1:
        out, lse = _blocked_attention(q, k, v, bias, allowed, sinks, scale, cap, return_residual, blocks)
    else:
        out, lse = _attention(q, k, v, bias, allowed, sinks, scale, cap, return_residual)  # [B,K,G,T,Hv]
    residual = None
    if return_residual:  # [B,K,G,T] -> [B,T,N]
        residual = jax.lax.stop_gradient(lse).transpose(0, 3, 1, 2).reshape(B, T, N)
    return heads_minor(out, query.dtype), None, residual  # [B,T,N,Hv]


# "causal_blocks" cuts T rows into at most MOST_BLOCKS blocks of a multiple of BLOCK_ROWS rows: on the CPU
# measured, smaller blocks ran faster down to 32 rows, and more blocks than 8 add to the compiled
# program more than they save (docs/performance.md §4.2).
BLOCK_ROWS, MOST_BLOCKS = 32, 8


def block_rows(T: int) -> int:
    """Rows a block of "causal_blocks" for T queries: a multiple of `BLOCK_ROWS`, at most `MOST_BLOCKS` blocks."""
    return BLOCK_ROWS * max(1, -(-T // (BLOCK_ROWS * MOST_BLOCKS)))


def blocked_attention(query, key, value, **arguments):
    """"causal_blocks": this kernel with a causal self-attention's rows in blocks of `block_rows(T)`."""
    return attention(query, key, value, rows_per_block=block_rows(query.shape[1]), **arguments)


def causal_row_blocks(T: int, S: int, is_causal: bool, rows_per_block: int | None) -> tuple[tuple[int, int], ...]:
    """The `(start, stop)` query rows of each block: the fewest runs of consecutive rows, as even as
    they divide, of at most `rows_per_block` rows each, for a causal self-attention (T == S); else one
    block of all T rows."""
    if rows_per_block is None or not is_causal or T != S or T <= rows_per_block:
        return ((0, T),)
    n = -(-T // rows_per_block)
    bounds = [i * T // n for i in range(n + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


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
    q, k, v, bias, _, sinks = residuals[:6]
    d_q, d_k, d_v, d_bias, d_sinks = _gradients(scale, cap, residuals, cotangents[0])
    return _rounded(d_q, d_k, d_v, d_bias, d_sinks, q, k, v, bias, sinks)


def _rounded(d_q, d_k, d_v, d_bias, d_sinks, q, k, v, bias, sinks):
    """The float32 gradients rounded to their primals' dtypes (None for the mask)."""
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype),
            None if bias is None else d_bias.astype(bias.dtype), None,
            None if sinks is None else d_sinks.astype(sinks.dtype))


def _gradients(scale, cap, residuals, d_out):
    """(dq, dk, dv, d_bias | None, d_sinks | None) in float32 from `_forward`'s residuals and out's
    cotangent (the logsumexp's is ignored: it is returned under stop_gradient)."""
    q, k, v, bias, allowed, sinks, weights, tanh, lse = residuals
    f32, dtype = weights.dtype, v.dtype  # sums in f32; the products' operands in the inputs' dtype
    d_out = d_out.astype(dtype)
    d_v = _sum_over_queries(d_out, weights.astype(dtype))
    d_weights = jnp.einsum("BKGTH,BKSH->BKGTS", d_out, v, preferred_element_type=f32)
    delta = jnp.sum(weights * d_weights, axis=-1, keepdims=True)  # [B,K,G,T,1]
    d_logits = weights * (d_weights - delta)  # masked keys and empty rows have weight 0: 0 here
    d_bias = None if bias is None else _sum_to_shape(d_logits, bias.shape)  # 0 where masked
    if tanh is not None:  # through c * tanh(z / c): times 1 - tanh^2
        d_logits = d_logits * (1.0 - tanh * tanh)
    d_scores = d_logits.astype(q.dtype)
    d_q = jnp.einsum("BKGTS,BKSH->BKGTH", d_scores, k, preferred_element_type=f32) * scale
    d_k = _sum_over_queries(q, d_scores) * scale
    d_sinks = None
    if sinks is not None:  # dP_sink = 0 (no value): d_sink = p_sink * (0 - delta), summed over B and T
        p_sink = jnp.exp(sinks.astype(f32) - lse)  # [B,K,G,T]
        d_sinks = _sum_to_shape(-(p_sink * delta[..., 0]), sinks.shape)
    return d_q, d_k, d_v, d_bias, d_sinks


def _sum_to_shape(x, shape):
    """Sums a cotangent down to the broadcast `shape` of a bias (`[B,K,G,T,S]`) or of sinks (`[1,K,G,1]`)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


_attention.defvjp(_forward, _backward)


def _block_index(x, block, T, S):
    """The index of rows `block` and keys `[0, stop)` in a `[B,K,G,T,S]`-broadcastable mask or bias (a dim
    of size 1 stays whole)."""
    start, stop = block
    rows = slice(start, stop) if x.shape[3] == T else slice(None)
    keys = slice(0, stop) if x.shape[4] == S else slice(None)
    return slice(None), slice(None), slice(None), rows, keys


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _blocked_attention(q, k, v, bias, allowed, sinks, scale, cap, want_lse, blocks):
    """`_attention` with the query rows in `blocks` (`causal_row_blocks`), each over the keys before its end."""
    return _blocked_forward(q, k, v, bias, allowed, sinks, scale, cap, want_lse, blocks)[0]


def _blocked_forward(q, k, v, bias, allowed, sinks, scale, cap, want_lse, blocks):
    T, S = q.shape[3], k.shape[2]
    outs, lses, saved = [], [], []
    for block in blocks:
        start, stop = block
        (out, lse), block_saved = _forward(
            q[:, :, :, start:stop], k[:, :, :stop], v[:, :, :stop],
            None if bias is None else bias[_block_index(bias, block, T, S)],
            None if allowed is None else allowed[_block_index(allowed, block, T, S)], sinks, scale, cap, want_lse)
        outs.append(out)
        lses.append(lse)
        saved.append(block_saved)
    lse = jnp.concatenate(lses, axis=3) if want_lse else None
    # the last block's keys and values are all of them; q, k and v are kept only in the blocks' slices
    return (jnp.concatenate(outs, axis=3), lse), (bias, sinks, saved)


def _blocked_backward(scale, cap, want_lse, blocks, residuals, cotangents):
    bias, sinks, saved = residuals
    q_block, k, v = saved[0][0], saved[-1][1], saved[-1][2]
    T, S = blocks[-1][1], k.shape[2]
    f32 = jnp.promote_types(q_block.dtype, jnp.float32)
    d_qs = []
    d_k, d_v = jnp.zeros(k.shape, f32), jnp.zeros(v.shape, f32)
    d_bias = None if bias is None else jnp.zeros(bias.shape, f32)
    d_sinks = None if sinks is None else jnp.zeros(sinks.shape, f32)
    for block, block_saved in zip(blocks, saved):
        start, stop = block
        g_q, g_k, g_v, g_bias, g_sinks = _gradients(scale, cap, block_saved, cotangents[0][:, :, :, start:stop])
        d_qs.append(g_q)
        d_k = d_k.at[:, :, :stop].add(g_k)
        d_v = d_v.at[:, :, :stop].add(g_v)
        if bias is not None:
            d_bias = d_bias.at[_block_index(bias, block, T, S)].add(g_bias)
        if sinks is not None:
            d_sinks = d_sinks + g_sinks
    return _rounded(jnp.concatenate(d_qs, axis=3), d_k, d_v, d_bias, d_sinks, q_block, k, v, bias, sinks)


_blocked_attention.defvjp(_blocked_forward, _blocked_backward)
