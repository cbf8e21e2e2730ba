"""Attention of queries against a paged KV cache (`jaxattn.serving`, docs/theory.md §25).

A paged cache keeps each layer's keys and values in one pool of pages `[P, ps, K, H]`
(token-major inside a page) shared by every sequence; a block table `[R, Pr]` int32 names,
for row r, the pages of its sequence in order: slot j (absolute position j) of row r lives at
`pool[block_table[r, j // ps], j % ps]`. Table entries past a row's pages may name any valid
page: they are never visible, by the positions rule below.

Contract (both functions):

* `queries`: a tuple of `[R, C, N, H_i]` (R rows, C query columns per row) and `key_pages` a
  tuple of as many pools `[P, ps, K, H_i]`; the logits are `scale * sum_i q_i . k_i`. One part
  is MHA/GQA/MQA (N a multiple of K; queries grouped `[R, C, K, G, H]`, keys never repeated).
  Two parts are Multi-head Latent Attention absorbed (§6): (q_latent, c_kv pages)
  and (q_rope, k_rope pages), with K = 1 and the c_kv pages as values.
* `value_pages`: `[P, ps, K, Hv]`; `block_table`: `[R, Pr]` integer page ids.
* Any pool (key parts and values) may be float, or int8: a `jaxattn.cache.int8.QuantizedTokens`
  (int8 values `[P, ps, K, H_i]`, float32 scales `[P, ps, K]`), dequantized to queries[0]'s dtype
  as its pages are gathered (the whole table for the reference, a block at a time for the ragged one).
* `query_positions`: `[R, C]` integer absolute positions; -1 marks a padding query. Slot j is
  visible to a query at p iff `0 <= j <= p` (and `p - j < window`):
  `jaxattn.masks.visible_cache_slots`'s rule.
* `logits_soft_cap` c: `c * tanh(logits / c)` after the scale, before masking (§17). `sinks`:
  `[N]` logits joining each softmax's denominator without a value (§18).
* Returns `[R, C, N, Hv]` in queries[0]'s dtype; logits, softmax and sums in float32. A query
  that sees nothing (padding included) gives zeros, never NaN.

`gathered_paged_attention` is the reference: it gathers every row's whole table into a dense
`[R, Pr * ps, K, H]` and applies the masked softmax. `ragged_paged_attention` is the fast one,
forward only (inference): a pool holds every sequence's pages and a table reserves room for the
longest, so gathering whole tables costs the pages reserved. It instead loops, with a traced trip
count (as `jaxattn.kernels.blocked_decode`), over blocks of `pages_per_block` table columns from
the first block any query of the call can see to the one holding the highest position, gathering
only that block's pages per row and folding them into the online softmax of §15 (running max,
sum and rescaled accumulator, float32): the cost follows the tokens held, not the pages reserved.
Equal to the reference to float32 summation order.

Which one runs for a call (and the native loop of `jaxattn.kernels.native_paged`) is decided in one
place, `jaxattn.kernels.paged_select`, from the call's `PagedCall`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxattn._validate import is_int
from jaxattn.kernels._grouping import merge_heads
from jaxattn.kernels.blocked_decode import block_range, online_softmax_step
from jaxattn.masks import visible_cache_slots
from jaxattn.cache.int8 import as_float, is_quantized, leading
from jaxattn.softmax import grouped_sinks, masked_softmax, soft_cap, softmax_dtype


@dataclasses.dataclass(frozen=True)
class PagedCall:
    """What the per-call rule (`jaxattn.kernels.paged_select`) looks at: a call's static shapes and dtypes.

    Attributes:
      parts: key parts (1: MHA/GQA/MQA; 2: MLA absorbed, the latent and the rotary key).
      columns: C, query columns per row.
      query_heads, kv_heads: N and K.
      float32: queries, key parts and values are all float32 arrays (no int8 pages, no 16-bit floats).
    """

    parts: int
    columns: int
    query_heads: int
    kv_heads: int
    float32: bool

    @classmethod
    def of(cls, queries, key_pages, value_pages) -> "PagedCall":
        """The facts of a call with this module's arguments (shapes are static under `jit`)."""
        R, C, N = queries[0].shape[:3]
        float32 = all(x.dtype == jnp.float32 for x in (*queries, *key_pages, value_pages))
        return cls(parts=len(queries), columns=C, query_heads=N, kv_heads=value_pages.shape[2], float32=float32)

    @property
    def queries_per_kv_head(self) -> int:
        """C * G: the queries of a row that read one kv head's keys."""
        return self.columns * (self.query_heads // self.kv_heads)


def _shapes(queries, key_pages, value_pages, block_table, query_positions) -> str:
    parts = "; ".join(f"queries[{i}] {tuple(q.shape)}, key_pages[{i}] {tuple(k.shape)}"
                      for i, (q, k) in enumerate(zip(queries, key_pages)))
    return (f"{parts}; value_pages {tuple(value_pages.shape)}, block_table {tuple(block_table.shape)}, "
            f"query_positions {tuple(query_positions.shape)}")


def _check(queries, key_pages, value_pages, block_table, query_positions, sinks, window):
    """One ValueError naming the argument and every shape, before anything is traced."""
    for name, parts in (("queries", queries), ("key_pages", key_pages)):
        if not isinstance(parts, (tuple, list)) or not parts:
            raise ValueError(f"{name} must be a non-empty tuple of arrays, got {type(parts).__name__}")
    if len(queries) != len(key_pages):
        raise ValueError(f"queries and key_pages must have as many parts, got {len(queries)} and {len(key_pages)}")
    arrays = (*queries, *key_pages, value_pages, block_table, query_positions)
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in arrays):
        raise ValueError("queries, key_pages, value_pages, block_table and query_positions must be arrays")
    shapes = _shapes(queries, key_pages, value_pages, block_table, query_positions)

    def fail(problem):
        raise ValueError(f"{problem}: {shapes}")
    if any(x.ndim != 4 for x in (*queries, *key_pages, value_pages)):
        fail("queries must be [R, C, N, H_i], key_pages [P, ps, K, H_i] and value_pages [P, ps, K, Hv]")
    if not all(jnp.issubdtype(x.dtype, jnp.floating) for x in (*queries, *key_pages, value_pages)
               if not is_quantized(x)):
        fail("queries must be floating point, key_pages and value_pages floating point or QuantizedTokens")
    if any(is_quantized(x) for x in queries) or any(
            is_quantized(x) and (x.dtype != jnp.int8 or x.scales.shape != x.shape[:-1])
            for x in (*key_pages, value_pages)):
        fail("quantized pages must be int8 values [P, ps, K, H_i] with scales [P, ps, K], and queries float")
    R, C, N = queries[0].shape[:3]
    if any(q.shape[:3] != (R, C, N) for q in queries):
        fail("every part of queries must share [R, C, N]")
    if any(k.shape[:3] != value_pages.shape[:3] for k in key_pages):
        fail("every part of key_pages must share value_pages' [P, ps, K]")
    if any(q.shape[3] != k.shape[3] for q, k in zip(queries, key_pages)):
        fail("queries[i] and key_pages[i] must share their head dim H_i")
    K = value_pages.shape[2]
    if K == 0 or N % K:
        fail(f"the query heads N={N} must be a multiple of the key/value heads K={K}")
    if block_table.ndim != 2 or block_table.shape[0] != R or not jnp.issubdtype(block_table.dtype, jnp.integer):
        fail(f"block_table must be [R, Pr] = [{R}, Pr] integer, got dtype {block_table.dtype}")
    if block_table.shape[1] == 0 or value_pages.shape[1] == 0:
        fail("block_table must have a column and pages a slot")
    if query_positions.shape != (R, C) or not jnp.issubdtype(query_positions.dtype, jnp.integer):
        fail(f"query_positions must be [R, C] = {(R, C)} integer, got dtype {query_positions.dtype}")
    if sinks is not None and jnp.shape(sinks) != (N,):
        fail(f"sinks must be [N] = [{N}], got {jnp.shape(sinks)}")
    if window is not None and (not is_int(window) or window <= 0):
        raise ValueError(f"window must be None or a positive integer, got {window!r}")


