"""Decoding caches: immutable pytrees that go into the model and come out updated.

Why a cache is exact (docs/theory.md §9): the key and value of token j depend
only on tokens <= j and fixed weights, so they never change once computed.

Each attention kind declares, in one place, what it keeps per token: its
`cache_fields(config)`, a `CacheField` per array (per-token shape, logical axes,
where the dense layout puts its slots), and its `cache_type`, the container:

* standard attention (MHA/MQA/GQA, `jaxattn.layers.gqa`): `KVCache(k, v)`, per token
  `[K, H]` each, K/V kept at K heads (never repeated for GQA/MQA);
* Multi-head Latent Attention (`jaxattn.layers.mla`): `LatentCache(c_kv, k_rope)`, per
  token the normalised joint latent `[R]` (R = kv_lora_rank) and the one rotary
  key shared by all heads `[E]`; per-head keys and values are never stored.

Both caches a model has are built from those declarations (`jaxattn.cache.build`):

* the dense cache, `DecodeCache`: per layer each field as `[B, ..., L, ...]`, the
  L slots of a row at the field's `slot_axis` (heads-major `[B, K, L, H]` for
  keys and values: each (row, head) one contiguous `[L, H]` matrix, read in
  place by a matmul batched over (B, K); `[B, L, R]` for latents), with
  `lengths [B]`: row b holds `lengths[b]` tokens at slots `0 .. lengths[b] - 1`
  (slot = absolute position). Writes put T new tokens of row b at slots
  `lengths[b] + arange(T)` (`write_rows`); reads are masked by position
  (`jaxattn.masks.visible_cache_slots`): slot j is visible to a query at
  position p iff j <= p, so slots not yet written are never visible;
* the paged cache (docs/theory.md §25): per layer a pool of pages, each field as
  `[P, page_size, *per-token shape]`, shared by every sequence; a sequence's
  tokens live in the pages its block table lists (slot j at page
  `block_table[j // page_size]`, offset `j % page_size`). `PagedBatch` describes
  one step over such a pool: which slot each new token is written to and, per
  group of rows, the queries' positions and block tables (`write_pages`,
  `gather_pages`).

The cache dtype (`cache_dtype`) is the compute dtype by default, any float dtype, or "int8": each
field then a `jaxattn.cache.int8.QuantizedTokens`, int8 values in the field's layout and a
float32 scale per vector (per token and head; per token for MLA's parts) in the same layout less
the last axis. Writes quantize, reads dequantize before the float32 softmax (the layers'
`attend_cached`, the paged kernels per gathered block); the same writes, gathers and layouts serve
both, so a layer kind declares its fields once for either.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax.numpy as jnp

from jaxattn import kernels
from jaxattn.axes import BATCH, LENGTH
from jaxattn.cache.int8 import QuantizedTokens, empty, is_quantized, leading, quantize

KV_CACHES = ("auto", "int8")  # what generate, the engine and the CLIs offer: the compute dtype, or int8


def cache_dtype(dtype, compute_dtype) -> jnp.dtype:
    """The cache dtype a request names: None or "auto" -> `compute_dtype`; a float dtype as it is;
    "int8" (or `jnp.int8`) -> int8, the quantized cache. A ValueError names anything else."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return jnp.dtype(compute_dtype)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or not (resolved == jnp.int8 or jnp.issubdtype(resolved, jnp.floating)):
        raise ValueError(f"cache dtype must be 'auto', a float dtype or 'int8' (the quantized cache), got {dtype!r}")
    return resolved


def zeros(shape: tuple[int, ...], dtype) -> jnp.ndarray | QuantizedTokens:
    """An empty cache array of `shape` (a resolved `cache_dtype`): int8 is a `QuantizedTokens`."""
    dtype = jnp.dtype(dtype)
    return empty(shape) if dtype == jnp.int8 else jnp.zeros(shape, dtype)


@dataclasses.dataclass(frozen=True)
class CacheField:
    """One array an attention layer keeps per token.

    Attributes:
      shape: the per-token shape, e.g. `(K, H)` for keys.
      axes: the logical axis names of those dims (`jaxattn.axes`), for meshes.
      slot_axis: where the dense cache puts its L slots among them (1 for heads-major
        `[K, L, H]`, 0 for `[L, R]`); the paged pool always keeps a page's tokens first.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    slot_axis: int = 0

    def dense_shape(self, batch_size: int, num_slots: int) -> tuple[int, ...]:
        """`[B, ...]` with the L slots at `1 + slot_axis`."""
        shape = list(self.shape)
        shape.insert(self.slot_axis, num_slots)
        return (batch_size, *shape)

    def dense_axes(self) -> tuple[str | None, ...]:
        """The logical names of the dense array's dims (rows "batch", slots "length")."""
        axes = list(self.axes)
        axes.insert(self.slot_axis, LENGTH)
        return (BATCH, *axes)

    def paged_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """`[P, page_size, *shape]`."""
        return (num_pages, page_size, *self.shape)

    def paged_axes(self) -> tuple[str | None, ...]:
        """The pool's dims: pages and their tokens are never split, the rest as `axes`."""
        return (None, None, *self.axes)

    def to_dense(self, tokens):
        """`[B, S, *shape]` (tokens first, as layers compute them) -> the dense layout `[B, ..., S, ...]`
        (a `QuantizedTokens`' values and scales alike)."""
        return leading(lambda a: jnp.moveaxis(a, 1, 1 + self.slot_axis), tokens)

    def scale_field(self) -> "CacheField":
        """The int8 cache's scales of this field: one per vector, the per-token shape less its last
        axis (the slots stay where they are: `slot_axis` is never the last)."""
        return CacheField(shape=self.shape[:-1], axes=self.axes[:-1], slot_axis=self.slot_axis)

    def per_array(self, fn, array):
        """`fn(field, array)` for a float cache array; for a `QuantizedTokens`, a `QuantizedTokens` of
        `fn(self, values)` and `fn(self.scale_field(), scales)` (e.g. each one's sharding)."""
        if is_quantized(array):
            return QuantizedTokens(fn(self, array.values), fn(self.scale_field(), array.scales))
        return fn(self, array)


