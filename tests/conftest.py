"""The fixtures every folder shares live here (the browser's, from tests/browser.py); a folder's own in its
conftest.py (tests/train/run/conftest.py); helpers tests import by name beside them (tests/tiny_models.py,
tests/programs.py, tests/serving/server_process.py, tests/train/run/tiny_runs.py).

Every test runs with implicit rank promotion an error, as JAX's own test base does; programs compile
at XLA's backend optimisation level 0, and a program compiled twice in one test process is compiled once.

The library promises to be rank-promotion clean (no array silently broadcast against one of
lower rank). The tests check values, and compiling their many small programs is most of their
time: level 0 leaves XLA's graph optimisations as they are and skips only LLVM's, which
compiles faster and computes the same operations (float32 results may differ in the last bit, far
inside every tolerance here). XLA's older loop emitters (`--xla_cpu_use_fusion_emitters=false`)
would compile faster still, but at level 0 they round some fused programs far worse (Muon's update
drifts from its float64 reference beyond tests/train/run/test_optim.py's tolerance), so the tests keep the
emitters users get. An XLA_FLAGS that already sets the level keeps its own. The
environment variables carry both settings into the programs tests start.

Training runs started again, and models jitted anew, compile programs identical to ones compiled
before in the same process: JAX's compilation cache, in a directory of this process's own that is
removed when it ends, reads those back; the programs a test starts (train.serve, train.sample,
train.tiny_lm, which keep theirs through `jaxattn.program_cache`) are pointed there too
(JAXATTN_CACHE_DIR), never at the user's cache. Nothing carries over from one test run to the next.

When a test module is done, what it compiled is let go (`_let_go_of_compiled_programs`): JAX's
in-memory caches are cleared and the module's `functools.lru_cache`s emptied (they hold engines and
compiled steps). XLA:CPU maps a few regions of memory for every compiled program it keeps, and a test
process that kept every program of the suite reached the kernel's limit of memory maps per process
(`vm.max_map_count`, 65530 by default) about nine tenths of the way through, and died in XLA with a
segmentation fault. A program a later module compiles again is read back from the compilation cache.

Unless JAXATTN_TEST_PROGRAMS names a directory (`make test-fast` does): then every compiled program
is kept there, shared by the workers and read back by later runs, the way ccache keeps object files.
A program's key is its HLO without source locations, the compile options, the XLA flags and the
jaxlib version, so an edit recompiles only the programs it changes, and a clone elsewhere shares
the directory. JAX writes entries without a lock: a worker that reads one while the other is still
writing it warns and compiles it itself. At the end of a run the entries used longest ago go, past
PROGRAMS_KEPT_BYTES: JAX's own bound (`jax_compilation_cache_max_size`) locks the directory and sums
its sizes on every write, which made a first run four times slower.
"""

import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

import jax
import pytest

from browser import chromium, offline_page  # noqa: F401  (the browser tests' fixtures, shared: tests/browser.py)
from jaxattn.program_cache import MIN_COMPILE_SECONDS, machine_key

OPTIMISATION_LEVEL = "--xla_backend_optimization_level"

os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
jax.config.update("jax_numpy_rank_promotion", "raise")
if OPTIMISATION_LEVEL not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts its backend, after this
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPTIMISATION_LEVEL}=0".strip()

PROGRAMS_KEPT_BYTES = 1 << 30  # a whole fast tier's programs are about 70 MB
_kept = os.environ.get("JAXATTN_TEST_PROGRAMS")
_programs = Path(_kept or tempfile.mkdtemp(prefix="jaxattn-tests-compiled-"))  # one per process: no two writers
if not _kept:
    atexit.register(shutil.rmtree, _programs, ignore_errors=True)
# The programs tests start (train.serve, sample, tiny_lm: jaxattn.program_cache) keep theirs here too, never
# in the user's cache, in the folder this process uses, so one started in this process changes nothing.
os.environ["JAXATTN_CACHE_DIR"] = str(_programs)
_folder = _programs / machine_key()
_folder.mkdir(parents=True, exist_ok=True)  # pruned at the end even if nothing was compiled
jax.config.update("jax_compilation_cache_dir", str(_folder))
# All kept where they carry over to later runs; else those dearer to compile than to read.
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0 if _kept else MIN_COMPILE_SECONDS)


def _prune(directory: Path, keep_bytes: int) -> None:
    """Delete the entries used longest ago (access or write time, whichever is later) past keep_bytes."""
    entries = []
    for path in directory.iterdir():
        try:
            stat = path.stat()
        except FileNotFoundError:  # another run pruned it
            continue
        entries.append((max(stat.st_atime, stat.st_mtime), stat.st_size, path))
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):
        if total <= keep_bytes:
            break
        path.unlink(missing_ok=True)
        total -= size


@pytest.fixture(autouse=True, scope="module")
def _let_go_of_compiled_programs(request):
    """After each test module: its lru_caches emptied, JAX's caches cleared (see the module docstring)."""
    yield
    for value in list(vars(request.module).values()):
        if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()


def pytest_sessionfinish(session):
    if _kept and not hasattr(session.config, "workerinput"):  # once, in the process that started the workers
        _prune(_folder, PROGRAMS_KEPT_BYTES)