def _gather(pages, ids, dtype):
    """`pages [P, ps, K, H]`, `ids [R, n]` -> `[R, n * ps, K, H]`: each row's pages, slots in order;
    int8 pages dequantized to `dtype` once gathered (float pages as they are)."""
    R, n = ids.shape
    rows = leading(lambda a: a[ids].reshape(R, n * a.shape[1], *a.shape[2:]), pages)
    return as_float(rows, dtype)


def _logits(queries, keys, scale, cap):
    """`scale * sum_i q_i . k_i`, soft-capped: `[R, K, G, C, S]` float32 from q `[R, C, N, H_i]`, k `[R, S, K, H_i]`."""
    f32 = softmax_dtype(queries[0].dtype)
    K = keys[0].shape[2]
    total = sum(jnp.einsum("RCKGH,RSKH->RKGCS", q.reshape(*q.shape[:2], K, -1, q.shape[3]), k,
                           preferred_element_type=f32) for q, k in zip(queries, keys))
    return soft_cap(total * scale, cap)


def _heads_last(out, dtype):
    """`[R, K, G, C, Hv]` -> `[R, C, N, Hv]` in `dtype`."""
    return merge_heads(out.transpose(0, 3, 1, 2, 4), dtype)


def gathered_paged_attention(queries, key_pages, value_pages, block_table, query_positions, *, scale,
                             window=None, logits_soft_cap=None, sinks=None, pages_per_block=None):
    """The reference (module docstring's contract): every row's whole table gathered, then the masked
    softmax over all `Pr * ps` slots. `pages_per_block` is ignored (the ragged one's signature)."""
    del pages_per_block
    _check(queries, key_pages, value_pages, block_table, query_positions, sinks, window)
    K, dtype = value_pages.shape[2], queries[0].dtype
    logits = _logits(queries, [_gather(k, block_table, dtype) for k in key_pages], scale, logits_soft_cap)
    values = _gather(value_pages, block_table, dtype)  # [R, L, K, Hv]
    visible = visible_cache_slots(query_positions, values.shape[1], window)[:, :, None]  # [R, 1, 1, C, L]
    weights = masked_softmax(logits, visible, sinks=None if sinks is None else grouped_sinks(sinks, K))
    out = jnp.einsum("RKGCS,RSKH->RKGCH", weights.astype(values.dtype), values, preferred_element_type=logits.dtype)
    return _heads_last(out, queries[0].dtype)


