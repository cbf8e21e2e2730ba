"""Scaled dot-product attention: the fast grouped path and the textbook path.

Shapes follow `jax.nn.dot_product_attention`:

  query `[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]`

B batch, T queries, S keys, N query heads, K key/value heads (N a multiple of
K), G = N // K query heads per key/value head, H head dim, Hv value head dim.

`scaled_dot_product_attention` groups the query heads as `[B, K, G, T, H]`
(heads in front, G query heads per key/value head) so that MQA and GQA never
materialise repeated keys and values.
`reference_attention` is the seed formula `softmax(Q K^T / sqrt(d_k)) V`
with an explicit `repeat_kv`, kept as documentation and as the oracle the
tests compare against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxattn._validate import require_bool, require_broadcastable, require_rank
from jaxattn.masks import causal_mask

# Logits of masked keys. Finite, so a fully masked row softmaxes to a uniform
# row (then zeroed) instead of NaN, and gradients stay finite.
_MASKED_LOGIT = float(jnp.finfo(jnp.float32).min)


def repeat_kv(x: jnp.ndarray, n_rep: int) -> jnp.ndarray:
    """`[B, S, K, H] -> [B, S, K * n_rep, H]`; output head j is input head j // n_rep.

    This is Llama's `repeat_kv` (seed 000). The fast path does not need it; it
    is here for teaching and for parity tests of GQA against MHA.
    """
    require_rank("x", x, 4, "[B, S, K, H]")
    if not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be a positive integer, got {n_rep!r}")
    return x if n_rep == 1 else jnp.repeat(x, n_rep, axis=2)


def _validate(query, key, value, mask, bias, dropout_rate):
    require_rank("query", query, 4, "[B, T, N, H]")
    require_rank("key", key, 4, "[B, S, K, H]")
    require_rank("value", value, 4, "[B, S, K, Hv]")
    (B, T, N, H), (Bk, S, K, Hk) = query.shape, key.shape
    if Bk != B or value.shape[0] != B:
        raise ValueError(
            f"batch sizes differ: query {query.shape}, key {key.shape}, value {value.shape}"
        )
    if value.shape[1:3] != (S, K):
        raise ValueError(
            f"value {value.shape} must match key {key.shape} in length S and heads K"
        )
    if Hk != H:
        raise ValueError(f"head dims differ: query {query.shape} has H={H}, key {key.shape} has H={Hk}")
    if N % K:
        raise ValueError(
            f"query heads N={N} (query {query.shape}) must be a multiple of "
            f"key/value heads K={K} (key {key.shape})"
        )
    target = (B, N, T, S)
    if mask is not None:
        require_bool("mask", mask)
        require_broadcastable("mask", mask.shape, target, "[B, N, T, S]")
    if bias is not None:
        require_broadcastable("bias", bias.shape, target, "[B, N, T, S]")
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")


def _group_heads(x: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """Mask or bias broadcastable to `[B, N, T, S]` -> broadcastable to `[B, K, G, T, S]`."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def _full_mask(mask, is_causal, T, S, K):
    """The boolean mask to apply, broadcastable to `[B, K, G, T, S]`, or None."""
    grouped = None if mask is None else _group_heads(mask, K)
    if is_causal:
        causal = causal_mask(T, S)  # [T, S]
        grouped = causal if grouped is None else jnp.logical_and(grouped, causal)
    return grouped


def _softmax_dtype(dtype):
    """float32 for bf16/f16/f32 inputs; float64 inputs keep float64 (never downcast)."""
    return jnp.promote_types(dtype, jnp.float32)


def _dropout(weights, rate, rng):
    keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), 0.0)


def _may_have_empty_rows(mask, bias, is_causal, T, S) -> bool:
    """Whether some query row could have every key masked (then it must be zeroed).

    Without a mask or bias, and with causal masking only when every query sees
    at least key 0 (T <= S, end-aligned), each row keeps a finite logit and the
    masked keys' weights underflow to exactly 0 by themselves.
    """
    return mask is not None or bias is not None or (is_causal and T > S)


