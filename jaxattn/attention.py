"""Scaled dot-product attention: the fast grouped path and the textbook path.

Shapes follow `jax.nn.dot_product_attention`:

  query `[B, T, N, H]`, key `[B, S, K, H]`, value `[B, S, K, Hv]`

B batch, T queries, S keys, N query heads, K key/value heads (N a multiple of
K), G = N // K query heads per key/value head, H head dim, Hv value head dim.

`scaled_dot_product_attention` and `cached_attention` check their arguments,
fill in the defaults and hand the work to one implementation chosen by name
(`implementation=`, see `jaxattn.kernels`); every implementation groups the
query heads as `[B, T, K, G, H]` (G query heads per key/value head) so that MQA
and GQA never materialise repeated keys and values (docs/theory.md §2-§5).
`reference_attention` is the textbook formula `softmax(Q K^T / sqrt(d_k)) V`
with an explicit `repeat_kv`, independent of the kernels: the oracle the tests
compare every implementation against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxattn import kernels
from jaxattn._validate import (concrete_or_none, require_bool, require_broadcastable, require_float,
                               require_integer, require_positive_int, require_rank)
from jaxattn.masks import causal_mask, padding_mask, sliding_window_mask
from jaxattn.softmax import softmax_dtype


def repeat_kv(x: jnp.ndarray, n_rep: int) -> jnp.ndarray:
    """`[B, S, K, H] -> [B, S, K * n_rep, H]`; output head j is input head j // n_rep.

    This is Llama's `repeat_kv` (docs/theory.md §5). The kernels do not need
    it; it is here for teaching, for `reference_attention` and for parity tests
    of GQA against MHA.
    """
    require_rank("x", x, 4, "[B, S, K, H]")
    if not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"n_rep must be a positive integer, got {n_rep!r}")
    return x if n_rep == 1 else jnp.repeat(x, n_rep, axis=2)


def _validate(query, key, value, mask, bias, dropout_rate):
    require_rank("query", query, 4, "[B, T, N, H]")
    require_rank("key", key, 4, "[B, S, K, H]")
    require_rank("value", value, 4, "[B, S, K, Hv]")
    for name, x in (("query", query), ("key", key), ("value", value)):
        require_float(name, x)
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


def _validate_structure(query, key, is_causal, local_window_size, key_value_seq_lengths):
    """The structural masks: a causal sliding window and per-row key lengths `[B]` in [0, S]
    (their values are checked when known now, i.e. not traced under `jit`)."""
    if local_window_size is not None:
        require_positive_int("local_window_size", local_window_size)
        if not is_causal:
            raise ValueError(f"local_window_size={local_window_size} needs is_causal=True: the window is "
                             "the W - 1 keys before each query and the query itself")
    if key_value_seq_lengths is not None:
        require_rank("key_value_seq_lengths", key_value_seq_lengths, 1, "[B]")
        require_integer("key_value_seq_lengths", key_value_seq_lengths)
        if key_value_seq_lengths.shape[0] != query.shape[0]:
            raise ValueError(f"key_value_seq_lengths {key_value_seq_lengths.shape} must be [B] = "
                             f"({query.shape[0]},) for query {query.shape}")
        lengths = concrete_or_none(key_value_seq_lengths)
        S = key.shape[1]
        if lengths is not None and lengths.size and (lengths.min() < 0 or lengths.max() > S):
            raise ValueError(f"key_value_seq_lengths must be in [0, S={S}] for key {key.shape}, got "
                             f"{lengths.tolist()}")


def scaled_dot_product_attention(query, key, value, *, mask=None, bias=None,
                                 is_causal=False, scale=None, dropout_rate=0.0,
                                 dropout_rng=None, return_weights=False,
                                 local_window_size=None, key_value_seq_lengths=None,
                                 implementation="auto"):
    """softmax(Q K^T * scale + bias, masked) V, grouped for MQA/GQA (docs/theory.md §2-§5).

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
      local_window_size: None, or a sliding window W (needs `is_causal=True`):
        each query sees itself and the W - 1 keys before it, end-aligned like
        `is_causal` (`jaxattn.masks.sliding_window_mask`; an int, where
        `jax.nn.dot_product_attention` takes `(W - 1, 0)`).
      key_value_seq_lengths: None, or `[B]` integers in [0, S]: keys `j >= lengths[b]`
        of row b are hidden (right padding, `jaxattn.masks.padding_mask`); values
        outside [0, S] are a ValueError when known before tracing (under `jit` they
        are not checked: a negative length hides every key, one past S none).
      implementation: "auto" (default: this process's platform rule, e.g.
        "auto_cpu", which picks per call, see `jaxattn.kernels.auto`) or a
        name of `jaxattn.kernels.choices("attention")`: "xla" (the reference,
        differentiable in any order and mode: use it for `jax.jvp` or
        higher derivatives), "custom_vjp" (a hand-written backward for
        training), "chunked" (blockwise, O(T) memory, skips the blocks the
        causal mask or the window hides; docs/theory.md §10), "cudnn" (GPU)
        or "splash" (TPU). All but "xla" are reverse mode only and run the
        reference for dropout and `return_weights`.

    Returns:
      `[B, T, N, Hv]` in the query's dtype, or `(out, weights [B, N, T, S])`
      (float32, after dropout, as used for the output). Logits and softmax are
      float32 whatever the input dtype (float64 inputs stay float64). A query
      row with no key to attend to (masked, or biased to -inf) gives zeros,
      never NaN.

    Inputs must be finite, masked keys' values included: a masked key gets
    weight exactly 0, but 0 times NaN is NaN (padding and unwritten cache slots
    that this library writes are always finite).
    """
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    lengths = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    _validate(query, key, value, mask, bias, dropout_rate)
    _validate_structure(query, key, is_causal, local_window_size, lengths)
    if implementation == kernels.AUTO:
        implementation = kernels.select.attention_rule_here()
    attend = kernels.attention_kernel(implementation)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    out, weights = attend(query, key, value, mask=mask, bias=bias, is_causal=is_causal, scale=scale,
                          dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_weights=return_weights,
                          local_window_size=local_window_size, key_value_seq_lengths=lengths)
    return (out, weights) if return_weights else out


def cached_attention(query, key_cache, value_cache, query_positions, *, scale=None, window=None,
                     implementation="xla"):
    """Attention of T new queries against a KV cache (prefill and decode steps, docs/theory.md §9).

    The cache is heads-major (`jaxattn.cache`): each (row, kv head) is one
    contiguous `[L, H]` matrix. Slot j holds absolute position j and is visible
    to a query at position p iff j <= p (`jaxattn.masks.visible_cache_slots`),
    so slots not yet written never are. The same maths as
    `scaled_dot_product_attention` on the transposed cache with that mask.

    Args:
      query: `[B, T, N, H]` new queries, N a multiple of K.
      key_cache: `[B, K, L, H]` keys.
      value_cache: `[B, K, L, Hv]` values.
      query_positions: `[B, T]` integer absolute positions of the queries.
      scale: multiplies the logits; defaults to `1 / sqrt(H)`.
      window: None, or a sliding window W: slot j is also hidden when `p - j >= W`.
      implementation: a name of `jaxattn.kernels.choices("decode")`.

    Returns:
      `[B, T, N, Hv]` in the query's dtype; logits and softmax in float32.
    """
    require_rank("query", query, 4, "[B, T, N, H]")
    require_rank("key_cache", key_cache, 4, "[B, K, L, H]")
    require_rank("value_cache", value_cache, 4, "[B, K, L, Hv]")
    B, T, N, H = query.shape
    K = key_cache.shape[1]
    if key_cache.shape[0] != B or key_cache.shape[3] != H or N % K or value_cache.shape[:3] != key_cache.shape[:3]:
        raise ValueError(f"query {query.shape} [B, T, N, H], key_cache {key_cache.shape} [B, K, L, H] and "
                         f"value_cache {value_cache.shape} [B, K, L, Hv] must agree in B, H, K (N a multiple of K)")
    query_positions = jnp.asarray(query_positions)
    if query_positions.shape != (B, T):
        raise ValueError(f"query_positions must be [B, T] = {(B, T)}, got {query_positions.shape}")
    require_integer("query_positions", query_positions)
    attend = kernels.cached_attention_kernel(implementation)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    if window is not None:
        require_positive_int("window", window)
    return attend(query, key_cache, value_cache, query_positions, scale=scale, window=window)


def reference_attention(query, key, value, *, mask=None, bias=None,
                        is_causal=False, scale=None, return_weights=False,
                        local_window_size=None, key_value_seq_lengths=None):
    """The textbook formula, step by step (docs/theory.md §2-§5). Same contract as above.

    Slow on purpose and independent of `jaxattn.kernels` and of the masked
    softmax: it repeats K/V to every query head, moves heads in front
    (`[B, N, T, H]`) and masks with -inf, exactly as the textbook writes it.
    """
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    lengths = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    _validate(query, key, value, mask, bias, 0.0)
    _validate_structure(query, key, is_causal, local_window_size, lengths)
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    scale = 1.0 / math.sqrt(H) if scale is None else scale

    k = repeat_kv(key, N // K).transpose(0, 2, 1, 3)  # [B, N, S, H]
    v = repeat_kv(value, N // K).transpose(0, 2, 1, 3)  # [B, N, S, Hv]
    q = query.transpose(0, 2, 1, 3)  # [B, N, T, H]
    f32 = softmax_dtype(query.dtype)
    scores = jnp.matmul(q.astype(f32), k.astype(f32).swapaxes(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.astype(f32)  # [B, N, T, S]
    allowed = jnp.ones((T, S), bool) if mask is None else mask
    if is_causal:
        window = causal_mask(T, S) if local_window_size is None else sliding_window_mask(T, S, local_window_size)
        allowed = jnp.logical_and(allowed, window)
    if lengths is not None:
        allowed = jnp.logical_and(allowed, padding_mask(lengths, S))  # [B, 1, 1, S]
    if bias is not None:  # a key biased to -inf cannot be attended to
        allowed = jnp.logical_and(allowed, bias != -jnp.inf)
    allowed = jnp.broadcast_to(allowed, (B, N, T, S))
    scores = jnp.where(allowed, scores, -jnp.inf)
    # A row with every key masked is defined as zeros rather than 0/0.
    any_allowed = allowed.any(axis=-1, keepdims=True)
    scores = jnp.where(any_allowed, scores, 0.0)
    weights = jnp.where(any_allowed, jax.nn.softmax(scores, axis=-1), 0.0)
    out = jnp.matmul(weights, v.astype(f32))  # [B, N, T, Hv]
    out = out.transpose(0, 2, 1, 3).astype(query.dtype)  # [B, T, N, Hv]
    return (out, weights) if return_weights else out
