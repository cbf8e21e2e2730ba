"""Adapters in slots in a native loop: `jaxattn.lora.slot_delta`'s "native_cpu" form (`native/lora_slots.cc`).

Contract: `part_delta(x [M, K], slots [M] int, a [S, K, r], b [S, r, W], scale [S]) -> [M, W]` float32, row m
`scale[s] * (x[m] a[s]) b[s]` for `s = slots[m]` in `[0, S)`, zeros for any other slot (-1: none); every
operand read as float32 (a float32 model's are as stored; others are converted each call). Equal to the
float32 reference (`reference_part_delta`) up to the order of float additions. Forward only, any number of
rows; CPU only; built by `jaxattn.kernels.native_build`.

Why: a decode step's rows choose among many adapters, each product of rank 8 to 64. XLA:CPU has no
grouped matmul, and the loop over segments that runs best in XLA ("segment_cpu") spends a sort, a while
loop and scatters per projection, more than the arithmetic (docs/performance.md). One native call groups
the rows by slot and reads each used adapter once.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import native_build

SOURCE = Path(__file__).parent / "native" / "lora_slots.cc"
TARGET = "jaxattn_lora_slots"
WAY_OUT = "use empty_slots(..., form='segment_cpu')"


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI target, once per process."""
    cxx = native_build.compiler()
    if cxx is None:
        raise native_build.no_compiler("the 'native_cpu' form of adapters in slots", WAY_OUT)
    native_build.register(native_build.build(SOURCE, cxx, WAY_OUT), "JaxattnLoraSlots", TARGET,
                          "the native adapters in slots", WAY_OUT)
    return True


native_build.FFI_TARGETS[TARGET] = _registered


def _check(x, slots, a, b, scale) -> None:
    S, K, r = a.shape if a.ndim == 3 else (None, None, None)
    if (x.ndim != 2 or a.ndim != 3 or x.shape[1] != K or b.ndim != 3 or b.shape[:2] != (S, r)
            or slots.shape != (x.shape[0],) or scale.shape != (S,)):
        raise ValueError(f"lora slots: x must be [M, K], slots [M], a [S, K, r], b [S, r, W] and scale [S], got x "
                         f"{x.shape}, slots {slots.shape}, a {a.shape}, b {b.shape}, scale {scale.shape}")
    if not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"lora slots: slots must be int, got {slots.dtype}")


def part_delta(x, slots, a, b, scale) -> jax.Array:
    """`[M, W]` float32: each row's adapter product (the module docstring), in the native loop."""
    _check(x, slots, a, b, scale)
    _registered()
    out = jax.ShapeDtypeStruct((x.shape[0], b.shape[2]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    f32 = jnp.float32
    return call(x.astype(f32), slots.astype(jnp.int32), a.astype(f32), b.astype(f32), scale.astype(f32),
                threads=np.int32(native_build.threads()))


def reference_part_delta(x, slots, a, b, scale) -> jax.Array:
    """The float32 reference of `part_delta`: each row's adapter gathered, per-row products (tests' oracle)."""
    _check(x, slots, a, b, scale)
    f32 = jnp.float32
    valid = (slots >= 0) & (slots < a.shape[0])
    index = jnp.where(valid, slots, 0)
    h = jnp.einsum("mk,mkr->mr", x.astype(f32), a.astype(f32)[index])
    out = jnp.einsum("mr,mrw->mw", h, b.astype(f32)[index]) * scale.astype(f32)[index][:, None]
    return jnp.where(valid[:, None], out, 0.0)
