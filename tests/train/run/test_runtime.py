"""train.run.runtime: devices, XLA flags and kernels resolved once, with reasons, before a run starts."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxattn.axes import MeshShape
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, Platform
from train.config import RuntimeConfig
from train.run import runtime

ROOT = Path(__file__).resolve().parents[3]
AVX2 = Platform("cpu", frozenset({"avx2"}))


@pytest.mark.parametrize("batch, limit, width", [(12, 2, 2), (12, 5, 4), (12, 64, 12), (7, 2, 1), (1, 8, 1)])
def test_widest_split_divides_the_batch(batch, limit, width):
    assert runtime.widest_split(batch, limit) == width


def test_auto_on_a_cpu_uses_the_cores_that_divide_the_batch(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_cores", lambda: 2)
    resolved = runtime.resolve(RuntimeConfig(), batch_size=12, platform=AVX2, devices=2)
    assert resolved.mesh_shape == MeshShape(data=2) and resolved.config.mesh == MeshShape(data=2)
    assert resolved.kernels == Kernels(attention="auto_cpu", decode="auto_cpu", matmul="xla", moe="auto_cpu",
                                       paged="ragged")
    assert resolved.config.requested_kernels() == resolved.kernels  # what gets saved has no "auto"
    assert "2 cores" in resolved.reasons["mesh"]
    lines = resolved.describe()
    assert any(line.strip().startswith("runtime.matmul = 'xla' (this CPU has no AMX-BF16") for line in lines)
    assert "  runtime.mesh = 'data:2,fsdp:1,tensor:1' (one host device per CPU core that divides the batch " \
           "(2 cores, batch 12))" in lines  # the mesh as config.json holds it
    # JAX started with one device (a library caller): auto uses what there is, silently.
    assert runtime.resolve(RuntimeConfig(), 12, platform=AVX2, devices=1).mesh_shape == MeshShape()


def test_auto_on_an_accelerator_splits_the_batch_over_its_devices_and_picks_its_kernels():
    resolved = runtime.resolve(RuntimeConfig(), batch_size=64, platform=Platform("gpu"), devices=1)
    assert resolved.mesh_shape == MeshShape() and resolved.kernels == Kernels(attention="auto_gpu",
                                                                                matmul="bfloat16", moe="grouped")
    assert runtime.resolve(RuntimeConfig(), 12, platform=Platform("gpu"), devices=8).mesh_shape.data == 6


@pytest.mark.parametrize("mesh, devices, batch, message", [
    ("data:5", 5, 12, "data x fsdp = 5 does not divide the batch size = 12"),
    ("data:2,fsdp:4", 8, 12, "data x fsdp = 8 does not divide the batch size = 12"),
    ("data:4", 1, 12, "runtime.mesh='data:4,fsdp:1,tensor:1' uses 4 device(s) but JAX has 1 (--cpu-devices N"),
    ("tensor:3", 3, 12, "tensor = 3 does not divide num_heads = 4"),
    ("tensor:8", 8, 16, "tensor = 8 does not divide num_heads = 4"),
    ("fsdp:3", 3, 12, "fsdp = 3 does not divide d_model = 32"),
])
def test_a_mesh_that_does_not_fit_names_the_axis_and_the_size(mesh, devices, batch, message):
    model = ModelConfig(vocab_size=65, d_model=32, num_layers=1, num_heads=4, max_seq_len=16)
    with pytest.raises(ValueError, match=re.escape(message)):
        runtime.resolve(RuntimeConfig(mesh=mesh), batch, platform=AVX2, devices=devices, model=model)


def test_an_explicit_mesh_is_resolved_as_asked_and_makes_its_host_devices():
    model = ModelConfig(vocab_size=65, d_model=32, num_layers=1, num_heads=4, max_seq_len=16)
    resolved = runtime.resolve(RuntimeConfig(mesh="fsdp:2,data:2,tensor:2"), 8, platform=AVX2, devices=8, model=model)
    assert resolved.mesh_shape == MeshShape(2, 2, 2) and resolved.reasons["mesh"] == "asked for"
    assert runtime.cpu_devices_wanted(RuntimeConfig(mesh="data:2,tensor:4"), 8) == 8
    assert runtime.cpu_devices_wanted(RuntimeConfig(cpu_devices=3), 8) == 3


def test_the_mesh_is_parsed_once_and_built_once():
    asked = RuntimeConfig(mesh="data:1")
    resolved = runtime.resolve(asked, 4, platform=AVX2, devices=jax.device_count())
    assert resolved.mesh_shape is asked.mesh and resolved.config.mesh is asked.mesh  # no text parsed again
    assert resolved.mesh is resolved.mesh and resolved.mesh.shape == {"data": 1, "fsdp": 1, "tensor": 1}


def test_preparing_jax_after_it_started_warns_instead_of_failing():
    jax.devices()  # this test process has started JAX
    warnings = runtime.prepare_jax(RuntimeConfig(mesh="data:2"), batch_size=4)
    assert len(warnings) == 1 and "JAX had started" in warnings[0]
    assert runtime.prepare_jax(RuntimeConfig(mesh="data:1"), batch_size=4) == []  # nothing to set


def test_a_fresh_process_gets_its_devices_and_flags_and_importing_starts_nothing():
    """Importing the library and the programs must not start JAX, or the device count could not be set."""
    script = (
        "import os, jax, jaxattn, train.run.loop, train.tiny_lm, train.sample, train.compare, train.attention_maps\n"
        "from train.run import runtime\n"
        "from train.config import RuntimeConfig\n"
        "r = runtime.start(RuntimeConfig(mesh='data:3', xla_flags='--xla_cpu_enable_fast_math=false'), 6)\n"
        "assert r.warnings == (), r.warnings\n"
        "assert jax.device_count() == 3 and r.mesh.shape == {'data': 3, 'fsdp': 1, 'tensor': 1}\n"
        "assert '--xla_cpu_enable_fast_math=false' in os.environ['XLA_FLAGS']\n"
        "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_host_devices_asked_for_are_all_used_or_refused_before_they_are_made(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_cores", lambda: 2)
    with pytest.raises(ValueError, match=re.escape("runtime.cpu_devices=1000 makes 1000 host device(s), but a batch "
                                                   "of 12 splits over at most 12 of them: ask for --cpu-devices 12")):
        runtime.check_cpu_devices(RuntimeConfig(cpu_devices=1000), 12)
    with pytest.raises(ValueError, match=re.escape("runtime.mesh='data:2,fsdp:1,tensor:1' uses 2 device(s) but "
                                                   "runtime.cpu_devices=2 makes 4 in 2 processes")):
        runtime.check_cpu_devices(RuntimeConfig(cpu_devices=2, mesh="data:2"), 12, num_processes=2)
    assert runtime.check_cpu_devices(RuntimeConfig(cpu_devices=2), 12) == []
    assert runtime.check_cpu_devices(RuntimeConfig(cpu_devices=4), 12) == [
        "runtime.cpu_devices=4 host devices share 2 CPU core(s): right for trying a mesh, slower than one device "
        "per core"]
    resolved = runtime.resolve(RuntimeConfig(cpu_devices=4), 12, platform=AVX2, devices=4)  # all 4, not one per core
    assert resolved.mesh_shape == MeshShape(data=4)


LAGGING_COLLECTIVE = """
import sys, jax
from train.run import runtime
runtime.host_devices(2)
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
mesh = Mesh(jax.devices(), ("d",))
def body(x):  # device 0 works for seconds before the all-reduce; device 1 waits for it there
    heavy = lambda x: jax.lax.fori_loop(0, 20000, lambda i, y: jnp.sin(y) @ jnp.cos(y), x)
    return jax.lax.psum(jax.lax.cond(jax.lax.axis_index("d") == 0, heavy, lambda x: x, x), "d")
