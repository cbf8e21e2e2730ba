"""Matmuls against a quantized weight (`jaxattn.quantization.QuantizedWeight`): the `quantized` field.

Contract (all): `x [M, K] @ W -> [M, N]` float32, W the weight the values and scales stand for
(`dequantize`), x rounded to float32; forward only (the weights of a quantized model are not
trained). Each equals the reference to float32 summation order (tests/test_quantize.py).

* "xla" (reference): dequantize in XLA, then one float32 dot.
* "native_cpu": calls of at most `NATIVE_UP_TO` rows (decoding, a small batch) in a native loop
  (`native/quant_matmul.cc`, C++ through `jax.ffi`: the weight read once, row by row, converted as
  it is used; pieces of rows shared over the intra-op threads); more rows (a prompt) run the reference,
  which is a matmul XLA does well. CPU only; built by `jaxattn.kernels.native_build`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import native_build
from jaxattn.quantization import QuantizedWeight, dequantize

SOURCE = Path(__file__).parent / "native" / "quant_matmul.cc"
TARGET = "jaxattn_quant_matmul"
NATIVE_UP_TO = 8  # rows up to which "native_cpu" goes native
WAY_OUT = "use Kernels(quantized='xla')"


def matmul(x, weight: QuantizedWeight):
    """The "xla" reference: dequantize, then multiply in float32."""
    return jnp.dot(x.astype(jnp.float32), dequantize(weight), preferred_element_type=jnp.float32)


def library_path() -> Path:
    """The compiled library, built now unless the cache has it."""
    cxx = native_build.compiler()
    if cxx is None:
        raise native_build.no_compiler("quantized='native_cpu'", WAY_OUT)
    return native_build.build(SOURCE, cxx, WAY_OUT)


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI target, once per process."""
    native_build.register(library_path(), "JaxattnQuantMatmul", TARGET, "the native quantized matmul", WAY_OUT)
    return True


def native_matmul(x, weight: QuantizedWeight):
    """The whole call in the native loop (any number of rows)."""
    if x.ndim != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"quantized matmul: x must be [M, {weight.shape[0]}], got {x.shape}")
    _registered()
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[1]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), weight.values, weight.scales.astype(jnp.float32),
                bits=np.int32(weight.bits), threads=np.int32(native_build.threads()))


def matmul_cpu(x, weight: QuantizedWeight):
    """"native_cpu": `native_matmul` for at most `NATIVE_UP_TO` rows, else the reference."""
    return (native_matmul if x.shape[0] <= NATIVE_UP_TO else matmul)(x, weight)
