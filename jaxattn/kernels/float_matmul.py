"""The "native_cpu" dense matmul: a decode step's float32 products in a native loop (`native/float_matmul.cc`).

Contract: `x [M, K] @ w [K, N] -> [M, N]` float32, both operands rounded to float32, equal to the "xla"
reference (`jnp.dot` in float32) up to the order of float additions; `matmul_transposed(x, w)` is
`x @ w.T` for a weight stored `[N, K]` (the tied embedding read as the head), without the transposed
copy XLA would make to hand it to a native call. Calls of at most `NATIVE_UP_TO` rows (a decode step, a
short prompt) run the native tiles (`native/float_gemm.h`: one path per instruction set, chosen when the
library is compiled: `native_path()`); more rows (a prompt chunk, training) run the reference, which is a
product XLA does well. Gradients (reverse mode) are the reference's: `dx = dy @ w.T`, `dw = x.T @ dy`
in float32, so the kernel may train too. CPU only; built by `jaxattn.kernels.native_build`.

Why: XLA:CPU's float32 dot runs `[32, 576] @ [576, 1536]`, a decode step's shape, at a third of the
cores' arithmetic (docs/performance.md); a float32 model's step is nearly all such products.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import native_build

SOURCE = Path(__file__).parent / "native" / "float_matmul.cc"
TARGET, TARGET_T = "jaxattn_float_matmul", "jaxattn_float_matmul_t"
NATIVE_UP_TO = 64  # rows up to which the native tiles run (a decode step of up to 64 sequences)
WAY_OUT = "use Kernels(matmul='xla')"


def library_path() -> Path:
    """The compiled library, built now unless the cache has it."""
    cxx = native_build.compiler()
    if cxx is None:
        raise native_build.no_compiler("matmul='native_cpu'", WAY_OUT)
    return native_build.build(SOURCE, cxx, WAY_OUT)


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI targets, once per process."""
    path = library_path()
    native_build.register(path, "JaxattnFloatMatmul", TARGET, "the native float matmul", WAY_OUT)
    native_build.register(path, "JaxattnFloatMatmulT", TARGET_T, "the native float matmul", WAY_OUT)
    return True


native_build.FFI_TARGETS.update(dict.fromkeys([TARGET, TARGET_T], _registered))


@functools.cache
def native_path() -> str:
    """The instruction-set path of the native tiles (`native/float_gemm.h`): "avx512", "avx2", "neon" or
    "scalar"."""
    return native_build.text(library_path(), "JaxattnFloatMatmulPath", "the native float matmul", WAY_OUT)


def native_matmul(x, w, transposed: bool = False):
    """The whole call in the native loop (any number of rows): `x @ w` for `w [K, N]`, or `x @ w.T` for
    `w [N, K]` (`transposed`)."""
    K = w.shape[1] if transposed else w.shape[0]
    if w.ndim != 2 or x.ndim != 2 or x.shape[1] != K:
        layout = "[N, K]" if transposed else "[K, N]"
        raise ValueError(f"float matmul: x must be [M, K] and w {layout} with the same K, got x {x.shape}, "
                         f"w {w.shape}")
    _registered()
    N = w.shape[0] if transposed else w.shape[1]
    out = jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32)
    call = jax.ffi.ffi_call(TARGET_T if transposed else TARGET, out, vmap_method="sequential")
    return call(x.astype(jnp.float32), w.astype(jnp.float32), threads=np.int32(native_build.threads()))


def _forward(x, w, transposed: bool):
    """At most `NATIVE_UP_TO` rows natively, more in XLA (float32, the reference)."""
    if x.shape[0] <= NATIVE_UP_TO:
        return native_matmul(x, w, transposed)
    w32 = w.astype(jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w32.T if transposed else w32, preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, transposed):
    return _forward(x, w, transposed)


def _matmul_fwd(x, w, transposed):
    return _forward(x, w, transposed), (x, w)


def _matmul_bwd(transposed, residuals, dy):
    x, w = residuals
    x32, w32, dy = x.astype(jnp.float32), w.astype(jnp.float32), dy.astype(jnp.float32)
    dx = dy @ (w32 if transposed else w32.T)  # [M, K]
    dw = dy.T @ x32 if transposed else x32.T @ dy  # [N, K] or [K, N]
    return dx.astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x, w):
    """"native_cpu": `x [M, K] @ w [K, N]` float32 (see the module docstring)."""
    return _matmul(x, w, False)


def matmul_transposed(x, w):
    """"native_cpu" against a weight stored transposed: `x [M, K] @ w.T` for `w [N, K]`."""
    return _matmul(x, w, True)
