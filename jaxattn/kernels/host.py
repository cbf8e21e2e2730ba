"""What the host CPU is: its feature flags, read from `/proc/cpuinfo` (the kernel rules'
`Platform.detect`, the native kernels' build cache and the program cache's folder all ask).

`JAXATTN_CPU_FLAGS_MAX` caps the flags read at an x86 level of `CEILINGS`, to make the choices of "auto" those
of a smaller CPU on this one: `avx2` drops every AVX-512, AMX and AVX-VNNI-family flag (an AVX2-only CPU, such
as AMD's Zen 2 and 3 EPYCs), `avx_vnni` the AVX-512 and AMX ones, `avx512` the AMX ones. It limits what the
library believes, not what the CPU runs: an honest emulation of an AVX2 machine also builds the native kernels
for it (`JAXATTN_NATIVE_MARCH=x86-64-v3`, `jaxattn.kernels.native_build`) and caps XLA's code
(`XLA_FLAGS=--xla_cpu_max_isa=AVX2`); docs/performance.md §28 does the three.
"""

from __future__ import annotations

import os
from pathlib import Path

CEILING_VARIABLE = "JAXATTN_CPU_FLAGS_MAX"
# level -> the prefixes of the /proc/cpuinfo flags above it ("avx_" is AVX-VNNI, AVX-IFMA, AVX-NE-CONVERT and
# the like: the 256-bit extensions newer than AVX2; "avx2" itself does not start with it).
CEILINGS = {"avx512": ("amx",), "avx_vnni": ("amx", "avx512"), "avx2": ("amx", "avx512", "avx_")}


def cap_flags(flags: frozenset[str], ceiling: str | None) -> frozenset[str]:
    """`flags` without those above `ceiling` (a key of `CEILINGS`; None or "" keeps them all)."""
    if not ceiling:
        return flags
    if ceiling not in CEILINGS:
        raise ValueError(f"{CEILING_VARIABLE}={ceiling!r}: expected one of {', '.join(CEILINGS)}")
    return frozenset(flag for flag in flags if not flag.startswith(CEILINGS[ceiling]))


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in `cpuinfo`: x86's `flags` line, or ARM's `Features` (empty where
    there is no such file or line), capped by `$JAXATTN_CPU_FLAGS_MAX` where that is set (`cap_flags`)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    ceiling = os.environ.get(CEILING_VARIABLE, "").strip()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return cap_flags(frozenset(line.partition(":")[2].split()), ceiling)
    return frozenset()
