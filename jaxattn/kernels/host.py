"""What the host CPU is: its feature flags, read from `/proc/cpuinfo` (the kernel rules'
`Platform.detect`, the native kernels' build cache and the program cache's folder all ask)."""

from __future__ import annotations

from pathlib import Path


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in `cpuinfo`: x86's `flags` line, or ARM's `Features` (empty where
    there is no such file or line)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
