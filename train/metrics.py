"""What a run records: `metrics.jsonl` (losses by step) and the speed of each dispatch."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np


class MetricsLog:
    """`metrics.jsonl`: the mean loss of each log interval, and each evaluation."""

    def __init__(self, path: Path, log_interval: int, interval: list[float] = (), write: bool = True):
        """`interval`: the losses of the log interval in progress (a resumed run's, from its checkpoint);
        `write`: False keeps the records off the file (the processes of a run other than process 0)."""
        self.path, self.log_interval, self._interval = path, log_interval, list(interval)
        self.write = write

    def pending(self) -> list[float]:
        """The losses of the log interval in progress (saved with a checkpoint taken mid-interval)."""
        return list(self._interval)

    def _append(self, record: dict) -> None:
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def add_steps(self, first_step: int, losses: np.ndarray, lrs: np.ndarray, last_step: int) -> None:
        for i, loss in enumerate(losses):  # step first_step + i + 1 has just finished
            step = first_step + i + 1
            self._interval.append(float(loss))
            if step % self.log_interval == 0 or step == last_step:
                self._append({"step": step, "loss": float(np.mean(self._interval)), "lr": float(lrs[i])})
                self._interval.clear()

    def add_eval(self, step: int, losses: dict) -> None:
        self._append({"step": step, "train_loss": losses["train"], "val_loss": losses["val"]})

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class Throughput:
    """Seconds per optimizer step of each dispatch; evaluation and checkpoint time left out."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step, self.laps, self.tick = tokens_per_step, [], time.perf_counter()

    def restart(self) -> None:
        self.tick = time.perf_counter()

    def lap(self, steps: int) -> None:
        now = time.perf_counter()
        self.laps.append((now - self.tick) / steps)
        self.tick = now

    def step_seconds(self) -> list[float]:
        return self.laps[1:] or self.laps  # the first dispatch warms up

    def recent_tokens_per_s(self) -> float:
        return self.tokens_per_step / statistics.median(self.laps[-20:])


def peak_memory() -> dict:
    """This process's peak resident memory, and each accelerator's peak in use where JAX reports it.

    Returns `{"peak_rss_gib": float, "device_peak_gib": float | None}` (the largest over the
    local devices; None on a CPU, whose arrays are in the process's RSS).
    """
    import resource

    import jax
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    stats = [device.memory_stats() or {} for device in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return {"peak_rss_gib": rss / 2**30, "device_peak_gib": max(peaks) / 2**30 if peaks else None}


def describe_memory(memory: dict) -> str:
    """"peak memory 0.61 GiB RSS" (+ ", device 3.2 GiB" on an accelerator)."""
    device = memory.get("device_peak_gib")
    return f"peak memory {memory['peak_rss_gib']:.2f} GiB RSS" + (f", device {device:.2f} GiB" if device else "")
