"""Starting JAX for a run and resolving its runtime: the one place a program looks at the machine.

`start(config, batch_size)` runs before anything starts JAX's backends (the
command-line programs call it first, after `train.run.distributed.join` where a run
spans processes): it applies `runtime.xla_flags` and asks for the CPU host
devices the mesh needs, through public JAX settings, then detects the platform
and resolves every "auto" (kernels and the mesh) with a reason that the
programs print, and builds the device mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
from jax.sharding import Mesh

from jaxattn.axes import MeshShape, check_mesh, make_mesh
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels, Platform, resolve_kernels
from train.config import RuntimeConfig


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A resolved runtime.

    Attributes:
      platform: what the choices were made for.
      config: the `RuntimeConfig` with every "auto" replaced (what is saved with the run): its
        kernel names are `kernels`' and its mesh is `mesh_shape`.
      kernels: the implementations the model runs with.
      mesh_shape: the size of each mesh axis (data, fsdp, tensor).
      reasons: field -> why it has its value.
      warnings: what did not go as asked (e.g. JAX had started before the device count could be set).
    """

    platform: Platform
    config: RuntimeConfig
    kernels: Kernels
    mesh_shape: MeshShape
    reasons: dict[str, str]
    warnings: tuple[str, ...] = ()

    @functools.cached_property
    def mesh(self) -> Mesh:
        """The device mesh, built on first use: the first `mesh_shape.size` of JAX's devices (every process's)."""
        return make_mesh(self.mesh_shape, jax.devices()[:self.mesh_shape.size])

    def describe(self) -> list[str]:
        """One line per choice: `runtime.FIELD = VALUE (reason)`, VALUE as config.json holds it."""
        processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
        lines = [f"runtime: {self.platform.describe()}, {jax.device_count()} device(s){processes}"]
        values = self.config.to_dict()
        for field, reason in self.reasons.items():
            lines.append(f"  runtime.{field} = {values[field]!r} ({reason})")
        return lines


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def widest_split(batch_size: int, limit: int) -> int:
    """The largest divisor of `batch_size` that is at most `limit`."""
    return max(d for d in range(1, max(1, min(limit, batch_size)) + 1) if batch_size % d == 0)


# A host device already runs its programs' large operations on every core (XLA:CPU's intra-op threads), so a
# batch split over host devices gains only where each device's share is small. Measured (docs/performance.md
# §4.4, §10): the baby config (~2e9 FLOPs a step per device) ran 10% faster on two host devices than on one
# (Intel AMX); the 10.7M config (~7e11) within noise on two (AMD AVX2); a LoRA step of a 135M model (~4e11)
# on two devices of a loaded 2-core machine waited at a collective until XLA aborted the process.
LONG_STEP_FLOPS = 1e11


def train_step_flops(model: ModelConfig, tokens: int) -> float:
    """About a training step's arithmetic: 6 x the matmuls' parameters x the step's tokens (the usual
    estimate: attention's scores, and a MoE's experts beyond one, left out)."""
    D = model.d_model
    per_layer = 4 * D * D + 3 * D * (model.mlp_hidden or 4 * D)
    return 6.0 * tokens * (model.num_layers * per_layer + model.vocab_size * D)


def auto_host_devices(batch_size: int, step_flops: float | None = None) -> tuple[int, str]:
    """The host devices an "auto" runtime makes on a CPU, and why: one per core that divides the batch,
    or one where each device's share of a step (`step_flops`, `train_step_flops`) is long enough that
    the split gains little (`LONG_STEP_FLOPS`)."""
    cores = cpu_cores()
    split = widest_split(batch_size, cores)
    if split > 1 and step_flops is not None and step_flops / split >= LONG_STEP_FLOPS:
        return 1, (f"one host device: a step is ~{step_flops:.1e} FLOPs, long enough on one device (which uses all "
                   f"{cores} cores) that a split over {split} gains little and waits at its collectives")
    return split, f"one host device per CPU core that divides the batch ({cores} cores, batch {batch_size})"


