"""The process's host memory: giving pages the C heap has freed back to the operating system.

Compiling a large program (XLA's passes and LLVM's code generation) allocates and frees hundreds of MB
through the C heap. glibc's malloc keeps freed pages mapped below any block still in use, so without
being asked they stay resident: a run's resident memory through training sits that much above what it
uses (a LoRA step of SmolLM2-135M with 8-bit moments: 1.4 GB, docs/performance.md §17).
`release_freed_memory` asks glibc (`malloc_trim(0)`) to return them, once the programs are compiled.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, or none found)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Returns the C heap's free pages to the operating system (glibc's `malloc_trim(0)`); False where the
    C library has no such call (nothing is done). Safe at any time: only pages no block holds are returned."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
