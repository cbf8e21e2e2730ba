"""The int8 KV cache's storage: each cached vector as int8 values and one float32 scale.

A cache field (`jaxattn.cache.containers.CacheField`: keys and values `[K, H]` per token, MLA's latent `[R]`
and rotary key `[E]`) quantized is a `QuantizedTokens`: `values` int8 in the field's layout and
`scales` float32 with the same shape less its last axis, one per vector (per token and head for
keys and values, per token for MLA's two parts). Symmetric, per vector:
`scale = max|x| / 127`, `values = round(x / scale)` in [-127, 127]; each number read back
(`values * scale`) is off by at most half its vector's scale. A vector of zeros has scale 0
and reads back as zeros.

The last axis is never a slot axis (the dense layout puts its slots before it, a pool keeps pages
and their tokens first), so every layout operation of the cache (writes, page gathers, moving the
slot axis) applies to the scales as to the values, on the same leading axes.

A leaf module (jax and flax only): the cache, the layers and the paged kernels all import it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

INT8_MAX = 127.0


@flax.struct.dataclass
class QuantizedTokens:
    """One cache field stored as int8 (a pytree of two arrays).

    Attributes:
      values: int8 `[..., X]`, X the quantized axis (head dim, latent rank, rotary dims).
      scales: float32 `[...]` (values' shape less X): `max|x| / 127` of each vector.
    """

    values: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float array it stands for (the values')."""
        return self.values.shape

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        """int8: what is stored per number (`dequantize` gives floats)."""
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


def is_quantized(x) -> bool:
    """Whether a cache array is a `QuantizedTokens`."""
    return isinstance(x, QuantizedTokens)


def empty(shape: tuple[int, ...]) -> QuantizedTokens:
    """Zeros of `shape` (values int8, scales float32 `shape[:-1]`)."""
    return QuantizedTokens(jnp.zeros(shape, jnp.int8), jnp.zeros(shape[:-1], jnp.float32))


def quantize(x) -> QuantizedTokens:
    """`x [..., X]` (any float dtype) -> int8 values and float32 scales per vector over the last axis."""
    x = jnp.asarray(x, jnp.float32)
    scales = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)  # an all-zero vector: values 0, scale 0
    values = jnp.clip(jnp.round(x / safe[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedTokens(values, scales)


def dequantize(x: QuantizedTokens, dtype=jnp.float32) -> jax.Array:
    """The float array `values * scale` in `dtype`."""
    return (x.values.astype(jnp.float32) * x.scales[..., None]).astype(dtype)


def as_float(x, dtype):
    """A cache array ready for attention: a `QuantizedTokens` dequantized to `dtype`, a float array as it is."""
    return dequantize(x, dtype) if is_quantized(x) else x


def leading(fn, x):
    """`fn` applied to a cache array through an operation on its leading axes (all but the last):
    to a float array as it is, to a `QuantizedTokens`' values and scales alike."""
    return QuantizedTokens(fn(x.values), fn(x.scales)) if is_quantized(x) else fn(x)
