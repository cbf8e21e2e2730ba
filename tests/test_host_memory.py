"""train.host_memory: the C heap's freed pages go back to the operating system."""

import ctypes
import ctypes.util
import platform

import pytest

from train import host_memory


def resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                    reason="malloc_trim is glibc's")
def test_freed_pages_under_a_live_block_are_returned():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    start = resident_mb()
    blocks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MB in the heap (under the mmap threshold)
    for block in blocks:
        ctypes.memset(block, 1, 64 * 1024)  # resident
    top = libc.malloc(100 * 1024)  # a live block above them (no freed chunk fits it): the heap cannot shrink
    assert top > max(blocks)
    try:
        for block in blocks:
            libc.free(block)
        before = resident_mb()
        assert before - start > 150  # freed, and still resident: glibc keeps them
        assert host_memory.release_freed_memory() is True
        assert before - resident_mb() > 100  # most of the 200 MB left the process
    finally:
        libc.free(top)
