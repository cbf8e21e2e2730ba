"""Decoding caches: immutable pytrees that go into the model and come out updated.

Why a cache is exact (docs/theory.md §9): the key and value of token j depend
only on tokens <= j and fixed weights, so they never change once computed.
Each layer stores them once, in a buffer of `max_len` slots per row:

* standard attention (MHA/MQA/GQA): `KVCache(k [B, K, L, H], v [B, K, L, Hv])`,
  K/V kept at K heads (never repeated for GQA/MQA) and heads-major: each
  (row, head) is one contiguous `[L, H]` matrix, so attention against the
  cache is a matmul batched over (B, K) that reads the cache in place;
* Multi-head Latent Attention: `LatentCache(c_kv [B, L, R], k_rope [B, L, E])`,
  the normalised joint latent (R = kv_lora_rank) and the one rotary key shared
  by all heads (E = qk_rope_head_dim); per-head keys and values are never stored.

`DecodeCache` bundles the per-layer caches with `lengths [B]`: row b holds
`lengths[b]` tokens, at slots `0 .. lengths[b] - 1` (slot = absolute position).
Rows can be at different lengths. Writes put T new tokens of row b at slots
`lengths[b] + arange(T)` (`jax.lax.dynamic_update_slice`, one per row);
reads are masked by position (`jaxattn.masks.visible_cache_slots`): key slot j
is visible to a query at absolute position p iff j <= p, so slots not yet
written are never visible.
"""

from __future__ import annotations

import math

import flax.struct
import jax.numpy as jnp

from jaxattn import kernels
from jaxattn._validate import is_int
from jaxattn.config import ModelConfig


@flax.struct.dataclass
class KVCache:
    """One standard-attention layer's cache.

    Attributes:
      k: `[B, K, L, H]` rotated keys (RoPE already applied when used).
      v: `[B, K, L, Hv]` values.
    """

    k: jnp.ndarray
    v: jnp.ndarray


@flax.struct.dataclass
class LatentCache:
    """One MLA layer's cache: `kv_lora_rank + qk_rope_head_dim` numbers per token.

    Attributes:
      c_kv: `[B, L, R]` the RMS-normalised joint key/value latent.
      k_rope: `[B, L, E]` the decoupled rotary key, shared by all heads.
    """

    c_kv: jnp.ndarray
    k_rope: jnp.ndarray


@flax.struct.dataclass
class DecodeCache:
    """The model's cache.

    Attributes:
      layers: tuple over layers of `KVCache` or `LatentCache`.
      lengths: `[B]` int32, tokens of each row already in the cache (the slot
        the next token of that row is written to).
    """

    layers: tuple
    lengths: jnp.ndarray

    @property
    def max_len(self) -> int:
        """L, the number of slots per row."""
        first = self.layers[0]
        return first.k.shape[2] if isinstance(first, KVCache) else first.c_kv.shape[1]


def _layer_shapes(config: ModelConfig, batch_size: int, max_len: int) -> dict[str, tuple]:
    """Shapes of one layer's cache arrays, by field name."""
    if config.mla is not None:
        return {"c_kv": (batch_size, max_len, config.mla.kv_lora_rank),
                "k_rope": (batch_size, max_len, config.mla.qk_rope_head_dim)}
    K, H = config.num_kv_heads, config.head_dim
    return {"k": (batch_size, K, max_len, H), "v": (batch_size, K, max_len, H)}


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> DecodeCache:
    """An empty cache (all lengths 0) for `batch_size` rows of `max_len` slots.

    dtype defaults to the config's compute dtype.
    """
    for name, value in (("batch_size", batch_size), ("max_len", max_len)):
        if not is_int(value, numpy=False) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    layer_type = KVCache if config.mla is None else LatentCache
    shapes = _layer_shapes(config, batch_size, max_len)
    layers = tuple(layer_type(**{name: jnp.zeros(shape, dtype) for name, shape in shapes.items()})
                   for _ in range(config.num_layers))
    return DecodeCache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32))


def cache_bytes_per_token(config: ModelConfig, dtype=None) -> dict:
    """What one token costs in the cache.

    Returns a dict with `numbers_per_layer` (2*K*H for standard attention,
    kv_lora_rank + qk_rope_head_dim for MLA), `bytes_per_layer`, `num_layers`,
    `numbers` and `bytes` (all layers), for the cache dtype (default: the
    config's compute dtype). The per-row `lengths` counter is not per token.
    """
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    numbers = sum(math.prod(shape) for shape in _layer_shapes(config, 1, 1).values())  # B = L = 1
    return {
        "numbers_per_layer": numbers,
        "bytes_per_layer": numbers * dtype.itemsize,
        "num_layers": config.num_layers,
        "numbers": numbers * config.num_layers,
        "bytes": numbers * dtype.itemsize * config.num_layers,
    }


def write_rows(buffer: jnp.ndarray, update: jnp.ndarray, starts: jnp.ndarray, *, axis: int = 1,
               implementation: str = "xla") -> jnp.ndarray:
    """Writes row b of `update` into row b of `buffer` at slots `starts[b] + arange(T)` along `axis`.

    Args:
      buffer: `[B, ..., L, ...]` with the L slots at `axis` (1 for `[B, L, R]`
        latents, 2 for `[B, K, L, H]` keys/values).
      update: `[B, ..., T, ...]`, cast to the buffer's dtype.
      starts: `[B]` int, where each row's T new entries go.
      implementation: a name of `jaxattn.kernels.choices("decode")`.

    The caller keeps `starts[b] + T <= L`: `dynamic_update_slice` clamps the
    start index so that the update fits, which would shift the write.
    """
    return kernels.cache_writer(implementation)(buffer, update, starts, axis=axis)
