"""Traced programs kept between runs: a program exported once (`jax.export`), read back on the next start.

JAX's persistent compilation cache (`jaxattn.program_cache`) keeps what XLA compiled, but every start
still traces each program in Python and lowers it to StableHLO before it can look the compiled one up.
For the engine's step programs that is most of a second start: a model of 30 layers unrolled in each of a
dozen step shapes (docs/performance.md §20). A `ProgramStore` keeps the lowered program itself, as
`jax.export` serializes it, so a second start reads a file instead of tracing; the compiled program is
then found in the persistent cache as before.

What is in a key (the file's name). Everything that could change the program: the caller's `name` and
`context` (the model's config, the kernels chosen), the arguments' tree, shapes, dtypes and shardings,
the donated arguments, the JAX, jaxlib and Flax versions (Flax traces the modules) and backend, and a
digest of the library's own source (every .py, .cc and .h file under `jaxattn/`), so an edit to the maths
never reads an old program.

Exported programs take and give flat lists of arrays; the store keeps the output's tree beside it and
wraps the program in a `jax.jit` that takes and gives the original trees, with the same donation, so a
caller cannot tell a stored program from a traced one. The first start lowers through the same wrapper,
so both starts hand XLA the same module and the second finds the first's compiled program.

Only programs on one device are kept: a mesh's are traced at every start, as without a store.

A file that cannot be read back (damaged, or written by another version) is traced again with a warning
and written anew; a folder that cannot be written keeps nothing and says why once. Neither stops a run.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Sequence

import flax
import jax
import jaxlib

from jaxattn import program_cache
from jaxattn.kernels import native_build

SUFFIX = ".jaxexport"
PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def source_digest(root: Path = PACKAGE) -> str:
    """sha256 over the library's .py, .cc and .h files (their paths and bytes), 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cc", ".h") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _spec(leaf) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    sharding = getattr(leaf, "sharding", None)
    return jax.ShapeDtypeStruct(jax.numpy.shape(leaf), jax.numpy.result_type(leaf), sharding=sharding)


def _spans_devices(args: tuple) -> bool:
    """Whether some argument is laid out over several devices: such programs (a mesh's) are not kept."""
    return any(len(getattr(getattr(leaf, "sharding", None), "device_set", ())) > 1 for leaf in jax.tree.leaves(args))


def program_key(name: str, context: str, args: tuple, donate_argnums: Sequence[int]) -> str:
    """The file name (without suffix) a program is kept under: a hash of everything that changes it."""
    leaves, tree = jax.tree.flatten(args)
    parts = [name, context, str(tree), repr(tuple(donate_argnums)), jax.__version__, jaxlib.__version__,
             flax.__version__, jax.default_backend(), source_digest()]
    parts += [f"{s.shape}{s.dtype}{s.sharding}" for s in map(_spec, leaves)]
    return f"{name}-{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:24]}"


class StoredProgram:
    """A program as a `jax.jit` of its exported form: `lower(*args)` as a jitted function's."""

    def __init__(self, exported: jax.export.Exported, out_tree, donate_argnums: Sequence[int]):
        def call(*args):
            return jax.tree.unflatten(out_tree, exported.call(*jax.tree.leaves(args)))

        self.jitted = jax.jit(call, donate_argnums=tuple(donate_argnums))

    def lower(self, *args):
        return self.jitted.lower(*args)


class ProgramStore:
    """Exported programs in `folder` (`None`: nothing kept, every program traced, as without a store).

    `counts` says how many programs were read back (`"read"`) and exported and written (`"written"`)."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.counts = {"read": 0, "written": 0}
        self._warned, self._lock = False, threading.Lock()  # programs may be stored from several threads

    def program(self, name: str, context: str, fn: Callable, args: tuple,
                donate_argnums: Sequence[int] = ()) -> StoredProgram | Callable:
        """`fn` (a function of `args`' trees) as something to `.lower(*args)`: read from the folder when
        kept there, else traced, exported and kept. Without a folder, or for arguments laid out over
        several devices, `jax.jit(fn)` itself."""
        if self.folder is None or _spans_devices(args):
            return jax.jit(fn, donate_argnums=tuple(donate_argnums))
        path = self.folder / (program_key(name, context, args, donate_argnums) + SUFFIX)
        stored = self._read(path, donate_argnums)
        if stored is None:
            stored = self._export(path, fn, args, donate_argnums)
        return stored

    def _read(self, path: Path, donate_argnums) -> StoredProgram | None:
        try:
            blob = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):  # not kept yet, or the folder cannot hold it
            return None
        except OSError as err:
            warnings.warn(f"program store: could not read {path.name} ({err}); tracing it again", stacklevel=3)
            return None
        try:
            out_tree, targets, serialized = pickle.loads(blob)
            for target in targets:  # this process has not traced the kernels that register them
                native_build.FFI_TARGETS[target]()
            stored = StoredProgram(jax.export.deserialize(bytearray(serialized)), out_tree, donate_argnums)
        except Exception as err:  # noqa: BLE001 - any damage means: trace again, never fail the run
            warnings.warn(f"program store: {path.name} could not be read back ({type(err).__name__}: {err}); "
                          "tracing it again", stacklevel=3)
            return None
        with self._lock:
            self.counts["read"] += 1
        return stored

    def _export(self, path: Path, fn: Callable, args: tuple, donate_argnums) -> StoredProgram:
        leaves, in_tree = jax.tree.flatten(args)
        out_trees = []

        def flat(*leaves):
            out = fn(*jax.tree.unflatten(in_tree, leaves))
            out_leaves, out_tree = jax.tree.flatten(out)
            out_trees.append(out_tree)
            return out_leaves

        checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in sorted(native_build.FFI_TARGETS)]
        exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*map(_spec, leaves))
        serialized = exported.serialize()
        text = exported.mlir_module()
        targets = [target for target in sorted(native_build.FFI_TARGETS) if f"@{target}(" in text]
        self._write(path, pickle.dumps((out_trees[0], targets, bytes(serialized))))
        # Lowered from the deserialized form, as a second start will: both give XLA the same module.
        return StoredProgram(jax.export.deserialize(serialized), out_trees[0], donate_argnums)

    def _write(self, path: Path, blob: bytes) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
                handle.write(blob)
            os.replace(handle.name, path)  # whole or not at all, for a concurrent reader
            with self._lock:
                self.counts["written"] += 1
        except OSError as err:
            if not self._warned:
                warnings.warn(f"program store: could not write to {path.parent} ({err}); "
                              "programs will be traced again at the next start", stacklevel=4)
                self._warned = True


def store_for(cache_folder: Path | None) -> ProgramStore:
    """The store beside a program cache folder (`program_cache.enable()`'s): its `exported` subfolder;
    `None` gives a store that keeps nothing."""
    return ProgramStore(None if cache_folder is None else cache_folder / "exported")


_stores: dict[Path | None, ProgramStore] = {}


def default_store() -> ProgramStore:
    """The store beside the program cache this process enabled (`program_cache.enable()`), else one that
    keeps nothing: a program kept compiled is kept traced too. One per folder in a process, so its
    `counts` are the process's."""
    folder = program_cache.enabled_folder()
    return _stores.setdefault(folder, store_for(folder))

