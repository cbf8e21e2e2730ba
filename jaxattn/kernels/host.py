"""What the host CPU is: its feature flags, read from `/proc/cpuinfo` (the kernel rules'
`Platform.detect` and the native kernels' build cache both ask)."""

from __future__ import annotations

from pathlib import Path


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in `cpuinfo` (empty where there is no such file)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
