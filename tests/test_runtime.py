"""train.runtime: devices, XLA flags and kernels resolved once, with reasons, before a run starts."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxattn.kernels import Kernels, Platform
from train import runtime
from train.config import RuntimeConfig

ROOT = Path(__file__).resolve().parent.parent
AVX2 = Platform("cpu", frozenset({"avx2"}))


@pytest.mark.parametrize("batch, limit, width", [(12, 2, 2), (12, 5, 4), (12, 64, 12), (7, 2, 1), (1, 8, 1)])
def test_widest_split_divides_the_batch(batch, limit, width):
    assert runtime.widest_split(batch, limit) == width


def test_auto_on_a_cpu_uses_the_cores_that_divide_the_batch(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_cores", lambda: 2)
    resolved = runtime.resolve(RuntimeConfig(), batch_size=12, platform=AVX2, devices=2)
    assert resolved.data_parallel == 2 and resolved.config.data_parallel == 2
    assert resolved.kernels == Kernels(attention="auto_cpu", decode="auto_cpu", matmul="xla")
    assert resolved.config.requested_kernels() == resolved.kernels  # what gets saved has no "auto"
    assert "2 cores" in resolved.reasons["data_parallel"]
    lines = resolved.describe()
    assert any(line.strip().startswith("runtime.matmul = 'xla' (this CPU has no AMX-BF16") for line in lines)
    # JAX started with one device (a library caller): auto uses what there is, silently.
    assert runtime.resolve(RuntimeConfig(), 12, platform=AVX2, devices=1).data_parallel == 1


def test_auto_on_an_accelerator_is_one_device_and_its_kernels():
    resolved = runtime.resolve(RuntimeConfig(), batch_size=64, platform=Platform("gpu"), devices=1)
    assert resolved.data_parallel == 1 and resolved.kernels == Kernels(attention="auto_gpu", matmul="bfloat16")


def test_explicit_data_parallel_is_checked():
    with pytest.raises(ValueError, match="batch_size=12 must be divisible by runtime.data_parallel=5"):
        runtime.resolve(RuntimeConfig(data_parallel=5), 12, platform=AVX2, devices=8)
    fallback = runtime.resolve(RuntimeConfig(data_parallel=4), 12, platform=AVX2, devices=1)
    assert fallback.data_parallel == 1 and "JAX has 1 device(s): training on one" in fallback.warnings[0]


def test_preparing_jax_after_it_started_warns_instead_of_failing():
    jax.devices()  # this test process has started JAX
    warnings = runtime.prepare_jax(RuntimeConfig(data_parallel=2), batch_size=4)
    assert len(warnings) == 1 and "JAX had started" in warnings[0]
    assert runtime.prepare_jax(RuntimeConfig(data_parallel=1), batch_size=4) == []  # nothing to set


def test_a_fresh_process_gets_its_devices_and_flags_and_importing_starts_nothing():
    """Importing the library and the programs must not start JAX, or the device count could not be set."""
    script = (
        "import os, jax, jaxattn, train.loop, train.tiny_lm, train.sample, train.compare, train.attention_maps\n"
        "from train import runtime\n"
        "from train.config import RuntimeConfig\n"
        "r = runtime.start(RuntimeConfig(data_parallel=3, xla_flags='--xla_cpu_enable_fast_math=false'), 6)\n"
        "assert r.warnings == (), r.warnings\n"
        "assert jax.device_count() == 3 and r.data_parallel == 3\n"
        "assert '--xla_cpu_enable_fast_math=false' in os.environ['XLA_FLAGS']\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
