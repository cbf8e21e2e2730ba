"""One `error:` line, not XLA's abort, when a run's host devices wait at a collective for too long.

XLA:CPU's host devices meet at every collective (the gradients' all-reduce, an FSDP all-gather) on
threads of one process. One that waits longer than `--xla_cpu_collective_call_terminate_timeout_seconds`
for the others aborts the whole process from C++ (rendezvous.cc's "Termination timeout", a stack trace,
SIGABRT): nothing in Python can catch it. `train.run.runtime.COLLECTIVE_FLAGS` raises that timeout to
an hour; `CollectiveWatch` ends the run itself, with one line naming the cause and the settings, once
the host has waited for a chunk of steps for `FRACTION` of it: a chunk that long on host devices is
one whose devices wait at a collective (a stuck device, a machine loaded past what the split allows),
and XLA would abort it moments later. What the run saved (its checkpoints) stays; `--resume` continues.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable

TERMINATE_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
XLA_DEFAULT_SECONDS = 40.0  # XLA's own, where nothing raised it
FRACTION = 0.9


def terminate_timeout_s(xla_flags: str) -> float:
    """The collective terminate timeout XLA_FLAGS sets (the last one given), else XLA's default."""
    seconds = XLA_DEFAULT_SECONDS
    for flag in xla_flags.split():
        name, _, value = flag.partition("=")
        if name == TERMINATE_FLAG:
            seconds = float(value)
    return seconds


def stuck_message(waited_s: float, devices: int, timeout_s: float) -> str:
    return (f"error: a chunk of training steps has waited {waited_s:.0f} s on {devices} host devices, near XLA's "
            f"collective timeout ({TERMINATE_FLAG}={timeout_s:g}): a device waits for another at a collective (a "
            "stuck device, or a machine too loaded for the split); run with one host device (--cpu-devices 1, "
            "runtime.cpu_devices = 1), or raise the timeout in runtime.xla_flags; --resume continues from the "
            "last checkpoint")


class CollectiveWatch:
    """Ends the process (one line on stderr, exit 1) when a `waiting()` block lasts `FRACTION` of the
    collective timeout.

    Args:
      devices: the run's host devices (the message names them).
      timeout_s: XLA's collective terminate timeout (`terminate_timeout_s`).
      end: called with the message when the deadline passes (default: print it and `os._exit(1)`,
        which no blocked thread can hold up).
    """

    def __init__(self, devices: int, timeout_s: float, end: Callable[[str], None] | None = None):
        self.devices, self.timeout_s, self.deadline_s = devices, timeout_s, FRACTION * timeout_s
        self._end = end or _print_and_exit
        self._since: float | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="collective-watch", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self):
        """The host waits for the devices in this block."""
        with self._lock:
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.deadline_s / 20))
            with self._lock:
                waited = None if self._since is None else time.monotonic() - self._since
            if waited is not None and waited >= self.deadline_s:
                self._end(stuck_message(waited, self.devices, self.timeout_s))
                return


def _print_and_exit(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(1)


def watch_for(devices: int, platform_is_cpu: bool) -> CollectiveWatch | None:
    """The watch a run on `devices` needs: on several host devices of a CPU, else None (no host collectives)."""
    if devices < 2 or not platform_is_cpu:
        return None
    return CollectiveWatch(devices, terminate_timeout_s(os.environ.get("XLA_FLAGS", "")))
