"""Matmuls against a quantized weight (`jaxattn.quantization.QuantizedWeight`): the `quantized` field.

Contract (all): `x [M, K] @ W -> [M, N]` float32, W the weight the values and scales stand for
(`dequantize`), x rounded to float32; forward only (the weights of a quantized model are not
trained). Each equals its reference to float32 summation order (tests/test_quantize.py).

* "xla" (reference): dequantize in XLA, then one float32 dot.
* "native_cpu": calls of at most `NATIVE_UP_TO` rows (decoding, a small batch) in a native loop
  (`native/quant_matmul.cc`, C++ through `jax.ffi`: the weight read once, converted as it is used;
  pieces of columns shared over the intra-op threads); more rows (a prompt) run the reference,
  which is a matmul XLA does well. CPU only; built by `jaxattn.kernels.native_build`.
* "native_cpu_q8act": as "native_cpu", except that x is rounded to int8 in groups of 32
  (`quantize_rows`, as llama.cpp's Q8_0 activations) and multiplied with integer dots (one path per
  instruction set, chosen at build time: `native_path()` names it; `native/quant_dot.h`), for K a
  multiple of 32 and int4 weights in groups of a multiple of 32 rows (with minimums too, "int4:asym":
  the group's sum of xq times the minimum added), int8 weights in such groups (`quantize`'s "int8",
  llama.cpp's Q8_0, as a GGUF file's are kept) whose `out` is a multiple of 16, and int8 weights per
  output channel ("int8:channel"): a different result, the reference of which is `matmul_q8act` (x
  rounded so, then the "xla" reference). The rounding moves each x by at most half its group's scale
  `max|x_group| / 127`, so each output by at most `sum_k |x_k - xq_k xs_k| |W_kj|`
  (tests/test_quantize.py bounds it so). Other weights and more rows than `NATIVE_UP_TO` run as
  "native_cpu".

  Its weights are read fastest in the "panels" layout (`jaxattn.quantization.to_panels`: each 16
  columns' rows contiguous, one stream through memory per piece of work, and int8 rows already the
  integer dot's operand), which `prepare_weights` gives the weights it takes when the run is resolved
  (`jaxattn.kernels.prepare_weights`). Every formulation reads either layout; "native_cpu" and the
  reference put a panels weight back in rows first (a copy each call), and int8 weights in groups
  are read by integer dots in panels only (put in panels each call if they are not).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import native_build
from jaxattn.quantization import PANEL, QuantizedWeight, dequantize, to_panels, to_rows, with_layout

SOURCE = Path(__file__).parent / "native" / "quant_matmul.cc"
TARGETS = {8: "jaxattn_quant_matmul_int8", 4: "jaxattn_quant_matmul_int4"}
PANEL_TARGETS = {8: "jaxattn_quant_matmul_int8_panels", 4: "jaxattn_quant_matmul_int4_panels"}
NATIVE_UP_TO = 32  # rows up to which "native_cpu" goes native (a decode step of up to 32 sequences, a short prompt)
ACT_GROUP = 32  # activation rows per int8 scale in "native_cpu_q8act"
WAY_OUT = "use Kernels(quantized='xla')"


def matmul(x, weight: QuantizedWeight):
    """The "xla" reference: dequantize, then multiply in float32."""
    return jnp.dot(x.astype(jnp.float32), dequantize(weight), preferred_element_type=jnp.float32)


def quantize_rows(x) -> tuple[jax.Array, jax.Array]:
    """x `[M, K]` (K a multiple of 32) rounded to int8 per row in groups of 32: `(xq [M, K] int8,
    xs [M, K / 32] float32)`, `xs = max|x_group| / 127`, `xq = round(x / xs)`; x ~ xq * xs."""
    M, K = x.shape
    grouped = x.astype(jnp.float32).reshape(M, K // ACT_GROUP, ACT_GROUP)
    xs = jnp.max(jnp.abs(grouped), axis=-1) / 127.0
    safe = jnp.where(xs > 0, xs, 1.0)
    xq = jnp.clip(jnp.round(grouped / safe[..., None]), -127, 127).astype(jnp.int8).reshape(M, K)
    return xq, xs


def matmul_q8act(x, weight: QuantizedWeight):
    """The reference of "native_cpu_q8act": x rounded as `quantize_rows`, then `matmul`, for the
    weights it takes (`native_matmul`'s q8act); other weights, `matmul`."""
    if not _takes_q8act(weight):
        return matmul(x, weight)
    xq, xs = quantize_rows(x)
    M, K = x.shape
    rounded = (xq.astype(jnp.float32).reshape(M, K // ACT_GROUP, ACT_GROUP) * xs[..., None]).reshape(M, K)
    return matmul(rounded, weight)


def _takes_q8act(weight: QuantizedWeight) -> bool:
    """K (the weight's in) a multiple of 32 and the weight: int4 in groups of a multiple of 32 rows; int8 in
    such groups ("int8", llama.cpp's Q8_0) with `out` a multiple of `PANEL` (read in panels only); int8 per
    output channel ("int8:channel")."""
    K, N = weight.shape[-2:]
    per_channel = weight.group == K
    grouped = weight.group % ACT_GROUP == 0
    return K % ACT_GROUP == 0 and ((weight.bits == 4 and grouped) or (weight.bits == 8 and per_channel) or
                                   (weight.bits == 8 and grouped and N % PANEL == 0))


def library_path() -> Path:
    """The compiled library, built now unless the cache has it."""
    cxx = native_build.compiler()
    if cxx is None:
        raise native_build.no_compiler("quantized='native_cpu'", WAY_OUT)
    return native_build.build(SOURCE, cxx, WAY_OUT)


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI targets, once per process."""
    path = library_path()
    native_build.register(path, "JaxattnQuantMatmul8", TARGETS[8], "the native quantized matmul", WAY_OUT)
    native_build.register(path, "JaxattnQuantMatmul4", TARGETS[4], "the native quantized matmul", WAY_OUT)
    native_build.register(path, "JaxattnQuantMatmul8Panels", PANEL_TARGETS[8], "the native quantized matmul", WAY_OUT)
    native_build.register(path, "JaxattnQuantMatmul4Panels", PANEL_TARGETS[4], "the native quantized matmul", WAY_OUT)
    return True


native_build.FFI_TARGETS.update(dict.fromkeys([*TARGETS.values(), *PANEL_TARGETS.values()], _registered))


@functools.cache
def native_path() -> str:
    """The instruction-set path of the native loop's integer dots, chosen when the library was compiled
    (`native/quant_dot.h`): "avx512vnni", "avxvnni", "avx2", "neon-dotprod", "neon" or "scalar"."""
    return native_build.text(library_path(), "JaxattnQuantMatmulPath", "the native quantized matmul", WAY_OUT)


def _panels_fit(weight: QuantizedWeight) -> bool:
    """A weight "native_cpu_q8act" reads in panels: one it takes (`_takes_q8act`), `out` a multiple of 16."""
    return weight.shape[-1] % PANEL == 0 and _takes_q8act(weight)


def prepare_weights(params):
    """"native_cpu_q8act"'s weights: `params` with each quantized matmul weight it reads natively in the
    "panels" layout (`jaxattn.quantization.with_layout`); the others as they are."""
    return with_layout(params, "panels", fits=_panels_fit)


def native_matmul(x, weight: QuantizedWeight, q8act: bool = False):
    """The whole call in the native loop (any number of rows); `q8act` (a weight `_takes_q8act` takes): x
    rounded to int8 as `quantize_rows` first."""
    if len(weight.shape) != 2:
        raise ValueError(f"quantized matmul: the weight must be [in, out], got shape {weight.shape}")
    if x.ndim != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"quantized matmul: x must be [M, {weight.shape[0]}], got {x.shape}")
    if q8act and not _takes_q8act(weight):
        raise ValueError(f"quantized matmul: q8act takes an int4 weight in groups of a multiple of {ACT_GROUP} rows, "
                         f"an int8 one per output channel, or in such groups with out a multiple of {PANEL}, K a "
                         f"multiple of {ACT_GROUP}; got bits {weight.bits}, group {weight.group}, weight "
                         f"{weight.shape}, x {x.shape}")
    _registered()
    out = jax.ShapeDtypeStruct((x.shape[0], weight.shape[1]), jnp.float32)
    if q8act and weight.bits == 8 and weight.group != weight.shape[0]:
        weight = to_panels(weight)  # int8 in groups: integer dots in panels only (a copy each call in rows)
    if weight.layout != "panels" or not q8act:
        weight = to_rows(weight)  # the float loops read rows
    operands = [x.astype(jnp.float32), weight.values, weight.scales.astype(jnp.float32)]
    if weight.bits == 4:  # the minimums (llama.cpp's Q4_1), or an empty array for none
        operands.append(jnp.zeros((0,), jnp.float32) if weight.minimums is None else weight.minimums.astype(jnp.float32))
    threads = np.int32(native_build.threads())
    if weight.layout == "panels":
        return jax.ffi.ffi_call(PANEL_TARGETS[weight.bits], out, vmap_method="sequential")(*operands, threads=threads)
    call = jax.ffi.ffi_call(TARGETS[weight.bits], out, vmap_method="sequential")
    return call(*operands, q8act=np.int32(q8act), threads=threads)


def matmul_cpu(x, weight: QuantizedWeight):
    """"native_cpu": `native_matmul` for at most `NATIVE_UP_TO` rows, else the reference."""
    return (native_matmul if x.shape[0] <= NATIVE_UP_TO else matmul)(x, weight)


def matmul_cpu_q8act(x, weight: QuantizedWeight):
    """"native_cpu_q8act": at most `NATIVE_UP_TO` rows with x rounded to int8 (`native_matmul(...,
    q8act=True)`) where the weight allows; anything else as "native_cpu"."""
    if x.shape[0] <= NATIVE_UP_TO and _takes_q8act(weight):
        return native_matmul(x, weight, q8act=True)
    return matmul_cpu(x, weight)
