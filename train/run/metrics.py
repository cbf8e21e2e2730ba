"""What a run records: `metrics.jsonl` (losses by step), the speed of each dispatch, and its
figures (`RunResult`, written as `result.json`)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxattn.model import active_params, count_params


class MetricsLog:
    """`metrics.jsonl`: the mean loss of each log interval, and each evaluation.

    A model whose layers sow losses of their own (`jaxattn.layer_losses`: a mixture of experts'
    `load_balancing_loss`, `router_z_loss` and `aux_loss`) logs, beside each interval's mean loss
    (cross entropy + aux_loss), the interval's mean of each (`train.run.steps`: each step's mean over
    the layers that sowed it)."""

    def __init__(self, path: Path, log_interval: int, interval: list[float] = (), write: bool = True,
                 interval_layer_losses: dict[str, list[float]] | None = None):
        """`interval`, `interval_layer_losses`: the losses of the log interval in progress (a resumed
        run's, from its checkpoint); `write`: False keeps the records off the file (the processes of
        a run other than process 0)."""
        self.path, self.log_interval, self._interval = path, log_interval, list(interval)
        self._layer_losses = {name: list(values) for name, values in (interval_layer_losses or {}).items()}
        self.write = write

    @classmethod
    def resumed(cls, path: Path, log_interval: int, meta: dict, write: bool = True) -> "MetricsLog":
        """The log going on from a checkpoint's `meta` (`pending_meta`; {} for a new run). A checkpoint
        saved before the layers' losses had their generic name holds them as "interval_moe"."""
        layer_losses = meta.get("interval_layer_losses", meta.get("interval_moe"))
        return cls(path, log_interval, meta.get("interval_losses", []), write, layer_losses)

    def pending(self) -> list[float]:
        """The losses of the log interval in progress (saved with a checkpoint taken mid-interval)."""
        return list(self._interval)

    def pending_meta(self) -> dict:
        """What a checkpoint saves of the log interval in progress (`resumed` reads it back)."""
        sown = ({"interval_layer_losses": {name: list(v) for name, v in self._layer_losses.items()}}
                if self._layer_losses else {})
        return {"interval_losses": self.pending(), **sown}

    def _append(self, record: dict) -> None:
        if not self.write:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def add_steps(self, first_step: int, losses: np.ndarray, lrs: np.ndarray, last_step: int,
                  layer_losses: dict[str, np.ndarray] | None = None) -> None:
        """Step `first_step + i + 1` has loss `losses[i]`, lr `lrs[i]` and the layers' mean sown losses
        `layer_losses[name][i]` (none for a dense model); logs each interval that ends among them."""
        for i, loss in enumerate(losses):  # step first_step + i + 1 has just finished
            step = first_step + i + 1
            self._interval.append(float(loss))
            for name, values in (layer_losses or {}).items():
                self._layer_losses.setdefault(name, []).append(float(values[i]))
            if step % self.log_interval == 0 or step == last_step:
                record = {"step": step, "loss": float(np.mean(self._interval)), "lr": float(lrs[i])}
                record.update({name: float(np.mean(values)) for name, values in self._layer_losses.items()})
                self._append(record)
                self._interval.clear()
                self._layer_losses.clear()

    def add_eval(self, step: int, losses: dict, train_seconds: float) -> None:
        """`train_seconds`: the training time so far, compile and evaluations excluded."""
        self._append({"step": step, "train_loss": losses["train"], "val_loss": losses["val"],
                      "train_seconds": round(train_seconds, 3)})

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class Throughput:
    """Seconds per optimizer step of each dispatch; evaluation and checkpoint time left out.

    `earlier`: the step seconds of the run before a resume (saved with its checkpoint), so
    the figures of a resumed run cover all of it.
    """

    def __init__(self, tokens_per_step: int, earlier: list[float] = (), earlier_seconds: float = 0.0):
        """`earlier_seconds`: the training seconds of the run before a resume."""
        self.tokens_per_step, self.earlier, self.laps = tokens_per_step, list(earlier), []
        self.seconds = earlier_seconds  # every dispatch's time, the first included
        self.tick = time.perf_counter()

    def restart(self) -> None:
        self.tick = time.perf_counter()

    def lap(self, steps: int) -> None:
        now = time.perf_counter()
        self.laps.append((now - self.tick) / steps)
        self.seconds += now - self.tick
        self.tick = now

    def step_seconds(self) -> list[float]:
        """The timed dispatches of the whole run; this process's first one warms up (unless it is its only one)."""
        return self.earlier + (self.laps[1:] or self.laps)

    def recent_tokens_per_s(self) -> float:
        return self.tokens_per_step / statistics.median(self.laps[-20:])


def first_at_or_below(records: list[dict], target: float) -> dict | None:
    """The first evaluation in `metrics.jsonl` records whose val loss is at or below `target`:
    `{"step", "val_loss", "train_seconds"}`, or None."""
    for record in records:
        if "val_loss" in record and record["val_loss"] <= target:
            return {key: record.get(key) for key in ("step", "val_loss", "train_seconds")}
    return None


def speeds(step_seconds: list[float], tokens_per_step: int) -> dict:
    """The median and fastest speed of the timed dispatches (None without any)."""
    if not step_seconds:
        return dict(median_tokens_per_s=None, median_ms_per_iter=None, fastest_ms_per_iter=None)
    median = statistics.median(step_seconds)
    return dict(median_tokens_per_s=tokens_per_step / median, median_ms_per_iter=1e3 * median,
                fastest_ms_per_iter=1e3 * min(step_seconds))


@dataclasses.dataclass
class RunResult:
    """What a run measured (`result.json`). The speeds cover every timed dispatch of the run, those
    before a resume included; None when no step was timed (a run finished by `--resume`)."""

    final_val_loss: float
    final_train_loss: float
    best_val_loss: float
    steps: int
    median_tokens_per_s: float | None
    median_ms_per_iter: float | None
    fastest_ms_per_iter: float | None  # the fastest dispatch: the least disturbed by other processes
    compile_s: float
    wall_s: float
    train_seconds: float  # training time, compile and evaluations excluded (resumed runs: all of it)
    peak_rss_gib: float  # the process's peak resident memory (the arrays, on a CPU)
    device_peak_gib: float | None  # an accelerator's peak bytes in use, where JAX reports it
    num_params: int
    sample: str
    out_dir: str
    stopped: str | None = None  # why the run ended before its sample was complete (a signal), else None
    target_loss: float | None = None  # train.target_loss
    target_reached: dict | None = None  # first_at_or_below(records, target_loss), None if never
    input_wait_s: float = 0.0  # seconds training waited for its batches (read ahead in a thread; this process)
    config: Any = dataclasses.field(repr=False, default=None)  # the resolved ExperimentConfig
    params: Any = dataclasses.field(repr=False, default=None)  # the final parameters

    def figures(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "params")}


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


def describe_adapters(adapters, params) -> str:
    """"trained: 1,843,200 adapter parameters (1.36% of 135,358,016), the base frozen" (a LoRA run)."""
    trained, total = count_params(adapters), count_params(params)
    share = 100 * trained / max(total, 1)
    return f"trained: {trained:,} adapter parameters ({share:.2f}% of {total:,}), the base frozen"


def describe_params(model, params) -> str:
    """"parameters: 795,904", plus how many touch one token where that is fewer (routed experts;
    `jaxattn.model.active_params`; `model` a `ModelConfig`, `params` its parameters)."""
    total, active = count_params(params), active_params(model)
    return f"parameters: {total:,}" + (f" ({active:,} active: those one token touches)" if active < total else "")
