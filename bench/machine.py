"""What a benchmark ran on: the CPU by name, its relevant features, the JAX backend and versions.

Importable without JAX (`cpu_cores`, `write_results`, `portable_command`): the peers' processes
(bench/hf_decode.py, bench/nanogpt_baseline.py) may run under an interpreter that has torch and no JAX.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
from pathlib import Path


def pin_to_cores(threads: int) -> None:
    """This process on its first `threads` cores, before JAX or torch starts (their pools size to them)."""
    if threads < cpu_cores() and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name as `lscpu` shows it ("unknown" where /proc/cpuinfo is missing)."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_cores() -> int:
    """The CPU cores this process may run on: what JAX's CPU client spreads a program over, and so
    the threads a peer (torch) gets by default in a fair race. The same count as
    `train.run.runtime.cpu_cores`, which needs JAX."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes; more than `cpu_cores()` means the cores are shared),
    None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


# The CPU classes the native kernels have a path for (jaxattn/kernels/native/quant_dot.h), widest first:
# (a flag of /proc/cpuinfo, the class's file-name slug, the class in words).
CPU_CLASSES = (("amx_int8", "amx", "AMX (with AVX-512 and VNNI)"),
               ("avx512_vnni", "avx512_vnni", "AVX-512 with VNNI"),
               ("avx512f", "avx512", "AVX-512 without VNNI"),
               ("avx_vnni", "avx_vnni", "AVX2 with AVX-VNNI"),
               ("avx2", "avx2", "AVX2 only (no AVX-512)"),
               ("asimddp", "arm_dotprod", "ARM NEON with the dot-product extension"),
               ("asimd", "arm_neon", "ARM NEON"))


def cpu_class(flags) -> tuple[str, str]:
    """(slug, words) of the widest class of `CPU_CLASSES` whose flag `flags` holds; ("scalar", ...) for none.

    A speed measured on one class holds for that class: results files are kept per class."""
    return next(((slug, words) for flag, slug, words in CPU_CLASSES if flag in flags),
                ("scalar", "no vector extension the kernels use"))


# What narrows the instructions this CPU is used with, to emulate a smaller one (docs/performance.md §28): the
# native kernels' target, the CPU flags the kernel rules see, torch's own kernels, MKL's and oneDNN's (torch's
# matmuls); and XLA's `--xla_cpu_max_isa`.
LIMIT_VARIABLES = ("JAXATTN_NATIVE_MARCH", "JAXATTN_CPU_FLAGS_MAX", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                   "ONEDNN_MAX_CPU_ISA")


def isa_limits(environ=None) -> dict[str, str]:
    """The set `LIMIT_VARIABLES` of `environ` (default `os.environ`), and XLA_FLAGS's `--xla_cpu_max_isa=...`
    where it has one (its other flags do not narrow the instruction set)."""
    environ = os.environ if environ is None else environ
    limits = {name: environ[name] for name in LIMIT_VARIABLES if environ.get(name)}
    isa = [word for word in environ.get("XLA_FLAGS", "").split() if word.startswith("--xla_cpu_max_isa")]
    return {**({"XLA_FLAGS": " ".join(isa)} if isa else {}), **limits}


def limits_prefix(limits: dict[str, str]) -> str:
    """`isa_limits()` as the environment of a command line: "XLA_FLAGS=--xla_cpu_max_isa=AVX2 ... " ("" for none)."""
    return "".join(f"{name}={shlex.quote(value)} " for name, value in limits.items())


def describe_machine() -> dict:
    """A JSON-able record of the machine (starts JAX's backends)."""
    import jax

    from jaxattn.kernels import Platform
    detected = Platform.detect()
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "cores": cpu_cores(), "platform": detected.describe(),
            "amx_bf16": "amx_bf16" in detected.cpu_flags, "cpu_class": cpu_class(detected.cpu_flags)[1],
            "cpu_class_slug": cpu_class(detected.cpu_flags)[0], "jax": jax.__version__,
            "python": platform.python_version(), "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "isa_limits": isa_limits()}


def machine_line(machine: dict) -> str:
    """`describe_machine()` in a few words: "CPU (platform, N CPUs), jax VERSION", and the instruction set's
    limits where some were set (`isa_limits`)."""
    line = f"{machine['cpu']} ({machine['platform']}, {machine['cpus']} CPUs), jax {machine['jax']}"
    limits = machine.get("isa_limits")
    return line + (f", limited by `{limits_prefix(limits).strip()}`" if limits else "")


def write_results(out_dir: str | Path, name: str, record: dict, markdown: str) -> None:
    """`out_dir/NAME.json` (the record) and `NAME.md` (its table), and the table on stdout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(record, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def portable_command(argv: list[str], path_flags: tuple[str, ...]) -> str:
    """The command line with the values of `path_flags` (interpreters and files of one machine) made generic."""
    words = []
    for i, word in enumerate(argv):
        flag = argv[i - 1] if i else ""
        words.append("/path/to/" + flag.lstrip("-").replace("-", "_") if flag in path_flags else word)
    return " ".join(words)
