"""Emulating a smaller x86 CPU on a larger one: `JAXATTN_NATIVE_MARCH` replaces `-march=native` in the native
kernels' build and in the cached library's name (jaxattn/kernels/native_build.py), `JAXATTN_CPU_FLAGS_MAX` caps
the CPU flags the kernel rules see (jaxattn/kernels/host.py), and a benchmark records both
(bench/machine.py). One build for x86-64-v3 runs the float matmul's AVX2 tiles equal to the reference."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from bench.machine import isa_limits, limits_prefix, machine_line
from jaxattn.kernels import Kernels, Platform, native_build, resolve_kernels
from jaxattn.kernels.host import CEILING_VARIABLE, cap_flags, read_cpu_flags

XEON = frozenset({"fma", "avx", "avx2", "avx512f", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16",
                  "amx_tile", "amx_int8", "sse4_2"})
SOURCE = Path(native_build.__file__).parent / "native" / "float_matmul.cc"


def test_the_march_variable_replaces_native_in_the_flags_and_the_library_s_name(monkeypatch):
    monkeypatch.delenv(native_build.MARCH_VARIABLE, raising=False)
    native = native_build.flags()
    assert native == native_build.FLAGS and "-march=native" in native
    monkeypatch.setenv(native_build.MARCH_VARIABLE, " ")  # blank: the default
    assert native_build.flags() == native
    monkeypatch.setenv(native_build.MARCH_VARIABLE, "x86-64-v3")
    v3 = native_build.flags()
    assert "-march=x86-64-v3" in v3 and "-march=native" not in v3 and len(v3) == len(native)
    names = {flags: native_build.library_name(SOURCE, "g++ 12", flags) for flags in (native, v3)}
    assert names[native] != names[v3] and all(name.startswith("float_matmul-") for name in names.values())
    assert native_build.library_name(SOURCE, "g++ 12", v3) == names[v3]  # the same build, the same name


def test_the_ceiling_drops_the_flags_above_its_level():
    avx2 = cap_flags(XEON, "avx2")
    assert avx2 == {"fma", "avx", "avx2", "sse4_2"}
    assert cap_flags(XEON, "avx_vnni") == avx2 | {"avx_vnni"}
    assert cap_flags(XEON, "avx512") == XEON - {"amx_bf16", "amx_tile", "amx_int8"}
    assert cap_flags(XEON, None) == cap_flags(XEON, "") == XEON
    with pytest.raises(ValueError, match=r"JAXATTN_CPU_FLAGS_MAX='sse': expected one of avx512, avx_vnni, avx2"):
        cap_flags(XEON, "sse")


def test_the_ceiling_makes_auto_choose_as_on_an_avx2_cpu(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: " + " ".join(sorted(XEON)) + "\n")
    monkeypatch.delenv(CEILING_VARIABLE, raising=False)
    assert read_cpu_flags(str(cpuinfo)) == XEON
    monkeypatch.setenv(CEILING_VARIABLE, "avx2")
    detected = Platform.detect(str(cpuinfo))
    assert detected.cpu_flags == cap_flags(XEON, "avx2") and detected.describe() == "cpu backend (avx2)"
    ours, reasons = resolve_kernels(Kernels.auto(), Platform("cpu", detected.cpu_flags, cxx=True))
    amd, _ = resolve_kernels(Kernels.auto(), Platform("cpu", frozenset({"avx", "avx2", "fma"}), cxx=True))
    assert ours == amd and ours.matmul == "native_cpu" and "AVX2 integer dots" in reasons["quantized"]


def test_a_benchmark_records_the_limits_and_only_those():
    environ = {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true --xla_cpu_max_isa=AVX2",
               "JAXATTN_NATIVE_MARCH": "x86-64-v3", "JAXATTN_CPU_FLAGS_MAX": "avx2", "OMP_NUM_THREADS": "2"}
    limits = isa_limits(environ)
    assert limits == {"XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "JAXATTN_NATIVE_MARCH": "x86-64-v3",
                      "JAXATTN_CPU_FLAGS_MAX": "avx2"}
    assert limits_prefix(limits) == ("XLA_FLAGS=--xla_cpu_max_isa=AVX2 JAXATTN_NATIVE_MARCH=x86-64-v3 "
                                     "JAXATTN_CPU_FLAGS_MAX=avx2 ")
    assert isa_limits({"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=true"}) == {} and limits_prefix({}) == ""
    machine = {"cpu": "a Xeon", "platform": "cpu backend (avx2)", "cpus": 2, "jax": "0.10"}
    assert machine_line(machine) == "a Xeon (cpu backend (avx2), 2 CPUs), jax 0.10"
    assert machine_line({**machine, "isa_limits": {"JAXATTN_CPU_FLAGS_MAX": "avx2"}}).endswith(
        ", limited by `JAXATTN_CPU_FLAGS_MAX=avx2`")


AVX2_BUILD = """
import jax.numpy as jnp, numpy as np
from jaxattn.kernels import float_matmul
print(float_matmul.native_path())
rng = np.random.default_rng(0)
for M, K, N in ((1, 130, 49), (9, 64, 100), (33, 5, 7)):
    x, w = rng.normal(size=(M, K)).astype(np.float32), rng.normal(size=(K, N)).astype(np.float32)
    expected = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
    for got in (float_matmul.native_matmul(x, w), float_matmul.native_matmul(x, np.ascontiguousarray(w.T), True)):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=0, atol=4e-5 * np.sqrt(K))
print("ok")
"""


@pytest.mark.skipif(native_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64")
                    or "avx2" not in read_cpu_flags(), reason="the x86-64-v3 build runs on an x86 CPU with AVX2")
def test_a_library_built_for_x86_64_v3_runs_the_avx2_tiles_equal_to_the_reference(tmp_path):
    env = {**os.environ, "JAXATTN_NATIVE_CACHE": str(tmp_path), native_build.MARCH_VARIABLE: "x86-64-v3",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run([sys.executable, "-c", AVX2_BUILD], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and result.stdout.split() == ["avx2", "ok"], result.stderr[-2000:]
    assert len(list(tmp_path.glob("float_matmul-*.so"))) == 1
