"""The "ragged_cpu" paged attention: decoding rows in a native loop (C++ through `jax.ffi`), the rest ragged.

Contract: `jaxattn.kernels.paged`'s (same arguments, same numbers to float32 summation order).

XLA:CPU runs a decode row's attention against pages (a few queries per key/value head against a
few hundred slots) as many tiny batched dots, reading the cache at about a fifth of the memory
bandwidth (docs/performance.md §14). `native/paged_attention.cc` reads each key and value vector
once per row and kv head, for the G query heads that share it, a page at a time with an online
softmax in float32, its rows split over the CPU's cores; its dots and weighted sums run one path per
instruction set (`native/float_vec.h`, named by `native_path()`).

What the loop takes (`refusal` says what it does not): one key part (not MLA's two), everything
float32, and, to be worth it, at most `NATIVE_UP_TO` queries per row and kv head (C * G): decoding. A
prompt chunk's many queries are matmuls, which `ragged_paged_attention`'s blockwise loop does well.
Whether a call goes native is decided in `jaxattn.kernels.paged_select` ("ragged_cpu"), from `refusal`.

The library is built and cached by `jaxattn.kernels.native_build` (the host's C++ compiler, on first use).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import native_build, paged
from jaxattn.kernels.native_build import NativeBuildError, compiler, native_cache_dir  # noqa: F401 (re-exported)

SOURCE = Path(__file__).parent / "native" / "paged_attention.cc"
TARGET = "jaxattn_paged_attention"
# Queries per row and kv head (C * G) up to which a call goes native: a speculative verification's rows
# (C = k + 1 = 5, G = 3 on SmolLM2-135M: 15) ran its forward in 41.6 ms native against 46.7 ragged.
NATIVE_UP_TO = 16
WAY_OUT = "use Kernels(paged='ragged')"


def build(cxx: str) -> Path:
    """The compiled library's path, compiling it unless the cache has it."""
    return native_build.build(SOURCE, cxx, WAY_OUT)


def library_path() -> Path:
    """The compiled library, built now unless the cache has it."""
    cxx = compiler()
    if cxx is None:
        raise native_build.no_compiler("paged='ragged_cpu'", WAY_OUT)
    return build(cxx)


def native_path() -> str:
    """The instruction-set path of the loop's float dots and weighted sums this machine's build runs
    ("avx512", "avx2", "neon" or "scalar": `native/float_vec.h`), built now unless the cache has it."""
    return native_build.text(library_path(), "JaxattnPagedAttentionPath", "the native paged attention", WAY_OUT)


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI target, once per process."""
    native_build.register(library_path(), "JaxattnPagedAttention", TARGET, "the native paged attention", WAY_OUT)
    return True


native_build.FFI_TARGETS[TARGET] = _registered


def refusal(call: paged.PagedCall) -> str | None:
    """Why the native loop should not take a call (`paged.PagedCall`), or None where it should."""
    if call.parts != 1:
        return f"{call.parts} key parts (MLA's latent and rotary key): the loop reads one"
    if not call.float32:
        return "pages or queries not float32 (int8 pages, 16-bit floats): the loop reads float32 only"
    if call.queries_per_kv_head > NATIVE_UP_TO:
        return (f"{call.queries_per_kv_head} queries per row and kv head > {NATIVE_UP_TO}: matmuls, which the "
                "blockwise loop does well")
    return None


def native_paged_attention(queries, key_pages, value_pages, block_table, query_positions, *, scale,
                           window=None, logits_soft_cap=None, sinks=None, pages_per_block=None):
    """The whole call in the native loop (one key part, float32; any C). `pages_per_block` is ignored."""
    del pages_per_block
    paged._check(queries, key_pages, value_pages, block_table, query_positions, sinks, window)
    if len(queries) != 1 or not all(x.dtype == jnp.float32 for x in (*queries, *key_pages, value_pages)):
        raise ValueError("the native paged attention takes one key part in float32, got "
                         f"{len(queries)} part(s), dtypes {[str(x.dtype) for x in (*queries, *key_pages, value_pages)]}")
    _registered()
    (query,), (keys,) = queries, key_pages
    R, C, N = query.shape[:3]
    out = jax.ShapeDtypeStruct((R, C, N, value_pages.shape[3]), jnp.float32)
    sink_logits = jnp.zeros((1,), jnp.float32) if sinks is None else jnp.asarray(sinks, jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(query, keys, value_pages, block_table.astype(jnp.int32), query_positions.astype(jnp.int32),
                sink_logits, scale=np.float32(scale), window=np.int32(window or 0),
                cap=np.float32(logits_soft_cap or 0.0), has_sinks=np.int32(sinks is not None),
                threads=np.int32(native_build.threads()))
