"""Compiled programs kept between runs: JAX's persistent compilation cache, in one place for every program.

`enable()` points JAX's persistent compilation cache at `program_dir()`: `$JAXATTN_CACHE_DIR`, else
`$XDG_CACHE_HOME/jaxattn/programs` (default ~/.cache), and below it one folder per machine key
(`machine_key`). A second start of the same program on the same machine reads its compiled programs
back instead of compiling them again. `python -m train.serve`, `train.sample` and `train.tiny_lm`
call it before they compile anything (`--no-program-cache` skips it); a library user calls it once.

What is in a key. JAX's own key holds the program's HLO (so the model's config, its shapes and the
kernels chosen, which are all in the program), the compile options, the XLA flags and the jaxlib
version and backend. It does not hold the host CPU's instruction sets, which XLA:CPU compiles for
(and the native kernels are built for, with `-march=native`): a cache folder shared between machines
(a network home) could hand an AVX-512 program to a CPU without it. So the folder is named by the
JAX version, the machine's architecture and a hash of its CPU feature flags.

A damaged entry is JAX's to handle: it warns ("Error reading persistent compilation cache entry"),
compiles the program and writes the entry again; a run never fails on it.

Beside the compiled programs, in `exported/`, `jaxattn.program_store` keeps the engine's step programs
as traced and lowered (`jax.export`), so a second start neither traces nor compiles them.

`ProgramCounts` counts, from JAX's monitoring events, the programs read back and the programs compiled
and written since it was made, for the programs' start-up lines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
from pathlib import Path

import jax

from jaxattn.kernels.host import read_cpu_flags

# A program cheaper to compile than this is not written: reading an entry back costs about a millisecond.
MIN_COMPILE_SECONDS = 0.1

_enabled: Path | None = None  # what enable() chose, for the traced programs kept beside (jaxattn.program_store)


def program_dir() -> Path:
    """`$JAXATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxattn/programs` (default ~/.cache/jaxattn/programs)."""
    explicit = os.environ.get("JAXATTN_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxattn" / "programs"


def machine_key(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The folder a machine's programs go in: "jax-0.10.2-x86_64-<12 hex of the CPU's flags>"."""
    digest = hashlib.sha256(" ".join(sorted(read_cpu_flags(cpuinfo))).encode()).hexdigest()[:12]
    return f"jax-{jax.__version__}-{platform.machine() or 'unknown'}-{digest}"


def enable(directory: Path | None = None) -> Path:
    """Keeps every compiled program dearer than `MIN_COMPILE_SECONDS` in `directory` (default
    `program_dir()`) / `machine_key()`, and reads them back; returns that folder (created).

    Call it before the first compile: JAX fixes its cache the first time it compiles. OSError when
    the folder cannot be made (nothing is changed then)."""
    global _enabled
    folder = (directory or program_dir()) / machine_key()
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    _enabled = folder
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return folder


def enabled_folder() -> Path | None:
    """The folder `enable()` pointed this process's cache at, or None when it was not called."""
    return _enabled


@dataclasses.dataclass
class ProgramCounts:
    """Programs read back from the cache (`read`) and compiled and written to it (`written`) since
    `start()`: JAX's `/jax/compilation_cache/cache_hits` and `cache_misses` events."""

    read: int = 0
    written: int = 0

    def _listen(self, event: str, **kwargs) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.read += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.written += 1

    @staticmethod
    def start() -> "ProgramCounts":
        counts = ProgramCounts()
        jax.monitoring.register_event_listener(counts._listen)
        return counts

    def describe(self) -> str:
        """"12 programs read back from the cache, 2 compiled"."""
        return f"{self.read} program{'s' * (self.read != 1)} read back from the cache, {self.written} compiled"
