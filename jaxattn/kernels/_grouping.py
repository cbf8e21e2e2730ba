"""Shapes shared by the attention kernels: masks and biases grouped like the queries (docs/theory.md §5)."""

from __future__ import annotations

import jax.numpy as jnp

from jaxattn.masks import causal_mask, local_window_mask, padding_mask, segment_mask


def group_heads(x: jnp.ndarray, num_kv_heads: int) -> jnp.ndarray:
    """Mask or bias broadcastable to `[B, N, T, S]` -> broadcastable to `[B, K, G, T, S]`.

    Query head n = k * G + g belongs to key/value head k = n // G. The result has rank 5.
    """
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, n // num_kv_heads, t, s)


def allowed_keys(mask, is_causal: bool, T: int, S: int, K: int, grouped_bias=None,
                 window: tuple[int, int] | None = None, lengths=None, segments=None):
    """The boolean mask to apply, broadcastable to `[B, K, G, T, S]` and of rank 5, or None (every key allowed).

    `is_causal` (end-aligned), `window` (`(left, right)`, end-aligned: `jaxattn.masks.local_window_mask`)
    and `lengths` (`[B]` int: keys `j >= lengths[b]` hidden) are the structural arguments of
    `scaled_dot_product_attention` as a mask, and so are `segments` (`[B, T]` document ids of a packed
    self-attention, T == S: `jaxattn.masks.segment_mask`, id 0 padding). A key whose bias is -inf is masked too, so that a row
    biased to -inf everywhere has nothing to attend to (zeros) rather than 0/0 (NaN). Every operand
    is made rank 5 first: nothing relies on implicit rank promotion.
    """
    grouped = None if mask is None else group_heads(mask, K)

    def both(a, b):
        return b if a is None else jnp.logical_and(a, b)
    if is_causal:  # [T, S], aligned to the end of the keys
        grouped = both(grouped, causal_mask(T, S).reshape(1, 1, 1, T, S))
    if window is not None:
        grouped = both(grouped, local_window_mask(T, S, window).reshape(1, 1, 1, T, S))
    if lengths is not None:
        grouped = both(grouped, padding_mask(lengths, S)[:, None])  # [B, 1, 1, 1, S]
    if segments is not None:
        grouped = both(grouped, segment_mask(segments, segments)[:, None])  # [B, 1, 1, T, S]
    if grouped_bias is not None:
        grouped = both(grouped, grouped_bias != -jnp.inf)  # NaN stays visible: it is not -inf
    return grouped


def merge_heads(out: jnp.ndarray, dtype) -> jnp.ndarray:
    """`[B, T, K, G, Hv]` -> `[B, T, N, Hv]` in `dtype` (a free reshape: N = K * G)."""
    B, T, K, G, Hv = out.shape
    return out.reshape(B, T, K * G, Hv).astype(dtype)


def heads_major(query, key, value):
    """`[B,T,N,H]`, `[B,S,K,H]`, `[B,S,K,Hv]` -> q `[B,K,G,T,H]`, k `[B,K,S,H]`, v `[B,K,S,Hv]`.

    Heads in front, so every product is a matmul batched over (B, K).
    """
    B, T, N, H = query.shape
    K = key.shape[2]
    q = query.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)
    return q, key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)


def heads_minor(out: jnp.ndarray, dtype) -> jnp.ndarray:
    """`[B, K, G, T, Hv]` (heads-major) -> `[B, T, N, Hv]` in `dtype`."""
    return merge_heads(out.transpose(0, 3, 1, 2, 4), dtype)
