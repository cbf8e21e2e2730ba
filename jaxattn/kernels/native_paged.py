"""The "ragged_cpu" paged attention: decoding rows in a native loop (C++ through `jax.ffi`), the rest ragged.

Contract: `jaxattn.kernels.paged`'s (same arguments, same numbers to float32 summation order).

XLA:CPU runs a decode row's attention against pages (a few queries per key/value head against a
few hundred slots) as many tiny batched dots, reading the cache at about a fifth of the memory
bandwidth (docs/performance.md §14). `native/paged_attention.cc` reads each key and value vector
once per row and kv head, for the G query heads that share it, a page at a time with an online
softmax in float32, its rows split over the CPU's cores.

Which rows go native (`takes_native`): one key part (not MLA's two), everything float32, and at most
`NATIVE_UP_TO` queries per row and kv head (C * G): decoding. A prompt chunk's many queries are
matmuls, which `ragged_paged_attention`'s blockwise loop does well, so it goes there.

The library is compiled from its source on first use, with the C++ compiler `compiler()` finds
(`$CXX`, else c++, g++ or clang++) and `-O3 -march=native -ffast-math` (the source relies on no infinity), into the cache `native_cache_dir()`
under a name that hashes the source, the compiler, JAX's FFI headers and this CPU's flags: a
new CPU or JAX builds anew, nothing is shared between machines.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.kernels import paged
from jaxattn.kernels.host import read_cpu_flags

SOURCE = Path(__file__).parent / "native" / "paged_attention.cc"
TARGET = "jaxattn_paged_attention"
NATIVE_UP_TO = 8  # queries per row and kv head (C * G) up to which a call goes native
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC")


class NativeBuildError(RuntimeError):
    """The native kernel could not be compiled or loaded (the message says how to do without it)."""


def compiler() -> str | None:
    """The C++ compiler used: `$CXX`, else the first of c++, g++ and clang++ on PATH; None if none."""
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit) or explicit
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def native_cache_dir() -> Path:
    """`$JAXATTN_NATIVE_CACHE`, else `$XDG_CACHE_HOME/jaxattn/native` (default ~/.cache)."""
    explicit = os.environ.get("JAXATTN_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxattn" / "native"


def build(cxx: str) -> Path:
    """The compiled library's path, compiling it unless the cache has it."""
    include = jax.ffi.include_dir()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"the C++ compiler {cxx} does not run ({err}); use Kernels(paged='ragged')") from err
    key = hashlib.sha256("\0".join([SOURCE.read_text(), version, jax.__version__, str(FLAGS), " ".join(sorted(read_cpu_flags())),
                                    (Path(include) / "xla" / "ffi" / "api" / "api.h").read_text()]).encode())
    library = native_cache_dir() / f"paged_attention-{key.hexdigest()[:16]}.so"
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:  # built aside, then moved in whole
        built = Path(scratch) / library.name
        result = subprocess.run([cxx, *FLAGS, "-I", include, str(SOURCE), "-o", str(built)],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise NativeBuildError(f"compiling {SOURCE.name} with {cxx} failed: {' | '.join(tail)}; "
                                   "use Kernels(paged='ragged')")
        os.replace(built, library)
    return library


def library_path() -> Path:
    """The compiled library, built now unless the cache has it."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("paged='ragged_cpu' needs a C++ compiler ($CXX, c++, g++ or clang++), "
                               "and none was found; use Kernels(paged='ragged')")
    return build(cxx)


@functools.cache
def _registered() -> bool:
    """Compiles (or finds) and loads the library and registers its FFI target, once per process."""
    path = library_path()
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
    except OSError as err:
        raise NativeBuildError(f"loading the native paged attention failed ({err}); use Kernels(paged='ragged')")
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.JaxattnPagedAttention), platform="cpu")
    return True


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def takes_native(queries, key_pages, value_pages) -> bool:
    """Whether a call goes native: one key part, float32 throughout, C * G <= NATIVE_UP_TO."""
    if len(queries) != 1:
        return False
    R, C, N = queries[0].shape[:3]
    float32 = all(x.dtype == jnp.float32 for x in (*queries, *key_pages, value_pages))
    return float32 and C * (N // value_pages.shape[2]) <= NATIVE_UP_TO


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
                threads=np.int32(_threads()))


def ragged_cpu_paged_attention(queries, key_pages, value_pages, block_table, query_positions, *, scale,
                               window=None, logits_soft_cap=None, sinks=None, pages_per_block=4):
    """`native_paged_attention` where `takes_native`, else `paged.ragged_paged_attention`."""
    attend = native_paged_attention if takes_native(queries, key_pages, value_pages) else paged.ragged_paged_attention
    return attend(queries, key_pages, value_pages, block_table, query_positions, scale=scale, window=window,
                  logits_soft_cap=logits_soft_cap, sinks=sinks, pages_per_block=pages_per_block)
