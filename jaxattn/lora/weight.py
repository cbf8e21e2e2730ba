"""The LoRA weight (`LoraWeight`): a frozen weight and low-rank adapters on parts of its output columns,
and its maths as the layers read it (`lora_delta` beside a matmul, `float_param` merged).

A part's adapter adds `scale * a b` to its columns (`a [..., in, r]`, `b [..., r, width]`); letters and
the parts of each weight as in `jaxattn.lora` (the package docstring).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import jax.scipy.linalg

from jaxattn.quantization import dequantize, float_param as quantized_float_param, is_quantized


@flax.struct.dataclass
class LoraWeight:
    """A frozen weight and low-rank adapters on parts of its output columns (a pytree; the rest static).

    Attributes:
      base: the frozen weight as the model stores it: a float array `[..., *weight_shape]` or a
        `QuantizedWeight` (`[..., in, out]`, out flattened).
      a: per part, `[..., in, r]` or None (the part is not adapted).
      b: per part, `[..., r, width]` or None (with its `a`).
      parts: the parts' names, e.g. ("q", "k", "v"), ("gate", "up"), ("out",).
      widths: the parts' widths; they sum to `out`, in column order.
      weight_shape: the float weight's shape the model reads, leading axes aside: `(in, out)`, or MLA's
        `wkv_b` `(R_lat, N, P + V)` (out = the product of all but the first).
      scale: alpha / r (or alpha / sqrt(r)).
      dropout: the rate of the dropout on the adapters' input.
    """

    base: Any
    a: tuple
    b: tuple
    parts: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    widths: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    weight_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    scale: float = flax.struct.field(pytree_node=False, default=1.0)
    dropout: float = flax.struct.field(pytree_node=False, default=0.0)

    @property
    def lead(self) -> tuple[int, ...]:
        """The leading axes (`[R]`, `[E]`, `[R, E]` or none)."""
        if is_quantized(self.base):
            return tuple(self.base.shape[:-2])
        return tuple(self.base.shape[:self.base.ndim - len(self.weight_shape)])

    @property
    def in_features(self) -> int:
        return self.weight_shape[0]

    @property
    def out_features(self) -> int:
        return math.prod(self.weight_shape[1:])

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each part's first column."""
        return tuple(sum(self.widths[:j]) for j in range(len(self.widths)))

    def delta(self, dtype=jnp.float32) -> jax.Array:
        """`scale * [a_0 b_0 | a_1 b_1 | ...]` `[..., in, out]` (zeros for parts without adapters)."""
        lead, f32 = self.lead, jnp.float32
        cols = [jnp.zeros((*lead, self.in_features, w), f32) if a is None
                else jnp.matmul(a.astype(f32), b.astype(f32), precision=jax.lax.Precision.HIGHEST)
                for a, b, w in zip(self.a, self.b, self.widths)]
        return (self.scale * jnp.concatenate(cols, axis=-1)).astype(dtype)

    def base_float(self, dtype=None) -> jax.Array:
        """The base as a float `[..., in, out]` (a quantized one dequantized)."""
        w = dequantize(self.base, dtype or jnp.float32) if is_quantized(self.base) else self.base
        w = w if dtype is None else w.astype(dtype)
        return w.reshape(*self.lead, self.in_features, self.out_features)

    def merged(self, dtype=None) -> jax.Array:
        """`base + delta` `[..., *weight_shape]` in `dtype` (default: a float base's dtype; float32 if quantized)."""
        dtype = dtype or (jnp.float32 if is_quantized(self.base) else self.base.dtype)
        w = self.base_float(jnp.float32) + self.delta(jnp.float32)
        return w.reshape(*self.lead, *self.weight_shape).astype(dtype)


class PerRowWeight:
    """What a weight whose adapters differ from one token row to the next derives from
    (`jaxattn.lora.slots.LoraSlots`): it runs only beside a matmul, as a Linear's kernel, and has no one
    float form for `float_param` to read."""


