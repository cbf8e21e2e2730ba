"""Fresh Python processes for the benchmarks: a script, or a function of a module, run in a new interpreter.

A fresh process starts JAX anew (its host device count and XLA flags are fixed when it starts), has its
own peak memory, and may be another interpreter (one with torch). Its result is the JSON of the last
line it prints:

    from bench import fresh
    record = fresh.call("bench.attention:worker", {"T": 256}, threads=2)
    done = fresh.run([python, "bench/hf_decode.py", "--cases", "baby:1:256"], what="Hugging Face's generate")
    done.json(), done.wall_s, done.peak_rss_bytes

    python -m bench.fresh MODULE:FUNCTION SPEC_JSON   # what `call` runs: prints FUNCTION(SPEC) as JSON

Needs only the standard library.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Read by torch's thread pools when it starts. OMP_WAIT_POLICY is left as the user has it: torch's default
# (idle threads spin a while) is its fastest on a quiet machine, while on one shared with other jobs a
# spinning thread takes the core its partner needs, and OMP_WAIT_POLICY=PASSIVE serves torch better there.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class FreshProcessError(RuntimeError):
    """A fresh process failed (non-zero exit, or past its timeout); the message ends with its last error line."""


@dataclass(frozen=True)
class Finished:
    """What a fresh process left: its stdout, wall seconds and peak resident memory (from the kernel)."""

    stdout: str
    wall_s: float
    peak_rss_bytes: int

    def json(self):
        """The JSON of the last line printed."""
        lines = self.stdout.strip().splitlines()
        if not lines:
            raise FreshProcessError("the fresh process printed nothing")
        return json.loads(lines[-1])


def environment(threads: int | None = None, xla_flags: str | None = None, **variables: str) -> dict[str, str]:
    """This process's environment with the repository importable; `threads` sets the size of the thread
    pools that read the OMP/MKL/OpenBLAS variables (torch's), `xla_flags` replaces XLA_FLAGS; then
    `variables`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if threads is not None:
        env.update({name: str(threads) for name in THREAD_VARIABLES})
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return {**env, **{name: str(value) for name, value in variables.items()}}


def run(argv: list[str], *, what: str | None = None, env: dict[str, str] | None = None,
        timeout: float | None = None, cwd: Path = ROOT) -> Finished:
    """Runs `argv` to its end (from `cwd`, with `env`, default `environment()`); FreshProcessError naming
    `what` (default: the command) when it exits non-zero or runs past `timeout` seconds."""
    what = what or " ".join(str(a) for a in argv[1:3])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen([str(a) for a in argv], cwd=cwd, env=env or environment(), stdout=out,
                                   stderr=err, stdin=subprocess.DEVNULL, text=True)
        usage, timed_out = _wait(process, timeout)
        wall = time.perf_counter() - start
        stdout, stderr = (_read(f) for f in (out, err))
    if timed_out:
        raise FreshProcessError(f"{what} ran past its timeout of {timeout:g} s")
    if process.returncode:
        tail = (stderr.strip() or stdout.strip() or "(no output)").splitlines()[-1][:300]
        raise FreshProcessError(f"{what} exited with status {process.returncode}: {tail}")
    return Finished(stdout, wall, usage.ru_maxrss * 1024)  # Linux reports KiB


def _wait(process: subprocess.Popen, timeout: float | None):
    """(the child's resource usage, whether it ran past `timeout` and was killed); sets its returncode.
    os.wait4 rather than Popen.wait: the kernel's peak RSS of this child alone. The child is killed too
    when this process is interrupted."""
    timed_out = threading.Event()
    killer = threading.Timer(timeout, lambda: (timed_out.set(), process.kill())) if timeout else None
    if killer:
        killer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        if killer:
            killer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    return usage, timed_out.is_set()


def _read(file) -> str:
    file.seek(0)
    return file.read()


def function_argv(function: str, spec, python: str | None = None) -> list[str]:
    """The command that runs `function` ("package.module:name") on the JSON-able `spec` in a fresh process."""
    return [python or sys.executable, "-m", "bench.fresh", function, json.dumps(spec)]


def call(function: str, spec, *, python: str | None = None, threads: int | None = None,
         xla_flags: str | None = None, timeout: float | None = None, **variables: str):
    """`function(spec)` ("package.module:name") in a fresh process of `python` (default: this one): its
    JSON-able result. FreshProcessError when the process fails."""
    env = environment(threads, xla_flags, **variables)
    return run(function_argv(function, spec, python), what=function, env=env, timeout=timeout).json()


def main(argv: list[str]) -> None:
    if len(argv) != 2 or ":" not in argv[0]:
        print("error: usage: python -m bench.fresh MODULE:FUNCTION SPEC_JSON", file=sys.stderr)
        sys.exit(2)
    module, _, name = argv[0].partition(":")
    result = getattr(importlib.import_module(module), name)(json.loads(argv[1]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
