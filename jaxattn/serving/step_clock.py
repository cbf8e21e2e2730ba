"""Where an engine step's wall time goes: the host's phases and the wait for the device.

A step (`Engine.step`) is, in order: `schedule` (the scheduler picks rows and pages), `inputs` (the
model runner builds the step's host arrays), `dispatch` (the compiled forward and draw are queued,
and the guided rows' masks filled meanwhile), `device` (waiting until the drawn tokens are ready),
`outputs` (the tokens and log-probabilities read back to Python) and `update` (the scheduler hands
them out, ends requests, frees pages). Every phase but `device` is host time the device does not
hide; on a CPU the device is the same cores, so `device` is the model's arithmetic. Steps that
schedule nothing are not counted.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "inputs", "dispatch", "device", "outputs", "update")


@dataclass
class StepClock:
    """Seconds per phase (`PHASES`) summed over `steps` steps; `reset()` starts again."""

    steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))

    @contextmanager
    def phase(self, name: str):
        """Adds the block's wall time to phase `name`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def reset(self) -> None:
        self.steps, self.seconds = 0, dict.fromkeys(PHASES, 0.0)

    def host_seconds(self) -> float:
        """The steps' time outside the wait for the device."""
        return sum(s for name, s in self.seconds.items() if name != "device")

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, and "host" (every phase but "device") and "total"."""
        if self.steps == 0:
            return {}
        out = {name: 1e3 * s / self.steps for name, s in self.seconds.items()}
        out["host"] = 1e3 * self.host_seconds() / self.steps
        out["total"] = 1e3 * sum(self.seconds.values()) / self.steps
        return out
