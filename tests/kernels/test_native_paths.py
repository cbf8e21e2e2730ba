"""The native kernels' instruction-set paths (the quantized matmul's integer dots, jaxattn/kernels/native/
quant_dot.h; the paged attention's float loops, float_vec.h; the float matmul's tiles, float_gemm.h), each checked against a reference whatever
path `-march=native` picks on this machine.

* The integer dots and float loops alone: tests/kernels/native_driver.cc compiled for each path and run
  where this machine can (x86 natively; ARM NEON with and without the dot-product extension
  cross-compiled with g++-aarch64-linux-gnu and run under qemu-aarch64, marked `qemu`): the integer sums
  exactly equal to a scalar reference, the float ones within 1e-5 of a double-precision one.
* The whole kernels through JAX: the libraries built for the scalar and the AVX2 paths (x86) in a process
  of its own each; the quantized matmul equal to `matmul_q8act` / `matmul` on odd shapes (N not a multiple
  of 16, K of 64, one row and 33 rows) to the tolerance tests/test_quantize.py holds the native build to;
  the float matmul, both weight layouts, within 1e-5 of the terms' magnitudes of a float64 product.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxattn.kernels import native_build
from jaxattn.kernels.host import read_cpu_flags

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "jaxattn" / "kernels" / "native"
DRIVER = Path(__file__).parent / "native_driver.cc"
CXX = native_build.compiler()
X86 = platform.machine() in ("x86_64", "AMD64")
needs_x86 = pytest.mark.skipif(CXX is None or not X86, reason="the x86 paths need an x86 machine and a C++ compiler")

# path: (the compiler's target flags, the /proc/cpuinfo flag the CPU needs to run it, or None)
X86_PATHS = {"scalar": (["-march=x86-64"], None), "avx2": (["-march=x86-64-v3"], "avx2"),
             "avxvnni": (["-march=x86-64-v3", "-mavxvnni"], "avx_vnni"),
             "avx512vnni": (["-march=x86-64-v4", "-mavx512vnni"], "avx512_vnni")}
ARM_PATHS = {"neon-dotprod": "-march=armv8.2-a+dotprod", "neon": "-march=armv8-a"}
# The paged attention's float path (native/float_vec.h) each of those builds takes; the float matmul's tiles
# (native/float_gemm.h) take the same.
FLOAT_PATHS = {"scalar": "scalar", "avx2": "avx2", "avxvnni": "avx2", "avx512vnni": "avx512", "neon-dotprod": "neon",
               "neon": "neon"}
ARM_CXX, QEMU = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")


def compile_driver(cxx: str, flags: list[str], out: Path) -> Path:
    result = subprocess.run([cxx, "-O2", "-std=c++17", *flags, "-I", str(NATIVE), str(DRIVER), "-o", str(out)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return out


def run_driver(command: list[str], path: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert result.stdout.startswith(f"path {path}: 24 cases, max |error| 0"), result.stdout
    float_line = result.stdout.splitlines()[1]
    assert float_line.startswith(f"float path {FLOAT_PATHS[path]}: 60 cases, max relative error within 1e-5"), float_line
    gemm_line = result.stdout.splitlines()[2]
    assert re.match(rf"gemm path {FLOAT_PATHS[path]}: \d+ cases, max relative error within 1e-5", gemm_line), gemm_line


def runnable(path: str) -> bool:
    """Whether this CPU has the instructions `path` needs."""
    needs = X86_PATHS[path][1]
    return needs is None or needs in read_cpu_flags()


RUNNABLE_X86 = [path for path in X86_PATHS if X86 and runnable(path)]


@needs_x86
@pytest.mark.parametrize("path", list(X86_PATHS))
def test_each_x86_path_compiles_and_names_itself(path, tmp_path):
    """Every path builds on any x86 machine, and the binary is the path it says (the paths this CPU
    cannot run are checked this far only)."""
    binary = compile_driver(CXX, X86_PATHS[path][0], tmp_path / "driver")
    assert f"\0{path}\0".encode() in binary.read_bytes() and f"\0{FLOAT_PATHS[path]}\0".encode() in binary.read_bytes()


@needs_x86
@pytest.mark.parametrize("path", RUNNABLE_X86)
def test_each_x86_path_this_cpu_runs_gives_integer_dots_equal_to_the_reference(path, tmp_path):
    run_driver([str(compile_driver(CXX, X86_PATHS[path][0], tmp_path / "driver"))], path)


ARM_TOOLS_MISSING = "needs Debian's g++-aarch64-linux-gnu and qemu-user (qemu-aarch64) to run the ARM paths"


@pytest.mark.qemu
@pytest.mark.parametrize("path", list(ARM_PATHS))
def test_each_arm_path_s_integer_dots_equal_the_reference_under_qemu(path, tmp_path):
    """CI installs the tools (`make arm-cross`) and fails without them; elsewhere a missing tool skips."""
    if ARM_CXX is None or QEMU is None:
        if os.environ.get("CI") == "true":
            pytest.fail(ARM_TOOLS_MISSING)
        pytest.skip(ARM_TOOLS_MISSING)
    binary = compile_driver(ARM_CXX, [ARM_PATHS[path]], tmp_path / "driver")
    run_driver([QEMU, "-L", "/usr/aarch64-linux-gnu", str(binary)], path)


WHOLE_KERNEL = """
import sys
import jax, numpy as np
from jaxattn.kernels import native_build, quant_matmul
from jaxattn.quantization import quantize_weight, to_panels
native_build.FLAGS = tuple(f for f in native_build.FLAGS if f != "-march=native") + tuple(sys.argv[1:])
print(quant_matmul.native_path())
rng = np.random.default_rng(0)
for M in (1, 33):
    for K in (96, 160):  # three and five groups of 32: not a multiple of 64
        x = rng.normal(size=(M, K)).astype(np.float32)
        for mode in ("int8", "int8:channel", "int4", "int4:32", "int4:asym"):  # int8: groups of 32; per channel; Q4_1
            for N in (17, 531, 80):  # a tail alone, vector columns and a tail, whole panels
                q = quantize_weight(rng.normal(size=(K, N)).astype(np.float32), mode)
                calls = [(q, False, quant_matmul.matmul), (q, True, quant_matmul.matmul_q8act)]
                if N % 16 == 0:
                    calls.append((to_panels(q), True, quant_matmul.matmul_q8act))
                for w, q8act, reference in calls:
                    if q8act and not quant_matmul._takes_q8act(q):
                        continue
                    expected = np.asarray(reference(x, q))
                    got = np.asarray(quant_matmul.native_matmul(x, w, q8act=q8act))
                    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
from jaxattn.kernels import float_matmul
print(float_matmul.native_path())
for M in (1, 9, 33):
    for K, N in ((70, 53), (130, 100)):  # bands of 64 rows and a remainder; tiles and a tail of columns
        x, w = rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(K, N)).astype(np.float32)
        expected = x.astype(np.float64) @ w
        for got in (float_matmul.native_matmul(x, w), float_matmul.native_matmul(x, w.T.copy(), transposed=True)):
            assert (np.abs(np.asarray(got) - expected) <= 1e-5 * (np.abs(x) @ np.abs(w))).all()
print("ok")
"""


@needs_x86
@pytest.mark.parametrize("path", [path for path in ("scalar", "avx2") if path in RUNNABLE_X86])
def test_the_whole_kernel_built_for_each_runnable_x86_path_equals_the_references(path, tmp_path):
    flags = X86_PATHS[path][0]
    env = {**os.environ, "JAXATTN_NATIVE_CACHE": str(tmp_path), "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    result = subprocess.run([sys.executable, "-c", WHOLE_KERNEL, *flags], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [path, FLOAT_PATHS[path], "ok"]
