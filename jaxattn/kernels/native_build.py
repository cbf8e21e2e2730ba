"""Building and loading the native kernels (C++ registered through `jax.ffi`), shared by each of them.

A kernel's source is compiled on first use with the C++ compiler `compiler()` finds (`$CXX`, else
c++, g++ or clang++) and `FLAGS` (`-ffast-math`: the sources rely on no infinity), into the cache
`native_cache_dir()` under a name that hashes the source and the headers beside it, the compiler,
the flags, JAX's FFI headers and this CPU's flags: a new CPU or JAX builds anew, nothing is shared
between machines. `-march=native` lets a source choose its instruction-set path by the compiler's
predefined macros (the tests build each x86 path by replacing it in `FLAGS`). `$JAXATTN_NATIVE_MARCH`
replaces `native` there (`flags()`): `JAXATTN_NATIVE_MARCH=x86-64-v3` builds the AVX2 and FMA paths on a CPU
with AVX-512, to measure what an AVX2-only CPU runs (with `JAXATTN_CPU_FLAGS_MAX=avx2`, `jaxattn.kernels.host`,
for the kernel choices). The flags are part of the cached library's name, so a library built for one
target is never loaded for another. Every failure is a `NativeBuildError` whose message ends with the
kernel's way out (the reference to ask for instead).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

import jax

from jaxattn.kernels.host import read_cpu_flags

FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC")
MARCH_VARIABLE = "JAXATTN_NATIVE_MARCH"


class NativeBuildError(RuntimeError):
    """A native kernel could not be compiled or loaded (the message says how to do without it)."""


def compiler() -> str | None:
    """The C++ compiler used: `$CXX`, else the first of c++, g++ and clang++ on PATH; None if none."""
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit) or explicit
    return next((path for name in ("c++", "g++", "clang++") if (path := shutil.which(name))), None)


def flags() -> tuple[str, ...]:
    """`FLAGS` with `-march=native` made `-march=$JAXATTN_NATIVE_MARCH` where that is set (e.g. x86-64-v3)."""
    march = os.environ.get(MARCH_VARIABLE, "").strip()
    if not march:
        return tuple(FLAGS)
    return tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)


def library_name(source: Path, cxx_version: str, build_flags: tuple[str, ...]) -> str:
    """The cached library's file name: the source's stem and a hash of everything the build depends on (the
    source, the headers beside it, the compiler's version, JAX's and its FFI header, `build_flags`, this CPU's
    flags)."""
    include = jax.ffi.include_dir()
    headers = [header.read_text() for header in sorted(source.parent.glob("*.h"))]  # what the source includes
    api = (Path(include) / "xla" / "ffi" / "api" / "api.h").read_text()
    key = hashlib.sha256("\0".join([source.read_text(), *headers, cxx_version, jax.__version__, str(build_flags),
                                    " ".join(sorted(read_cpu_flags())), api]).encode())
    return f"{source.stem}-{key.hexdigest()[:16]}.so"


def native_cache_dir() -> Path:
    """`$JAXATTN_NATIVE_CACHE`, else `$XDG_CACHE_HOME/jaxattn/native` (default ~/.cache)."""
    explicit = os.environ.get("JAXATTN_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxattn" / "native"


def build(source: Path, cxx: str, way_out: str) -> Path:
    """The library compiled from `source` with `cxx` and `flags()`, compiling it unless the cache has it.
    `way_out` ends every error's message, e.g. "use Kernels(paged='ragged')"."""
    include = jax.ffi.include_dir()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"the C++ compiler {cxx} does not run ({err}); {way_out}") from err
    build_flags = flags()
    library = native_cache_dir() / library_name(source, version, build_flags)
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:  # built aside, then moved in whole
        built = Path(scratch) / library.name
        result = subprocess.run([cxx, *build_flags, "-I", include, str(source), "-o", str(built)],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-5:]
            raise NativeBuildError(f"compiling {source.name} with {cxx} failed: {' | '.join(tail)}; {way_out}")
        os.replace(built, library)
    return library


def no_compiler(what: str, way_out: str) -> NativeBuildError:
    """The error for a kernel `what` (e.g. "paged='ragged_cpu'") when `compiler()` found none."""
    return NativeBuildError(f"{what} needs a C++ compiler ($CXX, c++, g++ or clang++), and none was found; {way_out}")


# Every FFI target this library's kernels call, declared by their modules with the function that builds (or
# finds) and registers it: a program exported with them (`jaxattn.program_store`) is read back by a process
# that never traced the kernels, so it registers the targets the program names itself.
FFI_TARGETS: dict[str, Callable[[], object]] = {}


def register(path: Path, symbol: str, target: str, what: str, way_out: str) -> None:
    """Loads the library at `path` and registers its handler `symbol` as the CPU FFI target `target`."""
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
    except OSError as err:
        raise NativeBuildError(f"loading {what} failed ({err}); {way_out}") from err
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")


def text(path: Path, symbol: str, what: str, way_out: str) -> str:
    """What the library at `path`'s C function `symbol` (no arguments, a constant C string) answers."""
    try:
        function = getattr(ctypes.cdll.LoadLibrary(str(path)), symbol)
    except (OSError, AttributeError) as err:
        raise NativeBuildError(f"loading {what} failed ({err}); {way_out}") from err
    function.restype = ctypes.c_char_p
    return function().decode()


def threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
