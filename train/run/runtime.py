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


def cpu_devices_wanted(config: RuntimeConfig, batch_size: int, num_processes: int = 1) -> int:
    """The CPU host devices this process makes: asked for, else its share of the mesh (which spans
    every process's devices), else one per core."""
    if config.cpu_devices != "auto":
        return config.cpu_devices
    if config.mesh != "auto":
        return max(1, config.mesh.size // num_processes)
    return widest_split(batch_size, cpu_cores())


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


def prepare_jax(config: RuntimeConfig, batch_size: int, num_processes: int = 1) -> list[str]:
    """Applies XLA flags and the CPU host device count (`cpu_devices_wanted`, with `COLLECTIVE_FLAGS` when
    several) before JAX starts; returns warnings. ValueError for host devices the mesh would leave idle
    (`check_cpu_devices`)."""
    warnings = check_cpu_devices(config, batch_size, num_processes)
    if config.xla_flags:
        add_xla_flags(config.xla_flags.split())
    devices = cpu_devices_wanted(config, batch_size, num_processes)
    if devices > 1 or config.xla_flags:
        try:  # only affects the CPU backend; harmless where the default backend is a GPU or TPU
            host_devices(devices)
        except RuntimeError:
            warnings.append(f"JAX had started before this run could set {devices} CPU device(s) and "
                            f"runtime.xla_flags={config.xla_flags!r}; it keeps its own "
                            "(the command-line programs set them first)")
    return warnings


def _mesh(config: RuntimeConfig, batch_size: int, platform: Platform, devices: int,
          model: ModelConfig | None) -> tuple[MeshShape, str]:
    """(mesh shape, reason); ValueError for a mesh that does not fit the devices, batch or model."""
    if config.mesh != "auto":
        asked, reason = config.mesh, "asked for"
    elif jax.process_count() > 1:
        asked, reason = MeshShape(data=devices), f"data parallel over all {devices} devices of the processes"
    else:  # host devices asked for by number are all used; made by "auto", one per core
        limit = min(cpu_cores(), devices) if platform.is_cpu and config.cpu_devices == "auto" else devices
        asked = MeshShape(data=widest_split(batch_size, limit))
        reason = (f"one host device per CPU core that divides the batch ({cpu_cores()} cores, batch {batch_size})"
                  if platform.is_cpu else f"the {platform.backend} devices that divide the batch ({devices})")
    check_mesh(model, asked, batch_size)  # before the device count: what the user must change first
    if config.mesh != "auto" and asked.size != devices:  # an "auto" mesh may use the first devices only
        raise ValueError(f"runtime.mesh={str(asked)!r} uses {asked.size} device(s) but JAX has {devices}" + (
            " (--cpu-devices N, runtime.cpu_devices = N, makes N host devices)" if platform.is_cpu else ""))
    return asked, reason


def resolve(config: RuntimeConfig, batch_size: int, platform: Platform | None = None,
            devices: int | None = None, model: ModelConfig | None = None) -> Runtime:
    """Every "auto" of `config` resolved for `platform` (default: this process's) with its reason.

    `model`: also check that the mesh divides its heads and widths.
    """
    platform = Platform.detect() if platform is None else platform
    devices = jax.device_count() if devices is None else devices
    kernels, reasons = resolve_kernels(config.requested_kernels(), platform)
    shape, reasons["mesh"] = _mesh(config, batch_size, platform, devices, model)
    concrete = config.replace(**kernels.to_dict(), mesh=shape)
    return Runtime(platform=platform, config=concrete, kernels=kernels, mesh_shape=shape, reasons=reasons)


def start(config: RuntimeConfig, batch_size: int, model: ModelConfig | None = None,
          num_processes: int = 1) -> Runtime:
    """`prepare_jax`, then `resolve` on this machine: call before anything else uses JAX."""
    warnings = prepare_jax(config, batch_size, num_processes)
    runtime = resolve(config, batch_size, model=model)
    return dataclasses.replace(runtime, warnings=tuple(warnings) + runtime.warnings)