def is_lora(x: Any) -> bool:
    return isinstance(x, LoraWeight)


def lora_delta(rows: jax.Array, weight: LoraWeight, matmul: Callable, dropout_key: jax.Array | None) -> jax.Array:
    """`scale * [(drop(rows) a_j) b_j]_j` `[M, out]` for rows `[M, in]` of a 2-D `LoraWeight`, in rows' dtype.

    `matmul(x, w)` is the Linear's matmul kernel; `dropout_key` (None: no dropout) draws an independent
    mask per part, as PEFT's separate modules (q_proj, k_proj, ...) each drop their own input.
    """
    if dropout_key is not None and weight.dropout > 0:
        return _delta_per_part(rows, weight, matmul, dropout_key)
    return _delta_shared_input(rows, weight, matmul)


def _delta_shared_input(rows: jax.Array, weight: LoraWeight, matmul: Callable) -> jax.Array:
    """`lora_delta` when every part reads the same rows: two products for all parts, not two per part.

    `h = rows [a_0 | a_1 | ...]` `[M, sum r]`, then `h` times the block-diagonal `[sum r, out]` of the b's
    (zero columns for a part without adapters): the same sums as part by part, plus exact zeros. Small
    products cost their fixed overhead more than their flops (a fused q, k, v Linear: 2 dots, not 6).
    """
    dtype, adapted = rows.dtype, [a.astype(rows.dtype) for a in weight.a if a is not None]
    if not adapted:
        return jnp.zeros((rows.shape[0], weight.out_features), dtype)
    h = matmul(rows, jnp.concatenate(adapted, axis=-1)).astype(dtype)  # [M, sum r]
    # a part without adapters: a block of no rows, its width of zero columns
    diagonal = jax.scipy.linalg.block_diag(*(jnp.zeros((0, width), dtype) if a is None else b.astype(dtype)
                                             for a, b, width in zip(weight.a, weight.b, weight.widths)))  # [sum r, out]
    return matmul(h, diagonal).astype(dtype) * jnp.asarray(weight.scale, dtype)


def _delta_per_part(rows: jax.Array, weight: LoraWeight, matmul: Callable, dropout_key: jax.Array) -> jax.Array:
    """`lora_delta` with dropout: each part's own mask on its own copy of the rows."""
    M, dtype = rows.shape[0], rows.dtype
    cols = []
    for j, (a, b, width) in enumerate(zip(weight.a, weight.b, weight.widths)):
        if a is None:
            cols.append(jnp.zeros((M, width), dtype))
            continue
        keep = jax.random.bernoulli(jax.random.fold_in(dropout_key, j), 1.0 - weight.dropout, rows.shape)
        x = jnp.where(keep, rows / (1.0 - weight.dropout), 0.0).astype(dtype)
        h = matmul(x, a.astype(dtype)).astype(dtype)  # [M, r]
        cols.append(matmul(h, b.astype(dtype)).astype(dtype) * jnp.asarray(weight.scale, dtype))  # [M, width]
    return jnp.concatenate(cols, axis=-1)


def float_param(module: nn.Module, name: str, init, shape: tuple[int, ...], dtype) -> jax.Array:
    """`jaxattn.quantization.float_param` (a float parameter, a quantized one dequantized), and a
    `LoraWeight` merged on read: `base + scale * a @ b` (per expert) reshaped to `shape` in `dtype`.
    What the routed experts and MLA's `wkv_b` read (no matmul kernel of theirs takes an adapter).
    A `PerRowWeight` (adapters in slots) is a ValueError naming the weight: it has no one float form."""
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if is_lora(stored):
            return stored.merged(dtype).reshape(shape)
        if isinstance(stored, PerRowWeight):
            raise ValueError(f"{'/'.join((*module.path, name))}: adapters in slots run per token row beside a "
                             "Linear's matmul, and this weight is read as one float array; jaxattn.lora.slots."
                             "empty_slots does not target it")
    return quantized_float_param(module, name, init, shape, dtype)