def cpu_devices_wanted(config: RuntimeConfig, batch_size: int, num_processes: int = 1,
                       step_flops: float | None = None) -> int:
    """The CPU host devices this process makes: asked for, else its share of the mesh (which spans
    every process's devices), else `auto_host_devices`."""
    if config.cpu_devices != "auto":
        return config.cpu_devices
    if config.mesh != "auto":
        return max(1, config.mesh.size // num_processes)
    return auto_host_devices(batch_size, step_flops)[0]


def check_cpu_devices(config: RuntimeConfig, batch_size: int, num_processes: int = 1) -> list[str]:
    """Before any device is made: ValueError when the mesh would leave some of the asked-for host
    devices idle; a warning when they outnumber the cores (useful to try a mesh, not for speed)."""
    if config.cpu_devices == "auto":
        return []
    devices, mesh = config.cpu_devices * num_processes, config.mesh
    widest = widest_split(batch_size, devices)
    if mesh == "auto" and widest < devices:
        raise ValueError(f"runtime.cpu_devices={config.cpu_devices} makes {devices} host device(s), but a batch "
                         f"of {batch_size} splits over at most {widest} of them: ask for --cpu-devices {widest}, "
                         "or give --mesh (runtime.cpu_devices, runtime.mesh)")
    if mesh != "auto" and mesh.size != devices:
        raise ValueError(f"runtime.mesh={str(mesh)!r} uses {mesh.size} device(s) but runtime.cpu_devices="
                         f"{config.cpu_devices} makes {devices}" + (f" in {num_processes} processes" if
                                                                    num_processes > 1 else ""))
    if config.cpu_devices > cpu_cores():
        return [f"runtime.cpu_devices={config.cpu_devices} host devices share {cpu_cores()} CPU core(s): right "
                "for trying a mesh, slower than one device per core"]
    return []


# XLA:CPU's host devices meet at every collective on threads of one process; one that waits 40 s for another
# aborts the process (rendezvous.cc's "Termination timeout", a C++ stack and SIGABRT), which a step of a real
# model on a loaded machine reaches: a LoRA step of a 135M model on 2 busy cores did. An hour instead, and the
# "may be stuck" warning after 10 minutes rather than 20 s, unless XLA_FLAGS or runtime.xla_flags set them.
COLLECTIVE_FLAGS = ("--xla_cpu_collective_timeout_seconds=3600", "--xla_cpu_collective_call_terminate_timeout_seconds=3600",
                    "--xla_cpu_collective_call_warn_stuck_timeout_seconds=600")


def add_xla_flags(flags, *, unless_named: bool = False) -> None:
    """Appends `flags` to XLA_FLAGS (before JAX starts), those not there already (with `unless_named`, those
    whose flag XLA_FLAGS does not set at all: a default that gives way to the user's)."""
    current = os.environ.get("XLA_FLAGS", "").split()
    there = {flag.split("=")[0] for flag in current} if unless_named else set(current)
    os.environ["XLA_FLAGS"] = " ".join(current + [f for f in flags if (f.split("=")[0] if unless_named else f)
                                                  not in there])


def host_devices(count: int) -> None:
    """Makes `count` CPU host devices, their collectives' timeouts raised (`COLLECTIVE_FLAGS`), before JAX
    starts; RuntimeError once it has."""
    if count > 1:
        add_xla_flags(COLLECTIVE_FLAGS, unless_named=True)
    jax.config.update("jax_num_cpu_devices", count)


def prepare_jax(config: RuntimeConfig, batch_size: int, num_processes: int = 1,
                step_flops: float | None = None) -> list[str]:
    """Applies XLA flags and the CPU host device count (`cpu_devices_wanted`, with `COLLECTIVE_FLAGS` when
    several) before JAX starts; returns warnings. ValueError for host devices the mesh would leave idle
    (`check_cpu_devices`)."""
    warnings = check_cpu_devices(config, batch_size, num_processes)
    if config.xla_flags:
        add_xla_flags(config.xla_flags.split())
    devices = cpu_devices_wanted(config, batch_size, num_processes, step_flops)
    if devices > 1 or config.xla_flags:
        try:  # only affects the CPU backend; harmless where the default backend is a GPU or TPU
            host_devices(devices)
        except RuntimeError:
            warnings.append(f"JAX had started before this run could set {devices} CPU device(s) and "
                            f"runtime.xla_flags={config.xla_flags!r}; it keeps its own "
                            "(the command-line programs set them first)")
    return warnings


def _mesh(config: RuntimeConfig, batch_size: int, platform: Platform, devices: int,
          model: ModelConfig | None, step_flops: float | None) -> tuple[MeshShape, str]:
    """(mesh shape, reason); ValueError for a mesh that does not fit the devices, batch or model."""
    if config.mesh != "auto":
        asked, reason = config.mesh, "asked for"
    elif jax.process_count() > 1:
        asked, reason = MeshShape(data=devices), f"data parallel over all {devices} devices of the processes"
    elif platform.is_cpu and config.cpu_devices == "auto":  # those `auto_host_devices` made, of those there are
        wanted, reason = auto_host_devices(batch_size, step_flops)
        asked = MeshShape(data=widest_split(batch_size, min(wanted, devices)))
    else:  # host devices asked for by number are all used
        asked = MeshShape(data=widest_split(batch_size, devices))
        reason = (f"the {config.cpu_devices} host devices asked for that divide the batch" if platform.is_cpu
                  else f"the {platform.backend} devices that divide the batch ({devices})")
    check_mesh(model, asked, batch_size)  # before the device count: what the user must change first
    if config.mesh != "auto" and asked.size != devices:  # an "auto" mesh may use the first devices only
        raise ValueError(f"runtime.mesh={str(asked)!r} uses {asked.size} device(s) but JAX has {devices}" + (
            " (--cpu-devices N, runtime.cpu_devices = N, makes N host devices)" if platform.is_cpu else ""))
    return asked, reason


def resolve(config: RuntimeConfig, batch_size: int, platform: Platform | None = None,
            devices: int | None = None, model: ModelConfig | None = None,
            step_flops: float | None = None) -> Runtime:
    """Every "auto" of `config` resolved for `platform` (default: this process's) with its reason.

    `model`: also check that the mesh divides its heads and widths. `step_flops`: a training step's
    arithmetic (`train_step_flops`), for the host devices of an "auto" mesh (`auto_host_devices`).
    """
    platform = Platform.detect() if platform is None else platform
    devices = jax.device_count() if devices is None else devices
    kernels, reasons = resolve_kernels(config.requested_kernels(), platform)
    shape, reasons["mesh"] = _mesh(config, batch_size, platform, devices, model, step_flops)
    concrete = config.replace(**kernels.to_dict(), mesh=shape)
    return Runtime(platform=platform, config=concrete, kernels=kernels, mesh_shape=shape, reasons=reasons)


def start(config: RuntimeConfig, batch_size: int, model: ModelConfig | None = None,
          num_processes: int = 1, block_size: int | None = None) -> Runtime:
    """`prepare_jax`, then `resolve` on this machine: call before anything else uses JAX. With `model` and
    `block_size`, an "auto" mesh weighs a training step's arithmetic (`auto_host_devices`)."""
    flops = None if model is None or block_size is None else train_step_flops(model, batch_size * block_size)
    warnings = prepare_jax(config, batch_size, num_processes, flops)
    runtime = resolve(config, batch_size, model=model, step_flops=flops)
    return dataclasses.replace(runtime, warnings=tuple(warnings) + runtime.warnings)