def _heads_major(query, key, value):
    """`[B,T,N,H]`, `[B,S,K,H]`, `[B,S,K,Hv]` -> q `[B,K,G,T,H]`, k `[B,K,S,H]`, v `[B,K,S,Hv]`.

    Heads in front make both attention products plain matmuls batched over
    (B, K); on CPU that beats contracting the `[B,T,K,G,H]` layout in place
    (bench/results/train_notes.md).
    """
    B, T, N, H = query.shape
    K = key.shape[2]
    q = query.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    return q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)


def _softmax_weights(q, k, bias, allowed, zero_empty_rows, scale, f32):
    """Masked softmax of the scaled logits: `[B,K,G,T,S]` weights in float32 (or float64)."""
    logits = jnp.einsum("BKGTH,BKSH->BKGTS", q, k, preferred_element_type=f32) * scale
    if bias is not None:
        logits = logits + bias.astype(f32)
    if allowed is not None:
        logits = jnp.where(allowed, logits, _MASKED_LOGIT)
    weights = jax.nn.softmax(logits, axis=-1)
    if allowed is not None and zero_empty_rows:
        weights = jnp.where(allowed, weights, 0.0)
    return weights


def _weighted_values(weights, v):
    return jnp.einsum("BKGTS,BKSH->BKGTH", weights.astype(v.dtype), v)


def _sum_to_shape(x, shape):
    """Sums a `[B,K,G,T,S]` cotangent down to the broadcast `shape` of a bias."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape)) if m == 1 and n != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention_custom_vjp(q, k, v, bias, allowed, zero_empty_rows, scale):
    return _attention_fwd(q, k, v, bias, allowed, zero_empty_rows, scale)[0]


def _attention_fwd(q, k, v, bias, allowed, zero_empty_rows, scale):
    f32 = _softmax_dtype(q.dtype)
    weights = _softmax_weights(q, k, bias, allowed, zero_empty_rows, scale, f32)
    out = _weighted_values(weights, v)
    return out, (q, k, v, bias, allowed, weights, out)


def _attention_bwd(zero_empty_rows, scale, residuals, d_out):
    """FlashAttention's backward: rowsum(dP * P) computed as rowsum(dO * O) (seed 004 maths)."""
    q, k, v, bias, allowed, weights, out = residuals
    f32 = weights.dtype
    d_out = d_out.astype(f32)
    d_v = jnp.einsum("BKGTS,BKGTH->BKSH", weights, d_out)
    d_weights = jnp.einsum("BKGTH,BKSH->BKGTS", d_out, v, preferred_element_type=f32)
    # rowsum(dO * O) as a batched dot: as a multiply and sum XLA:CPU fused it into the dO V^T
    # dot's library call, and the whole baby step ran ~5% slower (bench/results/train_notes.md).
    delta = jnp.einsum("BKGTH,BKGTH->BKGT", d_out, out.astype(f32))[..., None]  # [B,K,G,T,1]
    d_logits = weights * (d_weights - delta)  # masked keys have weight 0, so 0 here
    d_q = jnp.einsum("BKGTS,BKSH->BKGTH", d_logits, k, preferred_element_type=f32) * scale
    d_k = jnp.einsum("BKGTS,BKGTH->BKSH", d_logits, q, preferred_element_type=f32) * scale
    d_bias = None if bias is None else _sum_to_shape(d_logits, bias.shape).astype(bias.dtype)
    return (d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None)


_attention_custom_vjp.defvjp(_attention_fwd, _attention_bwd)


