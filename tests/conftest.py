"""Every test runs with implicit rank promotion an error, as JAX's own test base does; programs compile
at XLA's backend optimisation level 0, and a program compiled twice in one test process is compiled once.

The library promises to be rank-promotion clean (no array silently broadcast against one of
lower rank). The tests check values, and compiling their many small programs is most of their
time: level 0 leaves XLA's graph optimisations as they are and skips only LLVM's, which
compiles faster and computes the same operations (float32 results may differ in the last bit, far
inside every tolerance here). XLA's older loop emitters (`--xla_cpu_use_fusion_emitters=false`)
would compile faster still, but at level 0 they round some fused programs far worse (Muon's update
drifts from its float64 reference beyond tests/test_optim.py's tolerance), so the tests keep the
emitters users get. An XLA_FLAGS that already sets the level keeps its own. The
environment variables carry both settings into the programs tests start.

Training runs started again, and models jitted anew, compile programs identical to ones compiled
before in the same process: JAX's compilation cache, in a directory of this process's own that is
removed when it ends, reads those back. Nothing carries over from one test run to the next.
"""

import atexit
import os
import shutil
import tempfile

import jax

OPTIMISATION_LEVEL = "--xla_backend_optimization_level"

os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
jax.config.update("jax_numpy_rank_promotion", "raise")
if OPTIMISATION_LEVEL not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts its backend, after this
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {OPTIMISATION_LEVEL}=0".strip()

_compiled = tempfile.mkdtemp(prefix="jaxattn-tests-compiled-")  # one per process: no two writers share it
atexit.register(shutil.rmtree, _compiled, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _compiled)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)  # what is dearer to compile than to read