@flax.struct.dataclass
class KVCache:
    """One standard-attention layer's cache (dense `[B, K, L, H]`, or a page pool `[P, ps, K, H]`).

    Attributes:
      k: rotated keys (RoPE already applied when used).
      v: values.

    Each an array in the cache dtype, or a `QuantizedTokens` (the int8 cache: scales per token and head).
    """

    k: jnp.ndarray
    v: jnp.ndarray


@flax.struct.dataclass
class LatentCache:
    """One MLA layer's cache: `kv_lora_rank + qk_rope_head_dim` numbers per token
    (dense `[B, L, R]` and `[B, L, E]`, or pools `[P, ps, R]` and `[P, ps, E]`).

    Attributes:
      c_kv: the RMS-normalised joint key/value latent.
      k_rope: the decoupled rotary key, shared by all heads.

    Each an array in the cache dtype, or a `QuantizedTokens` (the int8 cache: a scale per token each).
    """

    c_kv: jnp.ndarray
    k_rope: jnp.ndarray


@flax.struct.dataclass
class DecodeCache:
    """The model's dense cache.

    Attributes:
      layers: tuple over layers of each layer's `cache_type` (`KVCache`, `LatentCache`).
      lengths: `[B]` int32, tokens of each row already in the cache (the slot
        the next token of that row is written to).
      num_slots: L, the slots per row (static).
    """

    layers: tuple
    lengths: jnp.ndarray
    num_slots: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def max_len(self) -> int:
        """L, the number of slots per row."""
        return self.num_slots


@flax.struct.dataclass
class RowGroup:
    """Rows of queries of one step over a paged cache, each row one sequence's new tokens.

    Attributes:
      positions: `[R, C]` int32 absolute positions of the row's queries; -1 marks a padding
        column (or a padding row): it sees nothing and its output is zeros.
      block_table: `[R, Pr]` int32 the pages of the row's sequence in order (slot j at
        page `block_table[r, j // page_size]`); entries past its pages may be any page id.
    """

    positions: jnp.ndarray
    block_table: jnp.ndarray


@flax.struct.dataclass
class PagedBatch:
    """One step of new tokens from many sequences over a paged cache (`DecoderLM.extend_paged`).

    The step's `Tf` tokens are flat; the groups tile them in order: group g's `R x C` queries
    are the next `R * C` flat tokens, row by row (a group of decode rows `[R, 1]`, a group of
    prefill chunks `[R, C]`).

    Attributes:
      positions: `[Tf]` int32 absolute positions (RoPE, learned positions); 0 for padding.
      slots: `[Tf]` int32 where each token's cache entry is written, `page * page_size + offset`;
        padding tokens carry a slot past the pool (`P * page_size`), and are not written.
      groups: tuple of `RowGroup`.
      logit_tokens: `[M]` int32 the flat tokens whose next-token logits are wanted.
    """

    positions: jnp.ndarray
    slots: jnp.ndarray
    groups: tuple
    logit_tokens: jnp.ndarray


def write_rows(buffer: jnp.ndarray, update: jnp.ndarray, starts: jnp.ndarray, *, axis: int = 1,
               implementation: str = "xla") -> jnp.ndarray:
    """Writes row b of `update` into row b of `buffer` at slots `starts[b] + arange(T)` along `axis`.

    Args:
      buffer: `[B, ..., L, ...]` with the L slots at `axis` (1 for `[B, L, R]`
        latents, 2 for `[B, K, L, H]` keys/values).
      update: `[B, ..., T, ...]`, cast to the buffer's dtype (quantized, for a `QuantizedTokens`
        buffer: its values and scales written at the same slots).
      starts: `[B]` int, where each row's T new entries go.
      implementation: a name of `jaxattn.kernels.choices("decode")`.

    The caller keeps `starts[b] + T <= L`: `dynamic_update_slice` clamps the
    start index so that the update fits, which would shift the write.
    """
    write = kernels.cache_writer(implementation)
    if is_quantized(buffer):
        new = quantize(update)
        return QuantizedTokens(write(buffer.values, new.values, starts, axis=axis),
                               write(buffer.scales, new.scales, starts, axis=axis))
    return write(buffer, update, starts, axis=axis)


def write_pages(pool, tokens: jnp.ndarray, slots: jnp.ndarray):
    """Writes token t of `tokens [Tf, *shape]` to slot `slots[t]` of `pool [P, ps, *shape]`;
    slots past the pool (padding) are dropped. Cast to the pool's dtype (quantized for a
    `QuantizedTokens` pool: values and scales to the same slots)."""
    def scatter(pages, new):
        flat = pages.reshape(-1, *pages.shape[2:])
        return flat.at[slots].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape)
    if is_quantized(pool):
        new = quantize(tokens)
        return QuantizedTokens(scatter(pool.values, new.values), scatter(pool.scales, new.scales))
    return scatter(pool, tokens)


def gather_pages(pool, block_table: jnp.ndarray):
    """`pool [P, ps, *shape]`, `block_table [R, Pr]` -> `[R, Pr * ps, *shape]`: each row's slots in order
    (a `QuantizedTokens` pool gives a `QuantizedTokens`, still int8)."""
    rows = block_table.shape[0]
    return leading(lambda pages: pages[block_table].reshape(rows, -1, *pages.shape[2:]), pool)
