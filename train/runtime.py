"""Starting JAX for a run and resolving its runtime: the one place a program looks at the machine.

`start(config, batch_size)` runs before anything starts JAX's backends (the
command-line programs call it first): it applies `runtime.xla_flags` and asks
for the CPU host devices data parallelism needs, through public JAX settings,
then detects the platform and resolves every "auto" (kernels and
`data_parallel`) with a reason that the programs print.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from jaxattn.kernels import Kernels, Platform, resolve_kernels
from train.config import RuntimeConfig


@dataclasses.dataclass(frozen=True)
class Runtime:
    """A resolved runtime.

    Attributes:
      platform: what the choices were made for.
      config: the `RuntimeConfig` with every "auto" replaced (what is saved with the run).
      kernels: the implementations the model runs with.
      data_parallel: devices each batch is split over.
      reasons: field -> why it has its value.
      warnings: what did not go as asked (e.g. JAX had started before the device count could be set).
    """

    platform: Platform
    config: RuntimeConfig
    kernels: Kernels
    data_parallel: int
    reasons: dict[str, str]
    warnings: tuple[str, ...] = ()

    def describe(self) -> list[str]:
        """One line per choice: `runtime.FIELD = VALUE (reason)`."""
        lines = [f"runtime: {self.platform.describe()}, {jax.device_count()} device(s)"]
        for field, reason in self.reasons.items():
            lines.append(f"  runtime.{field} = {getattr(self.config, field)!r} ({reason})")
        return lines


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def widest_split(batch_size: int, limit: int) -> int:
    """The largest divisor of `batch_size` that is at most `limit`."""
    return max(d for d in range(1, max(1, min(limit, batch_size)) + 1) if batch_size % d == 0)


def prepare_jax(config: RuntimeConfig, batch_size: int) -> list[str]:
    """Applies XLA flags and the CPU host device count before JAX starts; returns warnings."""
    warnings = []
    if config.xla_flags:
        current = os.environ.get("XLA_FLAGS", "").split()
        os.environ["XLA_FLAGS"] = " ".join(current + [f for f in config.xla_flags.split() if f not in current])
    devices = widest_split(batch_size, cpu_cores()) if config.data_parallel == "auto" else config.data_parallel
    if devices > 1 or config.xla_flags:
        try:  # only affects the CPU backend; harmless where the default backend is a GPU or TPU
            jax.config.update("jax_num_cpu_devices", devices)
        except RuntimeError:
            warnings.append(f"JAX had started before this run could set {devices} CPU device(s) and "
                            f"runtime.xla_flags={config.xla_flags!r}; it keeps its own "
                            "(the command-line programs set them first)")
    return warnings


def _data_parallel(asked, batch_size: int, platform: Platform, devices: int) -> tuple[int, str, list[str]]:
    """(width, reason, warnings) of data parallelism."""
    if asked == "auto" and not platform.is_cpu:
        return 1, f"one {platform.backend} device (multi-device meshes are not built yet)", []
    if asked == "auto":
        width = widest_split(batch_size, min(cpu_cores(), devices))
        return width, f"one host device per CPU core that divides the batch ({cpu_cores()} cores, " \
                      f"batch {batch_size}, {devices} device(s))", []
    if batch_size % asked:
        raise ValueError(f"train.batch_size={batch_size} must be divisible by runtime.data_parallel={asked}")
    if asked > devices:
        warning = f"runtime.data_parallel={asked} but JAX has {devices} device(s): training on one"
        return 1, "fewer devices than asked", [warning]
    return asked, "asked for", []


def resolve(config: RuntimeConfig, batch_size: int, platform: Platform | None = None,
            devices: int | None = None) -> Runtime:
    """Every "auto" of `config` resolved for `platform` (default: this process's) with its reason."""
    platform = Platform.detect() if platform is None else platform
    devices = jax.device_count() if devices is None else devices
    kernels, reasons = resolve_kernels(config.requested_kernels(), platform)
    width, reasons["data_parallel"], warnings = _data_parallel(config.data_parallel, batch_size, platform, devices)
    concrete = config.replace(**kernels.to_dict(), data_parallel=width)
    return Runtime(platform=platform, config=concrete, kernels=kernels, data_parallel=width, reasons=reasons,
                   warnings=tuple(warnings))


def start(config: RuntimeConfig, batch_size: int) -> Runtime:
    """`prepare_jax`, then `resolve` on this machine: call before anything else uses JAX."""
    warnings = prepare_jax(config, batch_size)
    runtime = resolve(config, batch_size)
    return dataclasses.replace(runtime, warnings=tuple(warnings) + runtime.warnings)