def _visible(query_positions, first_slot, num_slots: int, table_slots: int, window):
    """`[R, 1, 1, C, S]`: slot `first_slot + s` is in the table (not a clipped column) and visible."""
    slots = first_slot + jnp.arange(num_slots)[None, None, :]  # [1, 1, S]
    positions = query_positions[:, :, None]  # [R, C, 1]
    visible = (slots < table_slots) & (slots <= positions)  # a negative position sees nothing
    if window is not None:
        visible = visible & (slots > positions - window)
    return visible[:, None, None]


def _blocks(query_positions, table_slots: int, block_slots: int, window):
    """`(first, stop)`: the blocks `blocked_decode.block_range` reads, padding queries left out of the
    window's lowest position (a -1 would otherwise pull the start back to block 0)."""
    highest = jnp.max(query_positions)
    real = jnp.where(query_positions >= 0, query_positions, highest)  # all padding: all -1, nothing read
    return block_range(real, table_slots, block_slots, window)


def ragged_paged_attention(queries, key_pages, value_pages, block_table, query_positions, *, scale,
                           window=None, logits_soft_cap=None, sinks=None, pages_per_block=4):
    """The module docstring's contract, reading only blocks of `pages_per_block` table columns that
    hold a visible slot. Forward only: JAX cannot reverse-differentiate a loop whose trip count is
    traced. `pages_per_block` is capped at the table width; columns past the table's end are
    clipped to its last and masked."""
    _check(queries, key_pages, value_pages, block_table, query_positions, sinks, window)
    if not is_int(pages_per_block) or pages_per_block <= 0:
        raise ValueError(f"pages_per_block must be a positive integer, got {pages_per_block!r}")
    R, C, N = queries[0].shape[:3]
    ps, K = value_pages.shape[1:3]
    width = block_table.shape[1]
    per_block = min(pages_per_block, width)
    dtype = queries[0].dtype
    f32 = softmax_dtype(dtype)

    def body(index, carry):
        columns = index * per_block + jnp.arange(per_block)
        ids = jnp.take(block_table, columns, axis=1, mode="clip")  # [R, per_block]
        logits = _logits(queries, [_gather(k, ids, dtype) for k in key_pages], scale, logits_soft_cap)
        visible = _visible(query_positions, index * per_block * ps, per_block * ps, width * ps, window)
        values = _gather(value_pages, ids, dtype).transpose(0, 2, 1, 3)  # [R, K, S, Hv]: the step's layout
        return online_softmax_step(carry, logits, visible, values)

    stats = jnp.zeros((R, K, N // K, C), f32)
    if sinks is None:  # nothing seen yet: max -inf, sum 0
        carry = (stats - jnp.inf, stats)
    else:  # the sink is seen by every query, with no value: max = sink, sum = 1
        carry = (stats + grouped_sinks(sinks, K).astype(f32), stats + 1.0)
    carry += (jnp.zeros(stats.shape + value_pages.shape[-1:], f32),)
    first, stop = _blocks(query_positions, width * ps, per_block * ps, window)
    _, total, acc = jax.lax.fori_loop(first, stop, body, carry)
    out = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    return _heads_last(out, queries[0].dtype)