def scaled_dot_product_attention(query, key, value, *, mask=None, bias=None,
                                 is_causal=False, scale=None, dropout_rate=0.0,
                                 dropout_rng=None, return_weights=False,
                                 implementation="xla"):
    """softmax(Q K^T * scale + bias, masked) V, grouped for MQA/GQA.

    Args:
      query: `[B, T, N, H]`.
      key: `[B, S, K, H]`, N a multiple of K (K = N is MHA, K = 1 MQA).
      value: `[B, S, K, Hv]`.
      mask: boolean, True = attend, broadcastable to `[B, N, T, S]`.
      bias: additive logits, broadcastable to `[B, N, T, S]`.
      is_causal: also apply `causal_mask(T, S)`, aligned to the end of the keys.
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.
      dropout_rate: dropout on the attention weights, applied only when
        `dropout_rate > 0` and `dropout_rng` is given.
      dropout_rng: PRNG key for the dropout.
      return_weights: also return the attention weights.
      implementation: "xla" differentiates the maths with JAX (any order, any
        mode); "custom_vjp" uses a hand-written reverse-mode backward that
        keeps the weights and output and computes rowsum(dP * P) as
        rowsum(dO * O), faster for training (bench/results/train_notes.md) but
        `jax.jvp` through it raises. Dropout and `return_weights` always take
        the "xla" path.

    Returns:
      `[B, T, N, Hv]` in the query's dtype, or `(out, weights [B, N, T, S])`
      (float32, after dropout, as used for the output). Logits and softmax are
      float32 whatever the input dtype (float64 inputs stay float64, so that
      their gradients can be checked against finite differences). A query row
      with no key to attend to gives zeros, never NaN.
    """
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    _validate(query, key, value, mask, bias, dropout_rate)
    if implementation not in ("xla", "custom_vjp"):
        raise ValueError(f'implementation must be "xla" or "custom_vjp", got {implementation!r}')
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else scale

    q, k, v = _heads_major(query, key, value)  # [B,K,G,T,H], [B,K,S,H], [B,K,S,Hv]
    bias = None if bias is None else _group_heads(bias, K)
    allowed = _full_mask(mask, is_causal, T, S, K)  # broadcastable to [B,K,G,T,S]
    zero_empty_rows = _may_have_empty_rows(mask, bias, is_causal, T, S)
    dropout = dropout_rate > 0.0 and dropout_rng is not None
    if implementation == "custom_vjp" and not dropout and not return_weights:
        out = _attention_custom_vjp(q, k, v, bias, allowed, zero_empty_rows, scale)
    else:
        weights = _softmax_weights(q, k, bias, allowed, zero_empty_rows, scale,
                                   _softmax_dtype(query.dtype))  # [B,K,G,T,S]
        if dropout:
            weights = _dropout(weights, dropout_rate, dropout_rng)
        out = _weighted_values(weights, v)
    # [B,K,G,T,Hv] -> [B,T,K,G,Hv] -> [B,T,N,Hv]
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, value.shape[-1]).astype(query.dtype)
    if return_weights:
        return out, weights.reshape(B, N, T, S)
    return out


