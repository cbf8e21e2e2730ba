"""Cached attention that reads only the filled part of the cache ("blocked", docs/theory.md §9).

Contract: `jaxattn.attention.cached_attention`; equal to the reference ("xla")
in tests/kernels/test_blocked_decode.py and tests/kernels/test_kernels.py. The dense kernels
read all L slots of every row at every step, whatever the rows' lengths, so a
cache allocated for 8k tokens costs 8k slots per step even when it holds 256.
Here the cache is read in key blocks of `BLOCK_SIZE` slots
(`jax.lax.dynamic_slice`), in a loop whose trip count is traced: only the
blocks between `block_range`'s bounds are read, i.e. up to the block that
holds the batch's highest query position (and, with a sliding window, from
the block that holds its lowest visible slot). The blocks are combined by the
online softmax (a running max, a running sum and a rescaled accumulator, all
float32), so the result is the softmax over all visible slots, to float32
summation order. A soft cap (docs/theory.md §17) caps each block's logits; sinks
(§18) start every row's running max and sum (max = sink, sum = 1), so they join
the denominator without a value.

The cost follows the longest row of the batch: one loop serves every row.
Forward only: reverse-mode differentiation through a loop with a traced trip
count (`jax.lax.while_loop`) is unsupported by JAX, so this kernel is for
inference (decoding and prefill), not training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn.kernels._grouping import merge_heads
from jaxattn.softmax import softmax_dtype

BLOCK_SIZE = 256  # slots per block: few loop trips per step, little read past max(p); not tuned


def block_range(query_positions, num_slots: int, block_size: int, window: int | None = None):
    """`(first, stop)` traced int32 scalars: blocks `first .. stop - 1` hold every slot a query can see.

    Block i owns slots `[i * block_size, (i + 1) * block_size)`. Slot j is
    visible to position p iff `j <= p` (and `p - j < window`), so no block past
    the one holding `max(p)` and, with a window, none before the one holding
    `min(p) - window + 1` has a visible slot. `first >= stop` means nothing to read.
    """
    num_blocks = -(-num_slots // block_size)
    highest = jnp.max(query_positions).astype(jnp.int32)
    stop = jnp.clip((highest + block_size) // block_size, 0, num_blocks)  # ceil((highest + 1) / block_size)
    if window is None:
        return jnp.int32(0), stop
    lowest = jnp.min(query_positions).astype(jnp.int32) - window + 1
    return jnp.clip(lowest, 0, None) // block_size, stop


def block_start(index, num_slots: int, block_size: int):
    """The first slot read for block `index`: the last block is shifted back to end at slot L - 1.

    `dynamic_slice` would clamp it there anyway (a slice must fit); the slots it
    then reads twice belong to the previous block and are masked (`_visible`).
    """
    return jnp.minimum(index * block_size, num_slots - block_size)


def slots_read(query_positions, num_slots: int, block_size: int, window: int | None = None):
    """`(lo, hi)`: the kernel reads cache slots `lo .. hi - 1` and no other (`lo >= hi`: none)."""
    block_size = min(block_size, num_slots)
    first, stop = block_range(query_positions, num_slots, block_size, window)
    lo = block_start(first, num_slots, block_size)
    hi = block_start(stop - 1, num_slots, block_size) + block_size
    return jnp.where(first < stop, lo, 0), jnp.where(first < stop, hi, 0)


def _visible(query_positions, index, start, block_size: int, window: int | None):
    """`[B, 1, 1, T, S]`: slot `start + s` is owned by block `index` and visible to the query."""
    slots = start + jnp.arange(block_size)[None, None, :]  # [1, 1, S]
    positions = query_positions[:, :, None]  # [B, T, 1]
    visible = (slots >= index * block_size) & (slots <= positions)  # not the previous block's, not the future
    if window is not None:
        visible = visible & (slots > positions - window)
    return visible[:, None, None]


def online_softmax_step(carry, logits, visible, value_block):
    """Folds one block into `(max [B,K,G,T], sum [B,K,G,T], acc [B,K,G,T,Hv])`, all float32.

    Earlier blocks are rescaled by exp(old max - new max). While a query has
    seen nothing its max is -inf; the max used to exponentiate is then 0, so
    no -inf - -inf (NaN) arises and its sum and accumulator stay 0.
    """
    running_max, total, acc = carry
    block_max = jnp.max(jnp.where(visible, logits, -jnp.inf), axis=-1)
    new_max = jnp.maximum(running_max, block_max)
    shift = jnp.where(jnp.isneginf(new_max), 0.0, new_max)
    weights = jnp.where(visible, jnp.exp(logits - shift[..., None]), 0.0)  # [B, K, G, T, S]
    rescale = jnp.exp(running_max - shift)  # 0 while nothing was seen
    block_out = jnp.einsum("BKGTS,BKSH->BKGTH", weights.astype(value_block.dtype), value_block,
                           preferred_element_type=acc.dtype)
    return (new_max, total * rescale + weights.sum(-1),
            acc * rescale[..., None] + block_out)


def cached_attention(query, key_cache, value_cache, query_positions, *, scale, window=None,
                     logits_soft_cap=None, sinks=None, block_size=None):
    """Same arguments and result as `jaxattn.kernels.xla.cached_attention`, reading only `slots_read`.

    `block_size` defaults to `BLOCK_SIZE` (read at call time) and is capped at L.
    """
    B, T, N, H = query.shape
    K, L = key_cache.shape[1:3]
    size = min(BLOCK_SIZE if block_size is None else block_size, L)
    q = query.reshape(B, T, K, N // K, H)  # [B, T, K, G, H]: G query heads per kv head
    f32 = softmax_dtype(query.dtype)

    def body(index, carry):
        start = block_start(index, L, size)
        keys, values = (jax.lax.dynamic_slice_in_dim(c, start, size, axis=2) for c in (key_cache, value_cache))
        logits = jnp.einsum("BKSH,BTKGH->BKGTS", keys, q, preferred_element_type=f32) * scale
        if logits_soft_cap is not None:  # c * tanh(s / c), after the scale
            logits = logits_soft_cap * jnp.tanh(logits / logits_soft_cap)
        return online_softmax_step(carry, logits, _visible(query_positions, index, start, size, window), values)

    stats = jnp.zeros((B, K, N // K, T), f32)
    if sinks is None:  # nothing seen yet: max -inf, sum 0
        carry = (stats - jnp.inf, stats)
    else:  # query head n = k * G + g; the sink is seen by every query, with no value
        carry = (stats + jnp.reshape(sinks, (1, K, N // K, 1)).astype(f32), stats + 1.0)
    carry += (jnp.zeros(stats.shape + value_cache.shape[-1:], f32),)
    first, stop = block_range(query_positions, L, size, window)
    _, total, acc = jax.lax.fori_loop(first, stop, body, carry)
    out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return merge_heads(out.transpose(0, 3, 1, 2, 4), query.dtype)  # [B, K, G, T, Hv] -> [B, T, N, Hv]