jax.block_until_ready(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P()))(jnp.ones((512, 256))))
print("ok")
"""


def test_host_devices_wait_for_each_other_at_collectives_as_long_as_a_step_may_take():
    """XLA:CPU aborts a process whose host devices wait for each other at a collective past its termination
    timeout (40 s by default: a LoRA step of a 135M model on two busy cores did, SIGABRT and a C++ stack).
    `host_devices` raises it to an hour unless XLA_FLAGS sets it; the flags it sets are the ones XLA reads:
    set to 2 s they abort the same program, where device 0 works seconds before the all-reduce."""
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": str(ROOT)}
    ours = subprocess.run([sys.executable, "-c", LAGGING_COLLECTIVE + "import os; print(os.environ['XLA_FLAGS'])"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert all(flag in ours.stdout for flag in runtime.COLLECTIVE_FLAGS)
    short = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=1 --xla_cpu_collective_call_terminate_timeout_seconds=2 "
             "--xla_cpu_collective_timeout_seconds=2")
    aborted = subprocess.run([sys.executable, "-c", LAGGING_COLLECTIVE], cwd=ROOT, env={**env, "XLA_FLAGS": short},
                             capture_output=True, text=True, timeout=300)
    assert aborted.returncode != 0 and "Termination timeout" in aborted.stderr and "of 2 seconds" in aborted.stderr
    assert "ok" not in aborted.stdout  # the user's settings were kept, and they are what XLA obeys


def test_auto_keeps_one_host_device_where_a_step_is_long_enough_on_one(monkeypatch):
    monkeypatch.setattr(runtime, "cpu_cores", lambda: 2)
    base = ModelConfig(vocab_size=49152, d_model=576, num_layers=30, num_heads=9, num_kv_heads=3, mlp_hidden=1536)
    flops = runtime.train_step_flops(base, 2 * 512)  # a LoRA fine-tune of SmolLM2-135M's shape, batch 2
    assert 5e11 < flops < 1e12
    assert runtime.cpu_devices_wanted(RuntimeConfig(), 2, step_flops=flops) == 1
    resolved = runtime.resolve(RuntimeConfig(), 2, platform=AVX2, devices=1, step_flops=flops)
    assert resolved.mesh_shape == MeshShape() and "long enough on one device" in resolved.reasons["mesh"]
    # A small step keeps one device per core; asked-for devices are made whatever the step.
    baby = ModelConfig(vocab_size=65, d_model=128, num_layers=4, num_heads=4)
    assert runtime.cpu_devices_wanted(RuntimeConfig(), 12, step_flops=runtime.train_step_flops(baby, 12 * 64)) == 2
    assert runtime.cpu_devices_wanted(RuntimeConfig(cpu_devices=2), 2, step_flops=flops) == 2