def cached_attention(query, key_cache, value_cache, query_positions, *, scale=None):
    """Attention of T new queries against a heads-major KV cache (prefill and decode steps).

    Exists for speed: the cache is `[B, K, L, H]` (see `jaxattn.cache`) so that
    both einsums are plain matmuls batched over (B, K) and XLA never copies the
    cache; masking is one `[B, 1, 1, T, L]` position comparison instead of a
    full mask. Against `scaled_dot_product_attention` on a `[B, L, K, H]` cache
    one decode step of attention went from 1.12 ms to 0.28 ms at B=8, L=272,
    K=6, H=64 (bench/results/decode_notes.md). Same maths: tests compare the two.

    Args:
      query: `[B, T, N, H]` new queries, N a multiple of K.
      key_cache: `[B, K, L, H]` keys, slot j of row b = absolute position j.
      value_cache: `[B, K, L, Hv]` values.
      query_positions: `[B, T]` int absolute positions of the queries; slot j
        is visible to a query at position p iff j <= p (so slot 0 always is).
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.

    Returns:
      `[B, T, N, Hv]` in the query's dtype; logits and softmax in float32.
    """
    require_rank("query", query, 4, "[B, T, N, H]")
    require_rank("key_cache", key_cache, 4, "[B, K, L, H]")
    require_rank("value_cache", value_cache, 4, "[B, K, L, Hv]")
    B, T, N, H = query.shape
    K, L = key_cache.shape[1:3]
    if key_cache.shape[0] != B or key_cache.shape[3] != H or N % K or value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"query {query.shape} [B, T, N, H], key_cache {key_cache.shape} [B, K, L, H] and "
                         f"value_cache {value_cache.shape} [B, K, L, Hv] must agree in B, H, K (N a multiple of K)")
    if query_positions.shape != (B, T):
        raise ValueError(f"query_positions must be [B, T] = {(B, T)}, got {query_positions.shape}")
    scale = 1.0 / math.sqrt(H) if scale is None else scale

    q = query.reshape(B, T, K, N // K, H)
    # The cache as the dot's left operand, contracted on its minor dim: a matrix-vector product
    # that reads the cache in place (as the right operand XLA first transposed all of it).
    logits = jnp.einsum("BKSH,BTKGH->BKGTS", key_cache, q,
                        preferred_element_type=_softmax_dtype(query.dtype)) * scale
    visible = jnp.arange(L) <= query_positions[:, None, None, :, None]  # [B, 1, 1, T, L]
    weights = jax.nn.softmax(jnp.where(visible, logits, _MASKED_LOGIT), axis=-1)  # [B, K, G, T, L]
    out = _weighted_cache_values(weights.astype(value_cache.dtype), value_cache)  # [B, T, K, G, Hv]
    return out.reshape(B, T, N, value_cache.shape[-1]).astype(query.dtype)


def _weighted_cache_values(weights, value_cache):
    """`[B,K,G,T,L]` weights x `[B,K,L,Hv]` cache -> `[B,T,K,G,Hv]`, in the product form XLA:CPU runs fastest.

    With two real batch dims (B > 1 and K > 1) and several query rows per head
    (G * T > 1: GQA decode, prefill), XLA:CPU gives the product to YNNPACK only when its
    output is heads-major `[B,K,G,T,Hv]`; the `[B,T,K,G,Hv]` order falls back to XLA's generic
    dot, which made GQA decode at batch 8 1.6-1.8x slower (bench/results/decode_notes.md).
    Elsewhere the direct form is as fast or faster (a matrix-vector product for MHA steps).
    """
    B, K, G, T, L = weights.shape
    if B > 1 and K > 1 and G * T > 1:
        return _weighted_values(weights, value_cache).transpose(0, 3, 1, 2, 4)
    return jnp.einsum("BKGTS,BKSH->BTKGH", weights, value_cache)


def reference_attention(query, key, value, *, mask=None, bias=None,
                        is_causal=False, scale=None, return_weights=False):
    """The seed formula, step by step (seed 000 §5-§10). Same contract as above.

    Slow on purpose: it repeats K/V to every query head and moves heads in
    front, `[B, N, T, H]`, exactly as the textbook writes it.
    """
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    _validate(query, key, value, mask, bias, 0.0)
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else scale

    k = repeat_kv(key, N // K).transpose(0, 2, 1, 3)  # [B, N, S, H]
    v = repeat_kv(value, N // K).transpose(0, 2, 1, 3)  # [B, N, S, Hv]
    q = query.transpose(0, 2, 1, 3)  # [B, N, T, H]
    f32 = _softmax_dtype(query.dtype)
    scores = jnp.matmul(q.astype(f32), k.astype(f32).swapaxes(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.astype(f32)  # [B, N, T, S]
    allowed = jnp.ones((T, S), bool) if mask is None else mask
    if is_causal:
        allowed = jnp.logical_and(allowed, causal_mask(T, S))
    allowed = jnp.broadcast_to(allowed, (B, N, T, S))
    scores = jnp.where(allowed, scores, -jnp.inf)
    # A row with every key masked is defined as zeros rather than 0/0.
    any_allowed = allowed.any(axis=-1, keepdims=True)
    scores = jnp.where(any_allowed, scores, 0.0)
    weights = jnp.where(any_allowed, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.matmul(weights, v.astype(f32))  # [B, N, T, Hv]
    out = out.transpose(0, 2, 1, 3).astype(query.dtype)  # [B, T, N, Hv]
    return (out, weights) if return_weights else out
