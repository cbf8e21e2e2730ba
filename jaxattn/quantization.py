"""Weight-only quantization: every `Linear` kernel stored as int8 or int4 values with float32 scales.

* int8, per output channel: `values [in, out]` int8 in [-127, 127], `scales [1, out]`,
  `scale = max|W[:, j]| / 127`; each weight is off by at most half its column's scale.
* int4, in groups of `group` (32 or 64) consecutive input rows: values in [-8, 7] (symmetric: the
  largest magnitude maps to 7, `scale = max|group| / 7`), packed two to a byte along the input axis
  (rows 2i and 2i + 1 in the low and high nibble of row i: `values [in / 2, out]` int8),
  `scales [in / group, out]`; each weight is off by at most half its group's scale.

`quantize(params, config, mode)` replaces every `Linear` kernel (a 2-D parameter named "kernel":
the attention projections, MLA's projections, the MLP and an untied lm_head) with a
`QuantizedWeight`. Embeddings, norms, biases, MLA's `wkv_b`, a mixture of experts' router and
experts stay as they are; a tied head multiplies by the embedding table, so it stays float.
`Linear` hands a `QuantizedWeight` to the kernel seam (`Kernels.quantized`), whose reference
dequantizes and multiplies.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from jaxattn.config import ModelConfig

MODES = ("int8", "int4", "int4:32", "int4:64")


@flax.struct.dataclass
class QuantizedWeight:
    """A `[in, out]` weight as integer values and float32 scales (a pytree; `bits` and `group` are static).

    Attributes:
      values: int8; `[in, out]` for bits 8, `[in / 2, out]` (two int4 per byte) for bits 4.
      scales: float32 `[in / group, out]` (`[1, out]` per output channel).
      bits: 8 or 4.
      group: input rows per scale (`in` for per-channel).
    """

    values: jax.Array
    scales: jax.Array
    bits: int = flax.struct.field(pytree_node=False, default=8)
    group: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's shape `[in, out]`."""
        return (self.values.shape[0] * (2 if self.bits == 4 else 1), self.values.shape[1])

    @property
    def nbytes(self) -> int:
        return self.values.size * self.values.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize


def parse_mode(mode: str) -> tuple[int, int | None]:
    """`(bits, group)` for a mode: "int8" -> (8, None: per channel), "int4" / "int4:32" -> (4, 32),
    "int4:64" -> (4, 64); ValueError for anything else."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    if mode == "int8":
        return 8, None
    return 4, int(mode.partition(":")[2] or 32)


def quantize_weight(w: jax.Array, mode: str) -> QuantizedWeight:
    """One `[in, out]` weight quantized as `mode` (see `parse_mode`)."""
    bits, group = parse_mode(mode)
    w = jnp.asarray(w, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"a quantized weight is [in, out], got shape {w.shape}")
    K, N = w.shape
    group = K if group is None else group
    if K % group:
        raise ValueError(f"{mode} quantizes in groups of {group} input rows: the in-dimension {K} is not a multiple")
    top = 127.0 if bits == 8 else 7.0
    grouped = w.reshape(K // group, group, N)
    scales = jnp.max(jnp.abs(grouped), axis=1) / top  # [G, N]
    safe = jnp.where(scales > 0, scales, 1.0)
    values = jnp.clip(jnp.round(grouped / safe[:, None, :]), -top - (bits == 4), top).astype(jnp.int8).reshape(K, N)
    if bits == 4:
        low, high = values[0::2], values[1::2]
        values = ((low & 0xF) | (high << 4)).astype(jnp.int8)  # [K / 2, N]
    return QuantizedWeight(values, scales, bits=bits, group=group)


def unpack(weight: QuantizedWeight) -> jax.Array:
    """The integer values as int8 `[in, out]` (int4 unpacked, sign-extended)."""
    if weight.bits == 8:
        return weight.values
    low = jnp.right_shift(jnp.left_shift(weight.values, 4), 4)  # arithmetic shifts sign-extend int8
    high = jnp.right_shift(weight.values, 4)
    K2, N = weight.values.shape
    return jnp.stack([low, high], axis=1).reshape(2 * K2, N)


def dequantize(weight: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight `[in, out]` the values and scales stand for."""
    K, N = weight.shape
    values = unpack(weight).astype(jnp.float32).reshape(K // weight.group, weight.group, N)
    return (values * weight.scales[:, None, :]).reshape(K, N).astype(dtype)


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def quantize(params: Any, config: ModelConfig, mode: str) -> Any:
    """`params` (a DecoderLM's, boxed or not) with every `Linear` kernel quantized as `mode`.

    Args:
      params: the model's parameters (`{"params": ...}` or the inner tree); returned unboxed.
      config: the model's config (checked to be a `ModelConfig`).
      mode: "int8" (per output channel), "int4" (groups of 32) or "int4:64".

    Raises:
      ValueError: an unknown mode, or a kernel whose in-dimension is not a multiple of the group
        (the message names the parameter).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    parse_mode(mode)
    params = nn.unbox(params)

    def walk(tree, path):
        if not isinstance(tree, dict) and not hasattr(tree, "items"):
            return tree
        out = {}
        for key, value in tree.items():
            if key == "kernel" and not isinstance(value, (dict, QuantizedWeight)) and jnp.ndim(value) == 2:
                try:
                    out[key] = quantize_weight(value, mode)
                except ValueError as err:
                    raise ValueError(f"{'/'.join(path + (key,))}: {err}") from None
            else:
                out[key] = walk(value, path + (key,))
        return type(tree)(out) if isinstance(tree, dict) else out

    return walk(params, ())


def weight_bytes(params: Any) -> int:
    """Bytes of all parameters as stored (a quantized weight: its values and scales)."""
    leaves = jax.tree_util.tree_leaves(nn.unbox(params))
    return sum(x.size * x.dtype.itemsize for x in leaves)
